"""The asyncio producer: a `tensorbus.Producer` whose sends are awaited on the event loop.

tcp:// and unix:// producers send on the loop itself (socket_sending.py: no thread). Every other
producer (memory://, tcps://, brokers; any with metrics, tracing, compression or signing on) is driven
from one worker thread of its own (`tensorbus-aio-send`): every call runs there, in order, and the
coroutine awaits its result,
so a send that waits for the consumer (`max_unacked_bytes`, bounded by `send_timeout_s`), for a
broker's confirm or for a socket's room waits there, never on the loop. A producer that sends on the loop
makes a large strided array contiguous on that worker thread first (numpy lets go of the GIL as it copies).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from .. import api
from ..codec import MessageId
from ..errors import Closed
from .socket_sending import SCHEMES, LoopSender, sends_on_loop
from .turns import sent

_T = TypeVar("_T")
#: a strided (not C-contiguous) ndarray of this many bytes or more, sent on the loop, is copied into one piece
#: on the worker thread first (the frame needs its bytes in one piece: copied on the loop, 64 MB held it 150 ms)
STRIDED_OFF_LOOP_FROM = 1 << 20


class Producer:
    """Sends tensors to the consumer at `url` (the blocking `Producer`'s URLs and options), awaiting each send.

    On the worker thread, a send whose task is cancelled before its turn is not sent; one already
    being sent finishes (a frame goes whole or not at all), so the tensor must not change until then.
    On the loop (tcp://, unix://), see `LoopSender.send`.
    """

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self._options = options
        self._blocking: api.Producer | None = None
        self._sender: LoopSender | None = None  # sends on the loop (tcp://, unix://)
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None  # made at its first use
        self._closed = False

    async def _run(self, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        if self._worker is None:
            if self._closed:  # (no worker is made for a producer closed already)
                raise Closed(f"the Producer of {self.url} is closed")
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensorbus-aio-send")
        try:
            future = self._worker.submit(call, *args, **kwargs)
        except RuntimeError:  # (its worker shut down: `close` ran meanwhile)
            raise Closed(f"the Producer of {self.url} is closed") from None
        return await asyncio.wrap_future(future)

    async def open(self) -> Producer:
        """Make the producer (idempotent; `send` opens a producer not opened). Sockets connect at the first send."""
        if self._closed:
            raise Closed("open of a closed Producer")
        if self._blocking is None and urllib.parse.urlsplit(self.url).scheme in SCHEMES:
            made = api.Producer(self.url, **self._options)  # (no I/O: it connects at its first send)
            if sends_on_loop(made):
                self._blocking, self._sender = made, LoopSender(made)
                return self
            made.close()
        await self._run(self._opened)
        return self

    def _opened(self) -> api.Producer:
        """The blocking producer, made at its first use (on the worker thread, its one owner)."""
        if self._blocking is None:
            self._blocking = api.Producer(self.url, **self._options)
        return self._blocking

    @property
    def blocking(self) -> api.Producer:
        """The blocking producer underneath (to be used on the worker thread only, `_run`, unless the loop sends)."""
        if self._blocking is None:
            raise Closed(f"the Producer of {self.url} is not open: use `async with` or `await producer.open()`")
        return self._blocking

    async def send(self, key: str | None, tensor: Any, *, metadata: dict[str, Any] | None = None) -> MessageId:
        """Send one tensor under `key`; returns once the transport has taken the frame."""
        if self._closed:
            raise Closed("send on a closed Producer")
        if self._blocking is None:
            await self.open()
        sent()  # (a receive that waits next on this thread waits for a reply: turns.py)
        if self._sender is not None:
            if type(tensor) is np.ndarray and tensor.nbytes >= STRIDED_OFF_LOOP_FROM and not tensor.flags.c_contiguous:
                tensor = await self._run(np.ascontiguousarray, tensor)
            return await self._sender.send(key, tensor, metadata)
        return await self._run(self._send, key, tensor, metadata)

    def _send(self, key: str | None, tensor: Any, metadata: dict[str, Any] | None) -> MessageId:
        return self._opened().send(key, tensor, metadata=metadata)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until the transport confirms everything sent so far (where it confirms at all)."""
        if self._closed:
            raise Closed("flush on a closed Producer")
        if self._sender is not None:
            await self._sender.flush(timeout)
            return
        await self._run(self._flush, timeout)

    def _flush(self, timeout: float | None) -> None:
        if self._blocking is not None:
            self._blocking.flush(timeout)

    async def close(self) -> None:
        """Flush what can be flushed and release the connection (and the worker thread)."""
        if self._closed:
            return
        self._closed = True
        if self._sender is not None:
            await self._sender.close()
            return
        if self._worker is None:
            return
        try:
            await self._run(self._close)
        finally:
            self._worker.shutdown(wait=False)

    def _close(self) -> None:
        if self._blocking is not None:
            self._blocking.close()

    async def __aenter__(self) -> Producer:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
