"""A kafka-python client the Kafka transport made is closed when its setup fails after it was made.

Left open, its I/O thread and broker connections outlive the failure (a KafkaConsumer has no `__del__`).
The failure is injected after the real client connected to the real broker.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.errors import TransportError
from tensorbus.transports import kafka as kafka_transport
from tensorbus.transports.kafka import KafkaTransport
from tensorbus.transports.kafka_python import KafkaConsumer, KafkaProducer
from tests.conftest import endpoint_url
from tests.waiting import wait_for


def _no_thread_besides(earlier: set[threading.Thread]) -> None:
    """Wait until every thread started since `earlier` has ended (a client's I/O thread, force-closed, ends soon
    after): none is left to talk to the broker during the next test."""
    wait_for(lambda: not set(threading.enumerate()) - earlier, 10, "the client's threads to end")


pytestmark = pytest.mark.broker


def test_a_consumer_whose_topic_metadata_never_came_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[KafkaConsumer] = []

    class Recorded(KafkaConsumer):  # type: ignore[misc]
        def __init__(self, **config: Any) -> None:
            super().__init__(**config)
            made.append(self)

    def never(self: KafkaTransport, consumer: KafkaConsumer, timeout: float) -> None:
        raise TransportError("partitions of the topic unknown (injected)")

    monkeypatch.setattr(kafka_transport, "KafkaConsumer", Recorded)
    monkeypatch.setattr(KafkaTransport, "_await_metadata", never)
    earlier = set(threading.enumerate())
    with pytest.raises(TransportError, match="injected"):
        tb.Consumer(endpoint_url("kafka")).close()
    assert len(made) == 1
    assert made[0]._closed, "the consumer was left open"
    _no_thread_besides(earlier)


def test_a_producer_whose_partitions_never_came_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[KafkaProducer] = []

    class Unanswered(KafkaProducer):  # type: ignore[misc]
        def __init__(self, **config: Any) -> None:
            super().__init__(**config)
            made.append(self)

        def partitions_for(self, topic: str) -> Any:
            raise TransportError("partitions of the topic unknown (injected)")

    monkeypatch.setattr(kafka_transport, "KafkaProducer", Unanswered)
    earlier = set(threading.enumerate())
    with tb.Producer(endpoint_url("kafka")) as producer, pytest.raises(TransportError, match="injected"):
        producer.send("x", np.arange(3))
    assert len(made) == 1
    assert made[0]._closed, "the producer was left open"
    _no_thread_besides(earlier)
