"""The asyncio consumer: a `tensorbus.Consumer` whose receives are awaited on the event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from .. import api
from ..codec import Message
from ..errors import Aborted, Closed
from ..intake_state import ANY
from ..keys import check_key
from ..options import finite_timeout
from ..rendezvous import Rendezvous
from ..transports.socket_consumer import LOOP_POLLER
from .handoff import Deadlines, wait_message
from .socket_reading import LoopReading
from .turns import Turns


class Consumer:
    """Receives the tensors sent to `url` (the blocking `Consumer`'s URLs and options), awaiting them.

    Open it with `async with` (or `await consumer.open()`): the transport is set up on a worker thread,
    so that a broker's connection handshake does not block the loop. The event loop itself reads the
    producers of a socket consumer (tcp://, unix://, tcps://: socket_reading.py); other transports'
    own threads read frames. A receive waits on the loop for its message (see handoff.py).
    """

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self._options = options
        self._blocking: api.Consumer | None = None
        self._opening = asyncio.Lock()  # (two tasks opening at once make one consumer)
        self._closed = False
        self._reading: LoopReading | None = None  # the loop's reading of a socket consumer
        self._turns = Turns()
        self._deadlines = Deadlines()  # the timeouts of its receives, on one timer

    async def open(self) -> Consumer:
        """Start receiving (idempotent)."""
        if self._closed:
            raise Closed("open of a closed Consumer")
        async with self._opening:
            if self._blocking is None:
                reading = LoopReading()
                made_for_loop = LOOP_POLLER.set(reading.make_poller)  # (to_thread runs in a copy of this context)
                try:
                    opening = asyncio.ensure_future(asyncio.to_thread(api.Consumer, self.url, **self._options))
                finally:
                    LOOP_POLLER.reset(made_for_loop)
                try:
                    made = await asyncio.shield(opening)  # a cancelled open still gets its consumer, to close it
                except asyncio.CancelledError:
                    opening.add_done_callback(_close_unused)
                    raise
                if self._closed:  # closed while it opened: nobody will use it
                    await asyncio.to_thread(made.close)
                    raise Closed("the Consumer was closed while it opened")
                self._blocking = made
                if reading.attach(made.transport, asyncio.get_running_loop(), made.table, made.intake):
                    self._reading = reading
        return self

    @property
    def blocking(self) -> api.Consumer:
        """The blocking consumer underneath (its table, stats and transport)."""
        if self._blocking is None:
            raise Closed(f"the Consumer of {self.url} is not open: use `async with` or `await consumer.open()`")
        return self._blocking

    @property
    def address(self) -> str:
        """The URL producers should use (for tcp://host:0, with the port actually bound)."""
        return self.blocking.address

    @property
    def table(self) -> Rendezvous:
        """The rendezvous table (what is buffered, by key)."""
        return self.blocking.table

    @property
    def stats(self) -> Any:
        """The consumer's counts (received, duplicates, rejected...)."""
        return self.blocking.stats

    async def recv(self, key: str, timeout: float | None = None) -> Any:
        """The next tensor sent under `key`, awaited up to `timeout` seconds (then `tensorbus.Timeout`)."""
        check_key(key)
        return (await self._received(key, timeout)).tensor  # (not through `recv_message`: a coroutine fewer)

    async def recv_message(self, key: str, timeout: float | None = None) -> Message:
        """Like `recv`, returning the whole `Message` (tensor, metadata, message id)."""
        check_key(key)
        return await self._received(key, timeout)

    async def next_message(self, timeout: float | None = None) -> Message:
        """The oldest message not yet received, of any key (work-queue use)."""
        return await self._received(ANY, timeout)

    async def _received(self, key: Any, timeout: float | None) -> Message:
        """The next message of `key` (or ANY), counted as the blocking consumer's receives are (metrics)."""
        if self._closed:  # (receives pending at close fail with Aborted, as documented; later ones say why)
            raise Closed(f"receive on a closed Consumer of {self.url}")
        blocking = self.blocking
        started = time.perf_counter()
        reading = self._reading  # (a socket consumer read by its loop: receives run on that loop)
        if reading is not None and reading.loop is not None and reading.loop.is_closed():
            reading.move_to(asyncio.get_running_loop())  # (opened in an `asyncio.run` that has ended)
        message = await wait_message(
            blocking.table,
            key,
            finite_timeout(timeout),
            self._turns,
            _nothing if reading is None else reading.taken,  # (the loop reads again if it stopped reading ahead)
            self._deadlines,
            None if reading is None else reading.loop,
        )
        if blocking.monitor is not None:
            blocking.monitor.received(message, time.perf_counter() - started)
        return message

    def ack(self, message: Message) -> None:
        """With `ack="manual"`: acknowledge a message the application is done with (a plain call: it
        records into the consumer's acknowledgement ledger, and never waits)."""
        self.blocking.ack(message)

    def reject(self, message: Message) -> None:
        """With `ack="manual"`: give a message back unacknowledged; the next receive of its key gets it."""
        self.blocking.reject(message)

    def abort(self, reason: str) -> None:
        """Fail every pending and later receive with `tensorbus.Aborted(reason)`."""
        self.blocking.abort(reason)

    async def __aiter__(self) -> AsyncIterator[Message]:
        """Messages in arrival order until the consumer is closed or aborted."""
        while True:
            try:
                yield await self.next_message()
            except (Aborted, Closed):
                if self._closed:
                    return
                raise

    async def close(self) -> None:
        """Stop receiving; pending receives fail with `Aborted("consumer closed")`."""
        if self._closed:
            return
        self._closed = True
        if self._blocking is not None:
            self._blocking.table.abort("consumer closed")  # at once: pending receives end now
            if self._reading is not None:
                self._reading.detach()  # (the close reads what already arrived, off the loop)
            await asyncio.to_thread(self._close_blocking)

    def _close_blocking(self) -> None:
        """Off the loop: end the decoding thread of a socket consumer read by the loop, then close the consumer."""
        if self._reading is not None:
            self._reading.stop_decoding()
        assert self._blocking is not None
        self._blocking.close()

    async def __aenter__(self) -> Consumer:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _nothing() -> None:
    """What a receive's taking calls for a consumer not read by the loop."""


def _close_unused(opening: asyncio.Future[api.Consumer]) -> None:
    """Close, off the loop, a consumer whose `open` was cancelled while it was being made."""
    if not opening.cancelled() and opening.exception() is None:
        asyncio.get_running_loop().run_in_executor(None, opening.result().close)
