"""`tensorbus_backpressure_seconds` on every transport that holds a producer back: each test makes a send wait
and checks the counter grew by at least the time waited (and stayed 0 before any wait)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.conftest import require_module

require_module("prometheus_client", "metrics")  # CI installs every extra: there a missing one fails
from prometheus_client import CollectorRegistry

import tensorbus as tb
from tests.conftest import endpoint_url
from tests.integration.test_metrics import TENSOR, value
from tests.integration.test_metrics_acks import scrape

TIMEOUT_S = 0.3  # what the send that finds no room waits before it fails


def blocked_s(registry: CollectorRegistry) -> float:
    return value(scrape(registry), "tensorbus_backpressure_seconds_total", role="producer")


def test_memory_counts_the_seconds_a_send_waited_for_room() -> None:
    registry = CollectorRegistry()
    options: dict[str, Any] = {"max_unacked_bytes": 2 * TENSOR.nbytes, "send_timeout_s": TIMEOUT_S}
    with tb.Producer(endpoint_url("memory"), metrics=True, metrics_registry=registry, **options) as producer:
        for _ in range(2):  # (nobody receives: two frames fill the queue)
            producer.send("t", TENSOR)
        assert blocked_s(registry) == 0
        started = time.monotonic()
        with pytest.raises(tb.TransportError, match="max_unacked_bytes"):
            producer.send("t", TENSOR)
        waited = time.monotonic() - started
        assert TIMEOUT_S <= blocked_s(registry) <= waited


def test_shm_counts_the_seconds_a_send_waited_for_room() -> None:
    registry = CollectorRegistry()
    options: dict[str, Any] = {"max_unacked_bytes": 2 * TENSOR.nbytes, "send_timeout_s": TIMEOUT_S}
    with tb.Consumer(endpoint_url("shm"), max_buffered_bytes=4 * TENSOR.nbytes) as consumer:  # takes nothing
        with tb.Producer(
            consumer.address, close_timeout_s=0.1, metrics=True, metrics_registry=registry, **options
        ) as producer:
            producer.send("t", TENSOR)  # (nothing unacknowledged before it: it cannot wait)
            assert blocked_s(registry) == 0
            started = time.monotonic()
            with pytest.raises(tb.Timeout, match="shm://"):
                for _ in range(20):  # the table fills, acknowledgements stop, a send waits out its timeout
                    producer.send("t", TENSOR)
            sending = time.monotonic() - started
            assert TIMEOUT_S <= blocked_s(registry) <= sending


@pytest.mark.broker
def test_kafka_counts_the_seconds_a_send_waited_for_max_pending_bytes(kafka_client: str) -> None:
    """A second record waits for the first's acknowledgement (max_pending_bytes holds one), which the
    client holds back for `batch_linger_s`."""
    registry = CollectorRegistry()
    linger = 0.5
    options: dict[str, Any] = {"client": kafka_client, "batch_linger_s": linger, "max_pending_bytes": 6000}
    with tb.Producer(endpoint_url("kafka"), metrics=True, metrics_registry=registry, **options) as producer:
        producer.send("warm-up", TENSOR)  # (connected, so that the first send timed is a send, not a connection)
        producer.flush(60)
        started = time.monotonic()
        producer.send("t", TENSOR)
        first_done = time.monotonic()
        assert blocked_s(registry) == 0
        producer.send("t", TENSOR)  # waits until the first is acknowledged, at least `linger` after it was sent
        second_done = time.monotonic()
        blocked = blocked_s(registry)
        producer.flush(60)
    # (the first record's linger started after `started`; the wait, after `first_done` plus the encoding)
    assert linger - (first_done - started) - 0.1 <= blocked <= second_done - first_done
    assert blocked > 0
