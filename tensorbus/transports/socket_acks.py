"""A socket producer's side of the acks: the copies it keeps, and the ACK, TAKEN and REFUSAL records it reads.

The consumer tells a producer, on its connection, how many frames it received (ACK: the credit
`max_unacked_bytes` counts and what `flush` waits for) and how many it released (TAKEN: the
producer drops its copies of those), and which frames it refused (REFUSAL, raised by the next
`send` or `flush`). See stream.py for the records and ledger.py for what the consumer releases.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import math
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Generator

from ..codec.frame import Buffer
from ..errors import TransportError
from .base import ProducerSide
from .refusals import Refusals
from .stream import ACK, ACK_REQUEST_MARKER, REFUSAL, REFUSED, TAKEN, SocketOptions

log = logging.getLogger("tensorbus.transports.socket")  # (the socket transport's one logger)
#: a producer reads the acks that arrived every this many sends (four times `ack_every_frames` unacked asks for one)
READ_ACKS_EVERY = 64
#: a producer waiting for acks asks again this often when the consumer answers without progress
ACK_POLL_S = 0.02
#: a flush that saw every frame received waits for the consumer's word that it took them (TAKEN) at most
#: as long as copying the untaken ones would take (`_own_untaken`; into fresh memory ~1 GB/s on the
#: 2-vCPU VM, docs/PERFORMANCE.md) ...
COPY_BYTES_PER_S = 1e9
#: ... and never longer than this (a consumer that took them says so within `TAKEN_EVERY_S` unasked)
TAKEN_WAIT_MAX_S = 0.1
#: ... nor at all for less than this: a copy so short costs less than asking
TAKEN_WAIT_FROM_S = 0.001
#: that copy goes in slices of at most this many bytes and frames, an event loop's other tasks running
#: between two (a slice takes ~1 ms on the 2-vCPU VM)
OWN_SLICE_BYTES = 1 << 20
OWN_SLICE_FRAMES = 1024


class AckIO(enum.Enum):
    """What a wait for acks (`ProducerAcks._ack_steps`) asks its driver to do, with the step's number."""

    CONNECT = "connect"  # (re)connect, sending the unacknowledged frames again, by the deadline given (None: none)
    ASK = "ask"  # write ACK_REQUEST_MARKER on the connection
    READ = "read"  # wait up to the seconds given for the connection to be readable, and apply the acks there
    PAUSE = "pause"  # sleep the seconds given (0: let an event loop's other tasks run)


AckStep = tuple[AckIO, "float | None"]


def next_step(steps: Generator[AckStep, None, None], error: BaseException | None) -> AckStep | None:
    """A driver's next step of `steps`, after throwing in what the last one raised (`error`); None once done."""
    try:
        return steps.throw(error) if error is not None else next(steps)
    except StopIteration:
        return None


def readable(sock: socket.socket, wait_s: float = 0.0) -> bool:
    """Whether `sock` has bytes (or an error) to read within `wait_s`; poll, as select() fails on fds >= 1024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(wait_s * 1000))))


def _recv_now(sock: socket.socket) -> bytes | None:
    """What the socket has now; None when that is only part of a TLS record (a blocking read would wait)."""
    if not isinstance(sock, ssl.SSLSocket):
        return sock.recv(4096)
    timeout = sock.gettimeout()
    sock.settimeout(0.0)
    try:
        return sock.recv(4096)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
        return None
    finally:
        sock.settimeout(timeout)


class ProducerAcks(ProducerSide):
    """The copies a socket producer keeps and the records it reads; everything here is guarded by `_lock`
    (the send lock: `SocketProducer` takes it around every use)."""

    options: SocketOptions
    _lock: threading.Lock
    _sock: socket.socket | None

    def _init_acks(self) -> None:
        #: the frames sent on this connection that the consumer has not taken, from frame `_taken` on,
        #: each with its size: resent on reconnect
        self._unacked: collections.deque[tuple[list[Buffer], int]] = collections.deque()
        self._unacked_bytes = 0  # bytes of frames not received (the credit `max_unacked_bytes` bounds)
        self._untaken_bytes = 0  # bytes of frames received, not taken (the copies `max_untaken_bytes` bounds)
        self._sent = self._acked = self._taken = 0  # frames sent, received (ACK), taken (TAKEN) on this connection
        #: copies of received, untaken frames let go at `max_untaken_bytes` (not resent should the consumer die)
        self.untaken_let_go = 0
        self._ack_buf = bytearray()
        self._ack_requested = False
        #: the consumer's refusals of this producer's messages, raised one by one by the next sends or flushes
        self._rejections = Refusals(self.address)

    def forget(self, frames: list[list[Buffer]]) -> None:
        """Drop `frames` (the chunks of a message that failed part way) from those resent on reconnect: a
        message that can never complete would hold up the consumer's acks. Found by identity, not as the
        last ones sent: another thread's frames may have gone out between two chunks, and stay.

        A failed send has dropped the connection already; after an interrupt between two chunks it
        is dropped here, as its acks would wait for the rest of the message too.
        """
        doomed = {id(frame) for frame in frames}
        with self._lock:
            self._drop_connection()
            kept: collections.deque[tuple[list[Buffer], int]] = collections.deque()
            gone = gone_received = 0
            for index, (frame, n) in enumerate(self._unacked):
                if id(frame) not in doomed:
                    kept.append((frame, n))
                    continue
                gone += 1
                if self._taken + index < self._acked:  # (received already: its copy counted as untaken)
                    gone_received += 1
                    self._untaken_bytes -= n
                else:
                    self._unacked_bytes -= n
            self._unacked = kept
            self._sent -= gone
            self._acked -= gone_received

    def abandon(self) -> None:
        """Close this process's descriptor of the connection: the parent's stays open (no shutdown, no FIN)."""
        self._drop_connection()  # (close, not shutdown)
        self._unacked.clear()  # the parent's to resend
        self._unacked_bytes = self._untaken_bytes = 0
        self._sent = self._acked = self._taken = 0

    def _drop_connection(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._ack_requested = False

    def _keep_until_acked(self, frame: list[Buffer], nbytes: int) -> None:
        """Keep a sent frame until it is acked; read the acks that came every `READ_ACKS_EVERY` sends."""
        self._unacked.append((frame, nbytes))
        self._unacked_bytes += nbytes
        if self.tally.timed is None:  # (a frame in flight is timed already, mostly: no call)
            self.tally.timing(self._sent)
        self._sent += 1
        if self._sent % READ_ACKS_EVERY == 0 or self._unacked_bytes >= self.options.max_unacked_bytes:
            self._trim_acked()

    def _trim_acked(self) -> None:
        """Release the frames acks already received cover; never blocks.

        The consumer acks every `ack_every_frames` frames by itself (each ack costs it a system call
        that also wakes this side): an ack is asked for only when that plainly is not happening.
        """
        assert self._sock is not None
        overdue = (
            self._sent - self._acked >= 4 * self.options.ack_every_frames
            or self._unacked_bytes >= self.options.max_unacked_bytes
        )
        try:
            if overdue and not self._ack_requested:
                self._sock.sendall(ACK_REQUEST_MARKER)
                self._ack_requested = True
            self._read_acks(0)
        except OSError as exc:
            log.warning("connection to %s broke (%s); frames will be resent on reconnect", self.address, exc)
            self._drop_connection()

    def _read_acks(self, wait_s: float) -> bool:
        """Apply the acks that arrive within `wait_s` seconds (0: only those already here); False if none came."""
        sock = self._sock
        assert sock is not None
        pending = isinstance(sock, ssl.SSLSocket) and sock.pending()
        if not pending and not readable(sock, wait_s):
            return False
        data = _recv_now(sock)
        if data is None:
            return False  # part of a TLS record: the rest comes with a later read
        if not data:
            raise ConnectionResetError("consumer closed the connection")
        self._ack_buf += data
        while len(self._ack_buf) >= ACK.size:
            (count,) = ACK.unpack_from(self._ack_buf)
            if count & REFUSED:
                if not self._take_refusal():
                    return True  # (the rest of it comes with a later read)
                continue
            del self._ack_buf[: ACK.size]
            if count & TAKEN:
                self._drop_taken(count & ~TAKEN)
                continue
            if not self._acked <= count <= self._sent:
                raise ConnectionResetError(f"the consumer acked {count} frames; {self._sent} were sent")
            self._ack_requested = False
            self.tally.acked(count - self._acked, through=count)
            for index in range(self._acked - self._taken, count - self._taken):
                n = self._unacked[index][1]
                self._unacked_bytes -= n
                self._untaken_bytes += n
            self._acked = count
            self._let_go_over(self.options.max_untaken_bytes)
        return True

    def _drop_taken(self, count: int) -> None:
        """The consumer took the frames before `count`: drop their copies (caller holds the lock)."""
        if count > self._acked:
            raise ConnectionResetError(f"the consumer took {count} frames; it acked {self._acked} as received")
        for _ in range(count - self._taken):  # (none when copies were let go past it already)
            _, n = self._unacked.popleft()
            self._untaken_bytes -= n
        self._taken = max(self._taken, count)

    def _let_go_over(self, limit: int) -> None:
        """Let the oldest copies of received, untaken frames go while they hold more than `limit` bytes."""
        while self._untaken_bytes > limit and self._taken < self._acked:
            _, n = self._unacked.popleft()
            self._untaken_bytes -= n
            self._taken += 1
            if not self.untaken_let_go:
                log.warning(
                    "%s holds over max_untaken_bytes=%d received, untaken: letting the oldest copies go "
                    "(not resent should it die)", self.address, limit,
                )  # fmt: skip
            self.untaken_let_go += 1

    def _flush_steps(self, timeout: float | None) -> Generator[AckStep, None, None]:
        """A flush's waits (`_ack_steps`, for a driver to perform): every frame received, which is what
        `flush` promises, for at most `timeout` seconds; then the untaken ones made the producer's own.

        Between the two, briefly (`_taken_wait_s`), the consumer's word that it took them: a consumer
        takes a tensor just after it acks its arrival, and the copy of a large one costs more than asking."""
        yield from self._ack_steps(
            lambda: (self._sock is not None and self._acked == self._sent) or not self._unacked,
            timeout,
            lambda: f"{self._sent - self._acked} frames unacknowledged by {self.address} after {timeout}s",
        )
        wait_s = self._taken_wait_s()
        if wait_s >= TAKEN_WAIT_FROM_S:
            with contextlib.suppress(TransportError):  # (its time ran out: copy them)
                yield from self._ack_steps(lambda: self._sock is None or self._taken >= self._acked, wait_s, str)
        yield from self._own_untaken()

    def _taken_wait_s(self) -> float:
        """How long a flush waits for TAKEN before it copies what the kept frames borrow: no longer than
        that copy would take (COPY_BYTES_PER_S), nor than TAKEN_WAIT_MAX_S."""
        borrowed = sum(
            memoryview(part).nbytes
            for frame, _ in self._unacked
            for part in frame
            if not isinstance(part, (bytes, bytearray))
        )
        return min(borrowed / COPY_BYTES_PER_S, TAKEN_WAIT_MAX_S)

    def _own_untaken(self) -> Generator[AckStep, None, None]:
        """Replace the kept frames' references to the sender's arrays by copies (caller holds the lock).

        What `flush` does once every frame is received: the application may then change an array it
        sent, and a tensor still untaken, resent to a successor, carries the bytes it had when sent.
        It copies at most `max_untaken_bytes` (what may be kept once received), and each frame once,
        in slices (OWN_SLICE_BYTES, OWN_SLICE_FRAMES) with a pause of no time between: an event loop
        runs its other tasks there (ten thousand small frames copied at once held it for tens of ms).
        """
        copied = looked = 0
        for frame, _ in list(self._unacked):  # (a frame acked during a pause is copied all the same: harmless)
            for index, part in enumerate(frame):
                if isinstance(part, (bytes, bytearray)):  # (heads and signatures are owned; the rest views arrays)
                    continue
                view = memoryview(part).cast("B")
                owned = bytearray(view[:OWN_SLICE_BYTES])
                while len(owned) < view.nbytes:  # (a large array's bytes a slice at a time too)
                    yield AckIO.PAUSE, 0.0
                    owned += view[len(owned) : len(owned) + OWN_SLICE_BYTES]
                frame[index] = owned
                copied += len(owned)
            looked += 1
            if copied >= OWN_SLICE_BYTES or looked >= OWN_SLICE_FRAMES:
                copied = looked = 0
                yield AckIO.PAUSE, 0.0

    def _ack_steps(
        self, done: Callable[[], bool], timeout: float | None, failure: Callable[[], str]
    ) -> Generator[AckStep, None, None]:
        """Wait for acks until `done()`: ask for them, read them, reconnect (resending) when the connection
        breaks, for at most `timeout` seconds (then a TransportError saying `failure()`).

        The rule, with its waiting left to a driver: the blocking `SocketProducer._await_acks` and the event
        loop's `LoopSender._await_acks` perform each step (`AckIO`) and throw back what it raised (`next_step`).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TransportError(failure())
            acked = self._acked
            try:
                if self._sock is None:
                    try:
                        yield AckIO.CONNECT, deadline
                    except TransportError as exc:  # the wait's time ran out while reconnecting: say what waited
                        if deadline is None or time.monotonic() < deadline:
                            raise
                        raise TransportError(f"{failure()}; the last reconnect: {exc}") from None
                if not self._ack_requested:
                    yield AckIO.ASK, None
                    self._ack_requested = True
                yield AckIO.READ, 1.0 if remaining is None else min(remaining, 1.0)
                if self._acked == acked and not self._ack_requested and not done():  # answered, nothing new: don't spin
                    yield AckIO.PAUSE, ACK_POLL_S if remaining is None else min(ACK_POLL_S, remaining)
            except OSError as exc:
                if self._sock is not None:
                    with contextlib.suppress(OSError):
                        self._read_acks(0)  # a consumer that closed may have acked everything first
                self._drop_connection()
                if not done():
                    log.warning("connection to %s broke while awaiting acks (%s); reconnecting", self.address, exc)

    def _take_refusal(self) -> bool:
        """Take a REFUSAL off the front of the ack buffer (False: not all of it is here yet); a message's
        first refused frame becomes a `Rejected` for the next send or flush to raise."""
        if len(self._ack_buf) < REFUSAL.size:
            return False
        field, length = REFUSAL.unpack_from(self._ack_buf)
        if len(self._ack_buf) < REFUSAL.size + length:
            return False
        reason = bytes(self._ack_buf[REFUSAL.size : REFUSAL.size + length]).decode("utf-8", "replace")
        del self._ack_buf[: REFUSAL.size + length]
        index = field & ~REFUSED
        if not self._acked <= index < self._sent:
            raise ConnectionResetError(f"the consumer refused frame {index}; {self._sent} were sent")
        self._rejections.add(reason, self._unacked[index - self._taken][0][0])
        return True

    def _raise_rejection(self) -> None:
        """Raise the consumer's oldest refusal not raised yet, if there is one."""
        self._rejections.raise_oldest()
