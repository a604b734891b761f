"""CPU per tensor of tcp://, unix:// or shm://: a producer process and a consumer process, each side's own.

What it measures
    A `tb.Producer` in one child process sends `--tensors` float32 tensors of `--size` bytes back to back
    (`send(key, array, metadata={"i": n})`, as the bench's link does), a `tb.Consumer` in another receives them
    (`recv_message` in a loop, each message kept until the next comes, as a `for` loop keeps it). Printed: each
    side's CPU time per tensor (`time.process_time`, the first tensor left out), the consumer's tensors/s and its
    minor page faults per tensor (a frame received into fresh memory faults its pages in). On a shared machine
    CPU per tensor moves far less with the load than wall time does. The consumer's reader spins while it waits
    for bytes, so its figure is an upper bound when the producer is the slower side; `--spin-s 0` makes it sleep
    at once instead (its CPU is then its work and its wake-ups). With `--aio` the consumer is tensorbus.aio's,
    on uvloop (asyncio's loop without it), receiving in arrival order (`async for`), or with `--keyed` by key
    (`await recv_message(key)`, as the bench's link and the blocking consumer here do); with `--aio-producer`
    the producer is tensorbus.aio's, awaiting each send.

Run
    python -m benchmarks.socket_cpu [--transport tcp|unix|shm] [--size 4096] [--tensors 100000] [--rounds 1]
        [--spin-s SECONDS] [--aio [--keyed]] [--aio-producer]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import tempfile
import time
from collections.abc import Coroutine
from multiprocessing.queues import Queue
from typing import Any

import numpy as np

KEY = "k"
WAIT_S = 120.0


def consume(url: str, tensors: int, addresses: Queue[Any], results: Queue[Any], options: dict[str, Any]) -> None:
    """Receive `tensors` tensors; report CPU per tensor, tensors/s and minor faults per tensor after the first."""
    import tensorbus as tb

    if options.pop("aio", False):
        _run_loop(consume_async(url, tensors, addresses, results, options))
        return
    with tb.Consumer(url, **options) as consumer:
        addresses.put(consumer.address)
        message = consumer.recv_message(KEY, WAIT_S)
        start = _usage()
        for _ in range(tensors - 1):
            message = consumer.recv_message(KEY, WAIT_S)  # (kept until the next comes, as a `for` loop keeps it)
        del message
        results.put(("consumer", *_since(start, tensors - 1)))


async def consume_async(
    url: str, tensors: int, addresses: Queue[Any], results: Queue[Any], options: dict[str, Any]
) -> None:
    """`consume` through tensorbus.aio, on the running loop."""
    import tensorbus.aio as tba

    keyed = options.pop("keyed", False)
    async with tba.Consumer(url, **options) as consumer:
        addresses.put(consumer.address)
        arrivals = aiter(consumer)
        message = await (consumer.recv_message(KEY, WAIT_S) if keyed else anext(arrivals))
        start = _usage()
        for _ in range(tensors - 1):
            message = await (consumer.recv_message(KEY, WAIT_S) if keyed else anext(arrivals))
        del message
        results.put(("consumer", *_since(start, tensors - 1)))


def _run_loop(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run `coroutine` on uvloop, or on asyncio's own loop without it."""
    try:
        import uvloop

        run: Any = uvloop.run
    except ImportError:
        run = asyncio.run
    run(coroutine)


def _usage() -> tuple[float, float, int]:
    """CPU seconds, wall seconds, minor page faults, now."""
    return time.process_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _since(start: tuple[float, float, int], tensors: int) -> tuple[float, float, float]:
    """CPU seconds per tensor, wall seconds, minor faults per tensor since `start`."""
    cpu, wall, faults = (now - then for now, then in zip(_usage(), start, strict=True))
    return cpu / tensors, wall, faults / tensors


def produce(address: str, tensors: int, size: int, results: Queue[Any], aio: bool = False) -> None:
    """Send `tensors` tensors of `size` bytes; report CPU per tensor after the first, then flush."""
    import tensorbus as tb

    array = np.ones(size // 4, np.float32)
    if aio:
        _run_loop(produce_async(address, tensors, array, results))
        return
    with tb.Producer(address) as producer:
        producer.send(KEY, array, metadata={"i": 0})
        start = _usage()
        for index in range(1, tensors):
            producer.send(KEY, array, metadata={"i": index})
        results.put(("producer", *_since(start, tensors - 1)))
        producer.flush(WAIT_S)


async def produce_async(address: str, tensors: int, array: np.ndarray, results: Queue[Any]) -> None:
    """`produce` through tensorbus.aio, on the running loop."""
    import tensorbus.aio as tba

    async with tba.Producer(address) as producer:
        await producer.send(KEY, array, metadata={"i": 0})
        start = _usage()
        for index in range(1, tensors):
            await producer.send(KEY, array, metadata={"i": index})
        results.put(("producer", *_since(start, tensors - 1)))
        await producer.flush(WAIT_S)


def one_round(
    transport: str, size: int, tensors: int, options: dict[str, Any] | None = None, aio_producer: bool = False
) -> dict[str, tuple[float, float, float]]:
    """Each side's (CPU seconds per tensor, wall seconds, minor faults per tensor) for one round."""
    context = multiprocessing.get_context("spawn")
    addresses: Queue[Any] = context.Queue()
    results: Queue[Any] = context.Queue()
    url = {
        "tcp": "tcp://127.0.0.1:0",
        "unix": f"unix://{tempfile.gettempdir()}/socket-cpu-{os.getpid()}.sock",
        "shm": f"shm://socket-cpu-{os.getpid()}",
    }[transport]
    consumer = context.Process(target=consume, args=(url, tensors, addresses, results, options or {}))
    consumer.start()
    producer = context.Process(
        target=produce, args=(addresses.get(timeout=WAIT_S), tensors, size, results, aio_producer)
    )
    producer.start()
    try:
        return {
            side: (cpu, wall, faults) for side, cpu, wall, faults in (results.get(timeout=WAIT_S) for _ in range(2))
        }
    finally:
        for process in (producer, consumer):
            process.join(WAIT_S)
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=["tcp", "unix", "shm"], default="tcp")
    parser.add_argument("--size", type=int, default=4096, help="bytes a tensor")
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--spin-s", type=float, default=None, help="the consumer's spin_s (default: its own)")
    parser.add_argument("--aio", action="store_true", help="the consumer through tensorbus.aio")
    parser.add_argument("--keyed", action="store_true", help="the aio consumer receives by key, not in arrival order")
    parser.add_argument("--aio-producer", action="store_true", help="the producer through tensorbus.aio")
    args = parser.parse_args()
    for _ in range(args.rounds):
        options: dict[str, Any] = {} if args.spin_s is None else {"spin_s": args.spin_s}
        if args.aio:
            options["aio"] = True
            options["keyed"] = args.keyed
        sides = one_round(args.transport, args.size, args.tensors, options, args.aio_producer)
        (producer_cpu, _, _), (consumer_cpu, consumer_wall, faults) = sides["producer"], sides["consumer"]
        consumer = (" (aio consumer, keyed)" if args.keyed else " (aio consumer)") if args.aio else ""
        producer = " (aio producer)" if args.aio_producer else ""
        print(
            f"{args.transport}{consumer}{producer} {args.size} B: producer "
            f"{producer_cpu * 1e6:.2f} µs/tensor, consumer {consumer_cpu * 1e6:.2f} µs/tensor, "
            f"{faults:.1f} faults/tensor, {(args.tensors - 1) / consumer_wall / 1e3:.1f}k tensors/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
