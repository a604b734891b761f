"""CPU per round trip of a 4 KB ping-pong between two processes over tcp:// (or unix://, shm://), tensorbus.aio or
the blocking API.

What it measures
    Each process has a consumer and a producer connected to the other's consumer; the ping process sends a
    tensor and awaits the echo, `--rounds` times after one tensor of warm-up. Printed: the median round trip
    and each process's CPU time per round trip (`resource.getrusage`, every thread). With `--spin-s 0` the
    consumers sleep as soon as nothing is there, so the CPU counts the work of a round trip alone, not a
    busy-poll's: load disturbs it less than the round trip's wall time, and it says where an end costs more. Also
    printed: the median time a `send` of the ping took (the producer's own part of a hop).

Run
    python -m benchmarks.aio_ping_cpu [--api aio|blocking] [--loop asyncio|uvloop] [--transport tcp|unix|shm]
        [--rounds 4000] [--spin-s 0] [--size 4096]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import statistics
import tempfile
import time
import uuid
from collections.abc import Coroutine
from typing import Any, NamedTuple, TypeVar

import numpy as np

import tensorbus as tb
import tensorbus.aio as tba

T = TypeVar("T")


class Crossed:
    """Two queues crossed: each process puts its own consumer's address and gets the other's."""

    def __init__(self, mine: Any, theirs: Any) -> None:
        self.mine, self.theirs = mine, theirs

    def put(self, address: str) -> None:
        self.mine.put(address)

    def get(self) -> str:
        return str(self.theirs.get(timeout=60))


def run_on_loop(main: Coroutine[Any, Any, T], loop: str) -> T:
    """Run `main` on a new event loop of the kind `loop` names (asyncio's own, or uvloop's)."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def endpoint(transport: str) -> str:
    """A consumer URL of a fresh endpoint of `transport`."""
    name = f"aio-ping-{uuid.uuid4().hex[:8]}"
    return {
        "tcp": "tcp://127.0.0.1:0",
        "unix": f"unix://{tempfile.gettempdir()}/{name}.sock",
        "shm": f"shm://{name}",
    }[transport]


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _echo_aio(args: Any, addresses: Any, spent: Any) -> None:
    async with tba.Consumer(endpoint(args.transport), **args.options) as consumer:
        addresses.put(consumer.address)
        async with tba.Producer(addresses.get()) as producer:
            await producer.send("warm", np.zeros(1, np.uint8))
            started = cpu_s()
            for _ in range(args.rounds):
                await producer.send("pong", await consumer.recv("ping", timeout=30))
            spent.put(cpu_s() - started)
            await producer.flush(30)


def _echo(args: Any, addresses: Any, spent: Any) -> None:
    """The echo process: sends every tensor straight back."""
    if args.api == "aio":
        run_on_loop(_echo_aio(args, addresses, spent), args.loop)
        return
    with tb.Consumer(endpoint(args.transport), **args.options) as consumer:
        addresses.put(consumer.address)
        with tb.Producer(addresses.get()) as producer:
            producer.send("warm", np.zeros(1, np.uint8))
            started = cpu_s()
            for _ in range(args.rounds):
                producer.send("pong", consumer.recv("ping", timeout=30))
            spent.put(cpu_s() - started)
            producer.flush(30)


async def _ping_aio(args: Any, addresses: Any, tensor: np.ndarray, times: list[float], sends: list[float]) -> float:
    async with tba.Consumer(endpoint(args.transport), **args.options) as consumer:
        addresses.put(consumer.address)
        async with tba.Producer(addresses.get()) as producer:
            await consumer.recv("warm", timeout=30)
            started = cpu_s()
            for _ in range(args.rounds):
                sent = time.perf_counter()
                await producer.send("ping", tensor)
                sends.append(time.perf_counter() - sent)
                await consumer.recv("pong", timeout=30)
                times.append(time.perf_counter() - sent)
            return cpu_s() - started


def _ping(args: Any, addresses: Any, tensor: np.ndarray, times: list[float], sends: list[float]) -> float:
    if args.api == "aio":
        return run_on_loop(_ping_aio(args, addresses, tensor, times, sends), args.loop)
    with tb.Consumer(endpoint(args.transport), **args.options) as consumer:
        addresses.put(consumer.address)
        with tb.Producer(addresses.get()) as producer:
            consumer.recv("warm", timeout=30)
            started = cpu_s()
            for _ in range(args.rounds):
                sent = time.perf_counter()
                producer.send("ping", tensor)
                sends.append(time.perf_counter() - sent)
                consumer.recv("pong", timeout=30)
                times.append(time.perf_counter() - sent)
            return cpu_s() - started


class Result(NamedTuple):
    """One ping-pong's figures, in seconds: the median round trip, the ping's and the echo's CPU per round trip,
    and the median time the ping's `send` took."""

    p50: float
    ping_cpu: float
    echo_cpu: float
    send_p50: float


def run(
    api: str, rounds: int, size: int, spin_s: float | None, loop: str = "asyncio", transport: str = "tcp"
) -> Result:
    """One ping-pong of `rounds` round trips. The echo runs in a fresh interpreter (spawned: nothing of this
    process's state)."""
    options = {} if spin_s is None else {"spin_s": spin_s}
    args = argparse.Namespace(api=api, rounds=rounds, options=options, loop=loop, transport=transport)
    context = multiprocessing.get_context("spawn")
    to_echo, to_ping, spent = context.Queue(), context.Queue(), context.Queue()
    echo = context.Process(target=_echo, args=(args, Crossed(to_ping, to_echo), spent))
    echo.start()
    try:
        tensor = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        times: list[float] = []
        sends: list[float] = []
        mine = _ping(args, Crossed(to_echo, to_ping), tensor, times, sends)
        theirs = spent.get(timeout=120)
    finally:
        echo.join(60)
    return Result(statistics.median(times), mine / rounds, theirs / rounds, statistics.median(sends))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", choices=["aio", "blocking"], default="aio")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio", help="the event loop of --api aio")
    parser.add_argument("--transport", choices=["tcp", "unix", "shm"], default="tcp")
    parser.add_argument("--rounds", type=int, default=4000)
    parser.add_argument("--size", type=int, default=4096, help="bytes of the tensor (uint8)")
    parser.add_argument("--spin-s", type=float, default=None, help="the consumers' spin_s (default: theirs)")
    args = parser.parse_args()
    result = run(args.api, args.rounds, args.size, args.spin_s, args.loop, args.transport)
    api = f"{args.api} on {args.loop}" if args.api == "aio" else args.api
    print(
        f"{args.transport}, {api}: round trip p50 {result.p50 * 1e6:.0f} µs (a send {result.send_p50 * 1e6:.1f} µs); "
        f"CPU a round trip: ping {result.ping_cpu * 1e6:.0f} µs, echo {result.echo_cpu * 1e6:.0f} µs "
        f"(load {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
