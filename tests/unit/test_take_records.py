"""`FastDelivery.take_records`: the intake's C delivery over a run of broker records (kafka:// on librdkafka).

It must take exactly what `take` would, record by record (kafka_offsets.take_record's way: the record's bytes
copied to a 64-byte aligned buffer), and stop, changing nothing more, at the first record that is not part of
the run or that `take` leaves to Python: that record stays first in the deque, for the Python way.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from confluent_kafka import KafkaError, Message

import tensorbus as tb
from tensorbus.codec import encode, encode_chunks
from tensorbus.intake_state import FAST
from tensorbus.transports.kafka_offsets import take_record

from ..conftest import consumer_twins, require_native
from .test_fast_delivery import state

require_native(FAST is not None, "the intake's C delivery (tensorbus/_intake.c)")


def value_of(seq: int, key: str = "k", tensor: Any = None) -> bytes:
    """A record's value: one whole plain frame."""
    tensor = np.full(8, seq, np.float32) if tensor is None else tensor
    return b"".join(bytes(memoryview(p).cast("B")) for p in encode(tensor, key=key, message_id=("p" * 16, seq)))


def records(values: list[bytes], partition: int = 0, first: int = 0) -> collections.deque[Message]:
    """Records as librdkafka hands them over, at offsets `first`, `first + 1`, ..."""
    return collections.deque(
        Message(topic="t", partition=partition, offset=first + i, value=v) for i, v in enumerate(values)
    )


@pytest.fixture
def twins() -> Iterator[tuple[tb.Consumer, tb.Consumer]]:
    """Two consumers alike: one takes runs of records, the other record by record (`take_record`)."""
    with consumer_twins("runs", dedup_window=16) as made:
        yield made


def one_by_one(consumer: tb.Consumer, values: list[bytes]) -> list[Any]:
    """What `take_record` takes of `values`, in order, until the first it leaves to Python: the ids."""
    ids = []
    for value in values:
        taken, _ = take_record(consumer.intake.fast, value)
        if taken is None:
            break
        ids.append(taken.message_id)
    return ids


def test_a_run_of_plain_records_is_taken_as_take_record_takes_them_one_by_one(twins: Any) -> None:
    runs, single = twins
    values = [value_of(seq) for seq in range(1, 6)]
    backlog = records(values, partition=3, first=40)
    ids = runs.intake.take_records(backlog, 3, 40)
    assert ids == one_by_one(single, values) == [("p" * 16, seq) for seq in range(1, 6)]
    assert not backlog and state(runs) == state(single)
    received = [runs.recv("k", timeout=0) for _ in range(5)]
    assert [float(tensor[0]) for tensor in received] == [1, 2, 3, 4, 5]
    assert all(tensor.ctypes.data % 64 == 0 for tensor in received)  # (copied to aligned buffers, as take_record does)


@pytest.mark.parametrize(
    "stop",
    ["chunk", "offset gap", "other partition", "error", "empty", "duplicate", "full table"],
)
def test_the_run_stops_at_the_first_record_it_cannot_take_which_stays_first(twins: Any, stop: str) -> None:
    runs, single = twins
    values = [value_of(seq) for seq in range(1, 4)]
    backlog = records(values)
    odd = backlog[1]
    if stop == "chunk":
        chunk = next(
            iter(encode_chunks(np.zeros(4096, np.float32), key="k", max_chunk_bytes=8192, message_id=("q" * 16, 1)))
        )
        odd = Message(topic="t", partition=0, offset=1, value=b"".join(bytes(memoryview(p).cast("B")) for p in chunk))
    elif stop == "offset gap":
        odd = Message(topic="t", partition=0, offset=2, value=values[1])
    elif stop == "other partition":
        odd = Message(topic="t", partition=1, offset=1, value=values[1])
    elif stop == "error":
        odd = Message(topic="t", partition=0, offset=1, error=KafkaError(KafkaError._PARTITION_EOF))
    elif stop == "empty":
        odd = Message(topic="t", partition=0, offset=1, value=b"")
    elif stop == "duplicate":
        odd = Message(topic="t", partition=0, offset=1, value=values[0])
    elif stop == "full table":
        runs.table.max_buffered_bytes = single.table.max_buffered_bytes = 1  # (the first record fits an empty table)
    backlog[1] = odd
    ids = runs.intake.take_records(backlog, 0, 0)
    assert ids == [("p" * 16, 1)]
    assert list(backlog) == [odd, backlog[1]] and backlog[0] is odd and len(backlog) == 2  # (left for Python)
    assert one_by_one(single, values[:1]) == ids and state(runs) == state(single)


def test_nothing_taken_is_an_empty_list_and_leaves_every_record(twins: Any) -> None:
    runs, _ = twins
    backlog = records([value_of(1, key="a;b;c;d;e")])  # (a key that may name an incarnation: fencing is Python's)
    first = backlog[0]
    assert runs.intake.take_records(backlog, 0, 0) == [] and list(backlog) == [first]
    assert runs.intake.fast_delivery.taken == 0 and runs.table.buffered_bytes == 0
