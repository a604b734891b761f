"""Records a Kafka client reported delivered that may never have been written, kept to be produced again (kafka://,
both clients).

An idempotent producer's records reach a partition in the order it produced them, each at an offset past the one
before. Both clients report a record delivered when the broker answers DUPLICATE_SEQUENCE_NUMBER (taken for the
retry of a write that succeeded), with no offset (confluent-kafka gives None, kafka-python -1); and the broker
answers a batch whose sequence numbers repeat a recent one's with that batch's offsets: it happens when the client
forgets a partition's sequence (librdkafka #3712: a restarting broker lists the topic as gone), and the records
are then dropped as duplicates, reported delivered. Either way each such record is produced again; if it was
written after all, the consumer drops the copy (the same message id). librdkafka's delivery report hands the
record's bytes back, so nothing is kept for it meanwhile; kafka-python's does not, so its transport keeps each
record's value until the record is acknowledged (kafka-python copies it into its own batch: at most
`max_pending_bytes` more held).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("tensorbus.transports.kafka")  # (the Kafka transport's, either client's)

#: a record to produce again: its value, key and partition
Resend = tuple[bytes, bytes | None, int]


class Resends:
    """One producer's check of its acknowledgements (`written`) and the records due again (`take`).

    Its fields are guarded by the transport's `_pending_lock` (the thread that learns of an acknowledgement)."""

    def __init__(self, lock: Any, shown: str) -> None:
        self._lock, self._shown = lock, shown
        self._last: dict[int, int] = {}  # partition -> the last offset acknowledged there
        self.due: list[Resend] = []  # to be produced again

    def written(self, partition: int, offset: int | None, ordered: bool = True) -> bool:
        """Whether an acknowledged record got an offset of its own, past the last one's in its partition (`ordered`:
        not for a replaced producer's, whose reports come after the current one's); if not (no offset at all, as
        confluent-kafka gives librdkafka's invalid one: None, even for a partition's first record), a warning says
        so, and the caller `keep`s it; kafka-python's -1 is no offset too. The caller holds the lock."""
        last = self._last.get(partition, -1)
        if offset is not None and offset < 0:
            offset = None
        if offset is not None and (offset > last or not ordered):
            if ordered:
                self._last[partition] = offset
            return True
        how = "with no offset" if offset is None else f"at offset {offset}, not after {last}, the last there"
        log.warning(
            "%s: a record was reported delivered to partition %d %s: it may have been dropped as a duplicate; "
            "producing it again", self._shown, partition, how
        )  # fmt: skip
        return False

    def keep(self, value: bytes, key: bytes | None, partition: int) -> None:
        """A record not `written`, to produce again (the caller holds the lock)."""
        self.due.append((value, key, partition))

    def take(self) -> list[Resend]:
        """The records to produce again now (none left due)."""
        with self._lock:
            due, self.due = self.due, []
        return due
