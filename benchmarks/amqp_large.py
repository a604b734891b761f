"""Large tensors through RabbitMQ: wall time and each side's CPU, tensorbus amqp:// against raw pika.

What it measures
    A producer process and a consumer process move `--tensors` tensors of `--size` through one
    queue (quorum unless `--queue-type` says otherwise); the first is untimed. Reported per side:
    GB/s over the timed tensors and the process's CPU (user + system, from getrusage) per tensor,
    and, given `--broker-pid`, the bytes the broker process wrote to disk meanwhile. Three ways,
    alternating round by round:
      - tensorbus: `tb.Producer.send` / `tb.Consumer.recv`, chunks acknowledged once the tensor is whole;
      - tensorbus-4k: the same with pika's own 4 KiB socket reads on the consumer's connection;
      - pika: raw pika as in `tensorbus bench` (a confirm per chunk, each chunk acknowledged as it
        comes, the transport's chunk size).
    The CPU columns say which side a change relieved; the broker's writes, what acknowledging late costs it.

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

from .common import parse_sizes

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


def _pika_channel(queue: str, arguments: dict[str, Any] | None) -> tuple[Any, Any]:
    import pika

    from tensorbus.bench.brokers import amqp_parameters

    connection = pika.BlockingConnection(amqp_parameters(AMQP_URL, 30.0))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True, arguments=arguments)
    return connection, channel


def _pika_consumer(queue: str, arguments: Any, n: int, ready: Any, out: Any) -> None:
    from tensorbus.bench.broker_baselines import AMQP_PREFETCH, _Assembler

    connection, channel = _pika_channel(queue, arguments)
    channel.basic_qos(prefetch_count=AMQP_PREFETCH)
    assembler, done, started = _Assembler(), [0], [0.0, 0.0]

    def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
        chunk, count, step = properties.headers["c"], properties.headers["n"], properties.headers["s"]
        whole = assembler.add(chunk, count, body, step)
        ch.basic_ack(method.delivery_tag)
        if whole is not None:
            done[0] += 1
            if done[0] == 1:
                started[:] = [time.perf_counter(), _cpu_s()]

    channel.basic_consume(queue, on_message)
    ready.set()
    while done[0] < n:
        connection.process_data_events(time_limit=1.0)
    out.put(("consumer", time.perf_counter() - started[0], _cpu_s() - started[1]))
    connection.close()


def _pika_producer(queue: str, arguments: Any, n: int, nbytes: int, out: Any) -> None:
    import pika

    from tensorbus.options import defaults
    from tensorbus.transports.rabbitmq import RabbitMQOptions

    step = defaults(RabbitMQOptions)["max_frame_bytes"]  # the chunk size of amqp://
    view = np.ones(nbytes // 4, np.float32).data.cast("B")
    connection, channel = _pika_channel(queue, arguments)
    channel.confirm_delivery()
    count = -(-nbytes // step)

    def send() -> None:
        for chunk in range(count):
            headers = {"c": chunk, "n": count, "s": step}
            body = bytes(view[chunk * step : (chunk + 1) * step])
            channel.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2, headers=headers), True)

    send()
    t0, c0 = time.perf_counter(), _cpu_s()
    for _ in range(1, n):
        send()
    out.put(("producer", time.perf_counter() - t0, _cpu_s() - c0))
    connection.close()


def _written(pid: int | None) -> int:
    if pid is None:
        return 0
    with open(f"/proc/{pid}/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("write_bytes"))


def one_run(way: str, nbytes: int, n: int, queue_type: str, broker_pid: int | None = None) -> dict[str, float]:
    """Move `n` tensors one way; GB/s, CPU seconds per timed tensor on each side, broker MiB written per tensor."""
    queue = f"tb-large-{uuid.uuid4().hex[:8]}"
    arguments = None if queue_type == "classic" else {"x-queue-type": queue_type}
    context = multiprocessing.get_context("spawn")
    ready, out = context.Event(), context.Queue()
    if way == "pika":
        consumer = context.Process(target=_pika_consumer, args=(queue, arguments, n, ready, out))
        producer = context.Process(target=_pika_producer, args=(queue, arguments, n, nbytes, out))
    else:
        url = f"{AMQP_URL}?queue={queue}&queue_type={queue_type}"
        consumer = context.Process(target=_tensorbus_consumer, args=(url, n, way == "tensorbus-4k", ready, out))
        producer = context.Process(target=_tensorbus_producer, args=(url, n, nbytes, out))
    written = _written(broker_pid)
    consumer.start()
    if not ready.wait(60):
        consumer.kill()
        raise TimeoutError("the consumer did not start within 60 s")
    producer.start()
    sides = dict((side, (wall, cpu)) for side, wall, cpu in (out.get(timeout=600) for _ in range(2)))
    producer.join(60)
    consumer.join(60)
    out.close()
    connection, channel = _pika_channel(queue, arguments)
    channel.queue_delete(queue)
    connection.close()
    timed = n - 1
    return {
        "gbps": timed * nbytes / sides["consumer"][0] / 1e9,
        "consumer_cpu_s": sides["consumer"][1] / timed,
        "producer_cpu_s": sides["producer"][1] / timed,
        "broker_mib": (_written(broker_pid) - written) / n / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MB", help="tensor size (default 256MB)")
    parser.add_argument("--tensors", type=int, default=6, help="tensors per run, the first untimed (default 6)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each way, alternating (default 3)")
    parser.add_argument("--queue-type", default="quorum", choices=("quorum", "classic"))
    parser.add_argument("--broker-pid", type=int, help="the RabbitMQ process, to count its disk writes")
    args = parser.parse_args()
    (nbytes,) = parse_sizes(args.size)
    results: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            results[way].append(one_run(way, nbytes, args.tensors, args.queue_type, args.broker_pid))
    print(f"{args.size}, {args.tensors - 1} timed tensors per run, {args.queue_type} queue; medians of {args.rounds}")
    print(f"{'way':14} {'GB/s':>7} {'consumer CPU s':>15} {'producer CPU s':>15} {'broker MiB':>11}  (per tensor)")
    for way, runs in results.items():
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(
            f"{way:14} {median['gbps']:7.3f} {median['consumer_cpu_s']:15.3f} {median['producer_cpu_s']:15.3f}"
            f" {median['broker_mib']:11.0f}"
        )


if __name__ == "__main__":
    main()
