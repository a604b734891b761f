"""Who reads a kafka:// consumer's records on librdkafka (`client="confluent"`): the application thread waiting
in `Consumer.recv`, or a background thread while no application thread has lately (leading.py's rule, as
memory:// and shm:// follow it).

A hand-off from a delivering thread to the application costs a wake-up and the GIL's passing, about as much
CPU as the rest of a small tensor's delivery; a tensor read by the thread that wants it needs none.

One thread at a time leads: it alone calls the consumer (`consume` and the commits; librdkafka runs the
rebalance and commit callbacks inside those calls), delivers the records in their order and books them
(`Commits`). Records fetched and not yet delivered wait in `_backlog` for the next leader. A record the table
has no room for is held back (the intake's `may_hold`) and offered again when room opens, before any record
behind it: a leading application thread must never wait for room that only another of its threads could make.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_LOG_APPEND_TIME, Consumer, KafkaException, Message
from confluent_kafka import TopicPartition as RdTopicPartition

from ..codec.frame import Buffer, MessageId
from .base import Deliver, Held
from .kafka_offsets import appended_at, record_frame, take_record
from .kafka_python import TopicPartition
from .kafka_rdkafka import Commits, batch
from .leading import Leadership
from .peer_frames import never

log = logging.getLogger("tensorbus.transports.kafka_confluent")

#: the background thread leads once no application thread has for this long
LINGER_S = 0.01
#: the longest a leader waits in librdkafka for a record (it cannot be woken sooner: an application thread
#: asking a background leader for the lead waits this long at most, its tensor handed over meanwhile)
WAIT_S = 0.05
#: the shortest wait handed to librdkafka: it waits in whole milliseconds, and confluent-kafka drops the rest, so
#: a shorter one would not wait at all (a receive in the last millisecond of its slice spun, calling `poll` again
#: and again, 2-3 µs of CPU each, until the slice ended)
LEAST_WAIT_S = 0.001


class RecordReading:
    """The reading of one consumer's records: by a waiting receive (`wait`), else by a background thread."""

    def __init__(
        self, consumer: Consumer, commits: Commits, deliver: Deliver, topic: str, most: int, commit_every_s: float
    ) -> None:
        self._consumer, self._commits, self._deliver, self._topic = consumer, commits, deliver, topic
        self._most, self._commit_every_s = most, commit_every_s
        # (librdkafka's wait cannot be cut short: WAIT_S)
        self.leadership = Leadership(LINGER_S, lambda: None, deliver.taken_count)
        # -- the leader's, all of them (one thread at a time: `leadership`) --
        self._backlog: collections.deque[Message] = collections.deque()  # fetched, not yet delivered, in order
        #: the first record of the backlog with its frame, while the intake's Python delivery has it (a receive
        #: interrupted there offers the same frame again, which the intake recognises)
        self._offering: Buffer | None = None
        self._held: tuple[Held, TopicPartition, int] | None = None  # a record held back while the table is full
        self._partitions: dict[int | None, TopicPartition] = {}  # (made once each, not per record)
        self._last_commit = time.monotonic()
        # -- any thread's --
        self._room = threading.Event()  # set when the table may have room for the record held back
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kafka-confluent-{topic}")
        self._thread.start()

    def wait(self, done: threading.Lock, deadline: float | None) -> bool:
        """Wait for a receive's `done` until `deadline`, reading and delivering records on this thread meanwhile."""
        return self.leadership.wait(done, deadline, self._receive_step)

    def _receive_step(self, deadline: float | None, stop: Callable[[], bool]) -> bool:
        """`_step` of a waiting receive: it delivers all it fetched (the receives after it find those in the table)."""
        return self._step(deadline, never)

    def _run(self) -> None:
        try:
            self.leadership.run_in_background(self._step)
        finally:
            with self.leadership.last_lead():
                self._commits.commit(0)
                try:
                    self._consumer.close()  # leaves the group
                except (KafkaException, RuntimeError) as exc:
                    log.info("%s: closing the consumer: %s", self._commits.shown, exc)

    def _step(self, deadline: float | None, stop: Callable[[], bool]) -> bool:
        """Offer the record held back, else fetch records (waiting until `deadline`, WAIT_S at most) and deliver
        them until `stop()`; commit what is safe now and then. False once the consumer turned a record away."""
        wait = WAIT_S if deadline is None else min(max(deadline - time.monotonic(), LEAST_WAIT_S), WAIT_S)
        if self._held is not None:
            self._room.clear()  # (before the offer: room that opens after it sets it again)
            released = self._release()
            if released is None:  # no room yet
                self._room.wait(wait)
                return True
            if not released:
                return False
        if not self._backlog:
            try:
                self._backlog.extend(batch(self._consumer, self._most, wait))
            except KafkaException as exc:  # librdkafka reconnects by itself
                log.warning("%s: %s; consuming again", self._commits.shown, exc)
                self._room.wait(wait)
            except BaseException:  # e.g. Ctrl-C in a receive: what `consume` took may be gone with it
                self._rewind()
                raise
        taking = self._deliver_backlog(stop)
        if time.monotonic() - self._last_commit >= self._commit_every_s:
            self._commits.commit_soon()
            self._last_commit = time.monotonic()
        return taking

    def _deliver_backlog(self, stop: Callable[[], bool]) -> bool:
        """Deliver and book the backlog's records, in order, until one is held back or `stop()`; False once the
        consumer turned one away (not booked as taken: the group's next consumer reads it). A run of records
        the C delivery took, one offset after another, is booked in one step (`_Run`), before anything else."""
        backlog, fast, commits, run = self._backlog, self._deliver.fast, self._commits, _Run(self._commits)
        take_records = self._deliver.take_records
        try:
            while backlog:
                record = backlog[0]  # (taken off only once booked: a receive interrupted before offers it again)
                if (error := record.error()) is not None:
                    log.warning("%s: %s", commits.shown, error.str())
                    backlog.popleft()
                    continue
                tp = self._partitions.get(partition := record.partition())
                if tp is None:
                    tp = self._partitions[partition] = TopicPartition(self._topic, partition)
                offset = record.offset() or 0
                frame = self._offering
                if frame is None and take_records is not None:  # (C: the run of records it takes, off the backlog)
                    if ids := take_records(backlog, partition, offset):
                        run.extend(tp, offset, ids)
                        if stop():
                            return True
                        continue
                    frame = self._offering = record_frame(record.value() or b"")  # (left to Python: this one)
                elif frame is None:
                    taken, frame = take_record(fast, record.value() or b"")  # (an empty record is refused, and counted)
                    if taken is not None:  # a whole plain frame the C delivery took: booked in the fewest steps
                        run.extend(tp, offset, (taken.message_id,))
                        backlog.popleft()
                        if stop():
                            return True
                        continue
                    self._offering = frame
                run.book()  # (the records before this one first)
                kind, stamp = record.timestamp()
                stamped = appended_at(int(kind == TIMESTAMP_LOG_APPEND_TIME), stamp)
                result = self._deliver(frame, may_hold=True, appended_at=stamped)
                self._offering = None
                backlog.popleft()
                commits.record(tp, offset, result)
                if result.held is not None:
                    self._held = (result.held, tp, offset)
                    return True
                if result.turned_away:
                    return False  # aborted: leave the group, its partitions go to others
                if stop():
                    return True
            return True
        finally:
            run.book()  # (also when interrupted: what was delivered is booked)

    def _release(self) -> bool | None:
        """Offer the record held back again: None while there is still no room, False if it was turned away."""
        assert self._held is not None
        held, tp, offset = self._held
        result = self._deliver.release(held)
        if result is None:
            return None
        if result.held is not None:  # held again: the room went meanwhile
            self._held = (result.held, tp, offset)
            return None
        self._held = None
        self._deliver.ledger.apply(result)
        return not result.turned_away

    def _rewind(self) -> None:
        """After a receive was interrupted while it read: the records `consume` had taken may be gone with it.
        Each partition is read again from its first record not read under its stream (the backlog's come again),
        one with no stream from the group's commit."""
        self._backlog.clear()  # (no record of it was offered yet: the backlog was empty)
        try:
            read_to = self._commits.read_to()
            had = [RdTopicPartition(self._topic, p, read_to[p]) for p in self._commits.assigned if p in read_to]
            others = [RdTopicPartition(self._topic, p) for p in self._commits.assigned if p not in read_to]
            stored = self._consumer.committed(others, timeout=5) if others else []
            for position in had + stored:  # (none committed: from the start, as auto.offset.reset says)
                position.offset = position.offset if position.offset >= 0 else OFFSET_BEGINNING
                self._consumer.seek(position)
        except (KafkaException, RuntimeError) as exc:
            log.warning("%s: reading again after an interruption failed: %s", self._commits.shown, exc)

    def room_opened(self) -> None:
        """The table may have room for a record held back (under the table's lock: no waiting). Rare: when room
        opens in a full table, or a receive starts waiting in one."""
        self._room.set()

    def close(self, timeout_s: float) -> None:
        """Stop reading; the background thread commits what is safe and leaves the group."""
        self.leadership.stop()
        self._room.set()
        if threading.current_thread() is not self._thread and not self.leadership.is_leading():
            self._thread.join(timeout=timeout_s)


class _Run:
    """Records the C delivery took, one offset after another in one partition, booked together (`book`)."""

    __slots__ = ("_commits", "_first", "_ids", "_tp")

    def __init__(self, commits: Commits) -> None:
        self._commits = commits
        self._tp: TopicPartition | None = None
        self._first = 0
        self._ids: list[MessageId | None] = []

    def extend(self, tp: TopicPartition, first: int, message_ids: Sequence[MessageId | None]) -> None:
        """Records taken, at `first`, `first + 1`, ... of `tp`; records that do not follow the run's last book the
        run first."""
        if tp is not self._tp or first != self._first + len(self._ids):
            self.book()
            self._tp, self._first = tp, first
        self._ids.extend(message_ids)

    def book(self) -> None:
        """Book the run's records in the ledger (`Offsets.record_admitted_run`), and start an empty one."""
        if self._ids:
            assert self._tp is not None
            ids, self._ids = self._ids, []
            self._commits.record_admitted_run(self._tp, self._first, ids)
