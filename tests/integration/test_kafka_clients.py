"""The two Kafka clients of kafka:// side by side: records from one read by the other, keys on the same
partitions, settings and errors of librdkafka (confluent) mapped as kafka-python's are."""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from confluent_kafka import KafkaError

import tensorbus as tb
from tensorbus.codec.frame import encode
from tensorbus.transports.kafka import KafkaTransport
from tensorbus.transports.kafka_confluent import ConfluentKafkaTransport
from tensorbus.transports.kafka_python import KafkaConsumer, TopicPartition
from tensorbus.transports.kafka_rdkafka import client_config, translate_error
from tests.conftest import KAFKA_URL, endpoint_url, with_query
from tests.peers import same
from tests.waiting import catching, wait_for

BOOTSTRAP = urllib.parse.urlsplit(KAFKA_URL).netloc
KEYS = [f"key-{i}" for i in range(40)]


def on(url: str, client: str) -> str:
    """`url` (without a query) on the Kafka `client`."""
    return with_query(url, f"client={client}")


@pytest.mark.broker
@pytest.mark.parametrize(("producing", "consuming"), [("kafka-python", "confluent"), ("confluent", "kafka-python")])
def test_a_tensor_produced_through_one_client_is_consumed_through_the_other(producing: str, consuming: str) -> None:
    url = endpoint_url("kafka")
    big = np.random.default_rng(5).standard_normal(600_000).astype(np.float32)  # 2.4 MB: three chunk records
    with tb.Producer(on(url, producing)) as producer:
        producer.send("big", big)
        producer.send("small", np.arange(7), metadata={"from": producing})
        producer.flush(30)
    with tb.Consumer(on(url, consuming)) as consumer:
        assert same(consumer.recv("big", timeout=60), big)
        message = consumer.recv_message("small", timeout=30)
        assert same(message.tensor, np.arange(7)) and message.metadata == {"from": producing}
        assert consumer.stats["chunks"] >= 2  # it came chunked


def partitions_of_keys(topic: str, partitions: int) -> dict[str, int]:
    """key -> the partition its records are on, read back with a plain kafka-python consumer."""
    consumer = KafkaConsumer(bootstrap_servers=BOOTSTRAP, enable_auto_commit=False, auto_offset_reset="earliest")
    found: dict[str, int] = {}
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
        deadline = time.monotonic() + 30
        while len(found) < len(KEYS) and time.monotonic() < deadline:
            for tp, records in consumer.poll(timeout_ms=500).items():
                found.update((r.key.decode(), tp.partition) for r in records)
    finally:
        consumer.close()
    return found


@pytest.mark.broker
def test_keys_land_on_the_same_partitions_from_either_client() -> None:
    """librdkafka's murmur2_random places a keyed record where kafka-python's murmur2 does (Java's partitioner)."""
    from kafka.partitioner.default import murmur2

    placed = {}
    for client in ("kafka-python", "confluent"):
        url = on(endpoint_url("kafka"), client)
        with tb.Producer(url, partitions=8) as producer:
            for key in KEYS:
                producer.send(key, np.zeros(1, np.uint8))
            producer.flush(30)
        placed[client] = partitions_of_keys(urllib.parse.urlsplit(url).path.strip("/"), 8)
    expected = {key: (murmur2(key.encode()) & 0x7FFFFFFF) % 8 for key in KEYS}
    assert placed["kafka-python"] == placed["confluent"] == expected
    assert len(set(expected.values())) > 1  # the keys spread: a partitioner ignoring them would fail above


@pytest.mark.broker
def test_sends_queue_records_and_delivery_reports_settle_them() -> None:
    """No blocking flush per tensor: sends return with their records still unacknowledged (batched for
    `batch_linger_s`), and `flush` (which sends at once, lingering no longer) serves the delivery reports
    that settle every one."""
    url = on(endpoint_url("kafka"), "confluent")
    with tb.Producer(url, batch_linger_s=60, delivery_timeout_s=300) as producer, tb.Consumer(url) as consumer:
        transport = producer.transport
        assert isinstance(transport, ConfluentKafkaTransport)
        for i in range(20):
            producer.send(f"k{i}", np.full(100, i))
        assert transport._unconfirmed == 20  # queued for a batch due in a minute: none acknowledged yet
        producer.flush(30)
        assert transport._unconfirmed == 0 and transport._pending_bytes == 0
        for i in range(20):
            assert same(consumer.recv(f"k{i}", timeout=30), np.full(100, i))


@pytest.mark.broker
def test_a_small_ndarrays_record_is_the_frame_encode_makes() -> None:
    """The record of a plain ndarray that fits one (its frame made whole in C where the extension is built) is,
    byte for byte, the frame `encode` makes: the suite's run with TENSORBUS_NATIVE=0 checks the Python path."""
    from confluent_kafka import Consumer

    url = on(endpoint_url("kafka"), "confluent")
    array = np.arange(1000, dtype=np.float32).reshape(10, 100)
    with tb.Producer(url) as producer:
        message_id = producer.send("k", array, metadata={"i": 7})
        producer.flush(30)
    reader = Consumer(
        {"bootstrap.servers": BOOTSTRAP, "group.id": f"probe-{message_id[1]}", "auto.offset.reset": "earliest"}
    )
    try:
        reader.subscribe([urllib.parse.urlsplit(url).path.strip("/")])
        deadline, record = time.monotonic() + 30, None
        while record is None and time.monotonic() < deadline:
            record = reader.poll(0.5)
    finally:
        reader.close()
    assert record is not None and record.error() is None
    assert record.value() == b"".join(encode(array, key="k", metadata={"i": 7}, message_id=message_id))


def small_records_topic(url: str, partitions: int) -> str:
    """`url`, its topic made with `partitions` and a max.message.bytes of 20,000 (a larger record is refused)."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    try:
        topic = urllib.parse.urlsplit(url).path.strip("/")
        admin.create_topics([NewTopic(topic, partitions, 1, topic_configs={"max.message.bytes": "20000"})])
    finally:
        admin.close()
    return url


@pytest.mark.broker
def test_records_sent_by_several_threads_while_the_producer_is_replaced_are_all_settled() -> None:
    """A record the broker refuses (over the topic's max.message.bytes) fails the producer, and the next
    send replaces it, while three other threads keep sending: every record counted as pending is settled
    (acknowledged, or failed and reported), so nothing stays pending for ever and a flush succeeds."""
    url = small_records_topic(on(endpoint_url("kafka"), "confluent"), 1)
    failures: list[tb.TransportError] = []

    def send_small(name: str) -> None:
        for i in range(150):
            try:
                producer.send(f"{name}-{i}", np.full(16, i))
            except tb.TransportError as exc:  # a refused record (or one purged with its producer), reported
                failures.append(exc)

    with tb.Producer(url, batch_linger_s=0.01) as producer:
        transport = producer.transport
        assert isinstance(transport, ConfluentKafkaTransport)
        producer.send("first", np.zeros(4))
        producer.flush(30)
        first = transport._rd_producer
        threads = [threading.Thread(target=send_small, args=(f"t{n}",)) for n in range(3)]
        for thread in threads:
            thread.start()
        for _ in range(3):  # 80 KB records: each refused by the broker
            try:
                producer.send("big", np.random.default_rng(1).standard_normal(20_000).astype(np.float32))
            except tb.TransportError as exc:
                failures.append(exc)
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads)
        for _ in range(5):  # (failures reported by flush, one at a time, until none is left)
            try:
                producer.flush(30)
                break
            except tb.TransportError as exc:
                assert "unacknowledged" not in str(exc), exc
                failures.append(exc)
        assert transport._unconfirmed == 0 and transport._pending_bytes == 0
        producer.send("after", np.arange(3))
        producer.flush(30)
        assert failures and transport._rd_producer is not first  # (refused, and replaced)


def _counted(transport: KafkaTransport, frame: list[Any]) -> bytes:
    """A record's value, counted as pending as `send` counts one, not yet acknowledged."""
    value = b"".join(frame)
    with transport._pending_lock:
        transport._pending_bytes += len(value)
        transport._unconfirmed += 1
    return value


class _Reported:
    """A delivery report as librdkafka's `Message` gives it (the parts the producer reads)."""

    def __init__(self, value: bytes, key: bytes, partition: int, offset: int | None) -> None:
        self._value, self._key, self._partition, self._offset = value, key, partition, offset

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return self._key

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int | None:
        return self._offset  # (None: librdkafka's invalid offset, as confluent-kafka gives it)

    def __len__(self) -> int:
        return len(self._value)


@pytest.mark.broker
def test_a_record_reported_delivered_at_no_offset_past_the_last_is_produced_again_and_received_once() -> None:
    """librdkafka reports a record delivered with no offset (the broker said DUPLICATE_SEQUENCE_NUMBER; confluent-kafka
    gives None), or with an earlier batch's (it forgot the partition's sequence: librdkafka #3712): the broker may have
    dropped it. Such a report settles nothing, even for a partition's first record; the record is produced again, and
    the consumer gets each tensor once, a copy of one that was written after all dropped as a duplicate."""
    url = on(endpoint_url("kafka"), "confluent")
    with tb.Producer(url) as producer, tb.Consumer(url) as consumer:
        transport = producer.transport
        assert isinstance(transport, ConfluentKafkaTransport)
        pid = producer.producer_id

        def report(key: str, frame: list[Any], offset: int | None, current: bool = True) -> None:
            reported = _Reported(_counted(transport, frame), key.encode(), 0, offset)
            if current:
                transport._on_delivery(None, reported)  # type: ignore[arg-type]
            else:  # a replaced producer's report (served after the current one's)
                transport._delivered(None, reported, False)  # type: ignore[arg-type]

        # the partition's first report, with no offset: as if dropped (a lost first tensor, 2026-11-30)
        report("first", encode(np.arange(2), key="first", message_id=(pid, 999)), None)
        assert transport._unconfirmed == 1 and len(transport._resends.due) == 1 and not transport._resends._last
        written = producer.send("a", np.arange(3))  # ("first" is produced again before it)
        producer.flush(30)
        assert transport._resends._last == {0: 1}  # (one partition: "first" at offset 0, "a" at 1)
        report("a", encode(np.arange(3), key="a", message_id=written), 1)  # written: the copy is a duplicate
        report("b", encode(np.arange(4), key="b", message_id=(pid, 1000)), 0)  # never produced: as if dropped
        report("c", encode(np.arange(5), key="c", message_id=(pid, 1001)), None)
        report("d", encode(np.arange(7), key="d", message_id=(pid, 1002)), None, current=False)
        assert transport._unconfirmed == 4 and len(transport._resends.due) == 4  # none settled: all due again
        producer.send("z", np.arange(6))
        producer.flush(30)
        assert transport._unconfirmed == 0 and transport._pending_bytes == 0 and not transport._resends.due
        assert transport._resends._last[0] == 6  # first at 0, a at 1; a again, b, c and d at 2 to 5; z at 6
        for key, n in [("first", 2), ("a", 3), ("b", 4), ("c", 5), ("d", 7), ("z", 6)]:
            assert same(consumer.recv(key, timeout=30), np.arange(n))
        assert consumer.stats["duplicates"] == 1  # the copy of "a" (z came after it: it was read)
        assert len(consumer.table) == 0  # nothing else arrived


@pytest.mark.broker
def test_a_kafka_python_record_acknowledged_with_no_offset_past_the_last_is_produced_again_and_received_once() -> None:
    """kafka-python takes DUPLICATE_SEQUENCE_NUMBER for success too, reporting offset -1: the record is kept until
    then and produced again, as on confluent (a partition's first one too); `flush` produces again what is due."""
    url = on(endpoint_url("kafka"), "kafka-python")
    with tb.Producer(url) as producer, tb.Consumer(url) as consumer:
        transport = producer.transport
        assert type(transport) is KafkaTransport
        pid = producer.producer_id

        def report(key: str, frame: list[Any], offset: int) -> None:
            metadata = SimpleNamespace(partition=0, offset=offset)
            transport._acked(metadata, _counted(transport, frame), key.encode(), None)

        report("first", encode(np.arange(2), key="first", message_id=(pid, 999)), -1)  # the partition's first report
        assert transport._unconfirmed == 1 and len(transport._resends.due) == 1 and not transport._resends._last
        written = producer.send("a", np.arange(3))  # ("first" is produced again before it)
        producer.flush(30)
        assert transport._resends._last == {0: 1}  # (one partition: "first" at offset 0, "a" at 1)
        report("a", encode(np.arange(3), key="a", message_id=written), -1)  # written: the copy is a duplicate
        report("b", encode(np.arange(4), key="b", message_id=(pid, 1000)), 1)  # not past the last: as if dropped
        assert transport._unconfirmed == 2 and len(transport._resends.due) == 2
        producer.flush(30)  # (produces them again itself)
        assert transport._unconfirmed == 0 and transport._pending_bytes == 0 and not transport._resends.due
        assert transport._resends._last[0] == 3  # first at 0, a at 1; a again and b at 2 and 3
        for key, n in [("first", 2), ("a", 3), ("b", 4)]:
            assert same(consumer.recv(key, timeout=30), np.arange(n))
        wait_for(lambda: consumer.stats["duplicates"] == 1, 30, "the copy of a dropped as a duplicate")
        assert len(consumer.table) == 0  # nothing else arrived


@pytest.mark.broker
def test_a_kafka_python_record_found_undelivered_while_a_send_waits_for_room_or_a_flush_waits_is_produced_again() -> (
    None
):
    """The acknowledgement with no offset comes (on kafka-python's thread) while the application waits: a `send`
    over `max_pending_bytes`, then a `flush`. Each produces the record again and goes on; neither waits for good."""
    url = with_query(on(endpoint_url("kafka"), "kafka-python"), "max_pending_bytes=65536")
    with tb.Producer(url) as producer, tb.Consumer(url) as consumer:
        transport = producer.transport
        assert type(transport) is KafkaTransport
        pid = producer.producer_id
        producer.send("w", np.arange(1))  # (the producer made, and the partition's first offset taken)
        producer.flush(30)

        failures: list[BaseException] = []

        def waits(call: Callable[[], Any]) -> threading.Thread:
            """`call` on a thread of its own (what it raises kept in `failures`), once it waits under the lock."""
            thread = threading.Thread(target=catching(failures, call), daemon=True)
            thread.start()
            wait_for(lambda: transport._pending_waiters == 1, 30, "the call to wait")
            return thread

        for key, sequence, blocked in [("k", 1000, lambda: producer.send("z", np.arange(2))), ("m", 1001, None)]:
            frame = encode(np.arange(9000), key=key, message_id=(pid, sequence))  # (72 KB: over max_pending_bytes)
            value = _counted(transport, frame)
            thread = waits(blocked or (lambda: producer.flush(30)))
            transport._acked(SimpleNamespace(partition=0, offset=-1), value, key.encode(), None)
            thread.join(30)
            assert not thread.is_alive(), f"the waiting call after {key}'s report waits still"
            assert not failures, failures
        producer.flush(30)
        assert transport._unconfirmed == 0 and transport._pending_bytes == 0 and not transport._resends.due
        for key, n in [("w", 1), ("k", 9000), ("z", 2), ("m", 9000)]:
            assert same(consumer.recv(key, timeout=30), np.arange(n))


def test_an_unknown_client_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(tb.ConfigError, match="client must be one of kafka-python, confluent"):
        tb.Producer("kafka://127.0.0.1:9092/t?client=librdkafka")


def test_the_client_option_picks_the_backend() -> None:
    def transport(**options: Any) -> KafkaTransport:
        producer = tb.Producer("kafka://127.0.0.1:9092/t", **options)  # nothing connects before the first send
        assert isinstance(producer.transport, KafkaTransport)
        return producer.transport

    assert type(transport()) is KafkaTransport  # kafka-python stays the default
    assert type(transport(client="kafka-python")) is KafkaTransport
    assert type(transport(client="confluent")) is ConfluentKafkaTransport


def test_tls_and_sasl_options_reach_librdkafka() -> None:
    def config(url: str, **options: Any) -> dict[str, Any]:
        producer = tb.Producer(url, client="confluent", **options)
        assert isinstance(producer.transport, ConfluentKafkaTransport)
        return client_config(producer.transport)

    plain = config("kafka://127.0.0.1:9092/t")
    assert plain["security.protocol"] == "PLAINTEXT" and "ssl.ca.location" not in plain
    tls = config("kafkas://b1:9093,b2/t", ssl_cafile="ca.pem", ssl_certfile="c.pem", ssl_keyfile="k.pem")
    assert tls["security.protocol"] == "SSL" and tls["bootstrap.servers"] == "b1:9093,b2:9092"
    assert (tls["ssl.ca.location"], tls["ssl.certificate.location"], tls["ssl.key.location"]) == (
        "ca.pem",
        "c.pem",
        "k.pem",
    )
    sasl = config("kafkas://b1/t?sasl_mechanism=PLAIN&sasl_plain_username=u&sasl_plain_password=1234")
    assert sasl["security.protocol"] == "SASL_SSL" and sasl["sasl.mechanism"] == "PLAIN"
    assert (sasl["sasl.username"], sasl["sasl.password"]) == ("u", "1234")


def test_librdkafka_errors_become_the_tensorbus_errors_kafka_python_ones_do() -> None:
    too_large = translate_error(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), "here", 2_000_000)
    assert isinstance(too_large, tb.TransportError) and not too_large.retriable
    assert "too large" in str(too_large) and "message.max.bytes" in str(too_large)
    timed_out = translate_error(KafkaError(KafkaError._MSG_TIMED_OUT), "here", 4096)
    assert "did not acknowledge a record of 4096 bytes" in str(timed_out) and timed_out.retriable
    refused = translate_error(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), "here")
    assert "refused the request" in str(refused) and not refused.retriable
    assert isinstance(translate_error(KafkaError(KafkaError._INVALID_ARG), "here"), tb.ConfigError)
    other = translate_error(KafkaError(KafkaError._TRANSPORT), "here")
    assert type(other) is tb.TransportError and other.retriable


def test_a_producer_asks_again_while_the_topic_is_listed_without_its_partitions() -> None:
    """A broker just restarted can list a topic with an error and no partitions: the producer asks again until
    its partitions are known, and says why if they never are."""

    def listed(error: KafkaError | None, partitions: list[int]) -> Any:
        topic = SimpleNamespace(error=error, partitions={p: SimpleNamespace(id=p) for p in partitions})
        return SimpleNamespace(topics={"t": topic})

    class Listing:
        """What the brokers say, in turn (the last, again and again)."""

        def __init__(self, *answers: Any) -> None:
            self.answers, self.asked = list(answers), 0

        def list_topics(self, topic: str, timeout: float) -> Any:
            assert topic == "t" and timeout > 0
            self.asked += 1
            return self.answers[min(self.asked, len(self.answers)) - 1]

    producer = tb.Producer("kafka://127.0.0.1:9092/t", client="confluent")
    transport = producer.transport
    assert isinstance(transport, ConfluentKafkaTransport)
    not_yet = listed(KafkaError(KafkaError.LEADER_NOT_AVAILABLE), [])
    brokers = Listing(not_yet, listed(None, []), listed(None, [0, 1]))
    assert transport._partitions(brokers, time.monotonic() + 10) == [0, 1]  # type: ignore[arg-type]
    assert brokers.asked == 3
    never = Listing(not_yet)
    with pytest.raises(tb.TransportError, match=r"partitions of the topic unknown to the brokers .*[Ll]eader"):
        transport._partitions(never, time.monotonic() + 0.3)  # type: ignore[arg-type]
    assert never.asked >= 2


def test_a_flush_after_the_failed_producer_was_purged_and_no_new_one_could_be_made_raises_the_failure() -> None:
    """After a failed record, the next send purges the producer's queued records (each reported failed) and makes
    a new producer; if none can be made (the brokers still away), that send raises, and the purged records'
    failure is what the next flush must raise: it returned as if all were delivered."""
    url = urllib.parse.urlsplit("kafka://127.0.0.1:1/t")
    transport = KafkaTransport(url, KafkaTransport.Options(client="confluent"))
    assert isinstance(transport, ConfluentKafkaTransport)

    class Failed:
        """The failed producer, still holding two records (counted as pending)."""

        def __init__(self) -> None:
            self.held = [b"r2xx", b"r3xx"]

        def purge(self) -> None:
            for value in self.held:
                transport._on_delivery(KafkaError(KafkaError._PURGE_QUEUE), _Reported(value, b"", 0, None))
            self.held = []

        def poll(self, timeout: float) -> None:
            pass

        def __len__(self) -> int:
            return len(self.held)

    def no_broker() -> Any:
        raise tb.TransportError("no broker answered")

    transport._rd_producer = Failed()  # type: ignore[assignment]
    transport._pending_bytes, transport._unconfirmed, transport._failed = 8, 2, True
    transport._start_rd_producer = no_broker  # type: ignore[method-assign]
    with pytest.raises(tb.TransportError, match="no broker answered"):
        transport.send([b"r7xx"], key=None)
    with pytest.raises(tb.TransportError, match="Purged"):
        transport.flush(1.0)
    transport.flush(1.0)  # (raised once: nothing more failed)


def test_a_kafka_python_flush_with_no_producer_left_raises_the_failure_its_close_reported() -> None:
    transport = KafkaTransport(urllib.parse.urlsplit("kafka://127.0.0.1:1/t"), KafkaTransport.Options())
    transport._error = tb.TransportError("a record failed as the producer closed")
    with pytest.raises(tb.TransportError, match="failed as the producer closed"):
        transport.flush(1.0)


def _producer_of(transport: KafkaTransport) -> object:
    """The client producer a kafka:// transport sends through now (replaced after a failed record)."""
    return transport._rd_producer if isinstance(transport, ConfluentKafkaTransport) else transport._producer


@pytest.mark.broker
@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_keyless_records_stay_in_one_partition_when_the_producer_is_replaced(client: str) -> None:
    """A producer's keyless records go to one partition, chosen once (a chunked keyless message's chunks must
    all land in it): a producer replaced after a failed record (one over the topic's max.message.bytes) keeps
    it. Four replacements: a partition chosen afresh each time would match the first by chance 1 in 8**4."""
    url = small_records_topic(on(endpoint_url("kafka"), client), 8)
    topic = urllib.parse.urlsplit(url).path.strip("/")
    producers: list[object] = []  # (held: a freed producer's id could be its successor's)
    with tb.Producer(url, batch_linger_s=0) as producer:
        for round_ in range(5):
            for i in range(3):
                producer.send(None, np.full(16, 10 * round_ + i))
            producer.flush(30)
            producers.append(_producer_of(producer.transport))
            if round_ < 4:
                with pytest.raises(tb.TransportError):  # refused by the broker: the producer is failed
                    producer.send("big", np.zeros(20_000, np.float32))
                    producer.flush(30)
    assert len({id(p) for p in producers}) == 5  # (replaced after each refusal)
    consumer = KafkaConsumer(bootstrap_servers=BOOTSTRAP, enable_auto_commit=False, auto_offset_reset="earliest")
    keyless: dict[int, int] = {}
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(8)])
        deadline = time.monotonic() + 30
        while sum(keyless.values()) < 15 and time.monotonic() < deadline:
            for tp, records in consumer.poll(timeout_ms=500).items():
                for record in records:
                    if record.key is None:
                        keyless[tp.partition] = keyless.get(tp.partition, 0) + 1
    finally:
        consumer.close()
    assert sum(keyless.values()) == 15 and len(keyless) == 1, keyless
