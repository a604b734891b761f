"""The asyncio producer: a `tensorbus.Producer` whose sends are awaited on the event loop.

tcp:// and unix:// producers send on the loop itself (socket_sending.py: no thread). A memory://
producer sends a plain ndarray under MEMORY_ON_LOOP_BELOW on the loop too, when its consumer has room for
it (`MemoryTransport.has_room`) and no call of its own waits on the worker thread: the frame is copied into
the endpoint's queue, or delivered into its consumer's table, on the loop (an asyncio consumer on the same
loop gets it at once). Every other call (tcps://, brokers; any producer with metrics, tracing, compression
or signing on; a memory:// tensor that is large, or must wait for room) is driven from one worker thread
of its own (`tensorbus-aio-send`): every call runs there, in order, and the coroutine awaits its result,
so a send that waits for the consumer (`max_unacked_bytes`, bounded by `send_timeout_s`), for a
broker's confirm or for a socket's room waits there, never on the loop. A producer that sends on the loop
makes a large strided array contiguous on that worker thread first (numpy lets go of the GIL as it copies).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from .. import api
from ..codec import MessageId
from ..errors import Closed
from ..transports.memory import MemoryTransport
from .socket_sending import SCHEMES, LoopSender, sends_on_loop
from .turns import Turns, sent

_T = TypeVar("_T")
#: a strided (not C-contiguous) ndarray of this many bytes or more, sent on the loop, is copied into one piece
#: on the worker thread first (the frame needs its bytes in one piece: copied on the loop, 64 MB held it 150 ms)
STRIDED_OFF_LOOP_FROM = 1 << 20
#: a memory:// producer sends a plain ndarray smaller than this on the loop (a copy of microseconds); a larger
#: one on the worker thread (copying 256 MB into the endpoint's queue would hold the loop for ~50 ms)
MEMORY_ON_LOOP_BELOW = 1 << 20


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
        #: the worker's calls not known to be done, oldest first (the loop's thread's alone: `_run`, `_sends_on_loop`)
        self._calls: collections.deque[concurrent.futures.Future[Any]] = collections.deque()
        self._memory: MemoryTransport | None = None  # a memory:// producer that may send on the loop
        self._turns = Turns()
        self._closed = False

    async def _run(self, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        if self._worker is None:
            if self._closed:  # (no worker is made for a producer closed already)
                raise Closed(f"the Producer of {self.url} is closed")
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensorbus-aio-send")
        try:
            future = self._worker.submit(call, *args, **kwargs)
            self._outstanding().append(future)
        except RuntimeError:  # (its worker shut down: `close` ran meanwhile)
            raise Closed(f"the Producer of {self.url} is closed") from None
        return await asyncio.wrap_future(future)

    async def open(self) -> Producer:
        """Make the producer (idempotent; `send` opens a producer not opened). Sockets connect at the first send."""
        if self._closed:
            raise Closed("open of a closed Producer")
        if self._blocking is not None:
            return self
        scheme = urllib.parse.urlsplit(self.url).scheme
        if scheme == "memory":  # (no I/O: made on the loop)
            made = self._blocking = api.Producer(self.url, **self._options)
            plain = made._monitor is None and made._encoding.plain_flags is not None  # (as `sends_on_loop` asks)
            if plain and isinstance(made.transport, MemoryTransport):
                self._memory = made.transport
            return self
        if scheme in SCHEMES:
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
        if self._memory is not None and self._sends_on_loop(tensor):
            if not self._turns.due():  # (ten thousand sends in a row must not hold the loop: turns.py)
                return self.blocking.send(key, tensor, metadata=metadata)
            await asyncio.sleep(0)
            if self._closed:
                raise Closed("send on a closed Producer")
            if self._sends_on_loop(tensor):  # (still: the turn may have let another call go to the worker)
                return self.blocking.send(key, tensor, metadata=metadata)
        return await self._run(self._send, key, tensor, metadata)

    def _sends_on_loop(self, tensor: Any) -> bool:
        """Whether a memory:// send of `tensor` goes out on the loop now: a small plain ndarray, room for it (the
        transport's `has_room`, which also says no when it cannot tell at once), and no call of the worker thread
        left (it would be overtaken, and the producer is one thread's at a time: a finished call's future was set
        after the worker's last step, so this thread sees all it did: `_outstanding`)."""
        assert self._memory is not None
        return (
            not self._outstanding()
            and type(tensor) is np.ndarray
            and tensor.nbytes < MEMORY_ON_LOOP_BELOW
            and self._memory.max_frame_bytes is None
            and self._memory.has_room()
        )

    def _outstanding(self) -> collections.deque[concurrent.futures.Future[Any]]:
        """The worker's calls not done yet, oldest first (the worker runs them in order: one not done holds the
        rest, and a call cancelled before it ran is done at once, while the one before it may still run)."""
        calls = self._calls
        while calls and calls[0].done():
            calls.popleft()
        return calls

    def _send(self, key: str | None, tensor: Any, metadata: dict[str, Any] | None) -> MessageId:
        if self._memory is not None:  # (a pause the loop owed its consumer is paid here, where waiting is allowed)
            self._memory.pay_pace()
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
            if self._blocking is not None:  # (memory://, made on the loop and never used off it: its close waits for
                self._blocking.close()  # nothing)
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
