"""CPU per tensor of tcp://, unix:// or shm://: a producer process and a consumer process, each side's own.

What it measures
    A `tb.Producer` in one child process sends `--tensors` float32 tensors of `--size` bytes back to back
    (`send(key, array, metadata={"i": n})`, as the bench's link does), a `tb.Consumer` in another receives them
    (`recv_message` in a loop). Printed: each side's CPU time per tensor (`time.process_time`, the first tensor
    left out) and the consumer's tensors/s. On a shared machine CPU per tensor moves far less with the load than
    wall time does. The consumer's reader spins while it waits for bytes, so its figure is an upper bound when
    the producer is the slower side; `--spin-s 0` makes it sleep at once instead (its CPU is then its work and its
    wake-ups).

Run
    python -m benchmarks.socket_cpu [--transport tcp|unix|shm] [--size 4096] [--tensors 100000] [--rounds 1]
        [--spin-s SECONDS]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from multiprocessing.queues import Queue
from typing import Any

import numpy as np

KEY = "k"
WAIT_S = 120.0


def consume(url: str, tensors: int, addresses: Queue[Any], results: Queue[Any], options: dict[str, Any]) -> None:
    """Receive `tensors` tensors; report CPU per tensor and tensors/s after the first."""
    import tensorbus as tb

    with tb.Consumer(url, **options) as consumer:
        addresses.put(consumer.address)
        consumer.recv_message(KEY, WAIT_S)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(tensors - 1):
            consumer.recv_message(KEY, WAIT_S)
        results.put(("consumer", (time.process_time() - cpu) / (tensors - 1), time.perf_counter() - wall))


def produce(address: str, tensors: int, size: int, results: Queue[Any]) -> None:
    """Send `tensors` tensors of `size` bytes; report CPU per tensor after the first, then flush."""
    import tensorbus as tb

    array = np.ones(size // 4, np.float32)
    with tb.Producer(address) as producer:
        producer.send(KEY, array, metadata={"i": 0})
        cpu, wall = time.process_time(), time.perf_counter()
        for index in range(1, tensors):
            producer.send(KEY, array, metadata={"i": index})
        results.put(("producer", (time.process_time() - cpu) / (tensors - 1), time.perf_counter() - wall))
        producer.flush(WAIT_S)


def one_round(
    transport: str, size: int, tensors: int, options: dict[str, Any] | None = None
) -> dict[str, tuple[float, float]]:
    """Each side's (CPU seconds per tensor, wall seconds) for one round."""
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
    producer = context.Process(target=produce, args=(addresses.get(timeout=WAIT_S), tensors, size, results))
    producer.start()
    try:
        return {side: (cpu, wall) for side, cpu, wall in (results.get(timeout=WAIT_S) for _ in range(2))}
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
    args = parser.parse_args()
    for _ in range(args.rounds):
        options = {} if args.spin_s is None else {"spin_s": args.spin_s}
        sides = one_round(args.transport, args.size, args.tensors, options)
        (producer_cpu, _), (consumer_cpu, consumer_wall) = sides["producer"], sides["consumer"]
        print(
            f"{args.transport} {args.size} B: producer {producer_cpu * 1e6:.2f} µs/tensor, consumer "
            f"{consumer_cpu * 1e6:.2f} µs/tensor, {(args.tensors - 1) / consumer_wall / 1e3:.1f}k tensors/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
