"""What Prometheus metrics cost a 4 KB tcp:// stream: CPU per tensor with metrics on against off, with an
A/A control (off against a second off) in the same run.

What it measures
    Three tcp:// streams are open at once between a producer process and this one (which takes the
    tensors with `recv`): `off` (metrics off at both ends), `on` (`metrics=True` at both ends, into a
    registry nothing scrapes: the cost measured is that of the counting) and `off again` (off, the
    control). They take turns in short blocks of tensors, in an order rotated each triple of blocks,
    so that what the machine's other jobs do hits the three alike. One block: the producer sends its
    tensors and flushes (the consumer has them all), then the consumer takes them; a block's cost is
    the CPU time (`time.process_time`: every thread of the process, the transport's included) each
    process spent on it, per tensor. CPU time, not the wall-clock rate: on a shared machine the rate
    swings with what the other processes do, the CPU a tensor takes much less.

    Reported: each stream's median, and the median and quartiles over the triples of the ratios
    on/off and off again/off (1.0: free). The control's ratio is the method's noise: a cost smaller
    than its spread is not shown.

Run
    python -m benchmarks.metrics_cost [--size 4KB] [--block 1000] [--triples 200]
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

CASES = ("off", "on", "off again")
WARMUP_BLOCKS = 3  # a few untimed blocks on each stream first


def _options(case: str) -> dict[str, Any]:
    if case != "on":
        return {}
    from prometheus_client import CollectorRegistry

    return {"metrics": True, "metrics_registry": CollectorRegistry()}


def produce(orders: Connection, addresses: dict[str, str], size: int, block: int) -> None:
    """The producer process: a Producer per stream; for each order (a stream's name), one block sent and
    flushed, answered with the CPU seconds it took. None ends it."""
    array = np.ones(size // 4, np.float32)
    producers = {case: tb.Producer(address, **_options(case)) for case, address in addresses.items()}
    try:
        while (case := orders.recv()) is not None:
            producer = producers[case]
            started = time.process_time()
            for _ in range(block):
                producer.send("bench", array)
            producer.flush(120)
            orders.send(time.process_time() - started)
    finally:
        for producer in producers.values():
            producer.close()


def one_block(orders: Connection, consumer: tb.Consumer, case: str, block: int) -> tuple[float, float, float]:
    """One block on stream `case`: tensors per second, the producer's and the consumer's CPU µs per tensor."""
    started, started_cpu = time.perf_counter(), time.process_time()
    orders.send(case)
    producer_cpu = orders.recv()
    for _ in range(block):
        consumer.recv("bench", timeout=120)
    elapsed, spent = time.perf_counter() - started, time.process_time() - started_cpu
    return block / elapsed, producer_cpu / block * 1e6, spent / block * 1e6


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


Rows = dict[str, list[tuple[float, float, float]]]


def run(size: int, block: int, triples: int) -> Rows:
    """`triples` timed triples of blocks of `block` tensors of `size` bytes: each stream's `one_block` results."""
    consumers = {case: tb.Consumer("tcp://127.0.0.1:0", **_options(case)) for case in CASES}
    context = multiprocessing.get_context("spawn")
    orders, theirs = context.Pipe()
    addresses = {case: consumer.address for case, consumer in consumers.items()}
    producer = context.Process(target=produce, args=(theirs, addresses, size, block), daemon=True)
    producer.start()
    rows: Rows = {case: [] for case in CASES}
    try:
        for _ in range(WARMUP_BLOCKS):
            for case in CASES:
                one_block(orders, consumers[case], case, block)
        for triple in range(triples):
            shift = triple % len(CASES)
            for case in CASES[shift:] + CASES[:shift]:
                rows[case].append(one_block(orders, consumers[case], case, block))
    finally:
        orders.send(None)
        producer.join(60)
        for consumer in consumers.values():
            consumer.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4KB")
    parser.add_argument("--block", type=int, default=1000, help="tensors per block")
    parser.add_argument("--triples", type=int, default=200, help="timed triples of blocks (off, on, off again)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = run(parse_size(args.size), args.block, args.triples)
    load_after = os.getloadavg()
    print(f"{args.size} tcp://, {args.triples} triples of blocks of {args.block} tensors")
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
