"""What Prometheus metrics cost a 4 KB tcp:// stream: metrics on against off, in the same run.

What it measures
    A `tb.Producer` in another process streams float32 tensors over tcp:// to a `tb.Consumer` in this
    one, which takes them with `recv`: tensors per second from the first tensor after a warm-up to the
    last, and the CPU time per tensor of each end (the producer's over its sends and flush, the
    consumer's over its recvs; wall-clock rates swing with how a stream batches, CPU less). Rounds
    alternate between both ends with metrics off and both with `metrics=True` (into a registry of
    their own, which nothing scrapes during the round: the cost measured is that of the counting),
    starting with the other case each pair. Reported: the medians of each case and the median of the
    per-pair ratios on/off (1.0: free).

Run
    python -m benchmarks.metrics_cost [--size 4KB] [--tensors 20000] [--pairs 5] [--control]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

import numpy as np

import tensorbus as tb

from .common import parse_size

WARMUP = 500


def produce(address: str, size: int, count: int, metrics: bool, cpu: Any) -> None:
    """Send `count` tensors of `size` bytes under one key, then flush; the CPU seconds of it go in `cpu`."""
    options = {"metrics": True, "metrics_registry": _registry()} if metrics else {}
    with tb.Producer(address, **options) as producer:
        array = np.ones(size // 4, np.float32)
        for _ in range(WARMUP):
            producer.send("bench", array)
        started = time.process_time()
        for _ in range(count - WARMUP):
            producer.send("bench", array)
        producer.flush(120)
        cpu.value = time.process_time() - started


def _registry() -> object:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


def one_round(size: int, count: int, metrics: bool) -> tuple[float, float, float]:
    """Tensors per second of one stream of `count` tensors (after `WARMUP`), metrics on or off at both
    ends, and the producer's and consumer's CPU microseconds per tensor."""
    options = {"metrics": True, "metrics_registry": _registry()} if metrics else {}
    with tb.Consumer("tcp://127.0.0.1:0", **options) as consumer:
        context = multiprocessing.get_context("spawn")
        cpu = context.Value("d", 0.0)
        producer = context.Process(target=produce, args=(consumer.address, size, WARMUP + count, metrics, cpu))
        producer.start()
        for _ in range(WARMUP):
            consumer.recv("bench", timeout=120)
        started, started_cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            consumer.recv("bench", timeout=120)
        elapsed, spent = time.perf_counter() - started, time.process_time() - started_cpu
        producer.join(120)
    return count / elapsed, cpu.value / count * 1e6, spent / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4KB")
    parser.add_argument("--tensors", type=int, default=20000)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--control", action="store_true", help="metrics off in both cases (the method's noise)")
    args = parser.parse_args()
    size = parse_size(args.size)
    results: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    ratios: list[tuple[float, float, float]] = []
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        got = {metrics: one_round(size, args.tensors, metrics and not args.control) for metrics in order}
        for metrics, result in got.items():
            results[metrics].append(result)
        ratios.append(tuple(on / off for on, off in zip(got[True], got[False], strict=True)))  # type: ignore[arg-type]
        print(f"pair {pair + 1}: off {_show(got[False])}; on {_show(got[True])}", flush=True)
    medians = {
        metrics: tuple(statistics.median(column) for column in zip(*rows, strict=True))
        for metrics, rows in results.items()
    }
    ratio = [statistics.median(column) for column in zip(*ratios, strict=True)]
    print(f"{args.size} tcp://, {args.tensors} tensors a round, {args.pairs} pairs, medians:")
    print(f"  off {_show(medians[False])}")  # type: ignore[arg-type]
    print(f"  on  {_show(medians[True])}")  # type: ignore[arg-type]
    print(f"  on/off: rate {ratio[0]:.3f}, producer CPU {ratio[1]:.3f}, consumer CPU {ratio[2]:.3f}")


def _show(result: tuple[float, float, float]) -> str:
    rate, producer_us, consumer_us = result
    return f"{rate:,.0f} tensors/s, producer {producer_us:.2f} µs CPU/tensor, consumer {consumer_us:.2f}"


if __name__ == "__main__":
    main()
