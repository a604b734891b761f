"""Closing producer connections that have been idle for `idle_timeout_s`, without losing a frame.

A connection is idle when nothing it sent is in flight on the consumer's side: no frame since the
last look, none part-read, none held back or unacknowledged, no chunked message incomplete. A
quiet connection with frames delivered but not yet acknowledged is acknowledged first, and is
idle from then on. The producer keeps nothing unacknowledged then, and notices the closed
connection before its next send (see `SocketProducer`), so it just connects again.
A connection stalled in the middle of a frame (no byte of it for `idle_timeout_s`) is closed too: what
it sent of that frame is dropped, and its producer sends the frame again on its next connection.
"""

from __future__ import annotations

import logging
import time
from typing import Any

#: how often the reading thread looks for idle connections, at most and at least
SWEEP_S = (0.05, 5.0)


def in_flight(peer: Any) -> bool:
    """Whether the consumer holds anything of this connection's: part of a frame, a held, replayed
    or decoding frame, an incomplete chunked message or a tensor nobody took yet (closed, its producer would send it
    again), an ack or refusal not yet sent."""
    if peer.paused or peer.replay is not None or peer.ack_owed or peer.outbox:
        return True
    if peer.positions.first_open() < peer.frames:
        return True
    return bool(peer.reader.mid_frame or peer.reader.buffered)


class IdleSweep:
    """Looks at every connection every so often (on the reading thread) and drops the idle ones."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.every_s = 0.0 if timeout_s is None else min(max(timeout_s / 4, SWEEP_S[0]), SWEEP_S[1])
        self.next_at = time.monotonic() + self.every_s
        #: fd -> (peer, where it was at the last look: its frame count, with how far the frame under way got when
        #: it is stalled in one, since when it has been there)
        self._still: dict[int, tuple[Any, object, float]] = {}
        self.dropped = 0

    def due(self, now: float) -> bool:
        return self.timeout_s is not None and now >= self.next_at

    def run(self, reactor: Any, now: float) -> None:
        """Drop the connections idle for `timeout_s`; acknowledge the quiet ones that are owed an ack."""
        assert self.timeout_s is not None
        self.next_at = now + self.every_s
        still: dict[int, tuple[Any, object, float]] = {}
        for peer in reactor._peer_list():
            fd = peer.fd
            stalled = peer.reader.mid_frame and not peer.reader.buffered  # (part of a frame in, waiting for the rest)
            if not stalled and in_flight(peer):
                continue
            mark = (peer.frames, peer.reader.progress) if stalled else peer.frames
            seen = self._still.get(fd)
            since = seen[2] if seen is not None and seen[0] is peer and seen[1] == mark else now
            if not stalled and (peer.frames > peer.acked or peer.frames > peer.taken):
                try:
                    reactor._ack(peer)  # (delivered, just not acknowledged yet: the producer may let them go)
                except Exception as exc:  # (OSError, or an ack cut short)
                    reactor._drop(peer, f"connection failed: {exc}", logging.ERROR)
                    continue
                since = now
            elif now - since >= self.timeout_s:
                if stalled:
                    reason = f"closed after {self.timeout_s:g} s stalled mid-frame (idle_timeout_s)"
                    reactor._drop(peer, reason, logging.WARNING)
                else:
                    reactor._drop(peer, f"closed after {self.timeout_s:g} s idle (idle_timeout_s)", logging.INFO)
                self.dropped += 1  # (after the close: who sees the count may rely on the connection being gone)
                continue
            still[fd] = (peer, mark, since)
        self._still = still
