"""`ConfluentLink`: raw confluent-kafka (librdkafka), the client most Python users of Kafka would pick.

acks=all with the idempotent producer, one partition, the tensorbus kafka transport's chunk size,
records batched by librdkafka (its default linger) with delivery reports served by `poll`, and a
consumer taking batches (`consume`); chunks are joined into a reused buffer, so every byte is touched
(and checksummed by the worker). Otherwise librdkafka's defaults, as a user would start.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np

from . import brokers
from .broker_baselines import KafkaClientLink

#: records one `consume` call may return
BATCH = 64


def batch(consumer: Any, most: int, timeout: float) -> list[Any]:
    """Up to `most` records: those already fetched, else the first to arrive within `timeout` and those behind it
    (`consume(most, timeout)` alone waits for `most` records or the timeout: a user batching would do this)."""
    records = consumer.consume(most, 0)
    if records:
        return list(records)
    first = consumer.poll(timeout)
    return [] if first is None else [first, *consumer.consume(most - 1, 0)]


class ConfluentLink(KafkaClientLink):
    """Raw confluent-kafka: a topic per direction, one partition, chunked records, acks=all (idempotent)."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        self.failed: list[Any] = []

    def open(self) -> str:
        from confluent_kafka import Consumer

        brokers.create_topic(self.spec["url"], self.name, self.timeout_s)
        self.consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": self.name,
                "auto.offset.reset": "earliest",
                "max.partition.fetch.bytes": self.record_bytes,
            }
        )
        self.consumer.subscribe([self.name])
        deadline = time.monotonic() + self.timeout_s
        while not self.consumer.assignment() and time.monotonic() < deadline:
            self.records.extend(batch(self.consumer, BATCH, 0.2))
        if not self.consumer.assignment():
            raise TimeoutError(f"kafka consumer got no partition of {self.name} within {self.timeout_s:.0f}s")
        return self.name

    def connect(self, address: str) -> None:
        from confluent_kafka import Producer

        self.producer = Producer(
            {
                "bootstrap.servers": self.bootstrap,
                "acks": "all",
                "enable.idempotence": True,
                "message.max.bytes": self.record_bytes,
            }
        )
        self.topic = address

    def _delivered(self, error: Any, message: Any) -> None:
        if error is not None:
            self.failed.append(error)

    def send(self, array: np.ndarray, index: int) -> None:
        for chunk, count, body in self.chunks(array):
            headers = self.headers(index, chunk, count)
            while True:
                try:
                    self.producer.produce(self.topic, body, b"t", headers=headers, on_delivery=self._delivered)
                    break
                except BufferError:  # librdkafka's queue is full: serve delivery reports until it drains
                    self.producer.poll(0.05)
            self.producer.poll(0)
        if self.failed:
            raise RuntimeError(f"confluent-kafka failed to deliver: {self.failed[0]}")

    def recv(self, timeout: float) -> tuple[int, Any]:
        deadline = time.monotonic() + timeout
        while True:
            while self.records:
                record = self.records.popleft()
                if record.error() is not None or not self.is_new(record.partition(), record.offset()):
                    continue
                h = {k: int.from_bytes(v, "little") for k, v in record.headers()}
                whole = self.assembler.add(h["c"], h["n"], record.value(), self.chunk_bytes)
                if whole is not None:
                    return h["i"], whole
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no record on {self.name} within {timeout:.1f}s")
            self.records.extend(batch(self.consumer, BATCH, min(remaining, 1.0)))

    def finish(self, timeout: float) -> None:
        left = self.producer.flush(timeout)
        if left or self.failed:
            raise RuntimeError(f"confluent-kafka: {left} records unacknowledged, failures: {self.failed[:1]}")

    def idle(self) -> None:
        if self.producer is not None:
            self.producer.poll(0)

    def close(self) -> None:
        if self.producer is not None:
            with contextlib.suppress(Exception):
                self.producer.flush(5)
        if self.consumer is not None:
            with contextlib.suppress(Exception):
                self.consumer.close()
            self.delete_topic()
