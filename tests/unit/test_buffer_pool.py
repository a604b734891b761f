"""The receive buffer pool: which buffers come back for reuse, and what it keeps."""

from __future__ import annotations

import os
import sys
import threading
import types
import weakref

import numpy as np
import pytest

from tensorbus import buffers
from tests.waiting import child_exit_code


def test_a_middle_sized_buffer_comes_back_once_nothing_views_it_and_never_while_something_does() -> None:
    pool = buffers.BufferPool()
    n = 64 << 10
    first = pool.take(n)
    held = np.frombuffer(first, np.uint8)  # a tensor the application keeps, viewing it
    second = pool.take(n)
    assert buffers.address(second) != buffers.address(first)  # in use: not handed out again
    del first, held
    again = pool.take(n)
    assert buffers.address(again) % buffers.ALIGN == 0 and pool.reused == 1
    assert buffers.address(again) != buffers.address(second)  # (still viewed: `second` lives)
    del second, again
    assert buffers.address(pool.take(n)) % buffers.ALIGN == 0 and pool.reused == 2


def test_the_middle_sized_buffers_kept_hold_at_most_recycled_bytes() -> None:
    pool = buffers.BufferPool()
    n = 96 << 10
    live = [pool.take(n) for _ in range(2 * buffers.RECYCLED_BYTES // n)]  # all in use at once
    assert pool._recycled_bytes <= buffers.RECYCLED_BYTES
    kept = len(pool._recycled)
    assert 0 < kept < len(live)
    del live
    larger = pool.take(2 * n + 1)  # none fits it: a new one, for which free ones are let go
    assert pool._recycled_bytes <= buffers.RECYCLED_BYTES and len(pool._recycled) <= kept
    assert larger.nbytes == 2 * n + 1


def test_small_and_large_buffers_keep_their_own_rules() -> None:
    pool = buffers.BufferPool(max_buffers=1)
    small = pool.take(buffers.RECYCLED_FROM - 1)
    del small
    assert not pool._recycled and pool.take(buffers.RECYCLED_FROM - 1).nbytes == buffers.RECYCLED_FROM - 1
    large = pool.take(buffers.POOLED_FROM)
    assert len(pool._buffers) == 1 and not pool._recycled
    del large
    pool.take(buffers.POOLED_FROM)
    assert pool.reused == 1


def test_the_buffers_kept_more_are_only_those_of_up_to_their_size() -> None:
    """`keep_more` (a reader running ahead of its receives) keeps more buffers of a bounded size only:
    larger ones still keep to `max_buffers`, so the bytes kept grow by at most count x size."""
    pool = buffers.BufferPool(max_buffers=1)
    pool.keep_more(2, 2 << 20)
    small = [pool.take(3 << 19) for _ in range(3)]  # 1.5 MiB each, in use at once: one plus two more kept
    large = pool.take(4 << 20)  # past the extra ones' size, and `max_buffers` is taken: not kept
    assert sorted(len(kept) for kept in pool._buffers) == [3 << 19] * 3
    del small, large
    again = [pool.take(3 << 19) for _ in range(3)]
    assert pool.reused == 3 and len(again) == 3


def test_a_reused_buffer_goes_to_the_back_so_the_one_used_longest_ago_is_looked_at_first() -> None:
    pool = buffers.BufferPool(recycled_bytes=8 << 20)
    n = 64 << 10
    taken = [pool.take(n) for _ in range(4)]
    addresses = [buffers.address(view) for view in taken]
    del taken
    again = [pool.take(n) for _ in range(3)]  # each the front one: the first three, in order
    assert [buffers.address(view) for view in again] == addresses[:3] and pool.reused == 3
    assert [buffers.address(base.data) for base in pool._recycled] == addresses[3:] + addresses[:3]


def test_recycled_bytes_is_the_pools_own() -> None:
    pool = buffers.BufferPool(recycled_bytes=4 * ((64 << 10) + buffers.ALIGN))
    live = [pool.take(64 << 10) for _ in range(6)]
    assert len(pool._recycled) == 4 and len(live) == 6


def test_a_pool_whose_buffers_are_all_in_use_looks_at_each_once_a_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer far behind keeps every buffer in use: a take looks for a free one, and finding none, does
    not look at them all again for one to let go."""
    n = 64 << 10
    pool = buffers.BufferPool(recycled_bytes=4 * (n + buffers.ALIGN))
    live = [pool.take(n) for _ in range(4)]
    looks: list[int] = []

    def getrefcount(obj: object) -> int:
        looks.append(id(obj))
        return sys.getrefcount(obj) - 1  # (less this function's own reference)

    monkeypatch.setattr(buffers, "sys", types.SimpleNamespace(getrefcount=getrefcount))
    live.append(pool.take(n))
    assert len(looks) == 4 and len(pool._recycled) == 4  # one look each; the new one not kept
    looks.clear()
    del live[0]  # one free now, of the same size: taken again
    live.append(pool.take(n))
    assert pool.reused == 1 and len(looks) == 1


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and MADV_NOHUGEPAGE are Linux's")
def test_a_pool_without_huge_pages_maps_its_large_buffers_so_and_reuses_them_as_any() -> None:
    """An event loop's pool (`huge_pages` off): buffers from HUGE_PAGES_FROM in mappings marked no-huge-page ("nh"),
    aligned, writable and pooled as any; smaller ones and a default pool's large ones as numpy makes them."""
    pool = buffers.BufferPool()
    pool.huge_pages = False
    large = pool.take(buffers.HUGE_PAGES_FROM + 100)
    assert len(large) == buffers.HUGE_PAGES_FROM + 100 and not large.readonly
    assert buffers.address(large) % buffers.ALIGN == 0
    large[-1] = 7
    assert "nh" in _vm_flags(buffers.address(large))
    at = buffers.address(large)
    del large
    assert buffers.address(pool.take(buffers.HUGE_PAGES_FROM + 50)) == at and pool.reused == 1
    below = pool.take(buffers.POOLED_FROM)
    assert "nh" not in _vm_flags(buffers.address(below))
    default = buffers.BufferPool().take(buffers.HUGE_PAGES_FROM + 100)
    assert "nh" not in _vm_flags(buffers.address(default))


def _dropped_on(base: np.ndarray) -> tuple[threading.Event, list[str]]:
    """An event set, and a list given the thread's name, where `base`'s last reference goes."""
    gone, where = threading.Event(), []
    weakref.finalize(base, lambda: (where.append(threading.current_thread().name), gone.set()))
    return gone, where


@pytest.mark.parametrize("huge_pages", [False, True])
def test_a_large_buffer_an_event_loops_pool_evicts_is_dropped_on_the_releasing_thread(huge_pages: bool) -> None:
    """An event loop's pool (`huge_pages` off) hands a large buffer it evicts to `tensorbus-release`, which unmaps
    it (~60 ms for 256 MB of base pages): the evicting thread, the loop's, only lets go of it. A pool read on a
    thread of its own drops it there."""
    pool = buffers.BufferPool(max_buffers=1)
    pool.huge_pages = huge_pages
    first = pool.take(buffers.HUGE_PAGES_FROM)
    gone, where = _dropped_on(pool._buffers[0])
    del first
    larger = pool.take(2 * buffers.HUGE_PAGES_FROM + 1)  # none fits it: the free one is evicted for it
    assert len(pool._buffers) == 1 and len(pool._buffers[0]) == len(larger)
    assert gone.wait(10), "the evicted buffer was never dropped"
    assert where == (["MainThread"] if huge_pages else ["tensorbus-release"])


def test_the_releaser_drops_what_it_is_given_and_takes_the_callers_references() -> None:
    held = [buffers.small_pages_empty(1 << 20) for _ in range(3)]
    events = [_dropped_on(base) for base in held]
    buffers.RELEASER.release(held)
    assert held == []  # (the caller's references are the releaser's now)
    for gone, where in events:
        assert gone.wait(10) and where == ["tensorbus-release"]


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="forks, and waits on the child through a pidfd (Linux)")
def test_in_a_forked_child_the_releaser_starts_a_thread_of_its_own() -> None:
    """A forked child has no releasing thread (the parent's is not its): the handler `os.register_at_fork` runs
    (`Releaser.forked`) has its first release start one, which drops what it is given, not leave it pending."""
    buffers.RELEASER.release([buffers.small_pages_empty(1 << 20)])  # (the parent's thread runs)
    pid = os.fork()
    if pid == 0:  # the child: only what it needs, then out without pytest's teardown
        code = 1
        try:
            held = [buffers.small_pages_empty(1 << 20)]
            gone, where = _dropped_on(held[0])
            buffers.RELEASER.release(held)
            code = 0 if gone.wait(10) and where == ["tensorbus-release"] else 3
        finally:
            os._exit(code)
    assert child_exit_code(pid) == 0, "the child's release was not dropped on a thread of its own"


def test_a_releaser_that_cannot_start_its_thread_drops_the_buffers_where_it_is_called(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    releaser = buffers.Releaser()
    monkeypatch.setattr(threading.Thread, "start", refused)
    held = [buffers.small_pages_empty(1 << 20)]
    gone, where = _dropped_on(held[0])
    with caplog.at_level("WARNING", logger="tensorbus.buffers"):
        releaser.release(held)
    assert gone.is_set() and where == ["MainThread"] and held == []
    assert "no thread to release buffers on" in caplog.text
    monkeypatch.undo()
    again = [buffers.small_pages_empty(1 << 20)]
    gone, where = _dropped_on(again[0])
    releaser.release(again)  # (a thread is to be had again: it starts)
    assert gone.wait(10) and where == ["tensorbus-release"]
