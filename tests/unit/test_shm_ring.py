"""shm://'s notification ring (`_shm.c`), its two sides over one piece of memory in one process."""

from __future__ import annotations

import mmap
import sys
from typing import Any

import numpy as np
import pytest

from tensorbus.transports import shm_ring
from tests.conftest import require_native

require_native(shm_ring.available(), "shm://'s notification ring (tensorbus/transports/_shm.c)")
Ring: Any = shm_ring._shm.Ring


def sides(capacity: int = 4) -> tuple[Any, Any, mmap.mmap]:
    """A producer's and a consumer's side of one ring, and its memory."""
    memory = mmap.mmap(-1, shm_ring.size(capacity))
    return Ring(memory, capacity, fresh=True), Ring(memory, capacity), memory


def test_notices_come_out_in_order_and_a_full_ring_takes_no_more() -> None:
    producer, consumer, _ = sides(4)
    assert [producer.put(i, 7, 64 * i, 100 + i) for i in range(4)] == [0, 0, 0, 0]
    assert producer.put(9, 7, 0, 1) == -1 and producer.free() == 0
    assert consumer.take() == (0, 7, 0, 100)
    assert producer.free() == 1 and producer.put(4, 8, 256, 104) == 0
    assert [consumer.take() for _ in range(5)] == [
        (1, 7, 64, 101),
        (2, 7, 128, 102),
        (3, 7, 192, 103),
        (4, 8, 256, 104),
        None,
    ]
    assert not consumer.pending() and producer.free() == 4


def test_a_consumer_that_sleeps_is_woken_by_the_next_notice_once() -> None:
    producer, consumer, _ = sides()
    assert consumer.sleep() is True
    assert producer.put(1, 1, 0, 64) == 1  # (wake it)
    assert producer.put(2, 1, 0, 64) == 0  # (woken already: one wake-up, not one a notice)
    assert consumer.sleep() is False  # (notices wait: it does not sleep, and says so)
    assert consumer.take() == (1, 1, 0, 64) and consumer.take() == (2, 1, 0, 64)
    assert consumer.sleep() is True
    consumer.awake()  # (woken by something else: the producer need not wake it)
    assert producer.put(3, 1, 0, 64) == 0


def test_words_out_of_range_are_errors_not_reads_past_the_ring() -> None:
    producer, consumer, memory = sides(4)
    memory[64:72] = (100).to_bytes(8, "little")  # a tail far past the head
    with pytest.raises(ValueError, match="tail is out of range"):
        consumer.take()
    memory[64:72] = bytes(8)
    memory[128:136] = (50).to_bytes(8, "little")  # a head past the tail
    with pytest.raises(ValueError, match="head is out of range"):
        producer.put(1, 1, 0, 64)


def test_a_ring_that_does_not_fit_its_memory_is_refused() -> None:
    with pytest.raises(ValueError, match="power of two"):
        Ring(mmap.mmap(-1, shm_ring.size(4)), 3)
    with pytest.raises(ValueError, match="aligned bytes"):
        Ring(mmap.mmap(-1, 64), 4)
    memory = mmap.mmap(-1, shm_ring.size(8))
    Ring(memory, 4, fresh=True).close()
    with pytest.raises(ValueError, match="announced capacity"):  # (a producer's 4 read as 8)
        Ring(memory, 8)


@pytest.mark.parametrize("fault", ["not a ring", "too small"])
def test_a_ring_whose_init_failed_refuses_its_methods_and_holds_no_memory(fault: str) -> None:
    """A Ring object whose `__init__` was refused keeps no view of the memory, and its methods say it is closed
    (they read words it never set: a crash, before)."""
    memory = mmap.mmap(-1, shm_ring.size(8) if fault == "not a ring" else 64)
    ring = Ring.__new__(Ring)
    with pytest.raises(ValueError):
        ring.__init__(memory, 8)
    for method in (ring.pending, ring.take, ring.free, ring.sleep, ring.awake):
        with pytest.raises(ValueError, match="closed"):
            method()
    memory.close()  # (no view of it is held: a held one would refuse this with BufferError)


def test_a_closed_side_refuses_and_lets_its_memory_go() -> None:
    producer, consumer, memory = sides()
    consumer.close()
    consumer.close()
    with pytest.raises(ValueError, match="closed"):
        consumer.take()
    producer.close()
    memory.close()  # (no buffer exported any more)


FrameView: Any = shm_ring._shm.FrameView


def test_a_frame_view_calls_back_once_when_its_last_view_is_gone() -> None:
    memory = mmap.mmap(-1, 8192)
    memory[4096:4104] = bytes(range(8))
    freed: list[tuple[int, int]] = []
    view = memoryview(FrameView(memory, 4096, 64, lambda pos, length: freed.append((pos, length)), 7))
    array = np.frombuffer(view[:8], np.uint8)  # (a slice of the view, and an array over it)
    del view
    assert freed == [] and array.tolist() == list(range(8)) and not array.flags.writeable
    del array
    assert freed == [(7, 64)]


def test_a_frame_view_outside_its_mapping_is_refused_and_a_failing_callback_is_reported() -> None:
    memory = mmap.mmap(-1, 4096)
    with pytest.raises(ValueError, match="outside its segment"):
        FrameView(memory, 4000, 200, print, 1)

    def fails(pos: int, length: int) -> None:
        raise RuntimeError("the callback failed")

    reported: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, reported.append
    try:
        view = FrameView(memory, 0, 64, fails, 1)
        del view
    finally:
        sys.unraisablehook = hook
    assert [str(report.exc_value) for report in reported] == ["the callback failed"]
