"""A socket consumer: a `Listener` accepts producers, a `Reactor` reads them (on the waiting thread, too)."""

from __future__ import annotations

import os
import socket
import threading
import urllib.parse
from collections.abc import Callable
from contextvars import ContextVar

from ..buffers import POOLED_FROM, RECYCLED_AT_MOST, RECYCLED_BYTES, BufferPool
from ..codec.frame import Limits
from .base import ConsumerSide, Deliver
from .listener import Listener
from .reactor import Poller, Reactor
from .socket_endpoint import SocketEndpoint
from .stream import INCARNATION_BYTES, SocketOptions

#: set (by tensorbus.aio) while a consumer is made whose connections an event loop reads: what makes the
#: poller its reactor registers them with; then no thread starts (tensorbus/aio/socket_reading.py)
LOOP_POLLER: ContextVar[Callable[[], Poller] | None] = ContextVar("tensorbus_loop_poller", default=None)


class SocketConsumer(SocketEndpoint, ConsumerSide):
    """The consumer side of a socket endpoint: `listen`, `read_while_waiting`, `room_opened`, closing."""

    reads_while_waiting = True

    def __init__(self, url: urllib.parse.SplitResult, options: SocketOptions) -> None:
        super().__init__(url, options)
        #: this consumer's run, sent in its hello: what frames signed for it are bound to
        self.incarnation = os.urandom(INCARNATION_BYTES)
        self._listener: Listener | None = None
        self.reactor: Reactor | None = None
        # frames below 1 MiB: a run of the reader delivers up to `ack_every_bytes` of them before the
        # application takes one, so the pool keeps that many for reuse (fewer: the rest are fresh memory)
        recycled = min(max(RECYCLED_BYTES, options.ack_every_bytes), RECYCLED_AT_MOST)
        self._pool = BufferPool(options.pooled_buffers, recycled)

    def signing_identity(self, consumer: bool) -> tuple[str, bytes]:
        """ "socket" and this consumer's incarnation."""
        return "socket", self.incarnation

    def counts(self) -> dict[str, int]:
        """The producer connections being read."""
        return {"connections": 0 if self.reactor is None else self.reactor.connections}

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        """Bind, then accept producers on a background thread; their frames are read by a `Reactor`."""
        context = self._ssl_context(server_side=True)
        self._listener = Listener(
            self.family, self.target, self.options, self.secret, lambda: self.address, self.incarnation
        )
        bound = self._listener.bind()
        if self.family != socket.AF_UNIX:
            host, port = bound[:2]
            self.url = self.url._replace(netloc=f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        loop_poller = LOOP_POLLER.get()
        self.runs_on_loop = loop_poller is not None
        self.reactor = Reactor(
            deliver, limits, self.options, self._pool, None if loop_poller is None else loop_poller()
        )
        self._listener.start(self.reactor, context, thread=loop_poller is None)

    def read_ahead(self, nbytes: int) -> None:
        """Frames are read up to `nbytes` ahead of the receives (an event loop's reading): the pool keeps as
        many more buffers of up to half that (several such frames fit), so those frames too land in memory used
        before; none more if `pooled_buffers` is 0."""
        if self.options.pooled_buffers:
            self._pool.keep_more(nbytes // POOLED_FROM, nbytes // 2)

    def sender(self) -> str | None:
        """The address of the producer connection being read (on the reading thread)."""
        name = None if self.reactor is None else self.reactor.reading
        if isinstance(name, tuple) and len(name) >= 2:
            host, port = name[:2]
            return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
        return None if name is None else (str(name) or "a unix-socket producer")

    def read_while_waiting(self, done: threading.Lock, deadline: float | None) -> bool:
        """Wait for `done`, reading frames on the calling thread meanwhile (see `Reactor.read_while_waiting`)."""
        assert self.reactor is not None
        return self.reactor.read_while_waiting(done, deadline)

    def room_opened(self) -> None:
        """The consumer's table has room again (or a receiver waits): offer it what is held back."""
        if self.reactor is not None:
            self.reactor.room_opened()

    def close(self) -> None:
        """Stop listening and drop every producer (see `Reactor.close`)."""
        if self._listener is not None:
            self._listener.close()
