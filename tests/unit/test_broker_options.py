"""The amqp:// and kafka:// options are checked when they are built (keywords or a URL query), no broker needed."""

from __future__ import annotations

from typing import Any

import pytest

import tensorbus as tb
from tensorbus.transports.kafka import FETCH_PER_PARTITION, RECORD_OVERHEAD, KafkaOptions, KafkaTransport
from tensorbus.transports.rabbitmq import MAX_PREFETCH, RabbitMQOptions

AMQP = "amqp://guest:guest@127.0.0.1:1/%2F"
KAFKA = "kafka://127.0.0.1:1/tensors"


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({}, r"needs a queue: add \?queue=NAME"),
        ({"queue": "q", "prefetch_count": 0}, f"prefetch_count must be 1 to {MAX_PREFETCH}"),
        ({"queue": "q", "prefetch_count": MAX_PREFETCH + 1}, f"prefetch_count must be 1 to {MAX_PREFETCH}"),
        ({"queue": "q", "queue_type": "mirrored"}, "queue_type must be one of quorum, classic, stream"),
        ({"queue": "q", "durable": False}, "a quorum queue is always durable: durable=False needs queue_type=classic"),
        ({"queue": "q", "queue_type": "stream", "durable": False}, "a stream queue is always durable"),
        ({"queue": "q", "offset": "first"}, "offset is a position in a stream: it needs queue_type=stream"),
        ({"queue": "q", "queue_type": "stream", "offset": -3}, "offset must be first, next, last"),
        ({"queue": "q", "queue_type": "stream", "offset": "middle"}, "offset must be first, next, last"),
    ],
)
def test_amqp_option_mistakes_are_config_errors_when_built(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(tb.ConfigError, match=needle):
        RabbitMQOptions(**options)


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("", "needs a queue"),
        ("?queue=q&prefetch=3", r"unknown option.*prefetch"),
        ("?queue=q&prefetch_count=70000", "prefetch_count must be 1 to 65535"),
        ("?queue=q&queue_type=mirrored", "queue_type must be one of"),
        ("?queue=q&durable=false", "durable=False needs queue_type=classic"),
        ("?queue=q&offset=first", "needs queue_type=stream"),
        ("?queue=q&queue_type=stream&offset=-3", "offset must be first, next, last"),
    ],
)
def test_amqp_option_mistakes_in_a_url_are_config_errors_before_any_connection(query: str, needle: str) -> None:
    with pytest.raises(tb.ConfigError, match=needle):
        tb.Producer(AMQP + query)  # (port 1: nothing listens, so a connection attempt would be another error)


@pytest.mark.parametrize(("given", "kept"), [(None, "next"), ("first", "first"), ("last", "last"), ("12", 12), (0, 0)])
def test_a_stream_offset_is_read_once_where_the_options_are_built(given: Any, kept: str | int) -> None:
    assert RabbitMQOptions(queue="q", queue_type="stream", offset=given).offset == kept
    assert RabbitMQOptions(queue="q", queue_type="classic", durable=False).offset is None


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"max_frame_bytes": 2_000_000}, "max_frame_bytes \\+ 1024 must be at most max_request_size"),
        ({"max_partition_fetch_bytes": 1 << 19}, "max_partition_fetch_bytes"),  # under a whole record
        ({"fetch_max_bytes": 1 << 19}, "at most fetch_max_bytes"),  # the default record no longer fits one fetch
        ({"delivery_timeout_s": 0.5}, "delivery_timeout_s must be at least 1"),
        ({"replication_factor": 2, "min_insync_replicas": 3}, "min_insync_replicas=3 exceeds the topic's 2 replica"),
    ],
)
def test_kafka_option_mistakes_are_config_errors_when_built(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(tb.ConfigError, match=needle):
        KafkaOptions(**options)


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("?max_frame_bytes=2000000", "must be at most max_request_size"),  # over kafka-python's max_request_size
        ("?partition_count=3", r"unknown option.*partition_count"),
        ("?replication_factor=2&min_insync_replicas=3", r"min_insync_replicas=3 exceeds the topic's 2 replica"),
        ("?replication_factor=0", "whole number of 1 or more"),
        ("?replication_factor=two", "whole number of 1 or more"),
        ("?min_insync_replicas=-1", "whole number of 1 or more"),
        ("?delivery_timeout_s=0.5", "delivery_timeout_s must be at least 1"),
    ],
)
def test_kafka_option_mistakes_in_a_url_are_config_errors_before_any_connection(query: str, needle: str) -> None:
    with pytest.raises(tb.ConfigError, match=needle):
        tb.Producer(KAFKA + query)  # (port 1: nothing listens, so a connection attempt would be another error)


def test_kafka_url_and_keyword_mistakes_are_config_errors_for_producers_and_consumers() -> None:
    with pytest.raises(tb.ConfigError, match="needs a topic"):  # (the URL's path: checked by the transport)
        tb.Producer("kafka://127.0.0.1:1")
    with pytest.raises(tb.ConfigError, match=r"unknown option.*groupid"):
        tb.Producer(KAFKA, groupid="x")
    with pytest.raises(tb.ConfigError, match=r"unknown option.*partition_count"):
        tb.Consumer(f"{KAFKA}?partition_count=3")
    with pytest.raises(tb.ConfigError, match="prefetch_count must be 1 to 65535"):
        tb.Consumer(f"{AMQP}?queue=q", prefetch_count=0)


def test_a_kafka_fetch_takes_at_least_one_whole_record() -> None:
    assert KafkaOptions().partition_fetch_bytes == FETCH_PER_PARTITION
    big = KafkaOptions(max_frame_bytes=20 << 20, max_request_size=21 << 20, fetch_max_bytes=64 << 20)
    assert big.partition_fetch_bytes == (20 << 20) + RECORD_OVERHEAD
    assert KafkaOptions(max_partition_fetch_bytes=2 << 20).partition_fetch_bytes == 2 << 20
    assert KafkaOptions(fetch_max_bytes=4 << 20).partition_fetch_bytes == 4 << 20  # within fetch_max_bytes


def test_a_kafka_url_gives_the_brokers_the_group_and_the_tls_and_sasl_settings() -> None:
    """As kafka-python names them; that they reach it, tests/integration/test_broker_tls.py shows (SSL and
    SASL_SSL round trips, a wrong password refused)."""
    url = "kafkas://b1:9093,b2/t?group=1234&ssl_cafile=ca.pem&sasl_mechanism=PLAIN&sasl_plain_username=u"
    with tb.Producer(url, sasl_plain_password=1234) as producer:  # nothing connects before the first send
        transport = producer.transport
        assert isinstance(transport, KafkaTransport)
        assert transport.servers == ["b1:9093", "b2:9092"] and transport.group == "1234"  # (text, not a number)
        assert transport.options.client_settings() == {
            **dict.fromkeys(["ssl_certfile", "ssl_keyfile", "ssl_password"]),
            "ssl_cafile": "ca.pem",
            "sasl_mechanism": "PLAIN",
            "sasl_plain_username": "u",
            "sasl_plain_password": "1234",
        }


def test_a_kafka_group_member_outlasts_a_broker_failover_and_both_clients_reconnect_within_a_second() -> None:
    """A coordinator's failover (a dead broker fenced after 9 s, then new leaders) must not end a member's session:
    librdkafka would give up its partitions and re-read from the last commit (tests/integration/test_cluster_kafka.py
    shows the stalls). Heartbeats stay at most a second apart, so rebalances start quickly."""
    from tensorbus.transports.kafka_rdkafka import client_config

    assert KafkaOptions().session_timeout_s >= 20 and KafkaOptions().heartbeat_interval_ms == 1000
    assert KafkaOptions(session_timeout_s=6).heartbeat_interval_ms == 600  # a tenth of a short session
    with tb.Producer("kafka://b1:9092/t?client=confluent") as producer:  # nothing connects before the first send
        transport = producer.transport
        assert isinstance(transport, KafkaTransport)
        assert client_config(transport)["reconnect.backoff.max.ms"] == 1000
        assert transport._client_config()["reconnect_backoff_max_ms"] == 1000


def test_a_confluent_consumer_behind_its_prefetch_limit_fetches_again_within_a_readers_wait() -> None:
    """librdkafka postpones a partition's next fetch by `fetch.queue.backoff.ms` (1 s by default) whenever its queue
    holds more than `queued.max.messages.kbytes` (64 MiB): a consumer that far behind the log (16,000 tensors of
    4 KB) stalled a second at a time, draining a backlog at 22,000 tensors/s where it decodes 99,000/s
    (docs/PERFORMANCE.md). It fetches again within a reader's wait for records (kafka_reading.WAIT_S)."""
    from tensorbus.transports.kafka_rdkafka import CONSUMER
    from tensorbus.transports.kafka_reading import WAIT_S

    assert 0 < CONSUMER["fetch.queue.backoff.ms"] <= WAIT_S * 1000
