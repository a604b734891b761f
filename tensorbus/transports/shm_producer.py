"""The shm:// producer: writes each frame into a slot of its segments and tells the consumer where.

A slot is written again only when nothing keeps it (`Slot.busy`): the consumer has acknowledged
its frame (else it is kept to be resent to the next consumer), no array on the consumer's side
views it any more ("free"), and no `empty()` array of the producer's own is alive. When the
consumer goes away, every segment it may still map is retired (never written again, dropped once
idle): a consumer that closed while the application keeps arrays keeps them unchanged, and one that
was killed frees them with its mappings.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import operator
import os
import select
import socket
import struct
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from ..buffers import address
from ..codec.dtypes import describe
from ..codec.frame import Buffer, join_into
from ..codec.native import STREAMED_FROM, copy_streamed
from ..errors import AuthRefused, Rejected, Timeout, TransportError, brief
from . import shm_control as control
from . import shm_ring
from .base import backoff_s
from .refusals import Refusals
from .shm_ring import ProducerRing
from .shm_segments import Slot, Slots
from .stream import proof
from .tally import Tally

if TYPE_CHECKING:
    from .shm import ShmOptions

log = logging.getLogger(__name__)
#: room before an `empty()` array for its frame's header (written in place at send)
HEAD_ROOM = 4096
#: idle segments a producer keeps for reuse, at most (fresh pages are slow to touch), beside the
#: `RUN_AHEAD_SLOTS` slots of the size it sent last (four of a 256 MiB tensor's frame are 1028 MiB)
POOLED_BYTES = 1 << 30
_CREDENTIALS = struct.Struct("3i")
#: frames sent between two reads of the consumer's acks, at most (more are read whenever a slot is wanted)
POLL_EVERY = 16
#: slots of one size a producer fills before it waits for the consumer to receive (see `_reclaim`)
RUN_AHEAD_SLOTS = 4
#: how often a producer waiting for room in a full notification ring looks at it again, at most
RING_RECHECK_S = 0.005


class ShmSender:
    """One producer's segments, slots in flight and control connection (used by one thread at a time)."""

    def __init__(self, name: str, path: str, options: ShmOptions, tally: Tally | None = None) -> None:
        self.name, self.path, self.options = name, path, options
        self.tally = Tally() if tally is None else tally  # (the transport's: metrics read it)
        secret = options.auth_secret
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self.slots = Slots(POOLED_BYTES, RUN_AHEAD_SLOTS)
        self._sock: socket.socket | None = None
        self._ring: ProducerRing | None = None  # the connection's notification ring, if both sides have it
        self._untold: collections.deque[Slot] = collections.deque()  # frames the full ring has no room for yet
        self._announced: set[int] = set()  # segments whose descriptor the current consumer has
        self._inflight: dict[int, Slot] = {}  # position -> its slot, while busy
        self._unacked: collections.deque[Slot] = collections.deque()  # slots not yet acked, oldest first
        self._positions = 0
        self.unacked_bytes = 0
        self._leases: dict[int, Slot] = {}  # payload address -> the slot of a live `empty()` array
        self._ended: list[Slot] = []  # slots whose `empty()` array died (appended by finalizers, any thread)
        self._ended_lock = threading.Lock()
        self.stats = collections.Counter[str]()  # frames sent "in_place" (from `empty()`) and "copied"
        self._packer = control.packer()  # (this sender is used by one thread at a time: the transport's send lock)
        #: the consumer's refusals of this producer's messages ("rejected"), raised by the next send or flush
        self.refusals = Refusals(f"shm://{name}")

    # -- empty() ---------------------------------------------------------------------------------

    def empty(self, shape: Any, dtype: Any) -> np.ndarray:
        """A writable array in a slot, with room before it for its frame's header. A shape numpy refuses, or a
        dtype no frame carries, is refused before a slot is taken."""
        dtype = np.dtype(dtype)
        describe(dtype)  # (UnsupportedDtype: object arrays and the like could never be sent)
        dims = tuple(operator.index(n) for n in np.atleast_1d(shape).tolist())  # (as numpy reads a shape)
        if any(n < 0 for n in dims):
            raise ValueError(f"negative dimensions are not allowed: {dims}")
        nbytes = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        self._settle_ended()
        slot = self.slots.take(HEAD_ROOM + nbytes, self._reclaim)
        try:
            start = slot.offset + HEAD_ROOM
            base = np.frombuffer(slot.segment.view(start, nbytes), dtype)  # (its views keep it alive)
            array = base.reshape(dims)
        except BaseException:
            self.slots.give_back(slot)
            raise
        slot.leased = True
        ender = weakref.finalize(base, self._lease_ended, slot)
        ender.atexit = False
        self._leases[int(base.__array_interface__["data"][0])] = slot
        return array

    def _lease_ended(self, slot: Slot) -> None:
        with self._ended_lock:
            self._ended.append(slot)

    def _settle_ended(self) -> None:
        if not self._ended:
            return
        with self._ended_lock:
            ended, self._ended = self._ended, []
        for slot in ended:
            slot.leased = False
            self._leases = {a: s for a, s in self._leases.items() if s is not slot}
            self._settle(slot)

    def leased(self, tensor: np.ndarray) -> bool:
        """True if `tensor` is an array from `empty()` (whole, as it was made)."""
        return bool(self._leases) and int(tensor.__array_interface__["data"][0]) in self._leases

    def send_in_place(self, tensor: np.ndarray, buffers: list[Buffer]) -> bool:
        """Send an `empty()` array's frame where the array is, its header written just before it: True if
        sent so. False (the caller copies it) while the consumer still has its last send (its acks read
        first: it may have let it go), or when the frame is not one header and the array's bytes
        (compressed, or a header past `HEAD_ROOM`)."""
        data = int(tensor.__array_interface__["data"][0])
        slot = self._leases.get(data)
        if slot is None or not buffers:
            return False
        if slot.untaken or slot.pinned:
            self.poll()
            if slot.untaken or slot.pinned:
                return False
        head, payload = buffers[:-1], memoryview(buffers[-1])
        head_bytes = sum(memoryview(b).nbytes for b in head)
        if payload.nbytes != tensor.nbytes or head_bytes > HEAD_ROOM or head_bytes % 64 or address(payload) != data:
            return False
        start = slot.offset + HEAD_ROOM - head_bytes
        join_into(head, slot.segment.view(start, head_bytes))
        self.stats["in_place"] += 1
        self._notify(slot, start, head_bytes + payload.nbytes)
        return True

    # -- sending ---------------------------------------------------------------------------------

    def send(self, frame: list[Buffer]) -> None:
        """Copy one frame into a free slot and tell the consumer."""
        self._settle_ended()
        total = sum(memoryview(b).nbytes for b in frame)
        slot = self.slots.take(total, self._reclaim)
        try:
            join_into(frame, slot.segment.view(slot.offset, total))
            self.stats["copied"] += 1
        except BaseException:
            self.slots.give_back(slot)
            raise
        self._notify(slot, slot.offset, total)

    def send_plain(self, head: Buffer, payload: memoryview) -> None:
        """`send` of a plain array's frame, its head and its bytes (flat), in fewer steps."""
        if self._ended:
            self._settle_ended()
        at = len(head)
        total = at + payload.nbytes
        slot = self.slots.take(total, self._reclaim)
        try:
            view = slot.segment.view(slot.offset, total)
            view[:at] = head
            if payload.nbytes >= STREAMED_FROM:  # (the consumer reads it from memory: no cache line read first)
                copy_streamed(view[at:], payload)
            else:
                view[at:] = payload
            self.stats["copied"] += 1
        except BaseException:
            self.slots.give_back(slot)
            raise
        self._notify(slot, slot.offset, total)

    def _notify(self, slot: Slot, start: int, length: int) -> None:
        """Tell the consumer of the frame in `slot`, then (every POLL_EVERY frames) take what it said: the acks
        must not fill the socket, and read after the notice they keep no frame from it (a ping's round trip
        paid for a whole read of acks every POLL_EVERY sends, before the ping went)."""
        if slot.pos:  # (an `empty()` array sent again: its last send is settled)
            self._inflight.pop(slot.pos, None)
        self._positions += 1
        slot.pos, slot.frame, slot.untaken = self._positions, (start, length), True
        self._inflight[slot.pos] = slot
        if self._sock is not None:
            try:
                self._owe_ack(slot)
                self._tell(slot)
            except OSError:
                self._lost()
            else:
                if self._untold:  # (no room to tell it now: the send returns once the consumer was told)
                    self._wait_told()
                if self._positions % POLL_EVERY == 0:
                    self.poll()
                return
        self._connect()  # (it sends every untaken frame, this one too)

    def _tell(self, slot: Slot) -> None:
        """Tell the consumer of `slot`'s frame, now if there is room for its notice, else once there is (`_untold`:
        no send waits inside `_tell`, where `send_timeout_s` could not bound it)."""
        slot.pinned = True
        if self._untold or not self._put(slot):  # (behind frames waiting for room, or no room)
            self._untold.append(slot)

    def _put(self, slot: Slot) -> bool:
        """Tell the consumer of `slot`'s frame: in the ring (a datagram only to wake a consumer that sleeps), or in
        a "frame" datagram; a segment it has not seen is announced first (the notice must not overtake it). False,
        with the notice not told, if the ring is full or the socket has no room (a consumer that stopped reading
        it: its table is full, or it is stopped); nothing here waits for room."""
        ring, sock = self._ring, self._sock
        assert sock is not None
        segment = slot.segment
        try:
            if segment.seg_id not in self._announced:
                control.send(sock, "seg", segment.seg_id, segment.size, fds=[segment.fd], wait=False)
                self._announced.add(segment.seg_id)
            if ring is None:
                control.send(sock, "frame", slot.pos, segment.seg_id, *slot.frame, by=self._packer, wait=False)
                return True
        except BlockingIOError:
            return False
        try:
            told = ring.put(slot.pos, segment.seg_id, *slot.frame)
        except ValueError as exc:  # (the consumer's words in the ring are out of range)
            raise ConnectionResetError(f"the consumer's notification ring is corrupt: {exc}") from None
        if told > 0:  # (at most once a sleep: `put` takes the consumer's word back)
            with contextlib.suppress(BlockingIOError):  # (a socket full of datagrams it has not read wakes it too)
                control.send(sock, "wake", wait=False)
        return told >= 0

    def _tell_untold(self) -> None:
        """Tell the consumer of `_untold` frames, oldest first, while there is room: a full ring or socket (a
        reconnect's resends, a tensor's chunks, a consumer not reading) keeps the rest, and the frames after them
        wait behind them, told by the next send's `wait_for_room`, a flush, or a wait's look (never a wait inside
        `_tell`)."""
        while self._untold and self._put(self._untold[0]):
            self._untold.popleft()

    def _owe_ack(self, slot: Slot) -> None:
        if self.tally.timed is None:  # (a frame in flight is timed already, mostly: no call)
            self.tally.timing(slot.pos)
        slot.unacked = True
        self.unacked_bytes += slot.frame[1]
        self._unacked.append(slot)

    def wait_for_room(self) -> None:
        """Wait while `max_unacked_bytes` are unacknowledged, or the notification ring is full (the consumer
        has not read what it holds), up to `send_timeout_s`. First, `Rejected` for a message the consumer refused,
        if one was not raised yet."""
        if self.refusals.pending:
            self.refusals.raise_oldest()
        limit = self.options.max_unacked_bytes
        if self._sock is not None and self.unacked_bytes >= limit:
            self.poll()
        if self._sock is not None and self.unacked_bytes >= limit:
            self._wait_for_room(lambda: self.unacked_bytes < limit)
        if self._untold and self._sock is not None:
            self._poll_untold()
        ring, sock = self._ring, self._sock
        if ring is not None and (self._untold or not ring.free()):
            self._wait_for_room(
                lambda: self._ring is not ring or (not self._untold and ring.free() > 0), poll_s=RING_RECHECK_S
            )
        elif sock is not None and ring is None and self._untold:  # (a socket with no room for the notices)
            self._wait_told()

    def flush(self, timeout: float | None) -> None:
        """Wait until the consumer has every frame sent in its table; one that went away is replaced by
        the next consumer of the name, which is sent every frame the first did not hand out. Then `Rejected` for a
        message the consumer refused, if one was not raised yet."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll()  # (finds a consumer gone)
            if self._sock is None and any(slot.untaken for slot in self._inflight.values()):
                self._connect(deadline)
            if not self.unacked_bytes:
                self.refusals.raise_oldest()
                return
            # (a consumer lost meanwhile settles every ack owed: the loop then dials the next and waits for it)
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            self._wait(lambda: not self.unacked_bytes, left, "flush")

    def _wait(self, done: Any, timeout: float | None, what: str, poll_s: float | None = None) -> None:
        """Wait until `done()`, reading the consumer's messages, for up to `timeout` seconds (then `Timeout`), and
        asking `done` again every `poll_s` at least: a ring's room shows in memory, not as a message (the acks the
        consumer sends as it reads mostly end the wait sooner)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        asked = False  # (the consumer sends what it owes at once when asked, else within its LINGER_S)
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                full = self._untold or (self._ring is not None and not self._ring.free())
                room = "notification ring" if self._ring is not None else "socket"
                ring = f", its {room} full ({len(self._untold)} frames wait for room)" if full else ""
                raise Timeout(
                    f"{what}: {self.unacked_bytes} bytes unacknowledged by shm://{self.name}{ring} after {timeout}s "
                    f"(max_unacked_bytes={self.options.max_unacked_bytes}): is its consumer receiving, or aborted?"
                )
            if self._sock is None:
                self._connect(deadline)
                asked = False
            sock = self._sock
            assert sock is not None
            if self._untold:  # (room shows in memory, not as a message: looked at every RING_RECHECK_S)
                self._poll_untold()
                poll_s = RING_RECHECK_S if poll_s is None else min(poll_s, RING_RECHECK_S)
                if done() or self._sock is None:
                    continue
            if not asked:
                asked = True
                try:
                    control.send(sock, "ask", wait=False)
                except BlockingIOError:  # (it has our messages to read first: they get acks too)
                    pass
                except OSError:
                    self._lost()
                    continue
            # (the socket stays blocking without a timeout: Python waits out a socket timeout even with MSG_DONTWAIT)
            if poll_s is not None:
                left = poll_s if left is None else min(left, poll_s)
            readable, _, _ = select.select([sock], [], [], left)
            if readable:
                self.poll()

    # -- what the consumer says ------------------------------------------------------------------

    def _reclaim(self, size: int) -> None:
        """No slot of class `size` is free: take the consumer's frees; while it has not even received
        what was sent and `RUN_AHEAD_SLOTS` of the class are in use, wait for one rather than make a new
        segment (reused memory is hot: fresh pages are slow to touch, on the consumer's side too)."""
        self.poll()
        if self.slots.has_free(size) or not self.unacked_bytes or self.slots.busy(size) < RUN_AHEAD_SLOTS:
            return
        self._wait_for_room(lambda: self.slots.has_free(size) or not self.unacked_bytes)

    def _wait_for_room(self, done: Any, poll_s: float | None = None) -> None:
        """Wait until `done()` for up to `send_timeout_s`, the seconds waited counted as backpressure (the
        tally's `blocked_s`: written by the sending thread, under the transport's send lock)."""
        started = time.monotonic()
        try:
            self._wait(done, self.options.send_timeout_s, "wait for room", poll_s)
        finally:
            self.tally.blocked(started)

    def _wait_told(self) -> None:
        """Wait until the consumer was told of every frame sent (`_untold` empty), up to `send_timeout_s`: a send
        must not return with its tensor's notice still here, which nothing would send while the producer idles
        (a consumer that caught up would never see it). On `Timeout` the frames stay: told once there is room,
        or sent to the next consumer of the name."""
        sock = self._sock
        self._wait_for_room(lambda: self._sock is not sock or not self._untold, poll_s=RING_RECHECK_S)

    def _poll_untold(self) -> None:
        """`_tell_untold`, a consumer gone meanwhile noticed (its untold frames wait for the next)."""
        try:
            self._tell_untold()
        except OSError:
            self._lost()

    def poll(self) -> None:
        """Take what the consumer has said so far (acks, frees), without waiting; tell it of segments dropped
        that the socket had no room for before."""
        if self._sock is not None:
            try:
                self._drain(blocking=False)
                if self.slots.dropped:
                    self._tell_dropped()
            except OSError:
                self._lost()

    def _drain(self, *, blocking: bool) -> None:
        """Take the consumer's "ack" and "free" messages: one (waiting for it) if `blocking`, then all waiting."""
        assert self._sock is not None
        while True:
            got = control.receive(self._sock, blocking=blocking)
            if got is None:
                return
            blocking = False
            message, fds = got
            for fd in fds:  # (the consumer sends none)
                os.close(fd)
            if message[0] == "rejected" and len(message) == 3 and type(message[1]) is int and type(message[2]) is bytes:
                self._rejected(message[1], message[2].decode("utf-8", "replace"))
                continue
            if message[0] != "ack" or len(message) != 4 or type(message[1]) is not int:
                raise TransportError(f"shm://{self.name}: unexpected control message {message[0]!r}")
            _, received, taken, frees = message
            self._acked_before(received)
            for positions, field in ((taken, "untaken"), (frees, "pinned")):
                for pos in positions if isinstance(positions, list) else []:
                    slot = self._inflight.get(pos) if type(pos) is int else None
                    if slot is not None:
                        setattr(slot, field, False)
                        self._settle(slot)
            self._tell_dropped()

    def _rejected(self, pos: int, reason: str) -> None:
        """The consumer refused the frame at `pos`: a `Rejected` for the next send or flush (its names read from
        the frame itself, still in its slot: the consumer frees it after this message)."""
        slot = self._inflight.get(pos)
        self.refusals.add(reason, slot.segment.view(*slot.frame) if slot is not None else None)

    def _acked_before(self, pos: int) -> None:
        """Every frame before `pos` is in the consumer's table (or settled): no longer counted as unacked."""
        while self._unacked and self._unacked[0].pos < pos:
            slot = self._unacked.popleft()
            if slot.unacked:
                slot.unacked = False
                self.unacked_bytes -= slot.frame[1]
                self.tally.acked(1, through=pos)

    def _settle(self, slot: Slot) -> None:
        """Give `slot` back once nothing keeps it."""
        if slot.busy:
            return
        if slot.pos:
            if self._inflight.pop(slot.pos, None) is None:
                return
        self.slots.give_back(slot)

    def _tell_dropped(self) -> None:
        """Tell the consumer of the segments this side let go of, so that it unmaps them; one the socket has no
        room for now stays in `slots.dropped`, told at the next look (a consumer's mapping keeps its memory)."""
        dropped, self.slots.dropped = self.slots.dropped, []
        for at, seg_id in enumerate(dropped):
            if seg_id in self._announced and self._sock is not None:
                try:
                    control.send(self._sock, "drop", seg_id, wait=False)
                except BlockingIOError:
                    self.slots.dropped.extend(dropped[at:])
                    return
                except OSError:
                    return  # (gone: noticed at the next send, and every mapping goes with the connection)
                self._announced.discard(seg_id)

    # -- the connection --------------------------------------------------------------------------

    def _connect(self, until: float | None = None) -> None:
        """Connect (retrying up to `reconnect_timeout_s`, or until `until` if sooner: a flush's or a close's
        deadline) and send every frame not yet acknowledged; a consumer that goes away again meanwhile is
        dialled again, within the same deadline."""
        deadline = time.monotonic() + self.options.reconnect_timeout_s
        bound = f"reconnect_timeout_s={self.options.reconnect_timeout_s}s"
        if until is not None and until < deadline:
            deadline, bound = until, "the flush's timeout"
        delays = backoff_s()
        while True:
            while True:
                try:
                    self._sock, self._ring = self._handshake()
                    break
                except (TimeoutError, FileNotFoundError, ConnectionRefusedError, ConnectionResetError) as exc:
                    if time.monotonic() + 0.05 > deadline:
                        raise TransportError(
                            f"no consumer answers at shm://{self.name} ({self.path}: {exc}) within {bound}"
                        ) from None
                    time.sleep(min(next(delays), max(deadline - time.monotonic(), 0.0)))
            self._announced = set()
            try:
                for pos in sorted(self._inflight):
                    slot = self._inflight[pos]
                    if slot.untaken:
                        self._owe_ack(slot)
                        self._tell(slot)
                return
            except OSError as exc:
                self._lost()
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"the consumer at shm://{self.name} keeps dropping the connection ({exc}) within {bound}"
                    ) from None

    def _handshake(self) -> tuple[socket.socket, ProducerRing | None]:
        """A connection to the consumer, past its proof, and its notification ring if both sides have one."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(self.options.connect_timeout_s)
            sock.connect(self.path)
            uid = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))[1]
            if uid != os.getuid() and self._secret is None:
                raise TransportError(f"shm://{self.name} is served by another user (uid {uid}); set auth_secret")
            hello = control.receive(sock)
            assert hello is not None
            (kind, nonce, *offers), _fds = hello
            if kind != "hello" or not isinstance(nonce, bytes):
                raise TransportError(f"shm://{self.name}: unexpected greeting {kind!r}")
            control.send(sock, "proof", proof(self._secret, nonce))
            verdict = control.receive(sock)
            assert verdict is not None
            if verdict[0][0] != "ok":  # (the consumer refuses a producer for its proof alone: auth_secret)
                reason = verdict[0][1] if len(verdict[0]) > 1 else "refused"
                raise AuthRefused(
                    f"shm://{self.name} refused this producer: {brief(reason)}: check the auth_secret option"
                )
            if offers[2:3] == [True]:  # (["hello", nonce, auth, ring, refusals told]: before the ring, whose notices
                control.send(sock, "refusals")  # the consumer may read before a later message)
            ring = None
            if offers[1:2] == [True] and shm_ring.available():  # (["hello", nonce, auth, ring offered])
                ring = ProducerRing()
                try:
                    control.send(sock, "ring", ring.capacity, fds=[ring.fd])
                except BaseException:
                    ring.close()
                    raise
            sock.settimeout(None)
            return sock, ring
        except BaseException:
            sock.close()
            raise

    def _lost(self) -> None:
        """The consumer went away: what it may still map is retired; untaken frames wait for the next (and
        are owed acks again once sent to it: a `flush` that saw them acknowledged has returned)."""
        if self._sock is not None:
            # what it said before it went still counts: a consumer that closed sent its last acks, and frames it
            # took must not go to its successor again (a send that found it gone had not read them yet)
            with contextlib.suppress(OSError, TransportError):
                self._drain(blocking=False)
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        self._close_ring()
        self._untold.clear()  # (untaken: sent to the next consumer)
        self._unacked.clear()
        self.unacked_bytes = 0
        for pos in sorted(self._inflight):
            slot = self._inflight[pos]
            slot.unacked = False
            if slot.pinned:
                self.slots.retire(slot.segment)
                slot.pinned = False
            self._settle(slot)
        self.slots.dropped.clear()

    def _close_ring(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def close(self, timeout: float | None) -> None:
        """Wait up to `timeout` for the consumer's acks (while connected), then let go of the connection and
        the segments; what is still unacknowledged then is logged, not raised."""
        self.refusals.clear()  # (each was logged as it came)
        try:
            if self._sock is not None and self.unacked_bytes:
                self.flush(timeout)
        except Rejected:
            pass  # (logged as it came)
        except (TransportError, Timeout) as exc:
            # (its text, not the error: a kept log record would keep its traceback, this sender and its segments)
            log.warning("shm://%s: closed with frames unacknowledged: %s", self.name, str(exc))
        finally:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._close_ring()
            self.slots.close()
            # (frames never to be sent again: their segments' mappings go with the last array viewing them,
            # not with this sender, whose last frees may not have come before close)
            self._inflight.clear()
            self._unacked.clear()
