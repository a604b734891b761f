"""The asyncio producer: a `tensorbus.Producer` driven from one thread of its own.

Every call of the producer runs, in order, on its one worker thread (`tensorbus-aio-send`), and the
coroutine awaits its result: a send that waits for the consumer (`max_unacked_bytes`, bounded by
`send_timeout_s`), for a broker's confirm or for a socket's room waits there, never on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from .. import api
from ..codec import MessageId
from ..errors import Closed

_T = TypeVar("_T")


class Producer:
    """Sends tensors to the consumer at `url` (the blocking `Producer`'s URLs and options), awaiting each send.

    A send whose task is cancelled before its turn on the worker thread is not sent; one already
    being sent finishes (a frame goes whole or not at all), so the tensor must not change until then.
    """

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self._options = options
        self._blocking: api.Producer | None = None
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensorbus-aio-send")
        self._closed = False

    async def _run(self, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        return await asyncio.wrap_future(self._worker.submit(call, *args, **kwargs))

    async def open(self) -> Producer:
        """Connect (idempotent; `send` opens a producer that was not opened)."""
        if self._closed:
            raise Closed("open of a closed Producer")
        await self._run(self._opened)
        return self

    def _opened(self) -> api.Producer:
        """The blocking producer, made at its first use (on the worker thread, its one owner)."""
        if self._blocking is None:
            self._blocking = api.Producer(self.url, **self._options)
        return self._blocking

    @property
    def blocking(self) -> api.Producer:
        """The blocking producer underneath (to be used on the worker thread only: `_run`)."""
        if self._blocking is None:
            raise Closed(f"the Producer of {self.url} is not open: use `async with` or `await producer.open()`")
        return self._blocking

    async def send(self, key: str | None, tensor: Any, *, metadata: dict[str, Any] | None = None) -> MessageId:
        """Send one tensor under `key`; returns once the transport has taken the frame."""
        if self._closed:
            raise Closed("send on a closed Producer")
        return await self._run(self._send, key, tensor, metadata)

    def _send(self, key: str | None, tensor: Any, metadata: dict[str, Any] | None) -> MessageId:
        return self._opened().send(key, tensor, metadata=metadata)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until the transport confirms everything sent so far (where it confirms at all)."""
        await self._run(self._flush, timeout)

    def _flush(self, timeout: float | None) -> None:
        if self._blocking is not None:
            self._blocking.flush(timeout)

    async def close(self) -> None:
        """Flush what can be flushed and release the connection and the worker thread."""
        if self._closed:
            return
        self._closed = True
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
