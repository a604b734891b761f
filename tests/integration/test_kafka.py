"""Kafka-specific behaviour against a real broker: chunking, consumer groups, commits after reassembly, layout.

The tests taking `url` run once per Kafka client (kafka-python, confluent); `kafka_python_url`, kafka-python's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.parse
import zlib
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.transports import kafka as kafka_transport
from tensorbus.transports.kafka import KafkaOptions, KafkaTransport
from tensorbus.transports.kafka_offsets import Offsets

# kafka-python's own classes, imported by the transport with its import-time DeprecationWarnings silenced
from tensorbus.transports.kafka_python import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from tensorbus.transports.kafka_rdkafka import Commits
from tests.conftest import KAFKA_URL, endpoint_url, with_query
from tests.peers import same
from tests.waiting import wait_for

BOOTSTRAP = urllib.parse.urlsplit(KAFKA_URL).netloc
pytestmark = pytest.mark.broker


@pytest.fixture
def url(kafka_client: str) -> str:
    return endpoint_url("kafka" if kafka_client == "kafka-python" else "kafka-confluent")


@pytest.fixture
def kafka_python_url() -> str:
    return endpoint_url("kafka")


def renamed(url: str, suffix: str) -> str:
    """`url` with `suffix` added to its topic's name."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path=parts.path + suffix))


def topic_of(url: str) -> str:
    return urllib.parse.urlsplit(url).path.lstrip("/")


def committed(group: str, topic: str) -> dict[int, int]:
    """The group's committed offset per partition of `topic`, read with the admin client."""
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    try:
        offsets = admin.list_group_offsets({group: None})[group]
    finally:
        admin.close()
    return {tp.partition: meta.offset for tp, meta in offsets.items() if tp.topic == topic}


def owned(consumer: tb.Consumer) -> frozenset[int]:
    """The partitions a consumer owns right now."""
    assert isinstance(consumer.transport, KafkaTransport)
    return consumer.transport.assignment


def test_64_mb_tensor_is_chunked_under_the_default_limit(url: str) -> None:
    big = np.random.default_rng(0).standard_normal(16 << 20).astype(np.float32)  # 64 MiB
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        assert producer.transport.max_frame_bytes is not None and producer.transport.max_frame_bytes < 1 << 20
        producer.send("big", big)
        producer.flush(timeout=60)
        assert same(consumer.recv("big", timeout=60), big)
        assert consumer.stats["chunks"] >= 64


def test_a_new_consumer_joins_its_group_once(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first assignment already sees the topic's partitions, so no rebalance follows it.

    Such a rebalance, asked for only by metadata arriving late, can be lost by kafka-python 3.0
    (its join outliving a poll timeout): the partitions then stayed revoked and nothing was read.
    """
    assignments: list[set[TopicPartition]] = []
    assigned, on_assign = Offsets.on_partitions_assigned, Commits.on_assign

    async def counted(self: Offsets, partitions: set[TopicPartition]) -> None:
        assignments.append(set(partitions))
        await assigned(self, partitions)

    def counted_confluent(self: Commits, consumer: Any, partitions: list[Any]) -> None:
        assignments.append({TopicPartition(p.topic, p.partition) for p in partitions})
        on_assign(self, consumer, partitions)

    monkeypatch.setattr(Offsets, "on_partitions_assigned", counted)
    monkeypatch.setattr(Commits, "on_assign", counted_confluent)
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        producer.send("first", np.arange(10))
        assert same(consumer.recv("first", timeout=30), np.arange(10))
        # (a join with metadata lacking the partitions is assigned nothing: [set(), ...] would show it, and
        # the rejoin that follows comes before anything is read)
        assert assignments == [{TopicPartition(topic_of(url), 0)}]
        assert owned(consumer) == {0}


def test_two_consumers_in_one_group_share_partitions_without_duplicates(url: str) -> None:
    # (ack="arrival": with ack="take", the first's untaken tensors of the partition it gives up are the
    # second's too: see the next test)
    with tb.Consumer(url, partitions=2, ack="arrival") as first, tb.Producer(url) as producer:
        for i in range(20):
            producer.send(f"k{i}", np.full(1000, i, np.int32))
        producer.flush(30)
        wait_for(lambda: len(first.table) == 20, 30, "the first consumer to receive 20 tensors")
        with tb.Consumer(url) as second:  # joins the group: a rebalance hands it one of the two partitions
            wait_for(lambda: owned(first) and owned(second), 30, "a partition each")
            assert owned(first) | owned(second) == {0, 1}
            for i in range(20, 40):
                producer.send(f"k{i}", np.full(1000, i, np.int32))
            producer.flush(30)
            wait_for(lambda: len(first.table) + len(second.table) >= 40, 30, "all 40 tensors")
            # a record read twice (from before its partition's last commit) comes before the partition's
            # later records: once a marker sent now to each partition is in, anything read twice is too
            from kafka.partitioner.default import murmur2  # (loaded, its warnings silenced, by the transport)

            markers = ["end0", "end1", "end2", "end3"]
            assert {(murmur2(m.encode()) & 0x7FFFFFFF) % 2 for m in markers} == {0, 1}  # (kafka-python's partitioner)
            for marker in markers:
                producer.send(marker, np.zeros(1, np.int32))
            producer.flush(30)

            def arrived(key: str) -> bool:
                return any(c.table.buffered_keys().get(key) for c in (first, second))

            wait_for(lambda: all(arrived(m) for m in markers), 30, "a marker in each partition")
            got = [[str(c.next_message(timeout=1).key) for _ in range(len(c.table))] for c in (first, second)]
    assert sorted(got[0] + got[1]) == sorted([f"k{i}" for i in range(40)] + markers)  # nothing lost, nothing twice
    assert got[1], "the second consumer received nothing: the partitions were not shared"


def test_untaken_tensors_of_a_partition_given_up_in_a_rebalance_go_to_its_new_owner(url: str) -> None:
    with tb.Consumer(url, partitions=2) as first, tb.Producer(url) as producer:
        for i in range(20):
            producer.send(f"k{i}", np.full(1000, i, np.int32))
        producer.flush(30)
        wait_for(lambda: len(first.table) == 20, 30, "the first consumer to receive 20 tensors")
        with tb.Consumer(url) as second:  # joins the group: a rebalance hands it one of the two partitions
            wait_for(lambda: owned(first) and owned(second), 30, "a partition each")
            # nothing taken, nothing committed: the second reads its partition from the start
            wait_for(lambda: len(second.table) > 0, 30, "the second to read its partition's untaken tensors")
            got = {str(second.next_message(timeout=1).key) for _ in range(len(second.table))}
            assert got and got <= {f"k{i}" for i in range(20)}


def test_a_partition_kept_through_a_rebalance_commits_no_further_than_its_untaken_tensors(url: str) -> None:
    """kafka-python keeps a partition's read position through a rebalance that gives it back to the same
    consumer, and librdkafka reads it again from the commit: either way its records received before stay
    booked. Taking a newer record of it commits nothing past them, and the partition's next owner gets them."""
    from kafka.partitioner.default import murmur2  # (loaded, its warnings silenced, by the transport)

    def partition_of(key: str) -> int:
        return (murmur2(key.encode()) & 0x7FFFFFFF) % 2  # (both clients' partitioner)

    keys = [f"k{i}" for i in range(8)]
    assert sorted(partition_of(key) for key in keys) == [0, 0, 0, 0, 1, 1, 1, 1]
    with tb.Producer(url, partitions=2) as producer, tb.Consumer(url, partitions=2) as first:
        group, topic = first.transport.group, topic_of(url)
        for i, key in enumerate(keys):
            producer.send(key, np.full(1000, i, np.int32))
        producer.flush(30)
        wait_for(lambda: len(first.table) == 8, 60, "every record in the first consumer's table")
        with tb.Consumer(url) as second:  # joins the group: the first keeps one partition of the two
            wait_for(lambda: len(owned(first)) == 1 and len(owned(second)) == 1, 60, "a partition each")
            (kept,) = owned(first)
            late = next(key for key in (f"late{i}" for i in range(100)) if partition_of(key) == kept)
            producer.send(late, np.full(1000, -1, np.int32))
            producer.flush(30)
            assert same(first.recv(late, timeout=30), np.full(1000, -1, np.int32))
            first.close()  # commits what it may and leaves: the kept partition's four records were never taken
            assert committed(group, topic).get(kept, 0) == 0
            wait_for(
                lambda: {k for k in keys if partition_of(k) == kept} <= set(second.table.buffered_keys()),
                60,
                "the kept partition's untaken records in its next owner's table",
            )
            for i, key in enumerate(keys):
                if partition_of(key) == kept:
                    assert same(second.recv(key, timeout=1), np.full(1000, i, np.int32))


def test_broker_side_size_error_is_a_tensorbus_error(url: str) -> None:
    with tb.Producer(url, max_frame_bytes=3_000_000, max_request_size=4_000_000) as producer:
        producer.send("too-big", np.zeros(2_500_000, np.uint8))  # one 2.5 MB record > the broker's ~1 MiB
        with pytest.raises(tb.TransportError, match=r"too large.*message\.max\.bytes") as info:
            producer.flush(timeout=30)
        assert not info.value.retriable
        producer.send("fine", np.zeros(10))  # the producer keeps working
        producer.flush(timeout=30)
    with tb.Producer(url) as producer:  # a key that would push a full chunk past max_request_size: refused at send
        with pytest.raises(tb.ConfigError, match="the limit is 1024"):  # (by the key length limit, before Kafka)
            producer.send("k" * 60_000, np.zeros(2_000_000, np.uint8))
        producer.send("fine", np.zeros(10))
        producer.flush(timeout=30)


def test_a_plain_kafka_python_consumer_can_read_tensorbus_records(url: str) -> None:
    with tb.Producer(url) as producer:
        producer.send("weights", np.arange(12.0).reshape(3, 4), metadata={"step": 3})
        producer.send("big", np.arange(300_000, dtype=np.float64))  # 2.4 MB: chunk records
        producer.flush(30)
    consumer = KafkaConsumer(bootstrap_servers=BOOTSTRAP, enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        consumer.assign([TopicPartition(topic_of(url), 0)])
        records: list[Any] = []
        deadline = time.monotonic() + 30
        while len(records) < 4 and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
    finally:
        consumer.close()
    first = records[0]
    assert first.key == b"weights" and first.headers == [] and first.value[:4] == b"TBUS"
    message = tb.decode(first.value)
    assert message.key == "weights" and message.metadata == {"step": 3}
    assert same(message.tensor, np.arange(12.0).reshape(3, 4))
    reassembler = tb.Reassembler()
    results = [reassembler.feed(r.value) for r in records[1:]]
    assert all(r.key == b"big" for r in records[1:]) and results[:-1] == [None, None]
    assert results[-1] is not None and same(results[-1].tensor, np.arange(300_000, dtype=np.float64))


def test_a_new_topic_gets_as_many_replicas_as_live_brokers_and_no_more(url: str) -> None:
    """One broker: one replica and the broker's min.insync.replicas; asking for three is refused, saying why."""
    with tb.Producer(url) as producer:
        producer.send("t", np.arange(3))
        producer.flush(30)
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    try:
        [described] = admin.describe_topics([topic_of(url)])
    finally:
        admin.close()
    assert described["partitions"][0]["replica_nodes"] == [1]
    with tb.Producer(with_query(renamed(url, "-rf3"), "replication_factor=3")) as producer:
        with pytest.raises(tb.TransportError, match=r"replication_factor=3: the cluster has 1 live broker") as info:
            producer.send("t", np.arange(3))
        assert not info.value.retriable
    with tb.Producer(with_query(renamed(url, "-misr2"), "min_insync_replicas=2")) as producer:  # one replica allowed
        with pytest.raises(tb.ConfigError, match=r"min_insync_replicas=2 exceeds the topic's 1 replica"):
            producer.send("t", np.arange(3))


def test_a_fetch_brings_many_chunks_but_stays_within_fetch_max_bytes(
    kafka_python_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(kafka-python's fetch metrics: kafka-python only)"""
    url = kafka_python_url
    made: list[KafkaConsumer] = []

    class Recorded(KafkaConsumer):  # the real client, kept for its own fetch metrics
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(kafka_transport, "KafkaConsumer", Recorded)
    tensor = np.arange(5_000_000, dtype=np.float32)  # 20 MB: twenty 1 MB chunks
    with tb.Producer(url) as producer:
        producer.send("big", tensor)
        producer.flush(60)
    with tb.Consumer(url) as consumer:
        assert same(consumer.recv("big", timeout=60), tensor)
        fetches = made[0].metrics()["consumer-fetch-manager-metrics"]
    # kafka-python's own max_partition_fetch_bytes (1 MiB) brings one chunk per fetch
    assert fetches["records-per-request-avg"] > 4, fetches
    assert fetches["fetch-size-max"] <= KafkaOptions().partition_fetch_bytes <= KafkaOptions().fetch_max_bytes


#: a consumer process that reassembles with a running clock of short ticks (running_clock.py) and a 4 s timeout:
#: it says when it holds "big" incomplete (the marker record after its first chunks came), then what "big" was
STOPPED_CONSUMER = """
import sys, zlib
import tensorbus as tb
from tensorbus.running_clock import CLOCK

CLOCK.tick_s, CLOCK.slack_s = 0.1, 0.2
with tb.Consumer(sys.argv[1], reassembly_timeout_s=4) as consumer:
    print("ready", flush=True)
    consumer.recv("marker", timeout=60)
    print("holding", consumer.intake.reassembler.pending, flush=True)
    big = consumer.recv("big", timeout=60)
    print(zlib.crc32(big.tobytes()), consumer.intake.reassembler.stats["expired"], flush=True)
"""


def test_a_consumer_stopped_mid_tensor_for_longer_than_its_reassembly_timeout_completes_it(url: str) -> None:
    """A consumer process stopped (SIGSTOP) with a chunked tensor half read finds its other chunks in the log when
    it runs again: the stop does not count against `reassembly_timeout_s`, so nothing is dropped."""
    big = np.random.default_rng(9).standard_normal(300_000)  # 2.4 MB: 13 chunks of 200 KB
    message_id = ("stopped", 1)
    frame = tb.encode(big, key="big", message_id=message_id)
    chunks = [b"".join(c) for c in tb.split(frame, max_chunk_bytes=200_000, message_id=message_id, key="big")]
    command = [sys.executable, "-c", STOPPED_CONSUMER, url]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
        producer = KafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all")
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            for chunk in chunks[:-1]:  # one partition, in order: the marker comes after them
                producer.send(topic_of(url), chunk, partition=0)
            producer.send(topic_of(url), b"".join(tb.encode(np.zeros(1), key="marker")), partition=0)
            producer.flush(30)
            assert child.stdout.readline().split() == ["holding", "1"]
            os.kill(child.pid, signal.SIGSTOP)
            try:
                producer.send(topic_of(url), chunks[-1], partition=0)
                producer.flush(30)
                time.sleep(6.0)  # (the stop itself: longer than the 4 s timeout plus the ticker's tick and slack)
            finally:
                os.kill(child.pid, signal.SIGCONT)
            assert child.stdout.readline().split() == [str(zlib.crc32(big.tobytes())), "0"]
        finally:
            producer.close(5)
            child.kill()
