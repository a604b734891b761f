"""Reading one producer connection: its reader's events (frames, ack requests, skips), each delivered and booked.

Each connection has a frame reader (reader.py: the C one for plain sockets where it is built, the
Python one for TLS), a small state machine that a producer stalling mid-frame holds up for nobody
else; `_step` handles the events of either. A plain frame goes on into the consumer's table in C
where it can (the intake's `fast`, `_intake.FastDelivery`); the intake's Python delivery takes the rest.

An event loop that reads (tensorbus.aio) sets `off_loop`: a frame whose decoding would hold the loop
(a signature over, or a decompression into, DECODE_ON_LOOP_BELOW bytes or more) is then delivered on
another thread, and its connection is not read until that is done and booked here (its frames stay in
order; the others are read meanwhile).
"""

from __future__ import annotations

import collections
import logging
import ssl
import threading
from collections.abc import Callable
from typing import Any

from ..buffers import BufferPool
from ..codec.frame import PREFIX, Buffer, Limits, decode_work, frame_length
from ..errors import CallbackInterrupted, CodecError, LimitExceeded
from .base import Deliver, Delivered
from .peers import Peer, PeerGone, Peers
from .poller import Poller
from .reader import ACK_REQUEST, CHECK_PREFIX, MORE, SKIPPED
from .stream import CRC_TRAILER, REFUSALS_WANTED, SocketOptions

NO_LIMITS = Limits(max_header_bytes=1 << 32, max_payload_bytes=1 << 64)
#: frames read from one connection before the others get a turn
FAIR_SHARE = 16
#: what `_finish` books for a frame a recv_async callback had while it was being delivered (it was taken)
TAKEN_WITHOUT_ID = Delivered(None, True)


#: what a turn may read when nothing bounds it but FAIR_SHARE and the acks (`_read`'s `room`)
UNBOUNDED = 1 << 62
#: with `off_loop`, a frame whose decoding goes over this many bytes (`decode_work`) is decoded off the
#: loop: as much as a turn reads of a large frame (reactor.LOOP_READ_BUDGET), a millisecond or so of the
#: loop's time, where a thread's hand-off costs a tenth of that (docs/ASYNC.md)
DECODE_ON_LOOP_BELOW = 1 << 20


def never() -> bool:
    return False


def unbounded() -> int:
    return UNBOUNDED


class PeerFrames(Peers):
    """Reads a connection's frames and books each one delivered (acking every so many)."""

    def __init__(
        self, deliver: Deliver, limits: Limits, options: SocketOptions, pool: BufferPool, poller: Poller
    ) -> None:
        super().__init__(deliver, limits, options, pool, poller)
        self._ack_every = (options.ack_every_frames, options.ack_every_bytes)  # (read for every frame)
        self._fast = deliver.fast  # the intake's C delivery of plain frames
        self._largest_read = 0  # the largest frame read since an application thread took the lead
        #: per thread, the name of the connection whose frame it delivers (for the consumer's log lines: the
        #: reading thread's, or the loop's, and a decoding thread's while it delivers a frame: `_off_loop`)
        self._reading = threading.local()
        #: an event loop's: runs a delivery on another thread (see the module); None: deliver here
        self.off_loop: Callable[[Callable[[], None]], None] | None = None
        #: deliveries done off the loop, to book: (peer, the Delivered or what the delivery raised, whether it
        #: was a held message's release), appended by that thread and taken by the leader (a deque: its appends
        #: and pops are atomic)
        self._decoded: collections.deque[tuple[Peer, Any, bool]] = collections.deque()

    @property
    def reading(self) -> Any:
        """The name of the connection whose frame the calling thread delivers (None: none)."""
        return getattr(self._reading, "name", None)

    @reading.setter
    def reading(self, name: Any) -> None:
        self._reading.name = name

    def _read(self, peer: Peer, stop: Callable[[], bool], room: Callable[[], int] = unbounded) -> None:
        """Deliver up to FAIR_SHARE frames the connection has ready; stop early once `stop()` holds (and
        nothing is read ahead) or `room()`, the bytes the caller lets it read on (an event loop's read-ahead),
        is used up (bytes read ahead then wait in `_pending`). A run of frames read in C goes no further than
        the frame that uses it up, as a frame at a time would."""
        self.reading = peer.name
        runs = self._fast is not None
        try:
            steps = 0
            while steps < FAIR_SHARE:
                left = room()
                if peer.paused or (stop() and not self._has_bytes_ahead(peer)) or left <= 0:
                    break  # paused, done and nothing read ahead says more is on its way, or enough read ahead
                if runs and peer.replay is None:
                    taken, more = self._run(peer, FAIR_SHARE - steps, left)
                    steps += taken
                    if not more:
                        break
                elif self._step(peer):  # read on while bytes come: the next `recv` then finds its tensor waiting
                    steps += 1
                else:
                    break
                if peer.reader.drained and not peer.reader.buffered:
                    break  # the socket had no more: a poll says when it has (no read that finds nothing)
            if not peer.paused and self._has_bytes_ahead(peer):
                self._pending.add(peer)
        except PeerGone as exc:
            self._drop(peer, str(exc), exc.level)
        except (BrokenPipeError, ConnectionResetError) as exc:
            self._drop(peer, f"went away: {exc}", logging.INFO)
        except MemoryError:
            self._drop(peer, "dropped: no memory for its next frame", logging.ERROR)
        except (OSError, ssl.SSLError) as exc:
            self._drop(peer, f"connection failed: {exc}", logging.INFO if self._closed else logging.ERROR)
        except BaseException as exc:  # e.g. Ctrl-C in a recv reading for itself
            if peer.replay is not None or isinstance(exc, CallbackInterrupted):
                self._pending.add(peer)  # interrupted while delivering: that frame (if any) comes first next time
            else:  # somewhere in the middle of the stream: the producer reconnects and resends instead
                message = f"reading was interrupted ({type(exc).__name__}); its unacknowledged frames come again"
                self._drop(peer, message, logging.WARNING)
            raise

    def _replay(self, peer: Peer) -> bool:
        """Deliver again the frame whose delivery was interrupted (`peer.replay`, set); True, as a step."""
        assert peer.replay is not None
        frame, crc = peer.replay
        peer.replay = None
        self._deliver(peer, frame, crc)
        return True

    def _step(self, peer: Peer) -> bool:
        """Advance the connection by one event of its reader (a frame, an ack request...); False when out of bytes."""
        if peer.replay is not None:
            return self._replay(peer)
        reader = peer.reader
        event = reader.read()
        if event is None:
            return False
        if type(event) is tuple:
            peer.total = reader.last_total  # (what the acks count: with the CRC after the frame, if sent)
            frame, crc = event
            if self._fast is not None and (taken := self._fast(frame, crc, peer.source)) is not None:
                peer.positions.record_admitted(peer.frames, taken.message_id)  # (`_finish` of a plain tensor)
                self._booked(peer)
            else:
                self._deliver(peer, frame, crc)
        else:
            self._event(peer, event)
        return True

    def _run(self, peer: Peer, most: int, most_bytes: int = UNBOUNDED) -> tuple[int, bool]:
        """Up to `most` steps in one call of the reader (`read_taken`): the plain frames the C delivery
        takes, read and delivered without a Python step each, then booked as `_step` books them; the
        event that ended the run is handled as `_step` handles it. Returns the steps taken and whether
        to read on. The run ends where `_booked` would ack, so the acks go out where they did, and with
        the frame that brings its bytes to `most_bytes` (at least one frame is read)."""
        every_frames, every_bytes = self._ack_every
        frames = 1 if peer.ack_owed else max(min(most, every_frames - (peer.frames - peer.acked)), 1)
        reader = peer.reader
        ids, event, nbytes, largest = reader.read_taken(
            self._fast, peer.source, frames, min(every_bytes - peer.unacked_bytes, most_bytes)
        )
        if ids:
            peer.positions.record_admitted_run(peer.frames, ids)  # (`_finish` of a plain tensor, each)
            self._booked(peer, len(ids), nbytes, largest)
        if type(event) is int and event == MORE:
            return len(ids), True
        if event is None:
            return len(ids), False
        if isinstance(event, BaseException):
            raise event  # (what came after the frames booked above)
        if type(event) is tuple:  # a frame the C delivery declined: the Python way
            peer.total = reader.last_total
            self._deliver(peer, *event)
        else:
            self._event(peer, event)
        return len(ids) + 1, True

    def _event(self, peer: Peer, event: int) -> None:
        """Handle a reader's event other than a frame: an ack request, a skipped frame, a prefix to check, the end."""
        reader = peer.reader
        if event == ACK_REQUEST:
            self._ack(peer)
        elif event == SKIPPED:
            peer.total = reader.last_total  # (its prefix)
            self._deliver(peer, memoryview(reader.prefix))  # the consumer counts it as refused
        elif event == CHECK_PREFIX:
            if reader.prefix == REFUSALS_WANTED:  # (not a frame: a marker the readers leave to this step)
                peer.refusals = True
                reader.skip(0)
            else:
                reader.skip(self._skip_length(reader.prefix, CRC_TRAILER.size if reader.crc_after else 0))
        else:  # END
            raise PeerGone("disconnected mid-frame") if reader.mid_frame else PeerGone("went away", logging.INFO)

    def _deliver(self, peer: Peer, frame: memoryview, crc: int | None = None) -> None:
        """Hand a whole frame to the consumer and book it. Should that be interrupted (Ctrl-C in a
        `recv` reading for itself), the frame is kept and delivered again before anything else of
        its producer: it was read off the socket, and the acks count every frame."""
        if self.off_loop is not None and decode_work(frame, self.limits) >= DECODE_ON_LOOP_BELOW:
            self._deliver_off_loop(peer, frame, crc)
            return
        try:
            result = self.deliver(frame, crc, may_hold=True, source=peer.source)
        except CallbackInterrupted:  # in a recv_async callback, which had its message: delivered
            self._finish(peer, TAKEN_WITHOUT_ID)
            raise
        except BaseException:
            peer.replay = (frame, crc)
            raise
        self._finish(peer, result)

    def _deliver_off_loop(self, peer: Peer, frame: memoryview, crc: int | None) -> None:
        """Deliver a frame on `off_loop`'s thread; its connection is not read until `take_decoded` books it."""
        deliver, source = self.deliver, peer.source
        self._unwatch(peer)
        self._off_loop(peer, lambda: deliver.deliver_decoded_apart(frame, crc, may_hold=True, source=source))

    def _release(self, peer: Peer) -> None:
        """`Peers._release`, off the loop for a held frame whose decoding would hold it (once it fits)."""
        held = peer.held
        assert held is not None
        if (
            self.off_loop is None
            or held.frame is None
            or decode_work(held.frame, self.limits) < DECODE_ON_LOOP_BELOW
            or not self.deliver.fits(held)
        ):
            super()._release(peer)
            return
        deliver = self.deliver
        self._off_loop(peer, lambda: deliver.release(held, apart=True), released=True)

    def _off_loop(self, peer: Peer, delivery: Callable[[], Delivered | None], released: bool = False) -> None:
        """Run `delivery` on `off_loop`'s thread; `take_decoded` books what it returned or raised."""
        assert self.off_loop is not None
        decoded, reading, name = self._decoded, self._reading, peer.name

        def run() -> None:
            reading.name = name  # (this thread's log lines name the connection)
            try:
                outcome: Any = delivery()
            except BaseException as exc:  # (booked by the leader, as a delivery here would have raised it)
                outcome = exc
            decoded.append((peer, outcome, released))
            self._decoded_ready()

        peer.decoding = True
        self.off_loop(run)

    def _decoded_ready(self) -> None:
        """A delivery off the loop is done (on its thread): have the leader book it (`take_decoded`)."""

    def take_decoded(self) -> list[Peer]:
        """Book the frames delivered off the loop since the last call, and watch their connections again (with
        bytes read ahead: in `_pending`): the leader calls it before it reads, and acks those it returns."""
        booked = []
        while self._decoded:
            peer, outcome, released = self._decoded.popleft()
            peer.decoding = False
            try:
                if isinstance(outcome, CallbackInterrupted):  # (a recv_async callback had its message: taken)
                    held = peer.held if released else None
                    outcome = TAKEN_WITHOUT_ID if held is None else Delivered(held.message_id, True, admitted=True)
                elif isinstance(outcome, MemoryError):
                    raise outcome
                elif isinstance(outcome, BaseException):
                    raise PeerGone(
                        f"dropped: delivering a frame failed ({type(outcome).__name__}); "
                        "its unacknowledged frames come again",
                        logging.WARNING,
                    )
                if released:  # (a held message offered again; a dropped peer's too, as `_release_held` offers it)
                    self._released(peer, outcome)
                elif not peer.gone:
                    self._finish(peer, outcome)
                elif outcome.held is not None:  # (dropped meanwhile: not booked, the frame comes again; but the
                    self._hold(peer, outcome.held)  # consumer holds it: offered again, as a dropped held peer's is)
            except PeerGone as exc:
                self._drop(peer, str(exc), exc.level)
            except MemoryError:
                self._drop(peer, "dropped: no memory for its next frame", logging.ERROR)
            except (OSError, ssl.SSLError) as exc:  # (an ack it sent)
                self._drop(peer, f"connection failed: {exc}", logging.ERROR)
            if not peer.paused and not peer.gone:  # (else held: the table had no room for it)
                self._watch_again(peer)
                booked.append(peer)
        return booked

    def _skip_length(self, prefix: Buffer, trailer: int) -> int:
        """Bytes to skip after a frame's prefix over this consumer's limits, which the consumer then counts
        as refused; raises PeerGone (drop the connection) for a prefix that is not a frame at all."""
        try:
            frame_length(prefix, self.limits)
        except LimitExceeded:
            return frame_length(prefix, NO_LIMITS) + trailer - PREFIX.size
        except CodecError as exc:
            also = " (and bit 7, its CRC after it)" if trailer else ""
            raise PeerGone(f"dropped: it sent something that is not a tensorbus frame: {exc}{also}") from None
        raise PeerGone("dropped: its reader refused a prefix frame_length takes (a bug: please report it)")

    def _finish(self, peer: Peer, result: Delivered) -> None:
        """Book a delivered frame in the ledger; ack every `ack_every_frames` frames or `ack_every_bytes` bytes."""
        if result.held is not None:
            self._hold(peer, result.held)
        if result.refused is not None:
            self._refuse(peer, peer.frames, result.refused)
        peer.positions.record(peer.frames, result)
        self._booked(peer)

    def _booked(self, peer: Peer, frames: int = 1, nbytes: int | None = None, largest: int | None = None) -> None:
        """Count `frames` booked in the ledger (one, by default, of `peer.total` bytes), `nbytes` in all, the
        largest `largest`; ack every `ack_every_frames` frames or `ack_every_bytes` bytes."""
        if nbytes is None:
            nbytes = largest = peer.total
        peer.frames += frames
        peer.unacked_bytes += nbytes
        if largest is not None and largest > self._largest_read:
            self._largest_read = largest
        if self._ack_due(peer):
            self._ack(peer)

    def _ack_due(self, peer: Peer) -> bool:
        """Whether the frames booked call for an ack: `ack_every_frames` frames or `ack_every_bytes` bytes
        unacked, or an ack owed (one the socket had no room for, refusals to send)."""
        every_frames, every_bytes = self._ack_every
        return peer.frames - peer.acked >= every_frames or peer.unacked_bytes >= every_bytes or peer.ack_owed
