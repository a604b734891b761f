"""CPU per tensor of kafka:// on librdkafka (`client=confluent`) or raw confluent-kafka: producer and consumer.

What it measures
    The bench's own links (tensorbus/bench: `TensorbusLink` on `kafka://...?client=confluent`, or
    `ConfluentLink`, raw confluent-kafka as a user would write it) on the single-node Kafka: a producer in a
    child process sends `--tensors` float32 tensors of `--size` bytes after a warm-up, the consumer here
    receives them. Printed: each process's CPU time per tensor (`time.process_time`: librdkafka's threads
    included) and tensors/s, and the consumer's CPU per tensor by thread (/proc, 10 ms ticks). On two vCPUs
    shared with the broker the pipeline's CPU per tensor sets the rate, and load disturbs it less than wall time.
    With `--backlog` the consumer starts only once every tensor is in the topic: a consumer behind the log
    (librdkafka's prefetch limits then apply), timed alone.

Run
    python -m benchmarks.kafka_cpu [--impl tensorbus|confluent-kafka] [--size 4096] [--tensors 30000] [--backlog]
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
import uuid
from typing import Any

import numpy as np

from tensorbus.bench.links import make_link
from tensorbus.bench.plan import _transport_option

from .common import thread_stats

WARMUP = 2000


def spec(impl: str, tag: str) -> dict[str, Any]:
    """The bench's description of one method's link (tensorbus/bench/runner.py makes the same)."""
    url = "kafka://127.0.0.1:9092" + ("?client=confluent" if impl == "tensorbus" else "")
    chunk_bytes = _transport_option("kafka://h:1/t", "max_frame_bytes")
    return {"tag": tag, "timeout_s": 60, "url": url, "impl": impl, "chunk_bytes": chunk_bytes}


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each thread of this process, by name (Python's where it has one) and id."""
    names = {thread.native_id: thread.name[:16] for thread in threading.enumerate()}
    return {f"{names.get(tid, name)}:{tid}": cpu for tid, (name, cpu, _) in thread_stats().items()}


def produce(impl: str, tag: str, address: str, size: int, count: int, results: Any, go: Any) -> None:
    """The producer process: warm up, wait for `go`, send `count` tensors and wait for their acks."""
    link = make_link(spec(impl, tag), "A")
    link.connect(address)
    array = np.ones(size // 4, np.float32)
    for i in range(WARMUP):
        link.send(array, i)
    link.finish(60)
    go.wait()
    cpu, wall = time.process_time(), time.monotonic()
    for i in range(WARMUP, WARMUP + count):
        link.send(array, i)
    link.finish(60)
    results.put((time.process_time() - cpu, time.monotonic() - wall))
    link.close()


def measure(impl: str, size: int, count: int, backlog: bool = False) -> str:
    """One round: the consumer's and the producer's CPU per tensor, as a line (`backlog`: the consumer drains
    the topic once the producer is done)."""
    tag = uuid.uuid4().hex[:8]
    link = make_link(spec(impl, tag), "B")
    address = link.open()
    results, go = multiprocessing.Queue(), multiprocessing.Event()
    child = multiprocessing.Process(target=produce, args=(impl, tag, address, size, count, results, go))
    child.start()
    for _ in range(WARMUP):
        link.recv(60)
    if backlog:
        go.set()
        producer_cpu, producer_wall = results.get(timeout=120)  # (every tensor acknowledged: in the topic)
    threads_before, cpu, wall = thread_cpu(), time.process_time(), time.monotonic()
    go.set()
    for _ in range(count):
        link.recv(60)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    threads = {k: v - threads_before.get(k, 0.0) for k, v in thread_cpu().items()}
    if not backlog:
        producer_cpu, producer_wall = results.get(timeout=120)
    child.join()
    link.close()
    by_thread = {k.rsplit(":", 1)[0]: round(v / count * 1e6, 1) for k, v in threads.items() if v > 0}
    load = open("/proc/loadavg").read().split()[0]
    return (
        f"{impl} {size} B, {count} tensors{', backlog' if backlog else ''}, load {load}: "
        f"consumer {cpu / count * 1e6:.1f} µs/tensor "
        f"({count / wall:.0f}/s), producer {producer_cpu / count * 1e6:.1f} µs/tensor ({count / producer_wall:.0f}/s); "
        f"consumer threads, µs/tensor: {by_thread}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", default="tensorbus", choices=["tensorbus", "confluent-kafka"])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--tensors", type=int, default=30_000)
    parser.add_argument("--backlog", action="store_true", help="drain the topic once every tensor is in it")
    args = parser.parse_args()
    print(measure(args.impl, args.size, args.tensors, args.backlog), flush=True)


if __name__ == "__main__":
    main()
