"""tensorbus.aio over memory://, producer and consumer tasks on one event loop: a stream's rate and a round trip.

What it measures
    A stream: one task sends `--tensors` tensors of `--size` bytes under one key while another awaits each
    (after one such stream of warm-up). A round trip: a task sends a ping to one memory:// endpoint, an echo
    task on the same loop receives it and sends it back to another, `--rounds` times. Printed: tensors a second
    of the stream and the median round trip. Both ends live in the one process and loop, so this is the cost
    of tensorbus.aio's own steps, with no system call between the ends.

Run
    python -m benchmarks.aio_memory [--size 4096] [--tensors 20000] [--rounds 5000] [--loop asyncio|uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import numpy as np

import tensorbus.aio as tba


async def stream_rate(tensor: np.ndarray, tensors: int) -> float:
    """Tensors a second through one memory:// endpoint, sender and receiver tasks side by side."""
    async with tba.Consumer(f"memory://stream-{uuid.uuid4().hex}") as consumer:
        async with tba.Producer(consumer.address) as producer:

            async def produce() -> None:
                for _ in range(tensors):
                    await producer.send("k", tensor)

            async def consume() -> None:
                for _ in range(tensors):
                    await consumer.recv("k", timeout=60)

            await asyncio.gather(produce(), consume())  # (warm-up)
            started = time.perf_counter()
            await asyncio.gather(produce(), consume())
            return tensors / (time.perf_counter() - started)


async def round_trip(tensor: np.ndarray, rounds: int) -> float:
    """The median seconds of a ping sent and its echo received, the echo a task of the same loop."""
    name = uuid.uuid4().hex
    async with (
        tba.Consumer(f"memory://ping-{name}") as pings,
        tba.Consumer(f"memory://pong-{name}") as pongs,
        tba.Producer(f"memory://ping-{name}") as to_ping,
        tba.Producer(f"memory://pong-{name}") as to_pong,
    ):

        async def echo() -> None:
            for _ in range(rounds + 1):
                await to_pong.send("pong", await pings.recv("ping", timeout=60))

        echoing = asyncio.create_task(echo())
        times = []
        for _ in range(rounds + 1):  # (the first is warm-up)
            started = time.perf_counter()
            await to_ping.send("ping", tensor)
            await pongs.recv("pong", timeout=60)
            times.append(time.perf_counter() - started)
        await echoing
        return statistics.median(times[1:])


async def main(args: argparse.Namespace) -> None:
    tensor = np.ones(args.size // 4, np.float32)
    rate = await stream_rate(tensor, args.tensors)
    trip = await round_trip(tensor, args.rounds)
    print(f"{args.size} B, {args.loop}: stream {rate:,.0f} tensors/s; round trip p50 {trip * 1e6:.1f} µs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--tensors", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5_000)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    arguments = parser.parse_args()
    if arguments.loop == "uvloop":
        import uvloop

        uvloop.run(main(arguments))
    else:
        asyncio.run(main(arguments))
