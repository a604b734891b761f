"""What a Kafka consumer (either client) does with a record: hand it to the intake (`take_record`, `appended_at`),
and book its offset so the group commits each partition only up to the oldest record the consumer's ledger
has not released (`Offsets`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..buffers import aligned
from ..codec.frame import Buffer, Message, MessageId, is_chunk
from ..errors import TransportError
from ..ledger import Stream
from .base import Deliver, Delivered
from .kafka_python import AsyncConsumerRebalanceListener, KafkaConsumer, OffsetAndMetadata, TopicPartition, map_errors
from .tally import Tally

log = logging.getLogger(__name__)


def take_record(
    fast: Callable[[memoryview, int | None, object], Message | None] | None, value: bytes
) -> tuple[Message | None, Buffer]:
    """A record's frame through the intake's C delivery where that takes it: (the Message it delivered,
    the frame), else (None, the frame to hand the intake: `record_frame`; the record's bytes themselves
    where there is no C delivery)."""
    if fast is None:
        return None, value
    frame = record_frame(value)
    return (fast(frame, None, None) if isinstance(frame, memoryview) else None), frame


def record_frame(value: bytes) -> bytes | memoryview:
    """A record's frame as the intake is handed it. A record's bytes start 32 bytes into their object, so its
    tensors would be misaligned: a whole frame is copied to a 64-byte aligned buffer once, for the C delivery
    and the intake alike (`FastDelivery.take_records` copies as this does); a chunk is left as it is (the
    reassembler copies its payload into place anyway)."""
    return value if not value or is_chunk(memoryview(value)) else aligned(value)


def appended_at(timestamp_type: int | None, timestamp_ms: int | None) -> float | None:
    """A record's append time in seconds, if the broker set it (type 1, LogAppendTime; 0 is the producer's)."""
    return timestamp_ms / 1000 if timestamp_type == 1 and timestamp_ms is not None and timestamp_ms >= 0 else None


class Offsets(AsyncConsumerRebalanceListener):
    """What the group may commit: per partition, up to the oldest record the ledger has not released
    (a tensor nobody took yet, or one still missing chunks).

    `record` and `commit` run on the consumer thread; the rebalance callbacks on kafka-python's I/O
    thread (while the consumer thread waits in `poll`), hence the lock.
    """

    def __init__(self, consumer: KafkaConsumer, deliver: Deliver, shown: str, tally: Tally) -> None:
        self.consumer, self.deliver, self.shown, self.tally = consumer, deliver, shown, tally
        self.assigned: frozenset[int] = frozenset()
        self._lock = threading.Lock()
        self._streams: dict[TopicPartition, Stream] = {}  # each partition's offsets in the consumer's ledger
        self._committed: dict[TopicPartition, int] = {}
        #: the next offset of each partition this consumer has not had yet, kept across rebalances (the
        #: consumer thread's): a record below it is one the group delivers to it again
        self._unseen: dict[TopicPartition, int] = {}
        #: the next offset of each partition not read under its current stream (under `_lock`): where reading
        #: starts again after an interruption (`read_to`); gone with the stream
        self._read_to: dict[TopicPartition, int] = {}

    def record(self, tp: TopicPartition, offset: int, result: Delivered) -> None:
        """The consumer thread delivered the record at `offset` of `tp` (`result`): its ledger stream
        follows it; a record this consumer had before (re-read after a rebalance) counts as a redelivery."""
        stream = self._stream(tp, offset)
        if result == Delivered(result.message_id, True, admitted=True):  # (the commonest: in the fewest steps)
            stream.record_admitted(offset, result.message_id)
        else:
            stream.record(offset, result)

    def record_admitted(self, tp: TopicPartition, offset: int, message_id: MessageId | None) -> None:
        """`record` of a whole plain tensor the intake's C delivery took (`Stream.record_admitted`): the
        commonest record, without a `Delivered` made for it."""
        self._stream(tp, offset).record_admitted(offset, message_id)

    def record_admitted_run(self, tp: TopicPartition, first: int, message_ids: list[MessageId | None]) -> None:
        """`record_admitted` of the records at `first`, `first + 1`, ... of `tp` in one step (the ledger's
        `Stream.record_admitted_run`): a run the C delivery took one after the other."""
        self._stream(tp, first, len(message_ids)).record_admitted_run(first, message_ids)

    def _stream(self, tp: TopicPartition, offset: int, count: int = 1) -> Stream:
        """`tp`'s stream in the ledger, the `count` records from `offset` counted as redeliveries where this
        consumer had them."""
        unseen = self._unseen.get(tp, 0)
        if offset < unseen:
            self.tally.redeliveries += min(unseen - offset, count)
        if offset + count > unseen:
            if offset > unseen and tp in self._unseen:  # (another member's since a rebalance, compacted, or skipped)
                log.info("%s: partition %d read from offset %d on, %d to %d not read here", self.shown, tp.partition,
                         offset, unseen, offset - 1)  # fmt: skip
            elif offset > 0 and tp not in self._unseen:  # (the group's commit, or the log's start after retention)
                log.info("%s: partition %d first read at offset %d", self.shown, tp.partition, offset)
            self._unseen[tp] = offset + count
        with self._lock:
            stream = self._streams.get(tp)
            if stream is None:
                stream = self._streams[tp] = self.deliver.ledger.stream()
            if offset + count > self._read_to.get(tp, 0):
                self._read_to[tp] = offset + count
        return stream

    def read_to(self) -> dict[int, int]:
        """Per partition with a stream open, the first offset not read under it: where to read on after an
        interruption. Not `_unseen`: a partition given back after a rebalance may hold records before that
        untaken here under its closed stream; read again from the group's commit, the new stream books them
        as duplicates and holds its commits behind them, where a seek past them would let it commit past."""
        with self._lock:
            return {tp.partition: offset for tp, offset in self._read_to.items()}

    def committable(self) -> dict[TopicPartition, OffsetAndMetadata]:
        """Offsets safe to commit that differ from the last commit."""
        offsets = {}
        with self._lock:
            for tp, stream in self._streams.items():
                safe = stream.first_open()
                if self._committed.get(tp) != safe:
                    offsets[tp] = OffsetAndMetadata(safe, "", -1)
        return offsets

    def commit(self, timeout_s: float) -> None:
        """Commit what is safe, synchronously; a failure only means records may be read again."""
        offsets = self.committable()
        try:
            if offsets:
                with map_errors(self.shown):
                    self.consumer.commit(offsets, timeout_ms=int(timeout_s * 1000))
                self._committed_now(offsets)
        except TransportError as exc:  # e.g. a rebalance took the partitions: their new owner re-reads
            log.info("commit to %s failed (%s); records since the last commit may be read again", self.shown, exc)

    def _committed_now(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        with self._lock:
            self._committed.update((tp, meta.offset) for tp, meta in offsets.items())

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit the revoked partitions' progress before their new owner starts (awaited: heartbeats go on).

        Their streams stay open until the new assignment: kafka-python keeps the read position of a
        partition it is given back, so the records it does not read again stay booked here (a stream
        closed now would start over at that position, and its commits would pass untaken records)."""
        offsets = self.committable()
        try:
            if offsets:
                await self.consumer.commit_async(offsets)
                self._committed_now(offsets)
        except Exception as exc:  # the new owner re-reads from the last commit: duplicates, dropped above
            log.warning("%s: commit before giving up partitions failed: %r", self.shown, exc)
        self.assigned -= {tp.partition for tp in revoked}

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """The whole new assignment: forget the partitions not in it (kafka-python dropped their positions; one
        given back later is read again from the group's commit), and state every kept one's offset again at
        the next commit (another member may have committed it meanwhile)."""
        owned = set(self.consumer.assignment())
        with self._lock:
            gone = set(self._streams) - owned
            self._committed.clear()
        self._forget(gone)
        self.assigned = frozenset(tp.partition for tp in owned)

    async def on_partitions_lost(self, lost: set[TopicPartition]) -> None:
        self._forget(lost)

    def _forget(self, lost: set[TopicPartition]) -> None:
        """The partitions are no longer this consumer's: close their streams in the ledger, forget their commits."""
        with self._lock:
            for tp in lost:
                stream = self._streams.pop(tp, None)
                if stream is not None:
                    stream.close()
                self._committed.pop(tp, None)
                self._read_to.pop(tp, None)
        self.assigned -= {tp.partition for tp in lost}
