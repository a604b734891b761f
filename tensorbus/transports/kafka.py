"""`kafka://HOST:PORT/TOPIC` (and `kafkas://`, TLS): tensors through a Kafka topic, one record per frame.

Each frame (or chunk frame) is one record keyed by the tensor key (UTF-8), so all chunks of a tensor
land in one partition, in order (a producer pins its keyless records to one partition). Records go
out through the idempotent producer with `acks=all`; `send` only queues them, `flush` waits for the
acks and raises the first failure; a record acknowledged with no offset is produced again
(kafka_resends.py). The consumer, a consumer-group member on one thread (kafka-python's
consumer is not thread-safe), commits a partition only up to the oldest record the consumer's ledger
has not released (a tensor the application has not taken, or one whose chunks are incomplete): a
consumer that dies or closes loses nothing, its successor re-reads from there, and the duplicates
(later records that were taken) are dropped above this layer with `dedup_file`. A URL may list
several brokers; topics this transport creates are replicated (`replication_factor`,
`min_insync_replicas`), and a record is retried, across a leader election for one, until
`delivery_timeout_s`.

The modules beside this one: kafka_options.py (the options), kafka_topic.py (URL, brokers probed, topic created),
kafka_python.py (kafka-python's settings and errors), kafka_offsets.py (a record's way into the intake and the
commit bookkeeping); kafka_confluent.py and kafka_rdkafka.py are the librdkafka client (`client="confluent"`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import urllib.parse
from collections.abc import Callable, Collection
from typing import Any

from ..codec.frame import Buffer, Limits
from ..errors import ConfigError, TensorBusError, TransportError
from .base import Deliver
from .kafka_offsets import Offsets, appended_at, take_record
from .kafka_options import CLIENTS, FETCH_PER_PARTITION, RECORD_OVERHEAD, KafkaOptions
from .kafka_python import (
    CONSUMER,
    PRODUCER,
    KafkaConsumer,
    KafkaProducer,
    TopicPartition,
    delivery,
    map_errors,
    retrying,
    translate,
)
from .kafka_resends import Resends
from .kafka_topic import KafkaEndpoint

__all__ = [
    "CLIENTS",
    "FETCH_PER_PARTITION",
    "RECORD_OVERHEAD",
    "KafkaOptions",
    "KafkaTransport",
    "TopicPartition",
    "appended_at",
    "map_errors",
    "take_record",
    "translate",
]

log = logging.getLogger(__name__)


class KafkaTransport(KafkaEndpoint):
    """A topic per endpoint: an idempotent producer, or a consumer-group member on a thread of its own."""

    persists = True
    Options = KafkaOptions
    options: KafkaOptions

    def __new__(cls, url: urllib.parse.SplitResult, options: KafkaOptions) -> KafkaTransport:
        """The transport of the client `options.client` names (kafka_confluent.py for "confluent")."""
        if cls is KafkaTransport and options.client == "confluent":
            try:
                from .kafka_confluent import ConfluentKafkaTransport
            except ImportError as exc:
                raise ConfigError(
                    f"client='confluent' needs confluent-kafka ({exc.name} is not installed): "
                    "pip install 'tensorbus[kafka-fast]'"
                ) from None
            return super().__new__(ConfluentKafkaTransport)
        return super().__new__(cls)

    def __init__(self, url: urllib.parse.SplitResult, options: KafkaOptions) -> None:
        super().__init__(url, options)
        self._fetch_bytes = options.partition_fetch_bytes
        self.group: str = options.group or f"tensorbus-{self.topic}"
        self._lock = threading.Lock()
        self._producer: KafkaProducer | None = None
        self._failed = False  # a record failed: kafka-python's idempotent producer is stuck, replace it
        self._keyless_partition: int | None = None
        #: guards the pending counts, `_failed` and `_error`; `with self._pending_lock` where nothing waits (a
        #: Condition's `__enter__` is a Python-level call, and every record takes it twice)
        self._pending_lock = threading.RLock()
        self._pending = threading.Condition(self._pending_lock)
        self._pending_waiters = 0  # threads waiting on `_pending` (under it): a record settled with none wakes none
        self._pending_bytes = self._unconfirmed = 0
        self._error: TensorBusError | None = None
        self._resends = Resends(self._pending_lock, self._shown)  # records reported delivered, maybe not written
        self._offsets: Offsets | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()

    def signing_identity(self, consumer: bool) -> tuple[str, bytes]:
        """kafka:TOPIC (kafkas:// alike)."""
        return f"kafka:{self.topic}", b""

    @property
    def assignment(self) -> frozenset[int]:
        """The partitions this consumer owns at the moment (they move on rebalances)."""
        return self._offsets.assigned if self._offsets is not None else frozenset()

    # -- producer side -------------------------------------------------------------------------------

    def _start_producer(self) -> KafkaProducer:
        """Create the topic if needed and the idempotent producer; after a failed record, a fresh producer."""
        with self._lock:
            if self._producer is not None and self._failed:
                self._producer.close(timeout=0)  # what it still holds fails, and is reported, at once
                self._producer = None
            if self._producer is None:
                self._ensure_topic()
                o = self.options
                with map_errors(self._shown):
                    producer = KafkaProducer(
                        **self._client_config(),
                        **PRODUCER,
                        max_request_size=o.max_request_size,
                        max_block_ms=int(o.connect_timeout_s * 1000),
                        **delivery(o.delivery_timeout_s),
                        allow_auto_create_topics=False,
                        **({} if o.batch_linger_s is None else {"linger_ms": int(o.batch_linger_s * 1000)}),
                    )
                    try:
                        deadline = time.monotonic() + o.connect_timeout_s
                        partitions = retrying(lambda: producer.partitions_for(self.topic), deadline, self._shown)
                    except BaseException:  # (its I/O thread and connections are not left behind)
                        producer.close(timeout=0)
                        raise
                    self._pin_keyless(partitions)
                self._producer, self._failed = producer, False
            return self._producer

    def _pin_keyless(self, partitions: Collection[int]) -> None:
        """Choose the partition of this producer's keyless records, at random; a replacement producer (after a
        failed record) keeps it while the topic has it: a chunked message's chunks must all land in one."""
        if self._keyless_partition not in partitions:
            self._keyless_partition = random.choice(sorted(partitions))

    def send(self, frame: list[Buffer], *, key: str | None) -> None:
        """Queue one frame as one record; blocks only while max_pending_bytes are unacknowledged."""
        producer = self._producer if self._producer is not None and not self._failed else self._start_producer()
        value = b"".join(frame)
        nbytes = len(value)
        kafka_key, partition = (None, self._keyless_partition) if key is None else (key.encode(), None)
        limit = self.options.max_pending_bytes - nbytes
        room = lambda: self._error or not self._pending_bytes or self._pending_bytes <= limit  # noqa: E731
        started: float | None = None  # backpressure: its seconds counted under `_pending` (tally.py)
        while True:
            with self._pending:
                if not room() and not self._resends.due:
                    started = time.monotonic() if started is None else started
                    self._wait_pending(lambda: room() or self._resends.due, None)
                if room():
                    if started is not None:
                        self.tally.blocked(started)
                    self._raise_error()
                    self._pending_bytes += nbytes
                    self._unconfirmed += 1
                    again = bool(self._resends.due)
                    break
            self._produce_again(producer)  # (records due again count as pending: they make the room)
        if again:
            self._produce_again(producer)
        timed = self if self.tally.timing(self) else None  # (before the send: its callback may come at once)
        try:
            self._send_record(producer, value, kafka_key, partition, timed)
        except TensorBusError:
            self._settle(nbytes, None)
            raise

    def _send_record(
        self, producer: KafkaProducer, value: bytes, key: bytes | None, partition: int | None, timed: Any = None
    ) -> None:
        """Hand one record to kafka-python, settled by its acknowledgement (`_acked`) or its failure. Its value is
        kept until then: a record reported delivered with no offset is produced again (kafka_resends.py)."""
        with map_errors(self._shown):
            future = producer.send(self.topic, value=value, key=key, partition=partition)
        future.add_callback(lambda metadata, t=timed: self._acked(metadata, value, key, t))
        nbytes = len(value)
        future.add_errback(lambda exc: self._settle(nbytes, translate(exc, self._shown, nbytes)))

    def _acked(self, metadata: Any, value: bytes, key: bytes | None, timed: Any) -> None:
        """kafka-python acknowledged a record (on its sender thread): settled, unless the broker answered
        DUPLICATE_SEQUENCE_NUMBER (taken for success, with offset -1), when it is kept to be produced again."""
        with self._pending_lock:
            if not self._resends.written(metadata.partition, metadata.offset):
                self._resends.keep(value, key, metadata.partition)
                if timed is not None:
                    self.tally.forget_timing()
                if self._pending_waiters:  # (a flush waiting produces it again)
                    self._pending.notify_all()
                return
            self._settled(len(value), None, True, timed)

    def _produce_again(self, producer: KafkaProducer) -> bool:
        """Produce again the records reported delivered with no offset (`Resends`), on the application's thread
        (a send may wait, for metadata: never on kafka-python's own thread); whether there were any."""
        due = self._resends.take()
        for value, key, partition in due:
            try:
                self._send_record(producer, value, key, partition)
            except TensorBusError as exc:
                self._settle(len(value), exc)
        return bool(due)

    def _settle(self, nbytes: int, error: TensorBusError | None, current: bool = True, acked: Any = False) -> None:
        """A record was acknowledged or failed for good (called on kafka-python's sender thread); a failure
        marks the producer failed, unless the record was a replaced producer's (`current` false). `acked`:
        False unless the broker acknowledged it, then `self` if it is the record timed, else None (tally.py)."""
        with self._pending_lock:
            self._settled(nbytes, error, current, acked)

    def _settled(self, nbytes: int, error: TensorBusError | None, current: bool, acked: Any) -> None:
        """`_settle`, the caller holding `_pending_lock`."""
        self._pending_bytes -= nbytes
        self._unconfirmed -= 1
        if acked is False:
            self.tally.forget_timing()  # (a record that failed may be the one timed)
        else:
            self.tally.acked(1, at=acked)
        if error is not None:
            self._failed = self._failed or current
            self._error = self._error or error
        if self._pending_waiters:
            self._pending.notify_all()

    def _wait_pending(self, predicate: Callable[[], Any], timeout: float | None) -> bool:
        """`_pending.wait_for(predicate, timeout)`, counted in `_pending_waiters` (caller holds `_pending`)."""
        self._pending_waiters += 1
        try:
            return bool(self._pending.wait_for(predicate, timeout))
        finally:
            self._pending_waiters -= 1

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the broker has acknowledged every record sent so far; raise the first failure."""
        if self._producer is None:  # (none yet, or one closed after a failure and none made since: its records'
            with self._pending:  # failures, reported as it closed, still count)
                self._raise_error()
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with contextlib.suppress(TransportError), map_errors(self._shown):
            self._producer.flush(timeout)  # a timeout is reported below, with the count
        done = lambda: self._error or not self._unconfirmed or self._resends.due  # noqa: E731
        while True:
            with self._pending:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._wait_pending(done, remaining):
                    raise TransportError(
                        f"{self._unconfirmed} records unacknowledged by {self._shown} after {timeout}s"
                    )
                if self._error or not self._resends.due:
                    self._raise_error()
                    return
            self._produce_again(self._start_producer())  # (not under the lock: the acks' callbacks take it)
            with contextlib.suppress(TransportError), map_errors(self._shown):
                self._producer.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    # -- consumer side -------------------------------------------------------------------------------

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        """Create the topic if needed, then join the group and deliver records on a background thread."""
        self._ensure_topic()
        self._thread = threading.Thread(target=self._consume, args=(deliver,), daemon=True, name=f"kafka-{self.topic}")
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread = None
            self._raise_error()

    def _consume(self, deliver: Deliver) -> None:
        """The consumer thread: poll, deliver each record, commit what is complete (periodically and at the end)."""
        o = self.options
        try:
            with map_errors(self._shown):
                consumer = KafkaConsumer(
                    **self._client_config(),
                    group_id=self.group,
                    **CONSUMER,
                    allow_auto_create_topics=False,
                    fetch_max_bytes=o.fetch_max_bytes,
                    max_partition_fetch_bytes=self._fetch_bytes,
                    max_poll_records=o.max_poll_records,
                    max_poll_interval_ms=int(o.max_poll_interval_s * 1000),
                    session_timeout_ms=int(o.session_timeout_s * 1000),
                    heartbeat_interval_ms=o.heartbeat_interval_ms,
                )
                try:
                    offsets = self._offsets = Offsets(consumer, deliver, self._shown, self.tally)
                    consumer.subscribe([self.topic], listener=offsets)
                    self._await_metadata(consumer, o.connect_timeout_s)
                except BaseException:  # (its I/O thread and connections are not left behind)
                    consumer.close(autocommit=False, timeout_ms=0)
                    raise
        except TensorBusError as exc:
            self._error = exc
            return
        finally:
            self._ready.set()
        fast = deliver.fast  # the intake's C delivery of whole plain frames, where it is built
        last_commit = time.monotonic()
        turned_away = False
        while not self._stop.is_set() and not turned_away:
            try:
                with map_errors(self._shown):
                    batches = consumer.poll(timeout_ms=200)
            except TransportError as exc:  # kafka-python reconnects by itself, with backoff
                log.warning("%s; polling again", exc)
                self._stop.wait(1.0)
                continue
            for tp, records in batches.items():
                for record in records:
                    if self._stop.is_set() or turned_away:
                        break  # not delivered, so not committed: the group's next consumer reads it
                    taken, frame = take_record(fast, record.value)
                    if taken is not None:  # a whole plain frame the C delivery took: booked in the fewest steps
                        offsets.record_admitted(tp, record.offset, taken.message_id)
                        continue
                    result = deliver(frame, appended_at=appended_at(record.timestamp_type, record.timestamp))
                    offsets.record(tp, record.offset, result)
                    turned_away = result.turned_away  # aborted: leave the group, its partitions go to others
            if time.monotonic() - last_commit >= o.commit_interval_s:
                offsets.commit(o.connect_timeout_s)
                last_commit = time.monotonic()
        offsets.commit(o.close_timeout_s)
        with contextlib.suppress(Exception):
            consumer.close(autocommit=False, timeout_ms=int(o.close_timeout_s * 1000))

    def _await_metadata(self, consumer: KafkaConsumer, timeout: float) -> None:
        """After subscribing, before the first poll: fetch metadata until it lists the topic's partitions.

        The group's first assignment must see them. A join done with empty metadata is assigned
        nothing and rejoins when the metadata arrives, and kafka-python 3.0 can lose a rejoin that
        only changed metadata asked for: when its join outlives a `poll` timeout, the partitions stay
        revoked and the consumer reads nothing, for good. A fetch issued after `subscribe` also
        updates the group's view of the topic (`topics()` always asks the cluster).
        """
        deadline = time.monotonic() + timeout
        while True:
            topics = retrying(consumer.topics, deadline, self._shown)
            if self.topic in topics and consumer.partitions_for_topic(self.topic):
                return
            if time.monotonic() > deadline:
                raise TransportError(f"{self._shown}: partitions of the topic unknown to the client after {timeout}s")
            time.sleep(0.1)

    def close(self) -> None:
        """Flush and close the producer, or stop the consumer thread (which commits and leaves the group)."""
        if self._producer is not None:
            timeout = self.options.close_timeout_s
            try:
                self.flush(timeout)
            except TransportError as exc:
                log.warning("closing with records not acknowledged: %s", exc)
                timeout = 0
            with contextlib.suppress(Exception):
                self._producer.close(timeout=timeout)
            self._producer = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=self.options.close_timeout_s)
            self._thread = None
