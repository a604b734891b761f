"""Fan-out on amqp:// (a RabbitMQ stream queue read from its start): late joiners get the latest of each key."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import numpy as np
import pika
import pytest

import tensorbus as tb
from tests.conftest import AMQP_URL, require_broker
from tests.fanout_peers import check_four_subscriber_processes, check_idle_subscriber
from tests.integration.test_readme import free_port

pytestmark = pytest.mark.broker
SMALL_FRAMES = {"max_frame_bytes": 256_000}  # a 1.2 MB tensor is five chunk messages


@contextlib.contextmanager
def _stream() -> Iterator[str]:
    """A fresh queue URL (the publisher declares it a stream), deleted afterwards."""
    require_broker(AMQP_URL)
    name = f"tb-fanout-{uuid.uuid4().hex[:12]}"
    try:
        yield f"{AMQP_URL}?queue={name}"
    finally:
        with contextlib.suppress(Exception), pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as connection:
            connection.channel().queue_delete(name)


def test_a_late_subscriber_gets_the_latest_of_each_key_whole() -> None:
    with _stream() as url, tb.Publisher(url, **SMALL_FRAMES) as pub:
        for version in (1, 2, 3):
            pub.publish("w", np.full(300_000, version, np.float32), version=version)
            pub.publish("b", np.full(4, version), version=version * 10)
        pub.flush(30)  # the broker has them all: what a subscriber joining now reads
        with tb.Subscriber(url) as sub:  # its first answer is the newest: it read the stream to its end first
            message = sub.latest("w", timeout=60)
            assert message.version == 3 and message.tensor.min() == message.tensor.max() == 3.0
            assert sub.latest("b", timeout=60).version == 30
            pub.publish("w", np.full(300_000, 4, np.float32), version=4)
            assert sub.latest("w", newer_than=3, timeout=60).tensor[0] == 4.0


def test_versions_only_increase_and_a_restarted_publisher_learns_them() -> None:
    with _stream() as url:
        with tb.Publisher(url) as pub, tb.Subscriber(url) as sub:
            for version in range(1, 51):
                pub.publish("a", np.full(1000, version), version=version)
            seen = []
            while not seen or seen[-1] != 50:
                seen.append(sub.next(timeout=60).version)
            assert seen == sorted(set(seen))
        with tb.Publisher(url) as pub:
            assert pub.versions() == {"a": 50}
            with pytest.raises(tb.ConfigError, match="not greater"):
                pub.publish("a", np.zeros(1), version=50)


def test_four_subscriber_processes_get_the_last_16_mb_model() -> None:
    with _stream() as url, tb.Publisher(url) as pub:
        check_four_subscriber_processes(pub, url, {}, 3)


def test_a_subscriber_that_never_reads_does_not_slow_the_publisher() -> None:
    with _stream() as url, tb.Publisher(url) as pub, tb.Subscriber(url) as idle:
        check_idle_subscriber(pub, idle)


def test_a_publisher_with_no_broker_there_fails_at_once() -> None:
    with pytest.raises(tb.TransportError, match="failed"):
        tb.Publisher(f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F?queue=q", reconnect_timeout_s=1)


def test_a_signed_version_of_several_messages_reaches_a_signed_subscriber() -> None:
    with _stream() as url, tb.Publisher(url, signing_key="s3cret", **SMALL_FRAMES) as pub:
        pub.publish("w", np.full(300_000, 7, np.float32), version=1)  # five chunks, each signed for the queue
        pub.flush(30)
        with tb.Subscriber(url, signing_key="s3cret", **SMALL_FRAMES) as sub:
            message = sub.latest("w", timeout=60)
            assert message.version == 1 and message.tensor.min() == message.tensor.max() == 7.0


def test_fan_out_refuses_a_queue_that_is_not_a_stream_and_leaves_its_messages() -> None:
    with _stream() as url:
        name = url.rsplit("=", 1)[1]
        with pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as connection:
            channel = connection.channel()
            channel.queue_declare(name, durable=True, arguments={"x-max-length": 1000})  # a classic queue
            channel.basic_publish("", name, b"someone else's message")
        with pytest.raises(tb.ConfigError, match="not a stream queue"):
            tb.Publisher(url)
        with tb.Subscriber(url) as sub, pytest.raises(tb.ConfigError, match="not a stream queue"):
            sub.latest("w", timeout=30)
        with pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as connection:
            assert connection.channel().queue_declare(name, passive=True).method.message_count == 1


def test_fan_out_uses_a_stream_declared_with_its_own_retention() -> None:
    with _stream() as url:
        name = url.rsplit("=", 1)[1]
        with pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as connection:
            arguments = {"x-queue-type": "stream", "x-max-age": "1h", "x-max-length-bytes": 50_000_000}
            connection.channel().queue_declare(name, durable=True, arguments=arguments)
        with tb.Publisher(url) as pub, tb.Subscriber(url) as sub:
            pub.publish("w", np.full(4, 2.0), version=2)
            assert sub.latest("w", timeout=30).version == 2
