"""`Offsets`, what a Kafka consumer (either client) books of the records it delivers: its partitions' reading."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tensorbus.ledger import Ledger
from tensorbus.transports.kafka_offsets import Offsets
from tensorbus.transports.kafka_python import TopicPartition
from tensorbus.transports.tally import Tally


def test_a_partition_read_on_past_offsets_it_never_had_is_logged_and_one_read_again_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tally = Tally()
    offsets = Offsets(None, SimpleNamespace(ledger=Ledger()), "kafka://here/t", tally)  # type: ignore[arg-type]
    tp = TopicPartition("t", 0)
    with caplog.at_level(logging.INFO, "tensorbus.transports.kafka_offsets"):
        offsets.record_admitted_run(tp, 0, [("p", 0), ("p", 1), ("p", 2)])
        assert not caplog.records  # (the first records of a partition start where they start)
        offsets.record_admitted(tp, 5, ("p", 5))
        assert [r.getMessage() for r in caplog.records] == [
            "kafka://here/t: partition 0 read from offset 5 on, 3 to 4 not read here"
        ]
        caplog.clear()
        offsets.record_admitted_run(tp, 1, [("p", 1), ("p", 2)])  # read again (a rewind, a rebalance)
        assert not caplog.records and tally.redeliveries == 2
        offsets.record_admitted(TopicPartition("t", 1), 7, ("p", 9))  # a partition first read past its offset 0
        assert [r.getMessage() for r in caplog.records] == ["kafka://here/t: partition 1 first read at offset 7"]
    assert offsets.read_to() == {0: 6, 1: 8}


def test_a_partition_given_back_is_read_on_from_its_new_streams_records_not_from_what_it_had_before() -> None:
    """After a partition was revoked and given back, an interrupted read must not seek past records the consumer
    had under its closed stream (they may be untaken here): read them again, booked by the new stream."""
    offsets = Offsets(None, SimpleNamespace(ledger=Ledger()), "kafka://here/t", Tally())  # type: ignore[arg-type]
    tp = TopicPartition("t", 0)
    offsets.record_admitted_run(tp, 10, [("p", n) for n in range(10, 21)])
    assert offsets.read_to() == {0: 21}
    offsets._forget({tp})  # (revoked: its stream closed)
    assert offsets.read_to() == {}  # (read again from the group's commit)
    offsets.record_admitted_run(tp, 10, [("p", 10), ("p", 11)])  # given back, read again from the commit (10)
    assert offsets.read_to() == {0: 12}
