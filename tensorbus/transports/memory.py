"""`memory://NAME`: an in-process transport with the same semantics as the network ones.

Frames are copied on send (as a socket would) into the endpoint's queue (memory_frames.py), which
exists as soon as either side names it, so a producer may send before the consumer listens, as with a
broker queue. The consumer's delivery (memory_reading.py) takes a plain tensor on the producer's thread
while nothing is queued, else runs on the thread of a waiting `recv`, so a hand-over costs one thread
wake-up at most; it keeps each frame it delivered until the ledger releases it (ledger.py), and on
close what it did not release goes back to the front of the queue, for the next consumer.
All state lives in one `MemoryHub`; `HUB.reset()` clears it between tests.
"""

from __future__ import annotations

import itertools
import logging
import math
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..buffers import BufferPool, copy_into
from ..codec.frame import CRC_AT, FLAG_CHECKSUM, NATIVE, Buffer, Limits, MessageId, checksum_of, flat_bytes, join_into
from ..codec.native import crc32c, crc32c_copy
from ..errors import TransportError
from ..options import finite_timeout
from .base import Deliver
from .memory_frames import Frames
from .memory_pacing import BURST_BYTES
from .memory_reading import MemoryReader
from .named import NamedOptions, NamedTransport
from .refusals import Refusals

log = logging.getLogger(__name__)


#: numbers naming producers as the sources of their frames (`MemoryTransport._source`), in this process
_SOURCES = itertools.count(1)
#: a plain tensor smaller than this has its frame made whole in C, in a fresh buffer of its own (one call:
#: a small tensor's time is mostly steps); a larger one is copied into the pool's buffers (fresh pages are slow)
SMALL_FRAME = 64 << 10
#: a frame this large is copied and checksummed without the interpreter lock; a smaller one holding it: a
#: producer that lets go of it hands it to the receive for a while, and each hand-over wakes a thread (at
#: 64 KB, both ends in one process, 28-38k tensors/s letting go against 30-46k holding it; at 1 MB 7.5-8.5k
#: against 3.9-4.7k: docs/PERFORMANCE.md)
LET_GO_FROM = 1 << 20


class MemoryHub:
    """The named endpoints of the memory transport: name -> queue of frames."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, Frames] = {}
        self._listening: set[str] = set()

    def endpoint(self, name: str) -> Frames:
        """The queue for `name`, created on first use."""
        with self._lock:
            return self._endpoint(name)

    def _endpoint(self, name: str) -> Frames:
        """The queue for `name` (caller holds the lock); a new one is made only when there is none."""
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = Frames()
        return queue

    def claim(self, name: str) -> Frames:
        """Register the one consumer of `name`; a second is refused, as a socket address would be."""
        with self._lock:
            if name in self._listening:
                raise TransportError(f"memory://{name} already has a consumer")
            self._listening.add(name)
            return self._endpoint(name)

    def release(self, name: str) -> None:
        """Let another consumer take `name` (frames still queued stay for it)."""
        with self._lock:
            self._listening.discard(name)

    def listening(self, name: str) -> bool:
        """Whether `name` has a consumer."""
        with self._lock:
            return name in self._listening

    def reset(self) -> None:
        """Forget every endpoint and queued frame."""
        with self._lock:
            self._queues.clear()
            self._listening.clear()


HUB = MemoryHub()


@dataclass(frozen=True, kw_only=True)
class MemoryOptions(NamedOptions):
    """The options of memory:// endpoints (`max_unacked_bytes` counts what its consumer's delivery did not take)."""

    #: how long a waiting `recv` spins, without the interpreter lock, before it sleeps (a sleeping thread wakes
    #: late: wakeup.py). Longer than tcp://'s: a reply that comes after the spin ended wakes a sleeping thread
    #: (~100 µs), by when its peer's own spin has ended too, and both sleep from then on
    spin_s: float = 0.001


class MemoryTransport(NamedTransport):
    """Frames through an in-process queue, delivered to the consumer on its waiting receive's thread."""

    Options = MemoryOptions
    options: MemoryOptions
    reads_while_waiting = True

    def __init__(self, url: urllib.parse.SplitResult, options: MemoryOptions) -> None:
        super().__init__(url, options)
        self._reader: MemoryReader | None = None  # the consumer's
        #: as many middle-sized buffers recycled as a producer delivers ahead of a receive (memory_pacing.py)
        self._pool = BufferPool(max_buffers=4, recycled_bytes=BURST_BYTES + (1 << 20))
        #: what the consumer counts this producer's buffered tensors by (its share of the table)
        self._source = next(_SOURCES)
        #: the endpoint's queue, looked up once (it lives as long as the hub; `HUB.reset` is for between tests)
        self._frames = HUB.endpoint(self.name)
        #: the consumer's refusals of this producer's messages (it tells them through the queue: `Frames.refused`)
        self.refusals = Refusals(f"memory://{self.name}")
        self._frames.tell_refusals(self._source, self.refusals)
        self._send_timeout = finite_timeout(options.send_timeout_s, "send_timeout_s")

    def wait_for_room(self) -> None:
        """Before a new message: wait while `max_unacked_bytes` wait for the consumer (up to `send_timeout_s`).

        Called between messages, never between the chunks of one, so a message larger than the
        limit still goes out whole. First, `Rejected` for a message the consumer refused, if one was not raised yet.
        """
        if self.refusals.pending:
            self.refusals.raise_oldest()
        limit, queue, source = self.options.max_unacked_bytes, self._frames, self._source
        if queue.wait_for_room(limit, self._send_timeout, source, self.tally):
            return
        raise TransportError(
            f"memory://{self.name} has had {queue.queued(source)} bytes waiting for its consumer for "
            f"{self.options.send_timeout_s}s "
            f"(max_unacked_bytes={limit}): is a consumer listening, and receiving?"
        )

    def has_room(self) -> bool:
        """Whether a new message would go out now, with no wait for the consumer (`wait_for_room`), the pace
        (memory_pacing.py) or another thread (`Frames.has_room`: False when it cannot tell at once)."""
        return self._frames.has_room(self.options.max_unacked_bytes, self._source)

    def pay_pace(self) -> None:
        """Wait out a pause this endpoint's pace owes (memory_pacing.py `Pace.owe`), on a thread that may wait."""
        self._frames.pace.pay()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until a consumer's delivery took every frame this producer sent, as a socket producer waits for
        its acks: up to `timeout`, and up to `reconnect_timeout_s` while no consumer listens. Then `Rejected`
        for a message the consumer refused, if one was not raised yet."""
        queue, source = self._frames, self._source
        started = time.monotonic()
        deadline = math.inf if timeout is None else started + timeout
        nobody_until = started + self.options.reconnect_timeout_s
        while True:
            until = deadline if HUB.listening(self.name) else min(deadline, nobody_until)
            # (a second at most: a consumer that comes or goes is noticed, as a socket producer's ack wait does)
            if queue.wait_until_received(max(0.0, min(until - time.monotonic(), 1.0)), source):
                self.refusals.raise_oldest()
                return
            now, left = time.monotonic(), queue.unreceived(source)
            if now >= deadline:
                raise TransportError(
                    f"memory://{self.name}: {left} bytes sent were not taken into a consumer's table within the "
                    f"flush's timeout ({timeout}s)"
                )
            if now >= nobody_until and not HUB.listening(self.name):
                raise TransportError(
                    f"memory://{self.name} has no consumer: {left} bytes sent wait for one (gave up after "
                    f"{now - started:.1f}s, as reconnect_timeout_s={self.options.reconnect_timeout_s:g} bounds it)"
                )

    def _send_ndarray(
        self, array: np.ndarray, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, flags: int
    ) -> bool:
        """`encode` and `send` of one plain ndarray in the fewest steps: a small one's frame made whole in C
        (`ndarray_frame`); a larger one's head made in C, then it and the array copied into a pooled buffer,
        whose CRC is computed in one pass. False, with nothing sent, where it does not apply (no C extension,
        chunked frames, a tensor the C head leaves to `encode`)."""
        if self.max_frame_bytes is not None or NATIVE is None:
            return False
        if array.nbytes < SMALL_FRAME:
            built = NATIVE.ndarray_frame(array, key, metadata, message_id, flags)
            if built is None:
                return False
            self.wait_for_room()
            frame, crc = built
            self._frames.put(frame, source=self._source, nbytes=len(frame), crc=crc)
            return True
        head = NATIVE.ndarray_head(array, key, metadata, message_id, flags)
        if head is None:
            return False
        self.wait_for_room()
        payload = flat_bytes(array)
        at = len(head)
        nbytes = at + payload.nbytes
        copy = self._pool.take(nbytes)
        copy[:at] = head
        crc = None
        if not flags & FLAG_CHECKSUM:
            copy_into(copy[at:], payload)
        elif nbytes >= LET_GO_FROM:  # (copied and checksummed in one pass, the consumer's thread running meanwhile)
            crc = crc32c_copy(copy[at:], payload, checksum_of(head))
        else:  # (copied, then checksummed in the caches, holding the interpreter lock throughout)
            copy[at:] = payload
            crc = crc32c(copy[at:], checksum_of(head), 0)
        if crc is not None:  # (the consumer's check need not read it again)
            struct.pack_into("<I", copy, CRC_AT, crc)
        self._frames.put(copy, source=self._source, nbytes=nbytes, crc=crc)
        return True

    def send(self, frame: list[Buffer], *, key: str | None) -> None:
        """Copy the frame into the endpoint's queue (as a wire would); `wait_for_room` bounds the queue."""
        nbytes = sum(memoryview(b).nbytes for b in frame)
        # into a 64-byte aligned buffer (a large one no tensor views any more: fresh pages are slow)
        self._frames.put(join_into(frame, self._pool.take(nbytes)), source=self._source, nbytes=nbytes)

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        """Deliver queued and future frames of this endpoint: on a waiting receive's thread, or a background one."""
        self._reader = MemoryReader(
            self.name, HUB.claim(self.name), deliver, lambda: HUB.release(self.name), self.options.spin_s
        )

    def read_while_waiting(self, done: threading.Lock, deadline: float | None) -> bool:
        """Wait for `done`, delivering frames on this thread meanwhile (memory_reading.py)."""
        if self._reader is None:
            return super().read_while_waiting(done, deadline)
        return self._reader.wait(done, deadline)

    def room_opened(self) -> None:
        """The consumer may have room for a message held back: offer it again (under the table's lock: no waiting)."""
        if self._reader is not None:
            self._reader.room_opened()

    def close(self) -> None:
        """Stop delivering; frames not yet delivered, and those sent later, wait for the next consumer."""
        if self._reader is not None:
            self._reader.close()
