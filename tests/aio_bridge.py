"""The asyncio consumer behind the blocking consumer's methods, so that a suite written against
`tensorbus.Consumer` (tests/integration/test_behaviour.py) also runs through `tensorbus.aio`.

Each call runs as a coroutine of `tensorbus.aio.Consumer` on an event loop of the bridge's own thread,
and the calling thread waits for its result: what the suite checks is what the coroutines did.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import tensorbus as tb
import tensorbus.aio as tba

_T = TypeVar("_T")


class AioConsumer:
    """A `tensorbus.aio.Consumer` with the blocking `Consumer`'s methods."""

    def __init__(self, url: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="aio-bridge loop")
        self._thread.start()
        self.aio = tba.Consumer(url, **options)
        self._call(self.aio.open())

    def _call(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    @property
    def address(self) -> str:
        return self.aio.address

    @property
    def table(self) -> tb.Rendezvous:
        return self.aio.table

    @property
    def stats(self) -> Any:
        return self.aio.stats

    def recv(self, key: str, timeout: float | None = None) -> Any:
        return self._call(self.aio.recv(key, timeout))

    def recv_message(self, key: str, timeout: float | None = None) -> tb.Message:
        return self._call(self.aio.recv_message(key, timeout))

    def recv_async(self, key: str, callback: Any) -> tb.RecvHandle:
        """(Not part of the asyncio API, whose receives are coroutines: the blocking consumer's own.)"""
        return self.aio.blocking.recv_async(key, callback)

    def abort(self, reason: str) -> None:
        self._loop.call_soon_threadsafe(self.aio.abort, reason)

    def __iter__(self) -> Iterator[tb.Message]:
        messages = self.aio.__aiter__()
        while True:
            try:
                yield self._call(messages.__anext__())
            except StopAsyncIteration:
                return

    def close(self) -> None:
        try:
            self._call(self.aio.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()

    def __enter__(self) -> AioConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
