"""What the C fast paths buy: the same socket stream and round trip with them and without (TENSORBUS_NATIVE=0).

What it measures
    Over tcp:// between two processes, with a real tb.Producer and tb.Consumer:
      - stream: float32 tensors of --size bytes sent back to back; GB/s at the consumer, and the
        consumer's and producer's CPU per tensor.
      - ping: a 4 KB tensor sent and sent back; the round trip's median.
    Each round runs once with the C paths and once with Python only (alternating, as the machine is
    noisy: the extensions are chosen at import, so every run is a fresh pair of processes). Medians
    of the rounds, and their ratio.

Run
    python -m benchmarks.native_speedup [--size 64KB] [--tensors 5000] [--pings 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .common import parse_sizes

WARMUP = 200


def _produce(address: str, size: int, count: int, report: multiprocessing.Queue) -> None:
    import tensorbus as tb

    array = np.ones(size // 4, np.float32)
    with tb.Producer(address) as producer:
        for i in range(WARMUP + count):
            if i == WARMUP:
                started = time.process_time()
            producer.send("k", array)
        report.put((time.process_time() - started) / count)
        producer.flush(60)


def stream(size: int, count: int) -> dict[str, float]:
    """GB/s and µs of CPU per tensor on each side, for `count` tensors of `size` bytes."""
    import tensorbus as tb

    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        report: multiprocessing.Queue = multiprocessing.Queue()
        producer = multiprocessing.Process(target=_produce, args=(consumer.address, size, count, report))
        producer.start()
        for _ in range(WARMUP):
            consumer.recv("k", timeout=60)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            consumer.recv("k", timeout=60)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        producer_cpu = report.get(timeout=60)
        producer.join(60)
    return {"gbps": size * count / wall / 1e9, "consumer_us": cpu / count * 1e6, "producer_us": producer_cpu * 1e6}


def _echo(address: str, count: int, ready: multiprocessing.Queue) -> None:
    import tensorbus as tb

    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        ready.put(consumer.address)
        with tb.Producer(address) as producer:
            for _ in range(count):
                producer.send("pong", consumer.recv("ping", timeout=60))


def ping(count: int) -> dict[str, float]:
    """Median 4 KB round trip in µs."""
    import tensorbus as tb

    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        ready: multiprocessing.Queue = multiprocessing.Queue()
        echo = multiprocessing.Process(target=_echo, args=(consumer.address, WARMUP + count, ready))
        echo.start()
        array, rtts = np.ones(1024, np.float32), []
        with tb.Producer(ready.get(timeout=60)) as producer:
            for i in range(WARMUP + count):
                started = time.perf_counter()
                producer.send("ping", array)
                consumer.recv("pong", timeout=60)
                if i >= WARMUP:
                    rtts.append(time.perf_counter() - started)
        echo.join(60)
    return {"rtt_us": statistics.median(rtts) * 1e6}


def one_run(native: bool, size: int, tensors: int, pings: int) -> dict[str, float]:
    """Both measurements in a fresh interpreter, with or without the C paths."""
    env = {**os.environ, "TENSORBUS_NATIVE": "1" if native else "0"}
    code = f"import benchmarks.native_speedup as b; b.child({size}, {tensors}, {pings})"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True, timeout=600
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result.pop("native") != native:
        raise SystemExit("the C paths are not built: pip install -e . (with a C compiler)")
    return result


def child(size: int, tensors: int, pings: int) -> None:
    """One run, in the interpreter `one_run` started: prints its measurements as JSON."""
    from tensorbus.codec.native import NATIVE
    from tensorbus.transports.stream import NATIVE_STREAM

    native = NATIVE is not None and NATIVE_STREAM is not None
    print(json.dumps({**stream(size, tensors), **ping(pings), "native": native}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="64KB", help="stream tensor size (binary units)")
    parser.add_argument("--tensors", type=int, default=5000)
    parser.add_argument("--pings", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    (size,) = parse_sizes(args.size)
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for native in (True, False):
            runs[native].append(one_run(native, size, args.tensors, args.pings))
    print(f"{'':22s} {'C paths':>10s} {'Python only':>12s} {'ratio':>7s}")
    for metric, label in (
        ("gbps", f"{args.size} stream GB/s"),
        ("consumer_us", "consumer µs CPU/tensor"),
        ("producer_us", "producer µs CPU/tensor"),
        ("rtt_us", "4 KB round trip µs"),
    ):
        fast = statistics.median(r[metric] for r in runs[True])
        slow = statistics.median(r[metric] for r in runs[False])
        print(f"{label:22s} {fast:10.3g} {slow:12.3g} {fast / slow:6.2f}x")


if __name__ == "__main__":
    main()
