"""kafka:// and kafkas:// on confluent-kafka (librdkafka), chosen with `client="confluent"`.

The same topics, records, options, guarantees and errors as the kafka-python backend (kafka.py), whose
URL parsing, options, checks, topic creation and commit decision (`Offsets.committable`) this reuses;
only the client calls differ. librdkafka batches records (`batch_linger_s`), reports each delivery through a
callback served by `poll` (no blocking flush per tensor), hands the consumer batches (`consume`), and
places keyed records with `murmur2_random`: the same partitions as kafka-python's murmur2 partitioner.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import numpy as np
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer

from ..codec.frame import NATIVE, Buffer, Limits, MessageId
from ..errors import TensorBusError, TransportError
from .base import Deliver, Encoding
from .kafka import KafkaOptions, KafkaTransport
from .kafka_rdkafka import CONSUMER, PRODUCER, Commits, Reconnects, client_config, translate_error
from .kafka_reading import RecordReading

log = logging.getLogger(__name__)
#: a plain ndarray below this many bytes has its record made whole in C (`ndarray_frame`), then copied into the
#: `bytes` librdkafka takes: the Python steps saved outweigh that extra copy for small tensors, not for large ones
WHOLE_IN_C_BELOW = 64 << 10
#: a flush that finds records still unacknowledged after librdkafka's own flush (sent by another thread
#: meanwhile) serves reports in slices of this long until they settle or its timeout ends
FLUSH_SLICE_S = 0.05
#: producers a forked child let go of (see `ConfluentKafkaTransport.abandon`)
_ABANDONED: list[Producer] = []


def _joined(frame: list[Buffer]) -> bytes:
    """A frame's parts as one record value (librdkafka copies it once more)."""
    return frame[0] if len(frame) == 1 and isinstance(frame[0], bytes) else b"".join(frame)


class ConfluentKafkaTransport(KafkaTransport):
    """A topic per endpoint, through librdkafka: an idempotent producer, or a consumer-group member whose records
    a waiting receive reads itself (a background thread while none waits)."""

    reads_while_waiting = True

    def __init__(self, url: urllib.parse.SplitResult, options: KafkaOptions) -> None:
        super().__init__(url, options)
        self._rd_producer: Producer | None = None  # (swapped under `_lock`, and records produced under it)
        #: replaced producers whose purged records' reports were not all served yet (guarded by `_lock`)
        self._replaced: list[Producer] = []
        #: the current producer's delivery report callbacks (for a record timed to its ack, and for the
        #: others: tally.py), and the event set when it is replaced
        self._on_delivery: Callable[[KafkaError | None, Message], None] = self._delivered
        self._on_timed_delivery: Callable[[KafkaError | None, Message], None] = self._delivered
        self._replaced_now = threading.Event()
        self._reconnects = Reconnects(self)  # (its clients' statistics, with metrics on)
        self._reading: RecordReading | None = None  # a listening consumer's reading of the records

    def _current_rd_producer(self) -> Producer:
        """The producer to produce on (the caller holds `_lock`): made on the first send, and made again
        after a failed record, once the failed one's records are purged and their reports served, so
        every record counted in `_pending_bytes` and `_unconfirmed` is settled by some `poll`."""
        with self._pending_lock:
            failed = self._failed
        if self._rd_producer is not None and failed:
            old, self._rd_producer = self._rd_producer, None
            self._replaced_now.set()  # (its reports, failures included, no longer mark the next one failed)
            old.purge()  # what it still holds fails, and is reported, at once
            deadline = time.monotonic() + self.options.close_timeout_s
            while len(old) and time.monotonic() < deadline:
                old.poll(0.05)
            if len(old):  # (reports still due: served by the next flush or close)
                self._replaced.append(old)
        return self._rd_producer or self._start_rd_producer()

    def _serve_replaced(self, timeout: float) -> None:
        """Serve the delivery reports of replaced producers still holding records (for `timeout` at most)."""
        with self._lock:
            replaced = list(self._replaced)
        deadline = time.monotonic() + timeout
        for old in replaced:
            while len(old) and time.monotonic() < deadline:
                old.poll(0.05)
        with self._lock:
            self._replaced = [old for old in self._replaced if len(old)]

    def _start_rd_producer(self) -> Producer:
        """Create the topic if needed and the idempotent producer (the caller holds `_lock`)."""
        if self._rd_producer is None:
            self._ensure_topic()
            o = self.options
            delivery_ms = int(o.delivery_timeout_s * 1000)
            config = {
                **client_config(self),
                **self._reconnects.config(),
                **PRODUCER,
                "message.max.bytes": o.max_request_size,
                "delivery.timeout.ms": delivery_ms,
                "request.timeout.ms": min(30_000, delivery_ms // 2),
                "queue.buffering.max.kbytes": min((o.max_pending_bytes + o.max_request_size) // 1024 + 1, 2**31 - 1),
                **({} if o.batch_linger_s is None else {"linger.ms": o.batch_linger_s * 1000}),
            }
            try:
                producer = Producer(config)
                partitions = self._partitions(producer, time.monotonic() + o.connect_timeout_s)
            except KafkaException as exc:
                raise translate_error(exc.args[0], self._shown) from None
            self._pin_keyless(partitions)
            self._replaced_now = replaced = threading.Event()
            self._on_delivery = lambda error, message: self._delivered(error, message, not replaced.is_set())
            self._on_timed_delivery = lambda error, message: self._delivered(
                error, message, not replaced.is_set(), timed=True
            )
            with self._pending:
                self._failed = False
            self._rd_producer = producer
        return self._rd_producer

    def _partitions(self, producer: Producer, deadline: float) -> list[int]:
        """The topic's partitions, asked for again until a broker knows them (a topic just created, or listed by a
        broker just restarted, can come back with an error and none), until `deadline`."""
        while True:
            topic = producer.list_topics(self.topic, timeout=max(0.1, deadline - time.monotonic())).topics[self.topic]
            if topic.error is None and topic.partitions:
                return list(topic.partitions)
            said = f" ({topic.error.str()})" if topic.error is not None else ""
            if time.monotonic() >= deadline:
                raise TransportError(f"{self._shown}: partitions of the topic unknown to the brokers{said}")
            log.info("%s: partitions of the topic not known yet%s; asking again", self._shown, said)
            time.sleep(0.1)

    def send_message(
        self, tensor: Any, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, encoding: Encoding
    ) -> None:
        """Send one tensor; a plain ndarray that fits one record is one frame, a small one made whole in C where the
        extension is built (`ndarray_frame`: its head, the array's bytes and the CRC in one call), else encoded here,
        instead of going through the chunker: most of a small tensor's time."""
        limit, flags = self.max_frame_bytes, encoding.plain_flags
        if flags is not None and type(tensor) is np.ndarray and limit and tensor.nbytes < limit // 2:
            built = None
            if NATIVE is not None and tensor.nbytes < WHOLE_IN_C_BELOW:
                built = NATIVE.ndarray_frame(
                    tensor, key, metadata, message_id, flags
                )  # (None: one it leaves to Python)
            value = bytes(built[0]) if built else _joined(encoding.encode(tensor, key, metadata, message_id, None))
            if len(value) <= limit:
                self._produce(value, key)
                return
        super().send_message(tensor, key, metadata, message_id, encoding)

    def send(self, frame: list[Buffer], *, key: str | None) -> None:
        """Queue one frame as one record; blocks only while max_pending_bytes are unacknowledged."""
        self._produce(_joined(frame), key)

    def _produce(self, value: bytes, key: str | None) -> None:
        """Queue one record (the producer made on the first, after the pending bytes are counted)."""
        nbytes = len(value)
        with self._pending_lock:  # (the commonest case, room at once, in one hold)
            room = (
                self._error or not self._pending_bytes or self._pending_bytes <= self.options.max_pending_bytes - nbytes
            )
            if room:
                self._raise_error()
                self._pending_bytes += nbytes
                self._unconfirmed += 1
            again = bool(self._resends.due)
        if again:
            self._send_again()
        if not room:
            self._wait_for_room(nbytes)
        with self._lock:  # (so no other thread purges and replaces the producer between its choice and produce)
            try:
                producer = self._current_rd_producer()
            except BaseException:  # (no producer could be made: the record was never queued)
                self._settle(nbytes, None)
                raise
            keyless = self._keyless_partition
            partition = keyless if key is None and keyless is not None else -1  # -1: by the key (murmur2)
            timed = self.tally.timed is None and self.tally.timing(self)  # (one record in flight timed: tally.py)
            try:
                self._queue(producer, value, key, partition, self._on_timed_delivery if timed else self._on_delivery)
            except KafkaException as exc:
                self._settle(nbytes, None)
                raise translate_error(exc.args[0], self._shown, nbytes) from None
        producer.poll(0)

    def _queue(
        self, producer: Producer, value: bytes, key: str | bytes | None, partition: int, reported: Callable[..., None]
    ) -> None:
        """`produce` one record (the caller holds `_lock`), serving delivery reports while librdkafka's queue is
        full (its message count) until it takes it."""
        while True:
            try:
                producer.produce(self.topic, value, key, partition=partition, on_delivery=reported)
                return
            except BufferError:
                producer.poll(0.05)

    def _wait_for_room(self, nbytes: int) -> None:
        """Serve delivery reports (which lower the pending bytes) until `nbytes` more fit under max_pending_bytes
        (or a failure is to be raised); then count them. Its seconds are counted under `_pending`, as
        kafka-python's are."""
        limit, waiting_since = self.options.max_pending_bytes - nbytes, time.monotonic()
        while True:
            with self._pending_lock:
                if self._error or not self._pending_bytes or self._pending_bytes <= limit:
                    self.tally.blocked(waiting_since)
                    self._raise_error()
                    self._pending_bytes += nbytes
                    self._unconfirmed += 1
                    return
                again = bool(self._resends.due)
            if again:  # (their bytes count as pending until they are written)
                self._send_again()
            with self._lock:  # (the current one: a producer replaced meanwhile no longer gets the reports due)
                producer = self._current_rd_producer()
            producer.poll(0.05)

    def _delivered(self, error: KafkaError | None, message: Message, current: bool = True, timed: bool = False) -> None:
        """librdkafka's delivery report (served by `poll` or `flush`, on the thread that called it); `timed`:
        the record is the one timed from its send to its acknowledgement."""
        nbytes = len(message)
        if error is not None:
            self._settle(nbytes, translate_error(error, self._shown, nbytes), current, acked=False)
            return
        with self._pending_lock:  # (the check and the settling in one hold: every record's report takes it)
            partition = message.partition() or 0  # (both set in every delivery report)
            if not self._resends.written(partition, message.offset(), ordered=current):  # (None: no offset)
                self._resends.keep(message.value() or b"", message.key(), partition)
                if timed:
                    self.tally.forget_timing()
                return  # (still pending: settled by the report of its next production, `_send_again`)
            self._settled(nbytes, None, current, self if timed else None)

    def _send_again(self) -> bool:
        """Produce again the records reported delivered that may not have been written (`Resends`), on the
        current producer (the caller does not hold `_lock`); whether there were any."""
        due = self._resends.take()
        for value, key, partition in due:
            with self._lock:
                try:
                    self._queue(self._current_rd_producer(), value, key, partition, self._on_delivery)
                except KafkaException as exc:
                    self._settle(len(value), translate_error(exc.args[0], self._shown, len(value)))
                except TensorBusError as exc:  # (no producer could be made)
                    self._settle(len(value), exc)
        return bool(due)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the broker has acknowledged every record sent so far; raise the first failure."""
        with self._lock:
            producer = self._rd_producer
        if producer is None:  # (none yet, or one replaced after a failure and none made since: its records'
            self._serve_replaced(self.options.close_timeout_s if timeout is None else timeout)  # failures still count)
            with self._pending:
                self._raise_error()
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        producer.flush(-1 if timeout is None else timeout)  # serves the delivery reports
        self._flush_again(deadline)
        self._serve_replaced(self.options.close_timeout_s if timeout is None else timeout)
        self._flush_again(deadline)  # (a replaced producer's record reported with no offset goes on the current one)
        while True:
            with self._pending:
                if self._error or not self._unconfirmed:
                    self._raise_error()
                    return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TransportError(f"{self._unconfirmed} records unacknowledged by {self._shown} after {timeout}s")
            # (records a send on another thread counted before it produced them, after the flush above began)
            with self._lock:
                producer = self._current_rd_producer()
            wait_s = FLUSH_SLICE_S if left is None else min(FLUSH_SLICE_S, left)
            if len(producer):
                producer.flush(wait_s)
            else:  # (counted, not produced yet: librdkafka's flush of an empty queue returns at once)
                with self._pending:
                    self._wait_pending(lambda: self._error or not self._unconfirmed, wait_s)
            self._flush_again(deadline)

    def _flush_again(self, deadline: float | None) -> None:
        """Produce again, and flush, the records reported delivered that may not have been written, until none is
        due (`_send_again`; each flush serves their reports, which may make some due again)."""
        while self._send_again():
            with self._lock:
                producer = self._current_rd_producer()
            producer.flush(-1.0 if deadline is None else max(0.0, deadline - time.monotonic()))

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        """Create the topic if needed, join the group, and read records: on a waiting receive's thread, or a
        background one (kafka_reading.py)."""
        self._ensure_topic()
        consumer, commits = self._start_consumer(deliver)
        self._offsets = commits
        o = self.options
        self._reading = RecordReading(consumer, commits, deliver, self.topic, o.max_poll_records, o.commit_interval_s)

    def read_while_waiting(self, done: threading.Lock, deadline: float | None) -> bool:
        """Wait for a receive's `done`, reading records on this thread meanwhile (kafka_reading.py)."""
        if self._reading is None:
            return super().read_while_waiting(done, deadline)
        return self._reading.wait(done, deadline)

    def room_opened(self) -> None:
        """The table may have room for a record held back (under the table's lock: no waiting)."""
        if self._reading is not None:
            self._reading.room_opened()

    def _start_consumer(self, deliver: Deliver) -> tuple[Consumer, Commits]:
        o = self.options
        config = {
            **client_config(self),
            **self._reconnects.config(),
            **CONSUMER,
            "group.id": self.group,
            "fetch.max.bytes": o.fetch_max_bytes,
            "max.partition.fetch.bytes": self._fetch_bytes,
            "receive.message.max.bytes": min(o.fetch_max_bytes + (1 << 20), 2**31 - 1),
            "max.poll.interval.ms": int(o.max_poll_interval_s * 1000),
            "session.timeout.ms": int(o.session_timeout_s * 1000),
            "heartbeat.interval.ms": o.heartbeat_interval_ms,
        }
        commits = Commits(
            None, deliver, self._shown, self.tally
        )  # (its consumer is set below: librdkafka calls it back)
        try:
            commits.consumer = consumer = Consumer({**config, "on_commit": commits.on_commit})
            callbacks = {"on_assign": commits.on_assign, "on_revoke": commits.on_revoke, "on_lost": commits.on_lost}
            consumer.subscribe([self.topic], **callbacks)
        except KafkaException as exc:
            raise translate_error(exc.args[0], self._shown) from None
        return consumer, commits

    def abandon(self) -> None:
        """In a forked child: librdkafka's threads stayed in the parent, so the producer is kept, never destroyed
        (destroying it would wait for threads this process does not have)."""
        if self._rd_producer is not None:
            _ABANDONED.append(self._rd_producer)
            self._rd_producer = None

    def close(self) -> None:
        """Flush the producer, or stop the consumer thread (which commits and leaves the group)."""
        if self._rd_producer is not None:
            try:
                self.flush(self.options.close_timeout_s)
            except TransportError as exc:
                log.warning("closing with records not acknowledged: %s", exc)
                self._rd_producer.purge()
                self._rd_producer.poll(0)
            self._rd_producer = None
        if self._reading is not None:
            self._reading.close(self.options.close_timeout_s)
            self._reading = None
