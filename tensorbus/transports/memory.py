"""`memory://NAME`: an in-process transport with the same semantics as the network ones.

Frames are copied on send (as a socket would) into the endpoint's queue, which exists as soon as
either side names it, so a producer may send before the consumer listens, as with a broker queue.
All state lives in one `MemoryHub`; `HUB.reset()` clears it between tests.
"""

from __future__ import annotations

import logging
import queue
import threading
import urllib.parse
from typing import Any, ClassVar

from ..buffers import POOLED_FROM, BufferPool
from ..codec.frame import Buffer, Limits, join_into
from ..errors import ConfigError, TransportError
from .base import Deliver, Transport

log = logging.getLogger(__name__)
_STOP = object()


class MemoryHub:
    """The named endpoints of the memory transport: name -> queue of frames."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue[Any]] = {}
        self._listening: set[str] = set()

    def endpoint(self, name: str) -> queue.SimpleQueue[Any]:
        """The queue for `name`, created on first use."""
        with self._lock:
            return self._queues.setdefault(name, queue.SimpleQueue())

    def claim(self, name: str) -> queue.SimpleQueue[Any]:
        """Register the one consumer of `name`; a second is refused, as a socket address would be."""
        with self._lock:
            if name in self._listening:
                raise TransportError(f"memory://{name} already has a consumer")
            self._listening.add(name)
            return self._queues.setdefault(name, queue.SimpleQueue())

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


class MemoryTransport(Transport):
    """Frames through an in-process queue; a background thread delivers them to the consumer."""

    schemes = ("memory",)
    OPTIONS: ClassVar[dict[str, Any]] = {"max_frame_bytes": None}

    def __init__(self, url: urllib.parse.SplitResult, options: dict[str, Any]) -> None:
        super().__init__(url, options)
        self.name = url.netloc + url.path
        if not self.name:
            raise ConfigError(f"memory URL needs a name, e.g. memory://weights; got {self.address!r}")
        self._thread: threading.Thread | None = None
        self._queue: queue.SimpleQueue[Any] | None = None
        self._pool = BufferPool(max_buffers=4)

    def send(self, frame: list[Buffer], *, key: str | None) -> None:
        """Copy the frame into the endpoint's queue (as a wire would); never blocks."""
        views = [memoryview(b).cast("B") for b in frame]
        total = sum(len(v) for v in views)
        if total < POOLED_FROM:
            HUB.endpoint(self.name).put(b"".join(views))
            return
        # into a large buffer no tensor views any more: fresh pages are slow
        HUB.endpoint(self.name).put(join_into(views, self._pool.take(total)))

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        """Deliver queued and future frames of this endpoint on a background thread."""
        self._queue = HUB.claim(self.name)
        self._thread = threading.Thread(
            target=self._run, args=(self._queue, deliver), daemon=True, name=f"tensorbus-memory-{self.name}"
        )
        self._thread.start()

    def _run(self, frames: queue.SimpleQueue[Any], deliver: Deliver) -> None:
        while (frame := frames.get()) is not _STOP:
            try:
                deliver(frame)
            except Exception:
                log.exception("memory://%s: delivering a frame failed", self.name)

    def close(self) -> None:
        """Stop delivering; frames sent later wait for the next consumer of the name."""
        if self._thread is not None and self._queue is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout=5)
            HUB.release(self.name)
            self._thread = None
