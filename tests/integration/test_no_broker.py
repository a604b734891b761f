"""The Kafka transport with no broker to talk to: it fails fast, saying so, and asks again only what may succeed."""

from __future__ import annotations

import time

import pytest

import tensorbus as tb
from tensorbus.transports.kafka_python import ke, retrying


def test_no_broker_fails_fast_with_a_tensorbus_error(kafka_client: str) -> None:
    started = time.monotonic()
    with pytest.raises(tb.TransportError):
        tb.Consumer("kafka://127.0.0.1:1/tb-nobody", connect_timeout_s=2.0, client=kafka_client)
    assert time.monotonic() - started < 15


def test_setup_requests_are_made_again_after_a_retriable_error_until_a_deadline() -> None:
    """As when the cluster still lists a broker killed a moment ago and kafka-python asks it (NodeNotReadyError)."""
    calls: list[float] = []

    def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ke.NodeNotReadyError(1)
        return "answered"

    assert retrying(flaky, time.monotonic() + 10, "here") == "answered" and len(calls) == 3

    def failing(error: Exception) -> None:
        calls.append(time.monotonic())
        raise error

    calls.clear()
    with pytest.raises(ke.NodeNotReadyError):
        retrying(lambda: failing(ke.NodeNotReadyError(1)), time.monotonic() + 0.7, "here")
    assert 2 <= len(calls) <= 3  # asked again every 0.5 s until the deadline had passed
    calls.clear()
    with pytest.raises(ke.TopicAuthorizationFailedError):
        retrying(lambda: failing(ke.TopicAuthorizationFailedError()), time.monotonic() + 10, "here")
    assert len(calls) == 1  # not retriable: raised at once
