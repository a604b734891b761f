"""`memory://NAME`: an in-process transport with the same semantics as the network ones.

Frames are copied on send (as a socket would) into the endpoint's queue, which exists as soon as
either side names it, so a producer may send before the consumer listens, as with a broker queue.
All state lives in one `MemoryHub`; `HUB.reset()` clears it between tests.
"""

from __future__ import annotations

import collections
import logging
import threading
import urllib.parse
from dataclasses import dataclass

from ..buffers import BufferPool
from ..codec.frame import Buffer, Limits, MessageId, join_into
from ..errors import ConfigError, TransportError
from ..options import finite_timeout
from .base import Deliver, GivenUp, Transport, TransportOptions

log = logging.getLogger(__name__)


class Frames:
    """One endpoint's queue of frames; a frame the closing consumer turned away goes back to the front.

    It counts the bytes it holds, so that producers can wait for room (backpressure, as a socket's
    unacknowledged bytes bound a producer there).
    """

    def __init__(self) -> None:
        self._frames: collections.deque[Buffer] = collections.deque()
        lock = threading.Lock()
        self._ready = threading.Condition(lock)  # (a frame came)
        self._room = threading.Condition(lock)  # (a frame went)
        #: bytes of the frames queued
        self.nbytes = 0

    def put(self, frame: Buffer, *, front: bool = False) -> None:
        with self._ready:
            if front:
                self._frames.appendleft(frame)
            else:
                self._frames.append(frame)
            self.nbytes += memoryview(frame).nbytes
            self._ready.notify()

    def get(self, stop: threading.Event) -> Buffer | None:
        """The oldest frame, waiting for one; None once `stop` is set (the frames stay queued)."""
        with self._ready:
            while not self._frames and not stop.is_set():
                self._ready.wait()
            if stop.is_set():
                return None
            frame = self._frames.popleft()
            self.nbytes -= memoryview(frame).nbytes
            self._room.notify_all()
            return frame

    def wait_for_room(self, limit: int, timeout: float | None) -> bool:
        """Wait while `limit` bytes or more are queued: True once fewer are, False after `timeout` seconds."""
        with self._room:
            return self._room.wait_for(lambda: self.nbytes < limit, timeout)

    def wake(self) -> None:
        with self._ready:
            self._ready.notify_all()

    def __len__(self) -> int:
        """Frames waiting to be delivered."""
        return len(self._frames)


class MemoryHub:
    """The named endpoints of the memory transport: name -> queue of frames."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, Frames] = {}
        self._listening: set[str] = set()

    def endpoint(self, name: str) -> Frames:
        """The queue for `name`, created on first use."""
        with self._lock:
            return self._queues.setdefault(name, Frames())

    def claim(self, name: str) -> Frames:
        """Register the one consumer of `name`; a second is refused, as a socket address would be."""
        with self._lock:
            if name in self._listening:
                raise TransportError(f"memory://{name} already has a consumer")
            self._listening.add(name)
            return self._queues.setdefault(name, Frames())

    def release(self, name: str) -> None:
        """Let another consumer take `name` (frames still queued stay for it)."""
        with self._lock:
            self._listening.discard(name)

    def reset(self) -> None:
        """Forget every endpoint and queued frame."""
        with self._lock:
            self._queues.clear()
            self._listening.clear()


HUB = MemoryHub()


@dataclass(frozen=True, kw_only=True)
class MemoryOptions(TransportOptions):
    """The options of memory:// endpoints."""

    #: the bytes sent to the endpoint and not yet taken by its consumer's delivery, at most, before a
    #: new message waits for room (up to `send_timeout_s`), as on the socket transports
    max_unacked_bytes: int = 256 * 1024 * 1024
    send_timeout_s: float = 30.0


class MemoryTransport(Transport):
    """Frames through an in-process queue; a background thread delivers them to the consumer."""

    schemes = ("memory",)
    Options = MemoryOptions
    options: MemoryOptions

    def __init__(self, url: urllib.parse.SplitResult, options: MemoryOptions) -> None:
        super().__init__(url, options)
        self.name = url.netloc + url.path
        if not self.name:
            raise ConfigError("memory URL needs a name after memory://, e.g. memory://weights")
        self._thread: threading.Thread | None = None
        self._queue: Frames | None = None
        self._stop = threading.Event()
        self._pool = BufferPool(max_buffers=4)

    def signing_identity(self, consumer: bool) -> tuple[str, bytes]:
        """memory://NAME."""
        return f"memory://{self.name}", b""

    def wait_for_room(self) -> None:
        """Before a new message: wait while `max_unacked_bytes` wait for the consumer (up to `send_timeout_s`).

        Called between messages, never between the chunks of one, so a message larger than the
        limit still goes out whole.
        """
        limit, timeout = self.options.max_unacked_bytes, self.options.send_timeout_s
        queue = HUB.endpoint(self.name)
        if queue.nbytes < limit or queue.wait_for_room(limit, finite_timeout(timeout, "send_timeout_s")):
            return
        raise TransportError(
            f"memory://{self.name} has had {queue.nbytes} bytes waiting for its consumer for {timeout}s "
            f"(max_unacked_bytes={limit}): is a consumer listening, and receiving?"
        )

    def send(self, frame: list[Buffer], *, key: str | None) -> None:
        """Copy the frame into the endpoint's queue (as a wire would); `wait_for_room` bounds the queue."""
        views = [memoryview(b).cast("B") for b in frame]
        total = sum(len(v) for v in views)
        # into a 64-byte aligned buffer (a large one no tensor views any more: fresh pages are slow)
        HUB.endpoint(self.name).put(join_into(views, self._pool.take(total)))

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        """Deliver queued and future frames of this endpoint on a background thread."""
        self._queue = HUB.claim(self.name)
        self._thread = threading.Thread(
            target=self._run, args=(self._queue, deliver), daemon=True, name=f"tensorbus-memory-{self.name}"
        )
        self._thread.start()

    def _run(self, frames: Frames, deliver: Deliver) -> None:
        """Deliver frames until closed or turned away; what this consumer did not finish goes back, in order."""
        held: dict[MessageId | None, list[Buffer]] = {}  # the frames of messages not complete yet
        given_up = GivenUp(deliver)
        turned_away: MessageId | None = None
        try:
            while (frame := frames.get(self._stop)) is not None:
                try:
                    result = deliver(frame)
                except Exception:  # (a callback's own errors, even SystemExit, are caught where it is called)
                    log.exception("memory://%s: delivering a frame failed", self.name)
                    continue
                if result.done:
                    held.pop(result.message_id, None)
                    continue
                if result.message_id not in held:  # a new incomplete message: forget those given up on
                    for message_id in given_up.among(held):
                        del held[message_id]
                held.setdefault(result.message_id, []).append(frame)
                if result.turned_away:
                    turned_away = result.message_id
                    return
        finally:
            back = [f for m, fs in held.items() if m == turned_away or deliver.is_pending(m) for f in fs]
            for frame in reversed(back):  # first in line for the next consumer of the name
                frames.put(frame, front=True)
            HUB.release(self.name)  # here, not in close: close may run on this very thread (in a callback)

    def close(self) -> None:
        """Stop delivering; frames not yet delivered, and those sent later, wait for the next consumer.

        Called from a `recv_async` callback (on the delivering thread), it returns at once: the
        thread stops, and frees the name, once the callback returns.
        """
        if self._thread is not None and self._queue is not None:
            self._stop.set()
            self._queue.wake()
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=5)
                if self._thread.is_alive():
                    log.error(
                        "memory://%s: the delivering thread has not stopped; the name is taken until it does", self.name
                    )
            self._thread = None
