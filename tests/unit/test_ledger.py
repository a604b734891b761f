"""The acknowledgement ledger (tensorbus/ledger.py): which received frames a transport may acknowledge.

Rule by rule on a bare ledger, then through real consumers: what the intake reports, the C delivery
against the Python one, and memory:// handing untaken tensors to the next consumer.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec import encode, encode_chunks
from tensorbus.intake_state import FAST
from tensorbus.ledger import EARLY_TAKES, Ledger, Stream
from tensorbus.rendezvous import Handoff
from tensorbus.transports.base import Delivered, Held
from tests.waiting import wait_for

A, B, C = ("p", 1), ("p", 2), ("p", 3)
ADMITTED = {"done": True, "admitted": True}


def recorded(ledger: Ledger) -> tuple[Stream, list[Any]]:
    """A stream of `ledger`, and the list its released positions are appended to."""
    released: list[Any] = []
    return ledger.stream(released.extend), released


def test_a_tensor_in_the_table_is_released_once_taken_not_on_arrival() -> None:
    ledger = Ledger()
    stream, released = recorded(ledger)
    assert not stream.record(0, Delivered(A, **ADMITTED))
    assert stream.first_unreceived() == 1  # received: the producer's credit and flush
    assert stream.first_open() == 0 and released == []  # not taken: not acknowledged
    ledger.taken(A)
    assert released == [0] and stream.first_open() == 1


def test_with_ack_arrival_a_tensor_is_released_as_it_reaches_the_table() -> None:
    ledger = Ledger("arrival")
    stream, released = recorded(ledger)
    assert stream.record(0, Delivered(A, **ADMITTED))
    assert released == [0] and stream.first_open() == 1


def test_an_unknown_mode_is_a_config_error() -> None:
    with pytest.raises(tb.ConfigError, match="ack must be one of take, arrival"):
        Ledger("later")  # type: ignore[arg-type]
    with pytest.raises(tb.ConfigError, match="ack must be one of"):
        tb.Consumer(f"memory://{uuid.uuid4().hex}", ack="manually")


def test_a_chunked_tensors_frames_are_released_together_when_it_is_taken() -> None:
    ledger = Ledger()
    stream, released = recorded(ledger)
    stream.record(0, Delivered(A, False))  # chunk 0
    stream.record(1, Delivered(B, **ADMITTED))  # a whole tensor between the chunks
    stream.record(2, Delivered(A, False))  # chunk 1
    assert stream.first_unreceived() == 0  # its chunks are not received as a tensor yet
    stream.record(3, Delivered(A, **ADMITTED))  # the last chunk completes it
    assert stream.first_unreceived() == 4
    ledger.taken(B)
    assert released == [1] and stream.first_open() == 0  # cumulative: held at A's first chunk
    ledger.taken(A)
    assert sorted(released) == [0, 1, 2, 3] and stream.first_open() == 4


def test_a_copy_of_a_tensor_still_untaken_is_released_with_it_and_does_not_release_it() -> None:
    ledger = Ledger()
    first, released_first = recorded(ledger)
    second, released_second = recorded(ledger)
    first.record(0, Delivered(A, **ADMITTED))
    assert not second.record(0, Delivered(A, True))  # the resent copy, dropped as a duplicate
    assert released_second == [] and released_first == []  # both wait for the original to be taken
    assert second.first_unreceived() == 1 and second.first_open() == 0
    ledger.taken(A)
    assert released_first == [0] and released_second == [0]
    assert second.record(1, Delivered(A, True))  # a copy once it was taken: released on its own
    assert released_second == [0, 1]


def test_a_chunked_copy_of_a_tensor_released_already_is_released_whole_as_a_duplicate() -> None:
    """The reassembler forgets finished ids sooner than the intake's dedup window: a chunked copy of a tensor taken
    long ago is rebuilt, its chunks open it here again, and the intake calls the whole a duplicate: all of it goes."""
    ledger = Ledger()
    stream, released = recorded(ledger)
    stream.record(0, Delivered(A, **ADMITTED))
    ledger.taken(A)
    assert released == [0]
    stream.record(1, Delivered(A, False))  # the copy's first chunk: pending
    stream.record(2, Delivered(A, False))
    assert released == [0] and stream.first_open() == 1
    stream.record(3, Delivered(A, True, duplicate=True))  # its last chunk: the whole is a duplicate
    assert sorted(released) == [0, 1, 2, 3] and stream.first_open() == 4 and stream.first_unreceived() == 4


def test_a_copys_chunks_of_a_tensor_held_back_wait_for_it_and_do_not_release_it() -> None:
    """A chunked tensor held back for room (not admitted), and its chunks sent again on a new connection: the
    reassembler calls them done, and they wait with the original, which nothing has taken yet."""
    ledger = Ledger()
    first, released_first = recorded(ledger)
    second, released_second = recorded(ledger)
    first.record(0, Delivered(A, False))
    first.record(1, Delivered(A, False))
    first.record(2, Delivered(A, False, held=Held(None, None, "k", A)))  # complete, held back
    second.record(0, Delivered(A, True))  # the resent chunks: done (the reassembler finished A)
    second.record(1, Delivered(A, True))
    assert released_first == [] and released_second == []
    ledger.apply(Delivered(A, True, admitted=True))  # the table took it in
    ledger.taken(A)
    assert sorted(released_first) == [0, 1, 2] and sorted(released_second) == [0, 1]


def test_refused_frames_are_released_with_every_chunk_of_their_tensor() -> None:
    ledger = Ledger()
    stream, released = recorded(ledger)
    stream.record(0, Delivered(A, False))
    stream.record(1, Delivered(A, True, refused="stale incarnation"))  # refused once whole
    stream.record(2, Delivered(None, True, refused="bad checksum"))  # a frame that named nothing
    assert sorted(released) == [0, 1, 2] and stream.first_open() == 3


def test_a_tensor_given_up_or_dropped_unclaimed_is_released() -> None:
    ledger = Ledger()
    stream, released = recorded(ledger)
    stream.record(0, Delivered(A, False))
    stream.record(1, Delivered(B, **ADMITTED))
    ledger.dropped(A)  # its chunks stopped coming (the reassembler gave up)
    assert released == [0]
    stream.record(2, Delivered(A, True))  # a late chunk of it: dropped, released on its own
    assert released == [0, 2]
    ledger.dropped(B)  # unclaimed_timeout_s
    assert released == [0, 2, 1] and stream.first_open() == 3


def test_frames_turned_away_are_never_released_and_hold_the_cumulative_count() -> None:
    ledger = Ledger("arrival")  # (even on arrival)
    stream, released = recorded(ledger)
    stream.record(0, Delivered(A, **ADMITTED))
    stream.record(1, Delivered(B, False, turned_away=True))
    stream.record(2, Delivered(C, False, turned_away=True))
    assert released == [0] and stream.first_open() == 1 and stream.first_unreceived() == 1
    assert stream.unreleased() == [1, 2]


def test_a_tensor_taken_before_its_frame_is_recorded_is_released_at_the_record() -> None:
    # the C delivery hands a tensor to a waiting recv, which may return before the reader records the frame
    ledger = Ledger()
    stream, released = recorded(ledger)
    ledger.taken(A)
    assert stream.record(0, Delivered(A, **ADMITTED)) and released == [0]
    stream.record(1, Delivered(A, True))  # a copy of it later: on its own, not taken twice
    assert released == [0, 1]
    for sequence in range(EARLY_TAKES + 10):  # ids taken and never recorded are forgotten, oldest first
        ledger.taken(("q", sequence))
    assert len(ledger._early) == EARLY_TAKES


def test_a_held_tensor_is_received_only_once_the_table_takes_it() -> None:
    ledger = Ledger()
    stream, released = recorded(ledger)
    held = Held(b"frame", None, "k", A)
    stream.record(0, Delivered(A, False, held=held))
    stream.record(1, Delivered(B, **ADMITTED))
    assert stream.first_unreceived() == 0
    ledger.apply(Delivered(A, **ADMITTED))  # room opened: the table took it
    assert stream.first_unreceived() == 2 and released == []
    ledger.taken(A)
    ledger.taken(B)
    assert sorted(released) == [0, 1]


def test_a_closed_stream_releases_nothing_more_and_says_what_it_left() -> None:
    ledger = Ledger()
    stream, released = recorded(ledger)
    stream.record(5, Delivered(A, **ADMITTED))
    stream.record(6, Delivered(B, **ADMITTED))
    ledger.taken(A)
    assert stream.close() == [6]
    ledger.taken(B)
    assert released == [5]  # (the connection is gone: its producer sends B again to the next consumer)


def test_what_a_transport_keeps_of_a_frame_goes_with_its_release_and_comes_back_at_close() -> None:
    ledger = Ledger()
    stream = ledger.stream()
    stream.record_admitted(0, A, kept="frame 0")  # (the short path and the general one keep alike)
    stream.record(1, Delivered(B, **ADMITTED), kept="frame 1")
    stream.record(2, Delivered(A, True), kept="copy of frame 0")  # a copy of A, untaken: kept with it
    stream.record_admitted(3, C, kept="frame 3")
    ledger.taken(B)
    ledger.taken(C)
    assert stream.close_kept() == [(0, "frame 0"), (2, "copy of frame 0")]
    assert stream.close_kept() == [] and stream.unreleased() == []


def test_positions_may_be_any_hashable_amqp_deliveries_for_one() -> None:
    ledger = Ledger()
    stream, released = recorded(ledger)
    deliveries = [(1, tag, "ctag-1") for tag in (1, 2, 3)]
    for delivery, message_id in zip(deliveries, (A, B, C), strict=True):
        stream.record(delivery, Delivered(message_id, **ADMITTED))
    ledger.taken(C)
    ledger.taken(A)
    assert released == [deliveries[2], deliveries[0]]  # one by one, in the order taken


#: steps on one stream: ("admit", position, id) is the commonest frame (`record_admitted` on one side)
STEPS: list[tuple[Any, ...]] = [
    ("admit", 0, A),
    ("admit", 1, B),
    ("taken", B),
    ("copy", 2, A),  # a copy of A, untaken: waits with it
    ("taken", C),  # taken before its frame is recorded (the C delivery handed it to a waiting recv)
    ("admit", 3, C),
    ("admit", 4, ("p", 4)),
    ("dropped", ("p", 4)),
    ("admit", 5, ("p", 5)),
    ("acked", ("p", 5)),
    ("admit", 6, ("p", 6)),
    ("admit", 7, ("p", 6)),  # the same id admitted again (a resend after a reconnect)
    ("admit", 8, None),
    ("taken", A),
    ("taken", ("p", 6)),
    ("admit", 9, ("p", 9)),
    ("close",),
    ("taken", ("p", 9)),
    ("admit", 10, ("p", 10)),
]


def other_step(step: tuple[Any, ...], ledger: Ledger, stream: Any, released: list[Any]) -> None:
    """One of `STEPS` other than "admit": a copy recorded, the stream closed, or a call of the ledger's."""
    if step[0] == "copy":
        stream.record(step[1], Delivered(step[2], True))
    elif step[0] == "close":
        released.append(("closed", stream.close()))
    else:
        getattr(ledger, step[0])(step[1])


def booked(mode: str, lean: bool) -> tuple[Any, ...]:
    """`STEPS` through a ledger, the commonest frames booked by `record_admitted` if `lean`: what it released."""
    ledger = Ledger(mode)  # type: ignore[arg-type]
    stream, released = recorded(ledger)
    counts = []
    for step in STEPS:
        if step[0] == "admit" and lean:
            stream.record_admitted(step[1], step[2])
        elif step[0] == "admit":
            stream.record(step[1], Delivered(step[2], **ADMITTED))
        else:
            other_step(step, ledger, stream, released)
        counts.append((stream.first_open(), stream.first_unreceived(), list(released)))
    return counts, dict(ledger.stats), ledger.released_frames


@pytest.mark.parametrize("mode", ["take", "arrival", "manual"])
def test_record_admitted_books_a_frame_as_record_does(mode: str) -> None:
    lean, full = booked(mode, lean=True), booked(mode, lean=False)
    assert lean == full
    if mode == "take":  # (the steps do what they say: A with its copy once taken, C at its record)
        assert lean[0][-6][2] == [1, 3, 4, 5, 8, 0, 2]


def booked_in_runs(mode: str) -> tuple[Any, ...]:
    """`STEPS` through a ledger, each stretch of "admit" steps booked as one run (`record_admitted_run`):
    what it released after each other step, as `booked` says it."""
    ledger = Ledger(mode)  # type: ignore[arg-type]
    stream, released = recorded(ledger)
    counts, run = [], []
    for step in STEPS:
        if step[0] == "admit":
            if run and run[-1][0] + 1 != step[1]:
                raise AssertionError("STEPS' admits are consecutive positions")
            run.append((step[1], step[2]))
            counts.append(None)
            continue
        if run:
            stream.record_admitted_run(run[0][0], [message_id for _, message_id in run])
            run = []
        other_step(step, ledger, stream, released)
        counts.append((stream.first_open(), stream.first_unreceived(), list(released)))
    if run:
        stream.record_admitted_run(run[0][0], [message_id for _, message_id in run])
    counts.append((stream.first_open(), stream.first_unreceived(), list(released)))
    return counts, dict(ledger.stats), ledger.released_frames


@pytest.mark.parametrize("mode", ["take", "arrival", "manual"])
def test_a_run_of_admitted_frames_books_as_record_admitted_does_frame_by_frame(mode: str) -> None:
    counts, stats, released_frames = booked(mode, lean=True)
    in_runs, run_stats, run_released = booked_in_runs(mode)
    one_by_one = [count for count, run in zip(counts, in_runs, strict=False) if run is not None]
    assert [run for run in in_runs[: len(counts)] if run is not None] == one_by_one
    assert in_runs[-1] == counts[-1]  # (the last run, at 10, booked after the loop)
    assert (run_stats, run_released) == (stats, released_frames)


def test_a_run_on_a_closed_stream_books_nothing_but_moves_on() -> None:
    ledger = Ledger()
    stream, released = recorded(ledger)
    stream.record_admitted_run(0, [A, B])
    stream.close()
    stream.record_admitted_run(2, [C])
    ledger.taken(C)
    assert released == [] and stream.unreleased() == [] and stream.first_open() == 3


# -- through real consumers ------------------------------------------------------------------------


def frame_of(tensor: Any, key: str, seq: int) -> memoryview:
    parts = encode(tensor, key=key, message_id=("c" * 16, seq))
    return memoryview(bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts)))


def chunks_of(tensor: Any, key: str, seq: int) -> list[memoryview]:
    parts = encode_chunks(tensor, max_chunk_bytes=4096, key=key, message_id=("c" * 16, seq))
    return [memoryview(bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in part))) for part in parts]


def frames() -> list[memoryview]:
    """Plain frames (the C delivery's), a duplicate, a chunked tensor and a bad frame (Python's)."""
    out = [frame_of(np.arange(4.0) + i, f"k{i % 3}", i) for i in range(8)]
    out.append(frame_of(np.arange(4.0) + 2, "k2", 2))  # a duplicate of seq 2
    out.extend(chunks_of(np.arange(3000.0), "big", 100))
    bad = bytearray(frame_of(np.ones(3), "k0", 200))
    bad[-1] ^= 0xFF  # fails its checksum
    out.append(memoryview(bad))
    out.append(frame_of(np.arange(2.0), "late", 300))
    return out


def release_positions(consumer: tb.Consumer, fast: bool) -> tuple[list[Any], list[Any], int, int]:
    """Deliver `frames()` as the socket reader does (the C delivery first when `fast`), take some keys,
    and say what the ledger released: after delivery, after taking, and the two cumulative counts."""
    intake = consumer.intake
    stream, released = recorded(intake.ledger)
    got: list[Any] = []
    consumer.recv_async("late", lambda message, error: got.append(message))  # served on delivery
    for position, frame in enumerate(frames()):  # (the C delivery's frames booked as the reactor books them)
        message = intake.fast(frame, None, 1) if fast and intake.fast is not None else None
        if message is not None:
            stream.record_admitted(position, message.message_id)
        else:
            stream.record(position, intake(frame, None, may_hold=True, source=1))
    after_delivery = sorted(released)
    for key in ("k0", "big", "k1", "k0"):
        consumer.recv(key, timeout=1)
    assert got and got[0].key == "late"
    return after_delivery, sorted(released), stream.first_open(), stream.first_unreceived()


@pytest.mark.skipif(FAST is None, reason="the intake's C delivery is not built (its Python twin is tested alone)")
def test_the_c_delivery_and_the_python_delivery_release_the_same_positions() -> None:
    c_side, python_side = (tb.Consumer(f"memory://ledger-{uuid.uuid4().hex}") for _ in range(2))
    try:
        assert c_side.intake.fast is not None
        in_c = release_positions(c_side, fast=True)
        assert c_side.intake.fast_delivery.taken >= 7  # (most plain frames went through C)
        in_python = release_positions(python_side, fast=False)
        assert in_c == in_python
        after_delivery, after_taking, first_open, first_unreceived = in_c
        count = len(frames())
        assert after_delivery == [count - 2, count - 1]  # the bad frame, "late" (a callback had it)
        taken = [0, 3, 1, *range(9, count - 2)]  # k0 twice, k1 once, and every chunk of "big"
        assert after_taking == sorted([*after_delivery, *taken])  # (the copy of k2, at 8, waits with it)
        assert first_open == 2 and first_unreceived == count  # k2 (seq 2) is in the table, untaken
    finally:
        c_side.close()
        python_side.close()


def test_a_closed_memory_consumer_leaves_its_untaken_tensors_to_the_next_one_in_order() -> None:
    name = f"ledger-close-{uuid.uuid4().hex}"
    with tb.Producer(f"memory://{name}", max_frame_bytes=4096) as producer:
        first = tb.Consumer(f"memory://{name}")
        for i in range(60):
            producer.send(f"t{i}", np.full(600 if i % 10 == 0 else 3, i, np.float64))  # every tenth chunked
        for i in range(10):
            assert first.recv(f"t{i}", timeout=10)[0] == i
        wait_for(lambda: len(first.table) == 50, 10, "the other 50 in the first consumer's table")
        first.close()
        with tb.Consumer(f"memory://{name}") as successor:
            got = [int(successor.next_message(timeout=10).tensor[0]) for _ in range(50)]
            assert got == list(range(10, 60))  # every one, in the order sent
            with pytest.raises(tb.Timeout):
                successor.next_message(timeout=0.2)  # and none of the ten taken


def test_with_ack_arrival_a_closed_memory_consumers_untaken_tensors_are_lost() -> None:
    name = f"ledger-arrival-{uuid.uuid4().hex}"
    with tb.Producer(f"memory://{name}") as producer:
        first = tb.Consumer(f"memory://{name}", ack="arrival")
        for i in range(5):
            producer.send(f"t{i}", np.full(3, i))
        wait_for(lambda: len(first.table) == 5, 10, "the five in the table")
        first.close()
        with tb.Consumer(f"memory://{name}") as successor:
            with pytest.raises(tb.Timeout):
                successor.next_message(timeout=0.3)


def test_unclaimed_tensors_dropped_are_acknowledged() -> None:
    name = f"ledger-unclaimed-{uuid.uuid4().hex}"
    with tb.Producer(f"memory://{name}") as producer:
        first = tb.Consumer(f"memory://{name}", unclaimed_timeout_s=0.2)
        producer.send("nobody", np.ones(3))
        wait_for(lambda: first.stats["unclaimed"] == 1, 10, "the unclaimed tensor dropped")
        first.close()
        with tb.Consumer(f"memory://{name}") as successor:
            with pytest.raises(tb.Timeout):  # dropped for a stated reason: not handed on
                successor.next_message(timeout=0.3)


def test_an_incomplete_message_on_memory_expires_and_the_endpoint_goes_on() -> None:
    name = f"expiring-chunks-{uuid.uuid4().hex}"
    with tb.Consumer(f"memory://{name}", reassembly_timeout_s=0.3) as consumer:
        with tb.Producer(f"memory://{name}", max_frame_bytes=16384) as producer:
            parts = encode_chunks(np.zeros(20_000), max_chunk_bytes=16384, key="lost", message_id=("gone", 1))
            assert len(parts) > 2
            for part in parts[:-1]:  # its last chunk never comes
                producer.transport.send(part, key="lost")
            reassembler = consumer.intake.reassembler
            wait_for(lambda: reassembler.stats["expired"] == 1, 30, "the incomplete tensor to expire")
            assert reassembler.pending == 0 and reassembler.held_bytes == 0 and reassembler.given_up == 1
            assert consumer.intake.ledger.stats["dropped"] == 1  # its frames released
            producer.send("whole", np.arange(3))
            producer.send("chunked", np.arange(5000.0))
            assert consumer.recv("whole", timeout=30).tolist() == [0, 1, 2]
            assert np.array_equal(consumer.recv("chunked", timeout=30), np.arange(5000.0))
            assert "lost" not in consumer.table.buffered_keys()


def test_a_message_put_back_after_a_newer_incarnation_arrived_is_dropped_and_released() -> None:
    # a receiver went away as it was handed a message (an asyncio task cancelled just then) while a newer
    # incarnation of the message's source arrived: the table refuses it back, and its frame is released
    old, new = tb.make_key("src", 1, "dst", "w"), tb.make_key("src", 2, "dst", "w")
    with tb.Consumer(f"memory://{uuid.uuid4().hex}") as consumer:
        intake, table = consumer.intake, consumer.table
        stream, released = recorded(intake.ledger)
        had: list[Any] = []
        table.wait_async(old, Handoff(lambda message, error: had.append(message)))
        stream.record(0, intake(frame_of(np.ones(3), old, 1), None, may_hold=True, source=1))
        assert had and had[0].key == old and released == []  # handed to the callback, not taken yet
        stream.record(1, intake(frame_of(np.ones(3), new, 2), None, may_hold=True, source=1))
        table.put_back(had[0])  # its receiver went away: back in line, but src is at incarnation 2 now
        assert released == [0] and stream.first_open() == 1  # dropped for a stated reason: acknowledged


def test_stats_count_every_take_whichever_way_its_frame_was_booked() -> None:
    ledger = Ledger()
    stream = ledger.stream()
    stream.record_admitted(0, A)  # (the short path: its take is counted apart)
    stream.record(1, Delivered(B, **ADMITTED))
    ledger.taken(A)
    ledger.taken(B)
    ledger.dropped(C)
    assert ledger.stats == {"taken": 2, "dropped": 1}
    ledger.stats["taken"] = 0  # (a copy: the ledger's counts stay)
    assert ledger.stats["taken"] == 2
