"""Large tensors through RabbitMQ: wall time and each side's CPU, tensorbus amqp:// against raw pika.

What it measures
    A producer process and a consumer process move `--tensors` tensors of `--size` through one
    queue (quorum unless `--queue-type` says otherwise); the first is untimed. Reported per side:
    GB/s over the timed tensors and the process's CPU (user + system, from getrusage) per tensor,
    and, given `--broker-pid`, the broker process's CPU and the bytes it wrote to disk meanwhile. Three ways,
    alternating round by round:
      - tensorbus: `tb.Producer.send` / `tb.Consumer.recv`, chunks acknowledged once the tensor is whole;
      - tensorbus-4k: the same with pika's own 4 KiB socket reads on the consumer's connection;
      - pika: `tensorbus bench`'s raw pika baseline (`PikaLink`: a confirm per chunk, each chunk
        acknowledged as it comes, the transport's chunk size).
    The CPU columns say which side a change relieved; the broker's CPU and writes, what acknowledging late costs it.

Run
    python -m benchmarks.amqp_large [--size 256MB] [--tensors 6] [--rounds 3] [--broker-pid PID]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import time
import uuid
from typing import Any

import numpy as np

from tensorbus.bench.brokers import delete_queue

from .common import parse_sizes, process_cpu_s

AMQP_URL = os.environ.get("TENSORBUS_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
WAYS = ("tensorbus", "tensorbus-4k", "pika")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _tensorbus_consumer(url: str, n: int, pika_reads: bool, ready: Any, out: Any) -> None:
    import tensorbus as tb
    from tensorbus.transports import rabbitmq_consumer

    if pika_reads:
        rabbitmq_consumer.read_in_large_pieces = lambda connection: False
    with tb.Consumer(url) as consumer:
        ready.set()
        consumer.recv("t0", timeout=300)
        t0, c0 = time.perf_counter(), _cpu_s()
        for i in range(1, n):
            consumer.recv(f"t{i}", timeout=300)
        out.put(("consumer", time.perf_counter() - t0, _cpu_s() - c0))


def _tensorbus_producer(url: str, n: int, nbytes: int, out: Any) -> None:
    import tensorbus as tb

    array = np.ones(nbytes // 4, np.float32)
    with tb.Producer(url) as producer:
        producer.send("t0", array)
        producer.flush(timeout=300)
        t0, c0 = time.perf_counter(), _cpu_s()
        for i in range(1, n):
            producer.send(f"t{i}", array)
        producer.flush(timeout=300)
        out.put(("producer", time.perf_counter() - t0, _cpu_s() - c0))


def _pika_link(queue_type: str, tag: str, role: str) -> Any:
    """The raw pika baseline of `tensorbus bench` (`PikaLink`): role "B" consumes, "A" publishes to it."""
    from tensorbus.bench.broker_baselines import PikaLink
    from tensorbus.options import defaults
    from tensorbus.transports.rabbitmq import RabbitMQOptions

    chunk_bytes = defaults(RabbitMQOptions)["max_frame_bytes"]  # the chunk size of amqp://
    spec = {"tag": tag, "timeout_s": 300.0, "url": f"{AMQP_URL}?queue_type={queue_type}", "chunk_bytes": chunk_bytes}
    return PikaLink(spec, role)


def _pika_consumer(queue_type: str, tag: str, n: int, ready: Any, out: Any) -> None:
    link = _pika_link(queue_type, tag, "B")
    try:
        link.open()
        ready.set()
        link.recv(300)
        t0, c0 = time.perf_counter(), _cpu_s()
        for _ in range(1, n):
            link.recv(300)
        out.put(("consumer", time.perf_counter() - t0, _cpu_s() - c0))
    finally:
        link.close()  # (deletes the queue)


def _pika_producer(queue_type: str, tag: str, n: int, nbytes: int, out: Any) -> None:
    link = _pika_link(queue_type, tag, "A")
    array = np.ones(nbytes // 4, np.float32)
    try:
        link.connect(f"tbbench-{tag}-fwd")  # the consumer's queue (`Link.name` of role B)
        link.send(array, 0)
        t0, c0 = time.perf_counter(), _cpu_s()
        for i in range(1, n):
            link.send(array, i)
        out.put(("producer", time.perf_counter() - t0, _cpu_s() - c0))
    finally:
        link.close()


def _written(pid: int | None) -> int:
    if pid is None:
        return 0
    with open(f"/proc/{pid}/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("write_bytes"))


def _broker_cpu_s(pid: int | None) -> float:
    """CPU seconds the broker process has used (user + system); 0 without its PID."""
    return 0.0 if pid is None else process_cpu_s(pid)


def one_run(way: str, nbytes: int, n: int, queue_type: str, broker_pid: int | None = None) -> dict[str, float]:
    """Move `n` tensors one way; GB/s, CPU seconds per timed tensor on each side, broker MiB written per tensor."""
    queue = f"tb-large-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")
    ready, out = context.Event(), context.Queue()
    if way == "pika":
        consumer = context.Process(target=_pika_consumer, args=(queue_type, queue, n, ready, out))
        producer = context.Process(target=_pika_producer, args=(queue_type, queue, n, nbytes, out))
    else:
        url = f"{AMQP_URL}?queue={queue}&queue_type={queue_type}"
        consumer = context.Process(target=_tensorbus_consumer, args=(url, n, way == "tensorbus-4k", ready, out))
        producer = context.Process(target=_tensorbus_producer, args=(url, n, nbytes, out))
    written, broker_cpu = _written(broker_pid), _broker_cpu_s(broker_pid)
    consumer.start()
    if not ready.wait(60):
        consumer.kill()
        raise TimeoutError("the consumer did not start within 60 s")
    producer.start()
    sides = dict((side, (wall, cpu)) for side, wall, cpu in (out.get(timeout=600) for _ in range(2)))
    producer.join(60)
    consumer.join(60)
    out.close()
    if way != "pika":  # (the pika link deletes its own)
        delete_queue(AMQP_URL, queue)
    timed = n - 1
    return {
        "gbps": timed * nbytes / sides["consumer"][0] / 1e9,
        "consumer_cpu_s": sides["consumer"][1] / timed,
        "producer_cpu_s": sides["producer"][1] / timed,
        "broker_mib": (_written(broker_pid) - written) / n / 2**20,
        "broker_cpu_s": (_broker_cpu_s(broker_pid) - broker_cpu) / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MB", help="tensor size (default 256MB)")
    parser.add_argument("--tensors", type=int, default=6, help="tensors per run, the first untimed (default 6)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each way, alternating (default 3)")
    parser.add_argument("--queue-type", default="quorum", choices=("quorum", "classic"))
    parser.add_argument("--broker-pid", type=int, help="the RabbitMQ process, to count its CPU and disk writes")
    args = parser.parse_args()
    (nbytes,) = parse_sizes(args.size)
    results: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            results[way].append(one_run(way, nbytes, args.tensors, args.queue_type, args.broker_pid))
    print(f"{args.size}, {args.tensors - 1} timed tensors per run, {args.queue_type} queue; medians of {args.rounds}")
    print(
        f"{'way':14} {'GB/s':>7} {'consumer CPU s':>15} {'producer CPU s':>15} {'broker CPU s':>13}"
        f" {'broker MiB':>11}  (per tensor)"
    )
    for way, runs in results.items():
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(
            f"{way:14} {median['gbps']:7.3f} {median['consumer_cpu_s']:15.3f} {median['producer_cpu_s']:15.3f}"
            f" {median['broker_cpu_s']:13.3f} {median['broker_mib']:11.0f}"
        )


if __name__ == "__main__":
    main()
