"""`kafka://HOST:PORT/TOPIC`: a compacted topic keyed by tensor key keeps the latest version of each.

The publisher sends through the Kafka transport's producer (idempotent, `acks=all`); a version too
large for one record is split into chunk records keyed `KEY#i`, so compaction keeps the chunks of the
newest version of each key whole (a chunk is only compacted away once the next version's chunk of
the same index is in the log, and a chunk names its message: never a mix of two versions). On start
it reads the topic to learn the versions already published, and refuses lower ones.

A subscriber is no group member: it assigns itself every partition and reads from the start (nothing
committed), keeping the newest of each key; `latest` answers once it has read up to where the topic
ended when it started. Both Kafka clients (`client=kafka-python|confluent`) publish through their
transport and read through a `Reader` of their own (kafka_confluent.py for librdkafka's); what is
read, and when `latest` answers, is decided here for both.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable
from typing import Protocol

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka import KafkaAdminClient, KafkaConsumer
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError
    from kafka.structs import TopicPartition

from ..errors import CodecError, ConfigError, TensorBusError, TransportError
from ..transports.kafka import KafkaOptions, KafkaTransport, map_errors
from .api import Receiver
from .broker import BrokerPublishingSide
from .retained import Published, Retained

log = logging.getLogger(__name__)
#: the publisher keeps no frames for late joiners: the topic does (`max_retained_bytes` does not apply)
KEEPS_FRAMES = False
#: topic settings of a topic the publisher creates: keep the latest record of each key
COMPACTED = {"cleanup.policy": "compact"}


def endpoint(url: urllib.parse.SplitResult) -> str:
    """What frames are signed for: the topic."""
    return f"fanout-kafka:{urllib.parse.unquote(url.path.lstrip('/'))}"


def _transport(url: urllib.parse.SplitResult, options: KafkaOptions) -> KafkaTransport:
    """The Kafka transport (of the client `options.client` names) whose producer and settings the fan-out uses."""
    return KafkaTransport(url, options)


def _record_key(key: str, index: int, count: int) -> str:
    """A whole version is keyed by its key; chunk i of one by KEY#i (compaction keeps the newest of each;
    `PublishingSide.publish` refuses keys with '#', so no key is another's chunk)."""
    return key if count == 1 else f"{key}#{index}"


class Reader(Protocol):
    """A client's reader of the whole topic: no group, every partition assigned from its start, nothing committed.
    Its methods raise `TensorBusError` (the client's own errors translated)."""

    def ends(self) -> dict[int, int]: ...  # each partition's end offset now
    def position(self, partition: int) -> int: ...  # the next offset it reads in that partition
    def poll(self, timeout: float) -> list[bytes]: ...  # the values of the records that arrived (waits at most)
    def close(self) -> None: ...


class _PythonReader:
    """`Reader` on kafka-python."""

    def __init__(self, transport: KafkaTransport) -> None:
        o, self._shown = transport.options, transport._shown
        with map_errors(self._shown):
            self._consumer = consumer = KafkaConsumer(
                **transport._client_config(),
                group_id=None,
                enable_auto_commit=False,
                allow_auto_create_topics=False,  # (the publisher creates it, compacted; a deleted one stays deleted)
                fetch_max_bytes=o.fetch_max_bytes,
                max_partition_fetch_bytes=o.partition_fetch_bytes,
            )
            try:
                deadline = time.monotonic() + o.connect_timeout_s
                while not (partitions := consumer.partitions_for_topic(transport.topic)):
                    if time.monotonic() > deadline:
                        raise TransportError(
                            f"{self._shown}: the topic's partitions unknown after {o.connect_timeout_s}s"
                        )
                    time.sleep(0.1)
                self._partitions = {p: TopicPartition(transport.topic, p) for p in sorted(partitions)}
                consumer.assign(list(self._partitions.values()))
                consumer.seek_to_beginning()
            except BaseException:  # (its connections and fetcher are not left behind)
                consumer.close()
                raise

    def ends(self) -> dict[int, int]:
        with map_errors(self._shown):
            return {
                tp.partition: end for tp, end in self._consumer.end_offsets(list(self._partitions.values())).items()
            }

    def position(self, partition: int) -> int:
        with map_errors(self._shown):
            return int(self._consumer.position(self._partitions[partition]))

    def poll(self, timeout: float) -> list[bytes]:
        with map_errors(self._shown):
            batches = self._consumer.poll(timeout_ms=int(timeout * 1000))
        return [record.value for records in batches.values() for record in records if record.value is not None]

    def close(self) -> None:
        self._consumer.close()


def _reader(transport: KafkaTransport) -> Reader:
    """A reader of the topic on the transport's client."""
    if transport.options.client == "confluent":
        from .kafka_confluent import ConfluentReader

        return ConfluentReader(transport)
    return _PythonReader(transport)


def _read_to_end(reader: Reader, each: Callable[[bytes], object], stop: threading.Event) -> None:
    """Read every record up to where the partitions end now."""
    ends = reader.ends()
    while not stop.is_set() and any(reader.position(p) < end for p, end in ends.items()):
        for value in reader.poll(0.2):
            each(value)


class PublishingSide(BrokerPublishingSide):
    """Creates the compacted topic if needed, learns the versions in it, and sends each version's records."""

    _transport: KafkaTransport

    def __init__(
        self, url: urllib.parse.SplitResult, options: KafkaOptions, retained: Retained, signing_key: bytes | None = None
    ) -> None:
        super().__init__(_transport(url, options), options.max_frame_bytes, signing_key)
        self._create_compacted()
        reader = _reader(self._transport)
        try:
            _read_to_end(reader, self.learner(retained, signing_key), threading.Event())
        finally:
            reader.close()

    def _create_compacted(self) -> None:
        t = self._transport
        t._probe(t.options.connect_timeout_s)
        with map_errors(t._shown):
            admin = KafkaAdminClient(**t._client_config())
            try:
                if t.topic not in admin.list_topics():
                    replicas = min(3, len(admin.describe_cluster()["brokers"]))
                    with contextlib.suppress(TopicAlreadyExistsError):
                        admin.create_topics([NewTopic(t.topic, 1, replicas, topic_configs=COMPACTED)])
                        log.info("created compacted topic %s", t._shown)
            finally:
                admin.close()

    def publish(self, published: Published) -> None:
        """Queue the version's records (the producer blocks only while `max_pending_bytes` are unacknowledged)."""
        if "#" in published.key:  # chunk records are keyed KEY#i: "w#0" would be compacted with chunk 0 of "w"
            raise ConfigError(
                f"a key published on kafka:// may not contain '#' (chunks are keyed KEY#i): {published.key!r}"
            )
        chunks = self.chunks(published)
        for index, chunk in enumerate(chunks):
            self._transport.send(chunk, key=_record_key(published.key, index, len(chunks)))


class SubscribingSide:
    """Reads the topic from its start on a thread of its own; no group, no commits."""

    def __init__(self, url: urllib.parse.SplitResult, options: KafkaOptions, receive: Receiver) -> None:
        self._transport = _transport(url, options)
        self._transport._ssl_context()  # (a missing or bad TLS file fails the constructor, not each read)
        self._receive = receive
        self._stop = threading.Event()
        receive.latest.hold()  # until the topic is read up to where it ends now
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"tensorbus-fanout-kafka-{url.path}")
        self._thread.start()

    def _take(self, value: bytes) -> None:
        try:
            self._receive(value)
        except CodecError as exc:
            log.error("%s: a record failed its checks, skipped: %s", self._transport._shown, exc)

    def _run(self) -> None:
        """Read the topic to where it ends now (then answer `latest`), then follow it; on a failure, read it again."""
        caught_up = False
        while not self._stop.is_set():
            try:
                reader = _reader(self._transport)
            except TensorBusError as exc:  # (no topic yet: the publisher creates it)
                log.info("%s; trying again", exc)
                self._stop.wait(1.0)
                continue
            try:
                if not caught_up:
                    _read_to_end(reader, self._take, self._stop)
                    caught_up = True
                    self._receive.latest.release()
                self._follow(reader)
            except TensorBusError as exc:  # (versions already held are not taken twice)
                log.warning("%s; reading the topic again", exc)
                self._stop.wait(1.0)
            finally:
                reader.close()

    def _follow(self, reader: Reader) -> None:
        while not self._stop.is_set():
            try:
                for value in reader.poll(0.2):
                    self._take(value)
            except Exception as exc:  # both clients reconnect by themselves
                log.warning("%s: %s; polling again", self._transport._shown, exc)
                self._stop.wait(1.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._transport.options.close_timeout_s)
