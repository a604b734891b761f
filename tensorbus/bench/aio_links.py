"""The asyncio rows of the benchmark: `tensorbus.aio` (`aio-tcp`, `aio-unix`) and its baseline,
pyzmq's asyncio sockets (`zmq-asyncio`), each driven from one event loop per worker process.

Each send and receive is one `run_until_complete` of the coroutine on the worker's loop: the same
loop overhead for tensorbus.aio and for its baseline, so their same-round ratio compares the two.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np

from .baselines import HEADER, ZmqLink
from .links import KEY, TensorbusLink, monitoring

_T = TypeVar("_T")


class AioTensorbusLink(TensorbusLink):
    """`tensorbus.aio.Producer` on the outbound endpoint, `tensorbus.aio.Consumer` on the inbound one."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        self.loop = asyncio.new_event_loop()

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

    def send(self, array: np.ndarray, index: int) -> None:
        self._run(self.producer.send(KEY, array, metadata={"i": index}))

    def recv(self, timeout: float) -> tuple[int, Any]:
        message = self._run(self.consumer.recv_message(KEY, timeout))
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


class ZmqAsyncioLink(ZmqLink):
    """pyzmq's asyncio PUSH (outbound) and PULL (inbound) over TCP, zero-copy sends."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        import zmq.asyncio

        self.context.term()
        self.context = zmq.asyncio.Context()  # type: ignore[assignment]  # (the asyncio flavour of the same)
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)  # (the sockets find their loop when first used)

    def send(self, array: np.ndarray, index: int) -> None:
        self.loop.run_until_complete(self.push.send_multipart([HEADER.pack(index, array.nbytes), array], copy=False))

    def recv(self, timeout: float) -> tuple[int, Any]:
        header, payload = self.loop.run_until_complete(self.pull.recv_multipart(copy=False))
        index, _ = HEADER.unpack(header.buffer)
        return index, payload.buffer

    def close(self) -> None:
        super().close()
        self.loop.close()
