"""The exposition's acknowledgement, connection and backpressure series, and the asyncio consumer's counts."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import pytest

from tests.conftest import require_module

require_module("prometheus_client", "metrics")  # CI installs every extra: there a missing one fails
from prometheus_client import CollectorRegistry, generate_latest

import tensorbus as tb
import tensorbus.aio as tba
from tests.conftest import endpoint_url
from tests.integration.test_metrics import TENSOR, Samples, parse, value
from tests.unit.test_options_doc import OPTIONS_MD
from tests.waiting import wait_for


def scrape(registry: CollectorRegistry) -> Samples:
    return parse(generate_latest(registry).decode())


def test_tcp_counts_acks_times_send_to_ack_and_gauges_connections() -> None:
    registry = CollectorRegistry()
    monitored: dict[str, Any] = {"metrics": True, "metrics_registry": registry}
    with tb.Consumer("tcp://127.0.0.1:0", **monitored) as consumer:
        with tb.Producer(consumer.address, **monitored) as producer, tb.Producer(consumer.address) as other:
            for _ in range(3):  # each acknowledged before the next is sent: each one timed
                producer.send("t", TENSOR)
                producer.flush(30)
            other.send("u", TENSOR)
            other.flush(30)
            for _ in range(3):
                consumer.recv("t", timeout=30)
            consumer.recv("u", timeout=30)
            during = scrape(registry)
        wait_for(lambda: consumer.transport.counts()["connections"] == 0, 30, "both producers gone")
        after = scrape(registry)
    where = consumer.address.removeprefix("tcp://")
    producer_labels = {"role": "producer", "transport": "tcp", "endpoint": where}
    consumer_labels = {"role": "consumer", "transport": "tcp", "endpoint": where}
    assert value(during, "tensorbus_acknowledged_frames_total", **producer_labels) == 3
    assert value(during, "tensorbus_ack_seconds_count", **producer_labels) == 3
    assert 0 < value(during, "tensorbus_ack_seconds_sum", **producer_labels) < 90
    assert value(during, "tensorbus_acknowledged_frames_total", **consumer_labels) == 4  # both producers' frames
    assert value(during, "tensorbus_connections", **consumer_labels) == 2
    assert value(during, "tensorbus_connections", **producer_labels) == 1
    assert value(during, "tensorbus_backpressure_seconds_total", **producer_labels) == 0  # never out of credit
    assert value(during, "tensorbus_reconnects_total", **producer_labels) == 0
    assert value(after, "tensorbus_connections", **consumer_labels) == 0
    reference = OPTIONS_MD.read_text()
    names = {re.sub(r"_(total|bucket|count|sum)$", "", name) for name, _ in during}
    assert {name for name in names if not re.search(rf"\b{name}\b", reference)} == set()  # docs name them all


def test_tcp_times_a_frame_whose_acknowledgement_comes_after_a_reconnect() -> None:
    """A frame sent just before its consumer restarts is acknowledged by the next one, after the producer
    reconnects and resends it: its send to acknowledgement is timed too, reconnect included."""
    registry = CollectorRegistry()
    monitored: dict[str, Any] = {"metrics": True, "metrics_registry": registry}
    consumer = tb.Consumer("tcp://127.0.0.1:0")
    address = consumer.address
    with tb.Producer(address, reconnect_timeout_s=20, **monitored) as producer:
        producer.send("t", TENSOR)
        producer.flush(30)
        consumer.recv("t", timeout=30)
        consumer.close()
        with tb.Consumer(address) as successor:
            producer.send("t", TENSOR)  # (on the old connection, mostly: the producer learns of it at the flush)
            producer.flush(30)
            successor.recv("t", timeout=30)
            samples = scrape(registry)
    assert value(samples, "tensorbus_reconnects_total", role="producer") == 1
    assert value(samples, "tensorbus_acknowledged_frames_total", role="producer") == 2
    assert value(samples, "tensorbus_ack_seconds_count", role="producer") == 2  # each flushed: each one timed


def test_shm_times_send_to_ack_and_counts_the_acks_of_both_ends() -> None:
    registry = CollectorRegistry()
    monitored: dict[str, Any] = {"metrics": True, "metrics_registry": registry}
    with (
        tb.Consumer(endpoint_url("shm"), **monitored) as consumer,
        tb.Producer(consumer.address, **monitored) as producer,
    ):
        for _ in range(3):  # each acknowledged before the next is sent: each one timed
            producer.send("t", TENSOR)
            producer.flush(30)
        for _ in range(3):
            consumer.recv("t", timeout=30)
        samples = scrape(registry)
    assert value(samples, "tensorbus_acknowledged_frames_total", role="producer") == 3
    assert value(samples, "tensorbus_ack_seconds_count", role="producer") == 3
    assert value(samples, "tensorbus_acknowledged_frames_total", role="consumer") == 3


def test_tcp_counts_the_seconds_a_send_waited_for_credit() -> None:
    registry = CollectorRegistry()
    monitored: dict[str, Any] = {"metrics": True, "metrics_registry": registry}
    held_s, count = 0.3, 8
    # the table takes two tensors of the producer's; it acknowledges no more until the application takes them
    with tb.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=4 * TENSOR.nbytes, **monitored) as consumer:
        with tb.Producer(consumer.address, max_unacked_bytes=2 * TENSOR.nbytes, **monitored) as producer:

            def take_late() -> None:
                wait_for(lambda: len(consumer.table) == 2, 30, "the table's share full")
                time.sleep(held_s)  # (what the sends wait: the point of the test, not a wait for something)
                for _ in range(count):
                    consumer.recv("t", timeout=30)

            taker = threading.Thread(target=take_late)
            taker.start()
            started = time.monotonic()
            for _ in range(count):
                producer.send("t", TENSOR)
            producer.flush(30)
            elapsed = time.monotonic() - started
            taker.join(30)
            samples = scrape(registry)
    blocked = value(samples, "tensorbus_backpressure_seconds_total", role="producer")
    assert held_s / 2 <= blocked <= elapsed
    assert value(samples, "tensorbus_acknowledged_frames_total", role="producer") == count


@pytest.mark.broker
def test_rabbitmq_counts_confirms_redeliveries_and_connections() -> None:
    url = endpoint_url("amqp")
    registry = CollectorRegistry()
    monitored: dict[str, Any] = {"metrics": True, "metrics_registry": registry}
    first = tb.Consumer(url, **monitored)
    try:
        with tb.Producer(url, **monitored) as producer:
            for _ in range(3):  # each confirmed before the next is published: each one timed
                producer.send("t", TENSOR)
                producer.flush(30)
            wait_for(lambda: len(first.table) == 3, 60, "3 tensors in the first consumer's table")
            before = scrape(registry)
    finally:
        first.close()  # untaken: the broker delivers them again, flagged redelivered
    with tb.Consumer(url, **monitored) as second:
        for _ in range(3):
            second.recv("t", timeout=60)
        after = scrape(registry)
    queue = url.rpartition("queue=")[2]
    producer_labels = {"role": "producer", "transport": "amqp", "endpoint": queue}
    consumer_labels = {"role": "consumer", "transport": "amqp", "endpoint": queue}
    assert value(before, "tensorbus_acknowledged_frames_total", **producer_labels) == 3
    assert value(before, "tensorbus_ack_seconds_count", **producer_labels) == 3
    assert value(before, "tensorbus_connections", **producer_labels) == 1
    assert value(before, "tensorbus_connections", **consumer_labels) == 1
    assert value(before, "tensorbus_redeliveries_total", **consumer_labels) == 0
    assert value(before, "tensorbus_acknowledged_frames_total", **consumer_labels) == 0  # none taken
    assert value(after, "tensorbus_redeliveries_total", **consumer_labels) == 3
    assert value(after, "tensorbus_acknowledged_frames_total", **consumer_labels) == 3


@pytest.mark.broker
def test_kafka_counts_delivery_reports(kafka_client: str) -> None:
    registry = CollectorRegistry()
    monitored: dict[str, Any] = {"metrics": True, "metrics_registry": registry}
    url = endpoint_url("kafka")
    with tb.Producer(url, client=kafka_client, **monitored) as producer:
        for _ in range(3):  # each acknowledged before the next is sent: each one timed
            producer.send("t", TENSOR)
            producer.flush(60)
        samples = scrape(registry)
    assert value(samples, "tensorbus_acknowledged_frames_total", role="producer") == 3
    assert value(samples, "tensorbus_ack_seconds_count", role="producer") == 3
    assert 0 < value(samples, "tensorbus_ack_seconds_sum", role="producer") < 3 * 60


@pytest.mark.parametrize("transport", ["memory", "tcp"])
def test_the_asyncio_consumer_counts_its_receives_as_the_blocking_one_does(transport: str) -> None:
    registry = CollectorRegistry()
    monitored: dict[str, Any] = {"metrics": True, "metrics_registry": registry}

    async def exchange() -> None:
        async with tba.Consumer(endpoint_url(transport), **monitored) as consumer:
            async with tba.Producer(consumer.address, **monitored) as producer:
                for _ in range(3):
                    await producer.send("t", TENSOR)
                for _ in range(2):
                    await consumer.recv("t", timeout=30)
                await consumer.next_message(timeout=30)

    asyncio.run(exchange())
    samples = scrape(registry)
    assert value(samples, "tensorbus_sent_tensors_total", role="producer") == 3
    assert value(samples, "tensorbus_received_tensors_total", role="consumer") == 3
    assert value(samples, "tensorbus_received_bytes_total", role="consumer") == 3 * TENSOR.nbytes
    assert value(samples, "tensorbus_recv_wait_seconds_count", role="consumer") == 3
