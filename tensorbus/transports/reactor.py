"""The receiving side of the stream sockets: every producer connection read by whichever thread leads.

Connections are non-blocking and share one poller; one thread at a time leads and reads whole
frames, delivering each. The rules live in their own modules, from the bottom up:

- poller.py: what the reading thread waits on (`Poller`, and `IdleClock`, the application's idleness);
- peers.py: the connections (`Peer`), dropping one, holding one back for a full table, the acks;
- peer_frames.py: reading one connection, frame by frame, each delivered and booked in the ledger;
- reading_loop.py: who leads (an application thread in `recv`, the background thread, an event
  loop's turn: `read_ready`) and the leader's loop;
- here: the `Reactor` itself, adding a connection that finished its handshake, and closing.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import selectors
import socket
import ssl
import sys
import threading
import time
from typing import Any

from ..buffers import BufferPool
from ..codec.frame import Limits
from .base import Deliver
from .peers import WOULD_BLOCK, Peer, PeerGone
from .poller import IdleClock, Poller
from .reader import stream_reader
from .reading_loop import OVERLAP_FROM, TAKEN_EVERY_S, ReadingLoop
from .stream import SocketOptions, tune_connection

#: how long a closing consumer reads and drops what its producers still send after its last acks (an ack
#: request of a `flush` under way), until each closes its end or none sent anything for CLOSE_QUIET_S (a
#: producer runs no thread: an idle one closes its end only at its next call): a socket closed with bytes
#: unread, or that bytes reach after, is reset, and a reset can cost its producer the acks not read yet
CLOSE_LINGER_S = 0.05
CLOSE_QUIET_S = 0.01

__all__ = ["LOOP_READ_BUDGET", "OVERLAP_FROM", "RECV_LOWAT", "TAKEN_EVERY_S", "IdleClock", "Poller", "Reactor"]


def _lowat_is_safe(system: str = sys.platform, release: str | None = None) -> bool:
    """Whether SO_RCVLOWAT can never keep a reader waiting for bytes the kernel will not take in:
    Linux 5.8 on caps it to the receive buffer and wakes the reader anyway under memory pressure or
    a closing window ("tcp: fix SO_RCVLOWAT possible hangs under high mem pressure", 2020)."""
    version = re.match(r"(\d+)\.(\d+)", platform.release() if release is None else release)
    return system == "linux" and version is not None and (int(version[1]), int(version[2])) >= (5, 8)


#: while a TCP connection's reader waits in the middle of a large frame, the kernel wakes it once this
#: many bytes are in (SO_RCVLOWAT), not once per loopback packet (64 KiB); see `_stream.c`, set_lowat.
#: 0 (never set) where the kernel may not be safe with it
RECV_LOWAT = 256 << 10 if _lowat_is_safe() else 0
#: bytes of a frame one read takes at most on an event loop (tensorbus.aio), whatever pace they come at:
#: what bounds how long a read holds the loop (1 MiB into fresh pages: 1.5-2.5 ms on the 2-vCPU VM)
LOOP_READ_BUDGET = 1 << 20


class Reactor(ReadingLoop):
    """Reads frames from registered connections on the leading thread and hands them to `deliver`."""

    def __init__(
        self, deliver: Deliver, limits: Limits, options: SocketOptions, pool: BufferPool, poller: Poller | None = None
    ) -> None:
        """`poller`: an event loop's (tensorbus/aio), which then reads through `read_ready`; no thread starts, and
        the pool's new buffers take no transparent huge pages (a receive that faults one in zeroes 2 MiB while the
        loop waits: `buffers.small_pages_empty`)."""
        super().__init__(deliver, limits, options, pool, Poller() if poller is None else poller)
        if poller is not None:
            pool.huge_pages = False
        else:
            self._background = threading.Thread(target=self._lead_in_background, daemon=True, name="tensorbus-reader")
            self._background.start()

    def add(self, conn: socket.socket, name: Any) -> None:
        """Start reading a connection that finished its handshake."""
        conn.setblocking(False)
        tune_connection(conn)  # (acks go out at once)
        lowat = RECV_LOWAT if conn.family in (socket.AF_INET, socket.AF_INET6) else 0
        peer = Peer(conn, name, stream_reader(conn, self.limits, self.pool.take, lowat), self.deliver.ledger.stream())
        if self._background is None:  # read on an event loop: in turns
            peer.reader.budget = LOOP_READ_BUDGET
        with self._peers_lock:
            self._peers[peer.fd] = peer  # (first: a leader that reads it and drops it must find it here)
        try:
            if self._closed:
                raise ValueError("closed")
            # (no TLS bytes can be pending yet: a producer sends nothing until it has read the verdict)
            self._poller.register(peer.fd, peer)
        except (ValueError, KeyError, OSError, RuntimeError):  # the consumer closed during the handshake
            with self._peers_lock:
                if self._peers.get(peer.fd) is peer:
                    del self._peers[peer.fd]
            conn.close()
            return
        # A leader may have read it before it was registered (a lone peer is read unpolled), and either
        # dropped it or held its message for a full table (`_hold` found nothing to unregister then):
        # neither may stay watched (a held peer is registered again when its message is taken).
        if not self._reads(peer) or peer.paused:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._poller.unregister(peer.fd, peer)

    # -- shutdown -------------------------------------------------------------------------------

    def close(self, timeout: float) -> None:
        """Answer what already arrived (ack requests above all), ack every delivered frame, drop every connection.

        Called on the reading thread itself (from a `recv_async` callback), it finishes on a thread of
        its own once that thread stops leading: it cannot wait for a lock its own caller holds.
        """
        if threading.get_ident() == self.leading_thread():
            threading.Thread(target=self.close, args=(timeout,), daemon=True, name="tensorbus-close").start()
            return
        with self._state:
            self._wanted += 1  # a background leader steps aside
        self._wake()
        got = self._leader.acquire(timeout=timeout)
        try:
            if got:
                self._lead(lambda: False, time.monotonic())  # one pass over what is readable now
            self._closed = True
            self._wake()
            self._idle.wake()
            with self._state:
                self._state.notify_all()
            if self._background is not None:
                self._background.join(timeout)
            peers = self._peer_list()
            try:
                for peer in peers:
                    with contextlib.suppress(OSError, PeerGone, *WOULD_BLOCK):
                        if got:
                            self._ack(peer)  # what was received and taken: the producer sends the rest to the next one
                    peer.positions.close()
                    with contextlib.suppress(OSError):
                        peer.conn.shutdown(socket.SHUT_WR)  # (the end of the stream, after those acks)
                if got:  # (else another thread leads, and reads these: nothing was acked to protect anyway)
                    with contextlib.suppress(OSError):  # (e.g. no descriptor left for a selector)
                        _discard_until_closed([peer.conn for peer in peers], min(CLOSE_LINGER_S, timeout))
            finally:
                for peer in peers:
                    peer.conn.close()
            with self._peers_lock:
                self._peers.clear()
            self._poller.close()
            wake_r, wake_w, self._wake_r, self._wake_w = self._wake_r, self._wake_w, -1, -1
            os.close(wake_r)
            os.close(wake_w)
        finally:
            if got:
                self._leader.release()


def _discard_until_closed(conns: list[Any], timeout: float) -> None:
    """Read and drop what arrives on `conns` (their consumer closing) until each reaches its end, nothing came
    for CLOSE_QUIET_S, or `timeout` seconds passed: closed with nothing unread, a socket ends with a FIN, not a
    reset."""
    if not conns:
        return
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for conn in conns:
            with contextlib.suppress(OSError, ValueError):
                selector.register(conn, selectors.EVENT_READ)
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            ready = selector.select(min(left, CLOSE_QUIET_S))
            if not ready:
                return
            for key, _ in ready:
                try:
                    ended = not key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                    continue
                except OSError:
                    ended = True
                if ended:
                    selector.unregister(key.fileobj)
