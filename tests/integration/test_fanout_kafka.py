"""Fan-out on kafka://: a compacted topic gives late joiners the latest whole tensors, before and after compaction."""

from __future__ import annotations

import contextlib
import urllib.parse
import uuid
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import tensorbus as tb
from tests.conftest import KAFKA_CLIENTS, KAFKA_URL, require_broker
from tests.fanout_peers import check_four_subscriber_processes, check_idle_subscriber, crc_of
from tests.waiting import wait_for

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka import KafkaAdminClient, KafkaConsumer
    from kafka.admin import NewTopic
    from kafka.structs import TopicPartition

SERVERS = urllib.parse.urlsplit(KAFKA_URL).netloc
#: chunks of 256 KB: a 1 MB tensor is five records
pytestmark = pytest.mark.broker
SMALL_RECORDS = {"max_frame_bytes": 256_000}


@contextlib.contextmanager
def _topic(configs: dict[str, str] | None = None) -> Iterator[str]:
    """A fresh topic URL (created here, compacted, when `configs` are given), deleted afterwards (without the client:
    see `client_url`)."""
    require_broker(KAFKA_URL)
    name = f"tb-fanout-{uuid.uuid4().hex[:12]}"
    admin = KafkaAdminClient(bootstrap_servers=SERVERS)
    try:
        if configs is not None:
            admin.create_topics([NewTopic(name, 1, 1, topic_configs={"cleanup.policy": "compact", **configs})])
        yield f"{KAFKA_URL.rstrip('/')}/{name}"
    finally:
        with contextlib.suppress(Exception):
            admin.delete_topics([name])
        admin.close()


Topic = Callable[..., contextlib.AbstractContextManager[str]]


@pytest.fixture(params=KAFKA_CLIENTS)
def client_url(request: pytest.FixtureRequest) -> Topic:
    """`_topic`, its URL naming the Kafka client of this run (each test runs once per client)."""

    @contextlib.contextmanager
    def topic(configs: dict[str, str] | None = None) -> Iterator[str]:
        with _topic(configs) as url:
            yield f"{url}?client={request.param}"

    return topic


def _records(url: str) -> int:
    """How many records the topic holds now, read from its start."""
    consumer = KafkaConsumer(
        bootstrap_servers=SERVERS, group_id=None, enable_auto_commit=False, allow_auto_create_topics=False
    )
    try:
        tp = TopicPartition(urllib.parse.urlsplit(url).path.lstrip("/"), 0)
        consumer.assign([tp])
        consumer.seek_to_beginning()
        end = consumer.end_offsets([tp])[tp]
        count = 0
        while consumer.position(tp) < end:
            count += sum(len(r) for r in consumer.poll(timeout_ms=500).values())
        return count
    finally:
        consumer.close()


def test_a_late_subscriber_gets_the_latest_of_each_key_and_publish_refuses_older(client_url: Topic) -> None:
    with client_url() as url, tb.Publisher(url, **SMALL_RECORDS) as pub:
        for version in (1, 2, 3):
            pub.publish("w", np.full(300_000, version, np.float32), version=version)  # 1.2 MB: five chunks
            pub.publish("b", np.full(4, version), version=version * 10)
        pub.flush(30)  # the broker has them all: what a subscriber joining now reads
        with pytest.raises(tb.ConfigError, match="not greater"):
            pub.publish("w", np.zeros(1), version=3)
        with tb.Subscriber(url) as sub:
            message = sub.latest("w", timeout=60)
            assert message.version == 3 and message.tensor.min() == message.tensor.max() == 3.0
            assert sub.latest("b", timeout=60).version == 30
            pub.publish("w", np.full(300_000, 4, np.float32), version=4)
            assert sub.latest("w", newer_than=3, timeout=60).tensor[0] == 4.0


def test_publish_takes_a_snapshot_of_arrays_changed_in_place_afterwards(client_url: Topic) -> None:
    with client_url() as url, tb.Publisher(url, **SMALL_RECORDS) as pub, tb.Subscriber(url) as sub:
        weights = np.zeros(300_000, np.float32)
        for version in (1, 2):
            weights += 1  # in place, right after the previous publish
            pub.publish("w", weights, version=version)
        weights += 1
        message = sub.latest("w", newer_than=1, timeout=60)
        assert message.tensor.min() == message.tensor.max() == 2.0


def test_versions_only_increase_for_a_subscriber_reading_along(client_url: Topic) -> None:
    with client_url() as url, tb.Publisher(url) as pub, tb.Subscriber(url) as sub:
        for version in range(1, 51):
            pub.publish("a", np.full(1000, version), version=version)
        seen: list[int] = []
        while not seen or seen[-1] != 50:
            message = sub.next(timeout=60)
            assert message.tensor[0] == message.version
            seen.append(message.version)
        assert seen == sorted(set(seen))


def test_after_compaction_a_late_joiner_still_gets_whole_latest_tensors(client_url: Topic) -> None:
    configs = {
        "segment.bytes": str(1 << 20),  # the smallest Kafka takes: four chunk records; closed segments get compacted
        "segment.ms": "100",
        "min.cleanable.dirty.ratio": "0.001",
        "min.compaction.lag.ms": "0",
        "delete.retention.ms": "0",
    }
    with client_url(configs) as url:
        rng = np.random.default_rng(1)
        with tb.Publisher(url, **SMALL_RECORDS) as pub:
            for version in range(1, 9):
                last = rng.standard_normal(200_000).astype(np.float32)  # 800 KB: four chunks, four record keys
                pub.publish("w", last, version=version)
                pub.publish("x", np.full(1000, version), version=version)
            published = 8 * 4 + 8
        wait_for(lambda: _records(url) < published - 8, 120, "the log cleaner to compact the topic")
        with tb.Subscriber(url) as sub:
            message = sub.latest("w", timeout=60)
            assert message.version == 8 and crc_of(message.tensor) == crc_of(last)
            assert sub.latest("x", timeout=60).tensor[0] == 8
        with tb.Publisher(url, **SMALL_RECORDS) as pub:  # a restarted publisher learns where versions stand
            assert pub.versions() == {"w": 8, "x": 8}
            with pytest.raises(tb.ConfigError, match="not greater"):
                pub.publish("w", last, version=8)


def test_four_subscriber_processes_get_the_last_16_mb_model(client_url: Topic) -> None:
    with client_url() as url, tb.Publisher(url) as pub:
        check_four_subscriber_processes(pub, url, {}, 3)


def test_a_subscriber_that_never_reads_does_not_slow_the_publisher(client_url: Topic) -> None:
    with client_url() as url, tb.Publisher(url) as pub, tb.Subscriber(url) as idle:
        check_idle_subscriber(pub, idle)


def test_a_restarted_subscriber_starts_from_the_latest_versions(client_url: Topic) -> None:
    with client_url() as url, tb.Publisher(url) as pub:
        pub.publish("w", np.full(10, 1), version=1)
        with tb.Subscriber(url) as sub:
            assert sub.latest("w", timeout=60).version == 1
        pub.publish("w", np.full(10, 2), version=2)
        pub.flush(30)
        with tb.Subscriber(url) as sub:  # nothing was committed: it reads the topic again, keeping the newest
            seen = [m.version for m in [sub.next(timeout=60)]]
            assert seen == [2]


@pytest.mark.parametrize("publisher_client", KAFKA_CLIENTS)
def test_what_one_client_publishes_the_other_subscribes_to(publisher_client: str) -> None:
    subscriber_client = next(client for client in KAFKA_CLIENTS if client != publisher_client)
    with _topic() as url:
        with tb.Publisher(f"{url}?client={publisher_client}", **SMALL_RECORDS) as pub:
            pub.publish("w", np.full(300_000, 5, np.float32), version=5)  # five chunk records
            pub.flush(30)
        with tb.Subscriber(f"{url}?client={subscriber_client}") as sub:
            message = sub.latest("w", timeout=60)
            assert message.version == 5 and message.tensor.min() == message.tensor.max() == 5.0
        with tb.Publisher(f"{url}?client={subscriber_client}") as pub:  # learns the version the other published
            assert pub.versions() == {"w": 5}


def test_a_signed_version_of_several_records_reaches_a_signed_subscriber(client_url: Topic) -> None:
    # 1.2 MB past the default max_frame_bytes (~1 MB): two chunk records, each signed for the topic
    with client_url() as url, tb.Publisher(url, signing_key="s3cret") as pub:
        pub.publish("w", np.full(300_000, 7, np.float32), version=1)
        pub.flush(30)
        with tb.Subscriber(url, signing_key="s3cret") as sub:
            message = sub.latest("w", timeout=60)
            assert message.version == 1 and message.tensor.min() == message.tensor.max() == 7.0


def test_a_subscriber_whose_first_read_fails_reads_the_topic_again(
    monkeypatch: pytest.MonkeyPatch, client_url: Topic
) -> None:
    from tensorbus.fanout import kafka as fanout_kafka

    read_to_end, failures = fanout_kafka._read_to_end, []

    def failing_once(*args: object) -> None:
        if not failures:
            failures.append(1)
            raise tb.TransportError("a broker did not answer in time")  # (as a fetch or offsets request may)
        read_to_end(*args)  # type: ignore[arg-type]

    with client_url() as url, tb.Publisher(url) as pub:
        pub.publish("w", np.full(4, 1.0), version=1)
        pub.flush(30)
        monkeypatch.setattr(fanout_kafka, "_read_to_end", failing_once)
        with tb.Subscriber(url) as sub:
            assert sub.latest("w", timeout=30).version == 1
        assert failures == [1]


def test_a_key_with_a_hash_is_refused_on_kafka_and_changes_nothing(client_url: Topic) -> None:
    # chunk i of "w" is keyed "w#i": a key "w#0" would be compacted with it
    with client_url() as url, tb.Publisher(url, **SMALL_RECORDS) as pub:
        pub.publish("w", np.full(300_000, 1, np.float32), version=1)  # five chunk records
        with pytest.raises(tb.ConfigError, match="'#'"):
            pub.publish("w#0", np.zeros(4), version=1)
        assert pub.versions() == {"w": 1}
        pub.flush(30)
        with tb.Subscriber(url) as sub:
            assert sub.latest("w", timeout=60).tensor.max() == 1.0


def test_a_signed_publisher_learns_versions_only_from_records_that_verify(client_url: Topic) -> None:
    with client_url() as url:
        with tb.Publisher(url) as forger:  # anyone who can write to the topic, without the key
            forger.publish("w", np.zeros(4), version=1_000_000)
            forger.flush(30)
        with tb.Publisher(url, signing_key="s3cret") as pub:
            assert pub.versions() == {}
            pub.publish("w", np.ones(4), version=1)
            pub.flush(30)
        with tb.Publisher(url, signing_key="s3cret") as pub:
            assert pub.versions() == {"w": 1}
