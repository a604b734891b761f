"""The raw broker clients, moving the same bytes as the tensorbus broker transports in the same run.

- `PikaLink`: raw pika, durable queue, persistent messages, publisher confirms, manual acks,
  prefetch 16 and the tensorbus amqp transport's chunk size.
- `KafkaLink`: raw kafka-python, acks=all (idempotent), one partition, the tensorbus kafka
  transport's chunk size; otherwise kafka-python's defaults, as a user would start.
Chunks of one tensor are joined in order into a reused buffer (a single chunk is used as is).
"""

from __future__ import annotations

import collections
import contextlib
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import brokers
from .links import Link

AMQP_PREFETCH = 16  # the tensorbus amqp transport's default prefetch_count
#: how long a raw kafka-python consumer may wait for its partition before it is made again (a join takes
#: well under a second here)
JOIN_ATTEMPT_S = 15.0


class _Assembler:
    """Joins the chunks of one tensor (in order) into a reused buffer; one chunk is passed through."""

    def __init__(self) -> None:
        self.buffer: memoryview | None = None
        self.offset = 0

    def prepare(self, nbytes: int) -> None:
        array = np.empty(nbytes, np.uint8)
        array.fill(1)
        self.buffer = array.data

    def add(self, chunk: int, count: int, body: bytes, chunk_bytes: int) -> memoryview | bytes | None:
        """Take chunk `chunk` of `count`; return the whole tensor after the last one."""
        if count == 1:
            return body
        if chunk == 0 and (self.buffer is None or len(self.buffer) <= (count - 1) * chunk_bytes):
            self.prepare(count * chunk_bytes)
        assert self.buffer is not None
        start = chunk * chunk_bytes
        end = start + len(body)
        if end > len(self.buffer):
            raise ValueError(f"chunk {chunk} of {count} does not fit the tensor being assembled")
        self.buffer[start:end] = body
        return self.buffer[:end] if chunk == count - 1 else None


class _ChunkedLink(Link):
    """A raw broker client's link: tensors go out in `chunk_bytes` pieces and are joined on receipt."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        self.chunk_bytes: int = spec["chunk_bytes"]
        self.assembler = _Assembler()

    def prepare(self, nbytes: int) -> None:
        if nbytes > self.chunk_bytes:
            self.assembler.prepare(nbytes)

    def release(self) -> None:
        self.assembler.buffer = None

    def chunks(self, array: np.ndarray) -> Iterator[tuple[int, int, bytes]]:
        """(chunk index, chunk count, bytes) for each piece of `array`."""
        view = array.data.cast("B")
        step = self.chunk_bytes
        count = max(1, -(-len(view) // step))
        for chunk in range(count):
            yield chunk, count, bytes(view[chunk * step : (chunk + 1) * step])


class PikaLink(_ChunkedLink):
    """Raw pika: a confirming publisher connection and a consuming connection with manual acks."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        import pika

        self.pika = pika
        self.params = brokers.amqp_parameters(spec["url"], min(self.timeout_s, 30.0))
        self.rx: Any = None
        self.tx: Any = None
        self.inbox: collections.deque[tuple[int, dict[str, Any], bytes]] = collections.deque()
        self.queues: list[str] = []
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(spec["url"]).query)
        queue_type = query.get("queue_type", ["quorum"])[-1]  # tensorbus's default (pika-classic: classic)
        self.arguments = None if queue_type == "classic" else {"x-queue-type": queue_type}

    def open(self) -> str:
        self.rx = self.pika.BlockingConnection(self.params)
        channel = self.rx.channel()
        channel.queue_declare(self.name, durable=True, arguments=self.arguments)
        self.queues.append(self.name)
        channel.basic_qos(prefetch_count=AMQP_PREFETCH)
        channel.basic_consume(
            self.name, lambda ch, method, props, body: self.inbox.append((method.delivery_tag, props.headers, body))
        )
        self.rx_channel = channel
        return self.name

    def connect(self, address: str) -> None:
        self.tx = self.pika.BlockingConnection(self.params)
        self.tx_channel = self.tx.channel()
        self.tx_channel.confirm_delivery()
        self.tx_channel.queue_declare(address, durable=True, arguments=self.arguments)
        self.tx_queue = address

    def send(self, array: np.ndarray, index: int) -> None:
        for chunk, count, body in self.chunks(array):
            self.tx_channel.basic_publish(
                "",
                self.tx_queue,
                body,
                properties=self.pika.BasicProperties(delivery_mode=2, headers={"i": index, "c": chunk, "n": count}),
                mandatory=True,
            )

    def recv(self, timeout: float) -> tuple[int, Any]:
        deadline = time.monotonic() + timeout
        while True:
            while self.inbox:
                tag, headers, body = self.inbox.popleft()
                whole = self.assembler.add(headers["c"], headers["n"], body, self.chunk_bytes)
                self.rx_channel.basic_ack(tag)
                if whole is not None:
                    return headers["i"], whole
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no message on {self.name} within {timeout:.1f}s")
            self.rx.process_data_events(time_limit=min(remaining, 1.0))

    def idle(self) -> None:
        for connection in (self.rx, self.tx):
            if connection is not None and connection.is_open:
                connection.process_data_events(0)

    def close(self) -> None:
        for connection in (self.tx, self.rx):
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.close()
        for queue in self.queues:
            with contextlib.suppress(Exception):
                brokers.delete_queue(self.spec["url"], queue)


class KafkaClientLink(_ChunkedLink):
    """A raw Kafka client's link (kafka-python here, confluent-kafka in confluent_baseline.py): the brokers,
    its producer and consumer, the records fetched and not yet joined, and how each chunk is labelled."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        self.bootstrap = brokers.kafka_bootstrap(spec["url"])
        self.consumer: Any = None
        self.producer: Any = None
        self.records: collections.deque[Any] = collections.deque()
        #: per partition, the offset after the last record taken: what a rebalance delivers again is skipped
        self.next_offsets: dict[int, int] = {}
        #: the largest record, fetch and request: one chunk and its batch's overhead, at least the client's 1 MiB
        self.record_bytes = max(1 << 20, self.chunk_bytes + 1024)

    @staticmethod
    def headers(index: int, chunk: int, count: int) -> list[tuple[str, bytes]]:
        """A chunk record's headers: the tensor's index, the chunk's and how many there are."""
        return [
            ("i", index.to_bytes(8, "little")),
            ("c", chunk.to_bytes(4, "little")),
            ("n", count.to_bytes(4, "little")),
        ]

    def is_new(self, partition: int, offset: int) -> bool:
        """Whether a record was not taken before: the group delivers again from its last commit after a
        rebalance (a busy machine can starve the heartbeats), and an at-least-once user skips those."""
        if offset < self.next_offsets.get(partition, 0):
            return False
        self.next_offsets[partition] = offset + 1
        return True

    def delete_topic(self) -> None:
        """Remove the link's topic (after its consumer closed)."""
        brokers.delete_endpoint(f"kafka://{self.bootstrap}/{self.name}")


class KafkaLink(KafkaClientLink):
    """Raw kafka-python: a topic per direction, one partition, chunked records, acks=all."""

    def open(self) -> str:
        """The topic, and a consumer in its own group that holds its partition: one made again when it got
        none within JOIN_ATTEMPT_S (kafka-python 3.0 was seen to wait 90 s for an assignment the broker had
        logged as sent; a new member is given the partition at once)."""
        import kafka

        brokers.create_topic(self.spec["url"], self.name, self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while True:
            self.consumer = kafka.KafkaConsumer(
                self.name,
                bootstrap_servers=self.bootstrap,
                group_id=self.name,
                auto_offset_reset="earliest",  # otherwise kafka-python's defaults, as a user would start
                max_partition_fetch_bytes=self.record_bytes,
                request_timeout_ms=int(max(self.timeout_s, 31) * 1000),
            )
            attempt_end = min(deadline, time.monotonic() + JOIN_ATTEMPT_S)
            while not self.consumer.assignment() and time.monotonic() < attempt_end:
                self.records.extend(r for rs in self.consumer.poll(timeout_ms=200).values() for r in rs)
            if self.consumer.assignment():
                return self.name
            self.consumer.close(autocommit=False)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"kafka consumer got no partition of {self.name} within {self.timeout_s:.0f}s")

    def connect(self, address: str) -> None:
        from kafka import KafkaProducer

        self.producer = KafkaProducer(
            bootstrap_servers=self.bootstrap,
            acks="all",  # and kafka-python's default: the idempotent producer
            max_request_size=self.record_bytes,
            max_block_ms=int(self.timeout_s * 1000),
        )
        self.topic = address

    def send(self, array: np.ndarray, index: int) -> None:
        for chunk, count, body in self.chunks(array):
            self.producer.send(self.topic, value=body, key=b"t", headers=self.headers(index, chunk, count))

    def recv(self, timeout: float) -> tuple[int, Any]:
        deadline = time.monotonic() + timeout
        while True:
            while self.records:
                record = self.records.popleft()
                if not self.is_new(record.partition, record.offset):
                    continue
                h = {k: int.from_bytes(v, "little") for k, v in record.headers}
                whole = self.assembler.add(h["c"], h["n"], record.value, self.chunk_bytes)
                if whole is not None:
                    return h["i"], whole
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no record on {self.name} within {timeout:.1f}s")
            polled = self.consumer.poll(timeout_ms=int(min(remaining, 1.0) * 1000))
            for records in polled.values():
                self.records.extend(records)

    def finish(self, timeout: float) -> None:
        self.producer.flush(timeout=timeout)

    def close(self) -> None:
        if self.producer is not None:
            with contextlib.suppress(Exception):
                self.producer.close(timeout=5)
        if self.consumer is not None:
            with contextlib.suppress(Exception):
                self.consumer.close(autocommit=False)
            self.delete_topic()
