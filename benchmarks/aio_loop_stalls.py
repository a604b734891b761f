"""How long a tensorbus.aio socket consumer's loop stands still while large tensors of changing sizes cross it.

What it measures
    A consumer and a producer of one URL (tcp:// by default) on one event loop, with a 1 ms heartbeat task
    beside them; the producer sends one tensor of each of `--sizes` in turn and the consumer receives it. For
    each tensor: the latest heartbeat while it crossed (how much later than asked a 1 ms sleep returned), in ms.
    The default sizes shrink and grow so that the consumer's receive pool, which keeps a few large buffers,
    lets go of some to make room for new sizes (what the loop must not pay for: unmapping 256 MB of base pages
    takes ~60 ms on the 2-vCPU VM). The tensors are made before the heartbeat starts: their allocation is not
    the consumer's doing.

Run
    python -m benchmarks.aio_loop_stalls [--url tcp://127.0.0.1:0] [--sizes 256,100,40,16,6,300,120,50,20,8,256]
        [--rounds 3] [--loop asyncio|uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import tensorbus.aio as tba

from .aio_ping_cpu import run_on_loop

DEFAULT_SIZES_MB = "256,100,40,16,6,300,120,50,20,8,256"


async def latest_beats(url: str, tensors: list[np.ndarray]) -> list[float]:
    """Send and receive each of `tensors` in turn on one loop; the latest heartbeat (s) while each crossed (the
    ends' opening and closing not counted)."""
    latest = [0.0] * len(tensors)
    crossing = [-1]  # (the index of the tensor crossing now, which the heartbeat reads; -1: none)
    stop = asyncio.Event()

    async def heartbeat() -> None:
        while not stop.is_set():
            index = crossing[0]  # (the tensor crossing as the beat was asked for is the one it waited on)
            due = time.perf_counter() + 0.001
            await asyncio.sleep(0.001)
            if index >= 0:
                latest[index] = max(latest[index], time.perf_counter() - due)

    async with tba.Consumer(url) as consumer, tba.Producer(consumer.address) as producer:
        beating = asyncio.create_task(heartbeat())
        try:
            for index, tensor in enumerate(tensors):
                crossing[0] = index
                await producer.send("t", tensor)
                received = await consumer.recv("t", timeout=120)
                if received.shape != tensor.shape:
                    raise AssertionError(f"received {received.shape}, sent {tensor.shape}")
                del received
            crossing[0] = -1
        finally:
            stop.set()
            await beating
    return latest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="tcp://127.0.0.1:0")
    parser.add_argument("--sizes", default=DEFAULT_SIZES_MB, help="MB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    tensors = [np.ones(size << 18, np.float32) for size in sizes]
    print("latest beat (ms) while each tensor crossed; sizes in MB:", " ".join(f"{size:>4}" for size in sizes))
    for round_ in range(args.rounds):
        beats = run_on_loop(latest_beats(args.url, tensors), args.loop)
        print(f"round {round_ + 1}:", " " * 42, " ".join(f"{beat * 1e3:4.0f}" for beat in beats))


if __name__ == "__main__":
    main()
