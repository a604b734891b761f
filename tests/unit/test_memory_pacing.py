"""A memory:// producer delivering on its own thread pauses a burst ahead of a receive taking its tensors.

Producer and receive share one interpreter lock, which the producer would keep for a switch interval (5 ms)
at a time: unpaced, it got hundreds of tensors ahead (memory_pacing.py). These hold the rule: a pause once
`BURST` frames (or `BURST_BYTES`) wait untaken while a receive takes them, ended by the receive taking half
of them or waiting for more; never one while nobody takes; and another key's untaken tensors not counted.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.intake_state import FAST
from tensorbus.transports import memory_pacing
from tensorbus.transports.memory import HUB
from tensorbus.transports.memory_frames import Frames
from tensorbus.transports.memory_pacing import BURST, BURST_BYTES

from ..conftest import require_native
from ..waiting import wait_for


@pytest.fixture(autouse=True)
def _patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause here ends by what the receive does, never by its time running out (however loaded the machine)."""
    monkeypatch.setattr(memory_pacing, "BURST_WAIT_S", 60.0)


def _delivering(frames: Frames) -> list[int]:
    """Have `put` deliver every frame itself; the count of taken positions as each one was delivered."""
    seen: list[int] = []

    def deliver_now(frame: Any, source: object, position: int, crc: int | None) -> bool:
        seen.append(frames.pace._taken)
        return True

    frames.deliver_with(deliver_now)
    return seen


def _take(frames: Frames, count: int) -> None:
    """What the consumer's ledger tells the pace once its receives took `count` more tensors."""
    frames.pace.released(list(range(count)))


def _producer(frames: Frames, count: int, nbytes: int | None = None) -> threading.Thread:
    thread = threading.Thread(target=lambda: [frames.put(b"frame", source="p", nbytes=nbytes) for _ in range(count)])
    thread.start()
    return thread


#: small frames: the producer looks every eighth of a burst, so it pauses at most this many frames late
STRIDE = BURST // 8


def test_a_producer_a_burst_ahead_of_a_receive_taking_its_tensors_pauses_until_it_took_half() -> None:
    frames = Frames()
    seen = _delivering(frames)
    _take(frames, 1)  # a receive takes tensors (one taken before these)
    producer = _producer(frames, BURST + STRIDE)  # (less than a burst after the first pause: no second)
    wait_for(lambda: frames.pace._pausing == 1, 30, "the producer to pause")
    paused_at = len(seen)
    assert BURST + 1 <= paused_at <= BURST + STRIDE  # (a burst ahead of the one taken)
    _take(frames, BURST // 2 - 1)
    assert frames.pace._pausing == 1 and len(seen) == paused_at  # (not yet: half of a burst)
    _take(frames, 1)
    producer.join(30)
    assert len(seen) == BURST + STRIDE and seen[paused_at] == BURST // 2 + 1  # it went on once the receive took half


def test_large_frames_pause_once_burst_bytes_of_them_wait_and_are_looked_at_each_time() -> None:
    frames = Frames()
    seen = _delivering(frames)
    _take(frames, 1)
    producer = _producer(frames, 6, nbytes=BURST_BYTES // 4)
    wait_for(lambda: frames.pace._pausing == 1, 30, "the producer to pause")
    assert len(seen) == 5  # four ahead of the one taken: a burst of bytes
    _take(frames, 2)
    producer.join(30)
    assert len(seen) == 6


def test_a_pause_ends_when_the_receive_waits_for_more() -> None:
    frames = Frames()
    seen = _delivering(frames)
    _take(frames, 1)
    producer = _producer(frames, 2 * BURST)
    wait_for(lambda: frames.pace._pausing == 1, 30, "the producer to pause")
    got = frames.get(threading.Event(), None, receiving=True)  # (it waits: the producer goes on, and wakes it)
    producer.join(30)
    assert got is None and len(seen) == 2 * BURST and set(seen) == {1}


def test_a_producer_never_pauses_while_nobody_takes() -> None:
    frames = Frames()
    seen = _delivering(frames)
    producer = _producer(frames, 3 * BURST)
    producer.join(30)  # (a pause would last a minute)
    assert not producer.is_alive() and len(seen) == 3 * BURST


def test_tensors_left_untaken_when_a_receive_waits_for_more_do_not_count() -> None:
    frames = Frames()
    seen = _delivering(frames)
    _producer(frames, 3 * BURST).join(30)  # another key's, say: nobody takes them
    frames.pace.waiting(3 * BURST)  # a receive (of this key) waits for more: those are set aside
    _take(frames, 1)  # and it takes one
    producer = _producer(frames, BURST + STRIDE)
    wait_for(lambda: frames.pace._pausing == 1, 30, "the producer to pause")
    assert BURST + 1 <= len(seen) - 3 * BURST <= BURST + STRIDE  # a burst ahead of the one taken, not before
    _take(frames, BURST // 2)
    producer.join(30)
    assert len(seen) == 4 * BURST + STRIDE


def test_a_memory_producer_stays_within_a_burst_of_the_receive_taking_its_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both ends in one process, 64 KB tensors: the table holds about a burst of them at most (unpaced, the
    producer got hundreds ahead before the receive ran). A pause lasts until the receive took half the burst
    here, not BURST_WAIT_S at most: on a busy machine the receive's thread can wait longer than that for a
    CPU, and the producer then goes on, by design (a send never waits on a receive for long)."""
    require_native(FAST is not None, "the intake's C delivery (tensorbus/_intake.c)")
    monkeypatch.setattr(memory_pacing, "BURST_WAIT_S", 60.0)
    tensor = np.zeros(1 << 14, np.float32)
    budget = min(BURST, BURST_BYTES // tensor.nbytes)
    count = 8 * budget
    with tb.Consumer("memory://paced") as consumer, tb.Producer("memory://paced") as producer:
        taken: list[int] = []
        receive = threading.Thread(target=lambda: taken.extend(consumer.recv("k", 30).size for _ in range(count)))
        receive.start()
        frames = HUB.endpoint("paced")
        wait_for(lambda: frames._getting == 1 and frames._receiving, 30, "the receive to wait")
        most = 0
        for _ in range(count):
            producer.send("k", tensor)
            most = max(most, len(consumer.table))
        receive.join(30)
        assert len(taken) == count
        # a burst, an eighth more (it looks every eighth of one), and on a busy machine what the receive set
        # aside as another key's when it last waited, the producer delivering meanwhile (84 and 94 of 72 seen)
        assert most <= 2 * budget


def test_each_of_two_pausing_producers_goes_on_once_its_own_count_is_taken() -> None:
    pace = memory_pacing.Pace()
    gone: list[int] = []

    def pause(until: int) -> None:
        pace.pause(until)
        gone.append(until)

    pausing = [threading.Thread(target=pause, args=(until,)) for until in (10, 20)]
    for thread in pausing:
        thread.start()
    wait_for(lambda: pace._pausing == 2, 30, "both producers to pause")
    pace.released(list(range(10)))
    pausing[0].join(30)
    assert gone == [10] and pace._pausing == 1  # (the other goes on with its own count, not before)
    pace.released(list(range(10)))
    pausing[1].join(30)
    assert gone == [10, 20]
