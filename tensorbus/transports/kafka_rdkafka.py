"""librdkafka's side of kafka:// with `client="confluent"` (kafka_confluent.py): its settings, named as it names
them, its errors translated as kafka-python's are, the consumer's batches and its commits (`Commits`)."""

from __future__ import annotations

import json
import logging
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message
from confluent_kafka import TopicPartition as RdTopicPartition

from ..errors import TensorBusError
from .kafka import KafkaTransport
from .kafka_offsets import Offsets
from .kafka_python import TopicPartition, ke, translate

log = logging.getLogger(__name__)

#: what the guarantees rest on, as for kafka-python; murmur2_random hashes keys as kafka-python does
PRODUCER = {
    "acks": "all",
    "enable.idempotence": True,
    "max.in.flight.requests.per.connection": 5,
    "partitioner": "murmur2_random",
}
CONSUMER = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "auto.offset.reset": "earliest",
    "topic.metadata.refresh.interval.ms": 5000,  # as kafka-python's metadata_max_age_ms here
    # a partition whose prefetched records pass queued.max.messages.kbytes (64 MiB) is fetched again this soon
    # after, not librdkafka's second: a consumer behind the log by that much stalled a second at a time
    "fetch.queue.backoff.ms": 10,
}
#: librdkafka's own error codes (negative) that have a kafka-python twin, so `translate` says the same
_LOCAL = {
    KafkaError._MSG_TIMED_OUT: ke.KafkaTimeoutError,
    KafkaError._TIMED_OUT: ke.KafkaTimeoutError,
    KafkaError._INVALID_ARG: ke.KafkaConfigurationError,
    KafkaError._AUTHENTICATION: ke.SaslAuthenticationFailedError,
    KafkaError._UNKNOWN_TOPIC: ke.UnknownTopicOrPartitionError,
}


def translate_error(error: KafkaError, where: str, nbytes: int | None = None) -> TensorBusError:
    """The tensorbus error for a librdkafka error: the kafka-python error of the same Kafka code, translated."""
    code = error.code()  # (a record over message.max.bytes is refused locally with the broker's code too)
    kind = ke.for_code(code) if code >= 0 else _LOCAL.get(code, ke.KafkaError)
    return translate(kind(error.str()), where, nbytes)


def client_config(transport: KafkaTransport) -> dict[str, Any]:
    """Connection settings shared by the producer and the consumer, named as librdkafka names them."""
    o = transport.options
    protocol = ("SASL_" if o.sasl_mechanism else "") + ("SSL" if transport.url.scheme == "kafkas" else "PLAINTEXT")
    names = {
        "ssl_cafile": "ssl.ca.location",
        "ssl_certfile": "ssl.certificate.location",
        "ssl_keyfile": "ssl.key.location",
        "ssl_password": "ssl.key.password",
        "sasl_mechanism": "sasl.mechanism",
        "sasl_plain_username": "sasl.username",
        "sasl_plain_password": "sasl.password",
    }
    settings = {names[name]: value for name, value in o.client_settings().items() if value is not None}
    return {
        "bootstrap.servers": ",".join(transport.servers),
        "security.protocol": protocol,
        "socket.connection.setup.timeout.ms": max(1000, int(o.connect_timeout_s * 1000)),
        # a broker back from a restart (and maybe leading or coordinating again) is reconnected to within a second,
        # as kafka-python is told (librdkafka's own backoff grows to 10 s)
        "reconnect.backoff.max.ms": 1000,
        "error_cb": _client_error,
        "logger": logging.getLogger("tensorbus.librdkafka"),  # (served by poll and consume, not written to stderr)
        **settings,
    }


class Reconnects:
    """Counts a transport's reconnects (`tally.reconnects`) from librdkafka's statistics: each broker
    connection that broke (a broker's `disconnects`; librdkafka connects again by itself, at once where it
    needs the broker). Served every `STATISTICS_MS` by `poll` or `consume`, never per record.

    The statistics of every client the transport makes (a producer replaced after a failure is a new
    one) are summed by client and broker, each the most it said: a counter that never goes down."""

    STATISTICS_MS = 1000

    def __init__(self, transport: KafkaTransport) -> None:
        self.tally = transport.tally
        self._lock = transport._pending  # (whichever thread polls, they count under one lock)
        self._broke: dict[tuple[str, str], int] = {}  # (client, broker) -> its disconnects (guarded by `_lock`)

    def config(self) -> dict[str, Any]:
        """A client's settings for its statistics: none unless metrics are on (`tally.metered`)."""
        if not self.tally.metered:
            return {}
        return {"statistics.interval.ms": self.STATISTICS_MS, "stats_cb": self.statistics}

    def statistics(self, text: str) -> None:
        """librdkafka's statistics (JSON), on the thread that called `poll` or `consume`."""
        try:
            stats = json.loads(text)
            client, brokers = str(stats["name"]), stats["brokers"]
            said = {(client, str(name)): int(broker["disconnects"]) for name, broker in brokers.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # (not what librdkafka documents)
            log.debug("librdkafka statistics not read: %r", exc)
            return
        with self._lock:
            for where, count in said.items():
                self._broke[where] = max(count, self._broke.get(where, 0))
            self.tally.reconnects = sum(self._broke.values())


def _client_error(error: KafkaError) -> None:
    """librdkafka's reports of trouble it retries by itself (a broker down, a connection refused)."""
    log.log(logging.WARNING if error.fatal() else logging.INFO, "librdkafka: %s", error.str())


def batch(consumer: Consumer, most: int, timeout: float) -> list[Message]:
    """Up to `most` records: those already fetched, else the first to arrive within `timeout` and those behind it.

    (`consume(most, timeout)` alone would wait for `most` records, or until `timeout`, before handing any over.)
    """
    records = consumer.consume(most, 0)
    if records:
        return records
    first = consumer.poll(timeout)
    return [] if first is None else [first, *consumer.consume(most - 1, 0)]


class Commits(Offsets):
    """Commits `Offsets.committable()` (the decision, shared with kafka-python) with a librdkafka consumer.

    Every method runs on the thread that leads the reading (kafka_reading.py), one at a time: librdkafka calls
    the rebalance and commit callbacks inside `consume` and the commits.
    """

    consumer: Consumer

    def _commit(self, offsets: dict[TopicPartition, Any], wait: bool = True) -> None:
        """Commit `offsets` (from `committable`), waiting for the broker or not (then `on_commit` reports it);
        a failure only means records may be read again."""
        wanted = [RdTopicPartition(tp.topic, tp.partition, meta.offset) for tp, meta in offsets.items()]
        try:
            if wait:
                self.consumer.commit(offsets=wanted, asynchronous=False)
                self._committed_now(offsets)
            else:
                self.consumer.commit(offsets=wanted, asynchronous=True)
        except KafkaException as exc:  # e.g. a rebalance took the partitions: their new owner re-reads
            log.info("commit to %s failed (%s); records since the last commit may be read again", self.shown, exc)

    def commit(self, timeout_s: float) -> None:
        """Commit what is safe and wait (librdkafka bounds the wait by its own request timeout, not `timeout_s`)."""
        if offsets := self.committable():
            self._commit(offsets)

    def commit_soon(self) -> None:
        """Commit what is safe without waiting for the broker: the consumer goes on reading meanwhile."""
        if offsets := self.committable():
            self._commit(offsets, wait=False)

    def on_commit(self, error: KafkaError | None, partitions: list[RdTopicPartition]) -> None:
        """librdkafka's report of a commit (served by `consume`, on the consumer thread)."""
        if error is not None:
            log.info("commit to %s failed (%s); records since the last commit may be read again", self.shown, error)
            return
        self._committed_now({TopicPartition(p.topic, p.partition): p for p in partitions if p.error is None})

    def on_assign(self, consumer: Consumer, partitions: list[RdTopicPartition]) -> None:
        self.assigned = frozenset(self.assigned | {p.partition for p in partitions})

    def on_revoke(self, consumer: Consumer, partitions: list[RdTopicPartition]) -> None:
        """Commit the revoked partitions' progress before their new owner starts, then forget them."""
        revoked = {TopicPartition(p.topic, p.partition) for p in partitions}
        if offsets := {tp: meta for tp, meta in self.committable().items() if tp in revoked}:
            self._commit(offsets)
        self.on_lost(consumer, partitions)

    def on_lost(self, consumer: Consumer, partitions: list[RdTopicPartition]) -> None:
        """Forget the lost partitions (their streams in the ledger close: nothing of them is committed here)."""
        self._forget({TopicPartition(p.topic, p.partition) for p in partitions})
