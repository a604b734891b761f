"""The asyncio rows of the benchmark: `tensorbus.aio` (`aio-tcp`, `aio-unix`) and its baseline,
pyzmq's asyncio sockets (`zmq-asyncio`), each driven from one event loop per worker process.

Each round (a run of sends, of receives, of round trips or echoes) is one coroutine on the worker's
loop, as an asyncio application awaits them all on one running loop: `LoopRounds` runs the loops of
`Worker.do_send`, `do_recv`, `do_ping` and `do_echo` awaited, for tensorbus.aio and its baseline alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from .baselines import HEADER, ZmqLink
from .links import KEY, TensorbusLink, monitoring

_T = TypeVar("_T")
#: why a received tensor is wrong, or None (`Worker.check`): the tensor, its index, the index expected
Check = Callable[[Any, int, int], "str | None"]


def new_loop(spec: dict[str, Any]) -> asyncio.AbstractEventLoop:
    """A new event loop of the kind the run asked for (`BenchConfig.event_loop`: asyncio's own, or uvloop's)."""
    if spec.get("event_loop") == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopRounds:
    """An asyncio link's rounds, each one coroutine on its loop: the loops of `Worker.do_send`,
    `do_recv`, `do_ping` and `do_echo`, awaited (a `run_until_complete` per tensor would cost an
    asyncio application a loop start and stop it never pays)."""

    loop: asyncio.AbstractEventLoop

    async def asend(self, array: np.ndarray, index: int) -> None:
        raise NotImplementedError

    async def arecv(self, timeout: float) -> tuple[int, Any]:
        raise NotImplementedError

    def send(self, array: np.ndarray, index: int) -> None:
        self.loop.run_until_complete(self.asend(array, index))

    def recv(self, timeout: float) -> tuple[int, Any]:
        return self.loop.run_until_complete(self.arecv(timeout))

    def send_round(self, slots: list[np.ndarray], first: int, n: int) -> tuple[float, float]:
        """Send tensors first..first+n-1 back to back: when the first send started and the last ended."""

        async def run() -> tuple[float, float]:
            count, t_start = len(slots), time.perf_counter()
            for index in range(first, first + n):
                await self.asend(slots[index % count], index)
            return t_start, time.perf_counter()

        return self.loop.run_until_complete(run())

    def recv_round(self, n: int, first: int, timeout: float, check: Check) -> dict[str, Any]:
        """Receive and check n tensors: when the first and the last arrived, and what was wrong."""

        async def run() -> dict[str, Any]:
            deadline = time.perf_counter() + timeout
            failures, problem, t_first = 0, None, 0.0
            for k in range(n):
                index, obj = await self.arecv(max(deadline - time.perf_counter(), 0.001))
                if k == 0:
                    t_first = time.perf_counter()
                error = check(obj, index, first + k)
                del obj
                if error is not None:
                    failures, problem = failures + 1, problem or error
            return {"t_first": t_first, "t_last": time.perf_counter(), "failures": failures, "problem": problem}

        return self.loop.run_until_complete(run())

    def ping_round(self, slots: list[np.ndarray], first: int, n: int, timeout: float, check: Check) -> dict[str, Any]:
        """Round trips: send a tensor, await the peer's echo of it; times in seconds."""

        async def run() -> dict[str, Any]:
            count, rtts, failures, problem = len(slots), [], 0, None
            for index in range(first, first + n):
                t0 = time.perf_counter()
                await self.asend(slots[index % count], index)
                got, obj = await self.arecv(timeout)
                rtts.append(time.perf_counter() - t0)
                error = check(obj, got, index)
                del obj
                if error is not None:
                    failures, problem = failures + 1, problem or error
            return {"rtts": rtts, "failures": failures, "problem": problem}

        return self.loop.run_until_complete(run())

    def echo_round(self, n: int, first: int, timeout: float, check: Check, dtype: Any) -> dict[str, Any]:
        """The other end of `ping_round`: send every tensor straight back, then check it."""

        async def run() -> dict[str, Any]:
            failures, problem = 0, None
            for expected in range(first, first + n):
                index, obj = await self.arecv(timeout)
                await self.asend(obj if isinstance(obj, np.ndarray) else np.frombuffer(obj, dtype), index)
                error = check(obj, index, expected)
                del obj
                if error is not None:
                    failures, problem = failures + 1, problem or error
            return {"failures": failures, "problem": problem}

        return self.loop.run_until_complete(run())


class AioTensorbusLink(LoopRounds, TensorbusLink):
    """`tensorbus.aio.Producer` on the outbound endpoint, `tensorbus.aio.Consumer` on the inbound one."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        self.loop = new_loop(spec)

    def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return self.loop.run_until_complete(coroutine)

    def open(self) -> str:
        import tensorbus.aio as tba

        self.consumer = tba.Consumer(self.url, **monitoring(self.spec))
        self._run(self.consumer.open())
        return str(self.consumer.address)

    def connect(self, address: str) -> None:
        import tensorbus.aio as tba

        self.producer = tba.Producer(self.outbound_url(address), **monitoring(self.spec))
        self._run(self.producer.open())

    async def asend(self, array: np.ndarray, index: int) -> None:
        await self.producer.send(KEY, array, metadata={"i": index})

    async def arecv(self, timeout: float) -> tuple[int, Any]:
        message = await self.consumer.recv_message(KEY, timeout)
        return message.metadata["i"], message.tensor

    def finish(self, timeout: float) -> None:
        self._run(self.producer.flush(timeout))

    def close(self) -> None:
        for end in (self.producer, self.consumer):
            if end is not None:
                with contextlib.suppress(Exception):
                    self._run(end.close())
        self.producer = self.consumer = None
        super().close()
        self.loop.close()


class ZmqAsyncioLink(LoopRounds, ZmqLink):
    """pyzmq's asyncio PUSH (outbound) and PULL (inbound) over TCP, zero-copy sends."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        import zmq.asyncio

        self.context.term()
        self.context = zmq.asyncio.Context()  # type: ignore[assignment]  # (the asyncio flavour of the same)
        self.loop = new_loop(spec)
        asyncio.set_event_loop(self.loop)  # (the sockets find their loop when first used)

    async def asend(self, array: np.ndarray, index: int) -> None:
        await self.push.send_multipart([HEADER.pack(index, array.nbytes), array], copy=False)

    async def arecv(self, timeout: float) -> tuple[int, Any]:
        header, payload = await self.pull.recv_multipart(copy=False)
        index, _ = HEADER.unpack(header.buffer)
        return index, payload.buffer

    def close(self) -> None:
        super().close()
        asyncio.set_event_loop(None)  # (not a closed loop left as the thread's)
        self.loop.close()
