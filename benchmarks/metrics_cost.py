"""What Prometheus metrics cost a 4 KB tcp:// stream: CPU per tensor with metrics on against off, with an
A/A control (off against off) in the same run.

What it measures
    One producer process, started once, streams float32 tensors over tcp:// to a `tb.Consumer` in this
    process, which takes them with `recv`, round after round; each round opens a new Producer and
    Consumer, both with metrics on (`metrics=True`, into a registry nothing scrapes during the round:
    the cost measured is that of the counting) or both off. What is compared is the CPU time per
    tensor of each process (`time.process_time`: every thread of it, the transport's included) over
    the round's tensors after a warm-up, not the wall-clock rate: on a shared machine the rate swings
    with what the other processes do, the CPU a tensor takes much less.

    Rounds come in triples, `off`, `on` and `off again` (the control), in an order rotated each
    triple, so that drift hits the three alike. Reported: each case's median, and the median and
    quartiles over the triples of the ratios on/off and off-again/off (1.0: free). The control's
    spread is the method's noise: a cost smaller than it is not shown.

Run
    python -m benchmarks.metrics_cost [--size 4KB] [--tensors 10000] [--triples 20]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import tensorbus as tb

from .common import parse_size

WARMUP = 500
CASES = ("off", "on", "off again")


def _options(metrics: bool) -> dict[str, Any]:
    if not metrics:
        return {}
    from prometheus_client import CollectorRegistry

    return {"metrics": True, "metrics_registry": CollectorRegistry()}


def produce(orders: Connection) -> None:
    """The producer process: for each order (address, size, count, metrics), send `count` tensors after a
    warm-up and flush; answer with the CPU seconds that took."""
    while (order := orders.recv()) is not None:
        address, size, count, metrics = order
        array = np.ones(size // 4, np.float32)
        with tb.Producer(address, **_options(metrics)) as producer:
            for _ in range(WARMUP):
                producer.send("bench", array)
            started = time.process_time()
            for _ in range(count):
                producer.send("bench", array)
            producer.flush(120)
            orders.send(time.process_time() - started)


def one_round(orders: Connection, size: int, count: int, metrics: bool) -> tuple[float, float, float]:
    """One stream of `count` tensors (after `WARMUP`), metrics on or off at both ends: tensors per second,
    and the producer's and the consumer's CPU microseconds per tensor."""
    with tb.Consumer("tcp://127.0.0.1:0", **_options(metrics)) as consumer:
        orders.send((consumer.address, size, count, metrics))
        for _ in range(WARMUP):
            consumer.recv("bench", timeout=120)
        started, started_cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            consumer.recv("bench", timeout=120)
        elapsed, spent = time.perf_counter() - started, time.process_time() - started_cpu
        producer_cpu = orders.recv()
    return count / elapsed, producer_cpu / count * 1e6, spent / count * 1e6


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4KB")
    parser.add_argument("--tensors", type=int, default=10000)
    parser.add_argument("--triples", type=int, default=20)
    args = parser.parse_args()
    size = parse_size(args.size)
    context = multiprocessing.get_context("spawn")
    orders, theirs = context.Pipe()
    producer = context.Process(target=produce, args=(theirs,), daemon=True)
    producer.start()
    load_before = os.getloadavg()
    rows: dict[str, list[tuple[float, float, float]]] = {case: [] for case in CASES}
    try:
        for triple in range(args.triples):
            shift = triple % len(CASES)
            for case in CASES[shift:] + CASES[:shift]:
                rows[case].append(one_round(orders, size, args.tensors, case == "on"))
    finally:
        orders.send(None)
        producer.join(60)
    load_after = os.getloadavg()
    print(f"{args.size} tcp://, {args.tensors} tensors a round, {args.triples} triples of rounds")
    print(f"load average (1, 5, 15 min): before {_load(load_before)}, after {_load(load_after)}")
    for case in CASES:
        medians = [statistics.median(column) for column in zip(*rows[case], strict=True)]
        print(f"  {case:9} median: {medians[0]:,.0f} tensors/s, producer {medians[1]:.2f} µs CPU/tensor, "
              f"consumer {medians[2]:.2f}")  # fmt: skip
    for name, what in (("rate", 0), ("producer CPU", 1), ("consumer CPU", 2)):
        for case in ("on", "off again"):
            ratios = [mine[what] / off[what] for mine, off in zip(rows[case], rows["off"], strict=True)]
            q1, median, q3 = quartiles(ratios)
            print(f"  {name:12} {case:9}/off: median {median:.3f} (quartiles {q1:.3f} - {q3:.3f})")


def _load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    main()
