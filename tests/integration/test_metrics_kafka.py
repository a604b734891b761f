"""Kafka's redeliveries and reconnects in the exposition, against the real single-node broker."""

from __future__ import annotations

import os
import socket
import urllib.parse
from typing import Any

import pytest

from tests.conftest import require_module

require_module("prometheus_client", "metrics")  # CI installs every extra: there a missing one fails
from kafka.partitioner.default import murmur2
from prometheus_client import CollectorRegistry

import tensorbus as tb
from tensorbus.transports.kafka import KafkaTransport
from tests.conftest import endpoint_url
from tests.integration.test_metrics import TENSOR, value
from tests.integration.test_metrics_acks import scrape
from tests.waiting import wait_for

pytestmark = pytest.mark.broker
KEYS = [f"k{i}" for i in range(8)]


def owned(consumer: tb.Consumer) -> frozenset[int]:
    assert isinstance(consumer.transport, KafkaTransport)
    return consumer.transport.assignment


def consumer_count(registry: CollectorRegistry, name: str) -> float:
    return value(scrape(registry), f"tensorbus_{name}_total", role="consumer")


def redeliveries(registry: CollectorRegistry) -> float:
    return consumer_count(registry, "redeliveries")


def test_kafka_counts_the_records_a_rebalance_delivers_again(kafka_client: str) -> None:
    """The first consumer holds every record untaken (nothing committed). A second joins the group and takes
    one partition (its records are new to it); once the second leaves, that partition comes back to the
    first, read again from its last commit: each of its records is one the first had, a redelivery."""
    by_partition = [sum((murmur2(key.encode()) & 0x7FFFFFFF) % 2 == p for key in KEYS) for p in (0, 1)]
    assert by_partition == [4, 4]  # (whichever partition goes to the second consumer, 4 records come back)
    url = endpoint_url("kafka")
    options: dict[str, Any] = {"client": kafka_client, "partitions": 2}
    first_registry, second_registry = CollectorRegistry(), CollectorRegistry()
    with tb.Consumer(url, metrics=True, metrics_registry=first_registry, **options) as first:
        with tb.Producer(url, **options) as producer:
            for key in KEYS:
                producer.send(key, TENSOR)
            producer.flush(60)
        wait_for(lambda: len(first.table) == len(KEYS), 60, "every record in the first consumer's table")
        assert redeliveries(first_registry) == 0
        with tb.Consumer(url, metrics=True, metrics_registry=second_registry, **options) as second:
            wait_for(lambda: len(second.table) == 4, 90, "one partition's records in the second's table")
            # (the first's own share of that rebalance applied too: a consumer that leaves before then starts
            # another, and a client whose assignment never changed keeps its read positions, reading nothing again)
            wait_for(lambda: len(owned(first)) == 1, 90, "the first left with one partition")
            assert redeliveries(second_registry) == 0  # (it never had them)
        wait_for(lambda: redeliveries(first_registry) >= 4, 90, "the partition back, its records read again")

        # each record read again is one the first consumer's table has: dropped as a duplicate
        same = lambda: redeliveries(first_registry) == consumer_count(first_registry, "duplicates")  # noqa: E731
        wait_for(same, 30, "every record read again dropped as a duplicate")
        assert len(first.table) == len(KEYS)


def cut_connections(opened_before: set[str], port: int) -> int:
    """Shut down every TCP connection to `port` this process opened since `opened_before` (its fds then):
    the client holding it sees its broker hang up, as when a network path breaks. Returns how many."""
    cut = 0
    for fd in set(os.listdir("/proc/self/fd")) - opened_before:
        try:
            sock = socket.socket(fileno=os.dup(int(fd)))  # (a duplicate: shutting it down ends the connection)
        except OSError:  # not a socket (or gone meanwhile)
            continue
        with sock:
            try:
                if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.getpeername()[1] == port:
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
            except OSError:  # not connected
                pass
    return cut


def test_kafka_confluent_counts_the_broker_connections_that_broke() -> None:
    """librdkafka's statistics count each broker connection that broke: the consumer's are cut under it (the
    broker stays up), it connects again by itself, and a tensor sent after the cut still arrives."""
    url = endpoint_url("kafka")
    options: dict[str, Any] = {"client": "confluent"}
    registry = CollectorRegistry()
    with tb.Producer(url, **options) as producer:
        producer.send("before", TENSOR)
        producer.flush(60)  # (its connections are open before those counted)
        opened_before = set(os.listdir("/proc/self/fd"))
        with tb.Consumer(url, metrics=True, metrics_registry=registry, **options) as consumer:
            consumer.recv("before", timeout=60)
            assert consumer_count(registry, "reconnects") == 0
            cut = cut_connections(opened_before, urllib.parse.urlsplit(url).port or 9092)
            assert cut >= 1  # (the consumer's, and any another client of this process opened meanwhile)
            wait_for(
                lambda: consumer_count(registry, "reconnects") >= 1, 60, "the consumer's broken connections counted"
            )
            producer.send("after", TENSOR)
            consumer.recv("after", timeout=60)
            assert 1 <= consumer_count(registry, "reconnects") <= cut
