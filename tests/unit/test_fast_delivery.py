"""The C delivery of plain frames (`_intake.FastDelivery`) against the Python delivery it stands in for.

A frame the C delivery takes must leave the consumer exactly as `Intake.__call__` leaves it (the table,
the ids seen, the counts, the receiver served); a frame it does not take must change nothing, so
that the Python delivery then decides. Checked case by case, on twin consumers.
"""

from __future__ import annotations

import collections
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec import encode, encode_chunks
from tensorbus.intake_state import FAST, Handoff, PyIntakeState, PyTableState

from ..conftest import consumer_twins, require_native, require_torch
from ..waiting import held_elsewhere

require_native(FAST is not None, "the intake's C delivery (tensorbus/_intake.c)")


def frame_of(tensor: Any, key: str | None = "k", seq: int | None = 1, **options: Any) -> memoryview:
    """One received frame (a buffer of its own, as a transport hands it over)."""
    message_id = None if seq is None else ("p" * 16, seq)
    parts = encode(tensor, key=key, message_id=message_id, **options)
    return memoryview(bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts)))


def state(consumer: tb.Consumer) -> tuple[Any, ...]:
    """Everything a delivery may change, comparable."""
    table = consumer.table
    arrivals = [
        (n, m.key, m.tensor.tolist(), m.tensor.dtype.str, m.metadata, m.message_id, m.kind, m.header_bytes, size, src)
        for n, (m, size, src) in table._arrivals.items()
    ]
    by_key = {key: list(numbers) for key, numbers in table._by_key.items()}
    waiting = {str(key): len(queue) for key, queue in table._waiters.items()}
    return (
        arrivals,
        by_key,
        waiting,
        table.buffered_bytes,
        dict(table._by_source),
        table._counter,
        dict(table.stats),
        dict(consumer.stats),
        list(consumer.intake.state.seen),
    )


@pytest.fixture
def twins() -> Iterator[tuple[tb.Consumer, tb.Consumer]]:
    """Two consumers alike: one delivers through its C delivery, the other the Python way."""
    with consumer_twins("fast", dedup_window=3) as made:
        yield made


def test_plain_frames_are_buffered_as_the_python_delivery_buffers_them(twins: Any) -> None:
    c_side, python_side = twins
    frames = [
        (np.arange(12, dtype=np.float32).reshape(3, 4), "a", 1, {"step": 3, "name": "w"}),
        (np.arange(5, dtype=np.int64), "b", 2, None),
        (np.ones((2, 2), dtype=">f8"), "a", 3, {}),
        (np.zeros(0, dtype=np.uint8), None, 4, None),
    ]
    for tensor, key, seq, metadata in frames:
        taken = c_side.intake.fast(frame_of(tensor, key, seq, metadata=metadata), None)
        python_side.intake(frame_of(tensor, key, seq, metadata=metadata), None, may_hold=True)
        assert isinstance(taken, tb.Message) and taken.key == key and taken.message_id == ("p" * 16, seq)
        assert state(c_side) == state(python_side)
    assert c_side.intake.fast_delivery.taken == 4
    assert len(c_side.intake.state.seen) == 3  # the dedup window (3) keeps the newest ids
    assert c_side.recv_message("a").metadata == {"step": 3, "name": "w"}
    assert np.array_equal(c_side.recv("a"), np.ones((2, 2)))
    assert c_side.next_message().key == "b"


def test_a_waiting_receiver_gets_the_frame_and_nothing_is_buffered(twins: Any) -> None:
    got: dict[str, Any] = {}
    for name, consumer in zip(("c", "python"), twins, strict=True):
        receiver = threading.Thread(target=lambda c=consumer, n=name: got.setdefault(n, c.recv("k", timeout=10)))
        receiver.start()
        while "k" not in consumer.table.awaited_keys():
            threading.Event().wait(0.001)
        frame = frame_of(np.arange(7), "k", 1)
        if name == "c":
            assert consumer.intake.fast(frame, None) is not None
        else:
            consumer.intake(frame, None, may_hold=True)
        receiver.join(10)
    assert got["c"].tolist() == got["python"].tolist() == list(range(7))
    assert state(twins[0]) == state(twins[1])
    assert twins[0].table.buffered_bytes == 0 and twins[0].stats["received"] == 1


def test_an_arrival_order_receiver_gets_a_frame_of_any_key(twins: Any) -> None:
    c_side = twins[0]
    got: list[tb.Message] = []
    receiver = threading.Thread(target=lambda: got.append(c_side.next_message(timeout=10)))
    receiver.start()
    while not c_side.table.awaited_keys():
        threading.Event().wait(0.001)
    assert c_side.intake.fast(frame_of(np.arange(2), "z", 1), None) is not None
    receiver.join(10)
    assert got[0].key == "z" and not c_side.table.awaited_keys()


def _unchanged(consumer: tb.Consumer, frame: memoryview) -> None:
    before = state(consumer)
    assert consumer.intake.fast(frame, None) is None
    assert state(consumer) == before


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: frame_of(np.arange(3), "a;1;b;c;0:0"), id="a key naming an incarnation (fencing)"),
        pytest.param(lambda: frame_of(np.arange(3), "k", None), id="no message id"),
        pytest.param(lambda: frame_of({"w": np.arange(3)}), id="a bundle"),
        pytest.param(lambda: frame_of(np.arange(3), metadata={"nested": {"x": 1}}), id="nested metadata"),
        pytest.param(lambda: frame_of(np.zeros(1000), compression="lz4"), id="compressed"),
        pytest.param(lambda: frame_of(np.arange(3), signing_key=b"s"), id="signed"),
        pytest.param(
            lambda: memoryview(
                bytearray(
                    b"".join(
                        bytes(memoryview(p).cast("B"))
                        for p in encode_chunks(np.zeros(4096), max_chunk_bytes=4096, message_id=("p" * 16, 9))[0]
                    )
                )
            ),
            id="a chunk",
        ),
    ],
)
def test_frames_of_other_kinds_are_left_to_python(twins: Any, make: Any) -> None:
    _unchanged(twins[0], make())


def test_a_damaged_frame_is_left_to_python_which_rejects_it(twins: Any) -> None:
    consumer = twins[0]
    frame = frame_of(np.arange(100, dtype=np.int32))
    frame[-1] ^= 0xFF
    _unchanged(consumer, frame)
    consumer.intake(frame, None, may_hold=True)
    assert consumer.stats["rejected"] == 1


def test_a_duplicate_is_left_to_python_which_counts_it(twins: Any) -> None:
    consumer = twins[0]
    assert consumer.intake.fast(frame_of(np.arange(3), "k", 5), None) is not None
    _unchanged(consumer, frame_of(np.arange(3), "k", 5))
    consumer.intake(frame_of(np.arange(3), "k", 5), None, may_hold=True)
    assert consumer.stats["duplicates"] == 1 and len(consumer.table) == 1


def test_an_aborted_table_or_an_interrupted_delivery_is_left_to_python(twins: Any) -> None:
    consumer = twins[0]
    consumer.intake.state.interrupted = (memoryview(b""), None)  # type: ignore[assignment]
    _unchanged(consumer, frame_of(np.arange(3)))
    consumer.intake.state.interrupted = None
    consumer.table.abort("stop")
    _unchanged(consumer, frame_of(np.arange(3)))


def test_a_full_table_is_left_to_python_unless_a_receiver_waits_for_the_key() -> None:
    with tb.Consumer(f"memory://fast-{uuid.uuid4().hex}", max_buffered_bytes=1000) as consumer:
        assert consumer.intake.fast(frame_of(np.zeros(200), "k", 1), None) is not None  # (1600 bytes: full now)
        _unchanged(consumer, frame_of(np.zeros(2), "k", 2))
        receiver = threading.Thread(target=lambda: consumer.recv("other", timeout=10))
        receiver.start()
        while "other" not in consumer.table.awaited_keys():
            threading.Event().wait(0.001)
        assert consumer.intake.fast(frame_of(np.zeros(2), "other", 3), None) is not None  # handed over: needs no room
        receiver.join(10)
        assert len(consumer.table) == 1


def test_a_producer_at_its_share_is_left_to_python_the_others_are_taken() -> None:
    with tb.Consumer(f"memory://fast-{uuid.uuid4().hex}", max_buffered_bytes_per_producer=1000) as consumer:
        fast = consumer.intake.fast
        assert fast is not None
        assert fast(frame_of(np.zeros(200), "k", 1), None, 7) is not None  # (1600 bytes: source 7 at its share)
        assert consumer.table._by_source == {7: consumer.table.buffered_bytes}
        before = state(consumer)
        assert fast(frame_of(np.zeros(2), "k", 2), None, 7) is None
        assert state(consumer) == before
        assert fast(frame_of(np.zeros(2), "k", 3), None, 8) is not None  # another source has room
        assert fast(frame_of(np.zeros(2), "k", 4), None) is not None  # and so has no source
        assert consumer.table._by_source[8] < 1000 and len(consumer.table) == 3
        consumer.recv("k")
        assert set(consumer.table._by_source) == {8}  # taken: source 7 has room again
        assert fast(frame_of(np.zeros(2), "k", 2), None, 7) is not None


def test_a_callback_first_in_line_is_left_to_python(twins: Any) -> None:
    consumer = twins[0]
    calls: list[Any] = []
    consumer.recv_async("k", lambda message, error: calls.append(message))
    _unchanged(consumer, frame_of(np.arange(3)))
    assert not calls


class _OwnHandoff(Handoff):
    """A Handoff that is its own callback, as tensorbus.aio's receive is (aio/handoff.py)."""

    def __call__(self, message: Any, error: Any) -> None:
        self.callback(message, error)


@pytest.mark.parametrize("kind", [Handoff, _OwnHandoff], ids=["Handoff", "a subclass"])
def test_a_handoff_first_in_line_gets_the_frame_as_the_python_delivery_hands_it(twins: Any, kind: type) -> None:
    """An awaited receive's callback (`Handoff`, or a subclass: tensorbus.aio's) is served in C too, the Handoff
    called once the locks are let go (`Rendezvous._complete`), the message not yet handed out: as the Python
    way does."""
    got: dict[str, list[Any]] = {"c": [], "python": []}
    for name, consumer in zip(("c", "python"), twins, strict=True):
        consumer.table.wait_async(
            "k", kind(lambda m, e, calls=got[name], t=consumer.table: calls.append((m, e, t._lock._is_owned())))
        )
        frame = frame_of(np.arange(5), "k", 1)
        if name == "c":
            assert consumer.intake.fast(frame, None) is not None
        else:
            consumer.intake(frame, None, may_hold=True)
    assert twins[0].intake.fast_delivery.taken == 1
    (c_message, c_error, c_locked), (py_message, py_error, _) = got["c"][0], got["python"][0]
    assert len(got["c"]) == len(got["python"]) == 1 and c_error is py_error is None and not c_locked
    assert c_message.key == py_message.key == "k" and c_message.tensor.tolist() == py_message.tensor.tolist()
    assert state(twins[0]) == state(twins[1])  # (nothing buffered, no waiter left, the id seen, not yet taken)


@pytest.mark.parametrize("which", ["consumer", "table"])
def test_a_lock_held_by_another_thread_leaves_the_frame_to_python(twins: Any, which: str) -> None:
    consumer = twins[0]
    lock = consumer.intake._lock if which == "consumer" else consumer.table._lock
    with held_elsewhere(lock):
        _unchanged(consumer, frame_of(np.arange(3)))
    assert consumer.intake.fast(frame_of(np.arange(3)), None) is not None  # and once it is free, it is taken


def test_consumers_the_c_delivery_cannot_serve_have_none() -> None:
    for options in ({"signing_key": b"s"}, {"like": "torch"}):
        if options.get("like") == "torch":
            require_torch()
        with tb.Consumer(f"memory://fast-{uuid.uuid4().hex}", **options) as consumer:
            assert consumer.intake.fast is None


class _FailingAdd(int):
    """An int whose `+` raises MemoryError, once: an allocation failing inside the C delivery."""

    failed = False

    def __add__(self, other: object) -> int:
        if not type(self).failed:
            type(self).failed = True
            raise MemoryError("injected")
        return int(self) + int(other)  # type: ignore[call-overload]


def _locks_free(consumer: tb.Consumer) -> bool:
    free = [lock.acquire(blocking=False) for lock in (consumer.intake._lock, consumer.table._lock)]
    for lock, got in zip((consumer.intake._lock, consumer.table._lock), free, strict=True):
        if got:
            lock.release()
    return all(free)


def test_a_memory_error_before_anything_changed_comes_out_as_such_and_changes_nothing(twins: Any) -> None:
    consumer = twins[0]
    consumer.table._counter = type("FailingCounter", (_FailingAdd,), {})(0)
    before = state(consumer)
    with pytest.raises(MemoryError, match="injected"):  # (not a SystemError from releasing the locks)
        consumer.intake.fast(frame_of(np.arange(3)), None)
    assert state(consumer) == before and _locks_free(consumer)
    assert consumer.intake.fast(frame_of(np.arange(3)), None) is not None  # the frame sent again is taken


class _FailingDeque(collections.deque):  # type: ignore[type-arg]
    """A key's queue of arrival numbers whose `append` raises MemoryError, once: a write failing half way."""

    failed = False

    def append(self, number: Any) -> None:
        if not _FailingDeque.failed:
            _FailingDeque.failed = True
            raise MemoryError("injected")
        super().append(number)


def test_a_memory_error_half_way_undoes_what_was_written_and_forgets_the_id(twins: Any) -> None:
    consumer = twins[0]
    assert consumer.intake.fast(frame_of(np.arange(3), "k", 6), None) is not None
    consumer.table._by_key["k"] = _FailingDeque(consumer.table._by_key["k"])
    before = state(consumer)
    with pytest.raises(MemoryError, match="injected"):  # after the id was marked and the arrival placed
        consumer.intake.fast(frame_of(np.arange(4), "k", 7), None)
    assert state(consumer) == before and ("p" * 16, 7) not in consumer.intake._seen and _locks_free(consumer)
    assert consumer.intake.fast(frame_of(np.arange(4), "k", 7), None) is not None  # sent again: not a duplicate
    assert [consumer.recv("k").tolist() for _ in range(2)] == [[0, 1, 2], [0, 1, 2, 3]] and len(consumer.table) == 0


def test_while_a_chunked_message_is_part_way_frames_are_left_to_python(twins: Any) -> None:
    consumer = twins[0]
    first = encode_chunks(np.zeros(4096), max_chunk_bytes=4096, message_id=("p" * 16, 9))[0]
    consumer.intake(memoryview(bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in first))), None)
    assert consumer.intake.reassembler.is_pending(("p" * 16, 9))
    _unchanged(consumer, frame_of(np.arange(3), "k", 10))  # (Python's delivery expires stale chunked ones first)


def test_the_c_state_types_have_the_fields_of_their_python_twins() -> None:
    assert FAST is not None
    for c_type, twin in ((FAST.TableState, PyTableState), (FAST.IntakeState, PyIntakeState)):
        members = {name for name, value in vars(c_type).items() if type(value).__name__ == "member_descriptor"}
        assert members == set(twin.__slots__)


@pytest.mark.parametrize("key", ["k", "a;b", "a;1;b", "a;1;b;c", "a;1;b;c;0:0", "x;y;z;w;v", "a;1;b;c;0:0;x", ";;;;"])
def test_the_c_delivery_leaves_to_python_exactly_the_keys_the_table_fences(twins: Any, key: str) -> None:
    from tensorbus.keys import may_name_incarnation

    taken = twins[0].intake.fast(frame_of(np.arange(3), key), None)
    assert (taken is None) == may_name_incarnation(key)


def test_the_c_delivery_evicts_ids_past_the_window_as_seen_ids_does(twins: Any) -> None:
    c_side, python_side = twins  # (dedup_window=3)
    for seq in range(1, 11):
        assert c_side.intake.fast(frame_of(np.arange(2), "k", seq), None) is not None
        python_side.intake(frame_of(np.arange(2), "k", seq), None, may_hold=True)
        assert list(c_side.intake.state.seen) == list(python_side.intake.state.seen)
    assert list(c_side.intake.state.seen) == [("p" * 16, seq) for seq in (8, 9, 10)]
