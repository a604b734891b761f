"""`tensorbus bench --fanout`'s own parts: what a subscriber process spends per round, and the table line."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest

from tensorbus.bench import fanout

LINUX = Path("/proc/self/task").is_dir()


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_usage_counts_a_processes_cpu_and_the_pages_it_touches_first() -> None:
    before = fanout.usage(os.getpid())
    ends = time.thread_time() + 0.05
    while time.thread_time() < ends:  # 50 ms of CPU
        pass
    # 64 MB mapped here, never touched before, in base pages: a fault per 4 KB page written. (Not an array from
    # malloc, whose memory need not be fresh: a CI run once counted 2 faults for numpy's 64 MB.)
    fresh = mmap.mmap(-1, 64 << 20)
    fresh.madvise(mmap.MADV_NOHUGEPAGE)
    np.frombuffer(fresh, np.uint8)[:: mmap.PAGESIZE] = 1
    after = fanout.usage(os.getpid())
    took = fanout.spent(before, after)
    assert took is not None
    assert took[0] >= 0.04
    assert took[1] >= (64 << 20) // mmap.PAGESIZE


def test_a_round_in_which_a_counted_thread_ended_tells_nothing() -> None:
    """Its CPU time went with it: the difference would be too low, even negative (a subscriber's last round)."""
    before = fanout.Usage(2.0, 100, frozenset({"1", "2"}))
    assert fanout.spent(before, fanout.Usage(2.5, 150, frozenset({"1", "2", "3"}))) == (0.5, 50)
    assert fanout.spent(before, fanout.Usage(1.5, 150, frozenset({"1"}))) is None
    assert fanout.spent(before, None) is None and fanout.spent(None, before) is None


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_usage_of_no_such_process_is_none() -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert fanout.usage(pid_max + 1) is None


def test_the_table_line_shows_a_subscribers_cpu_and_faults_per_round_for_each_side() -> None:
    cell = {
        "pair": ["kafka", "kafka-python"],
        "nbytes": 16 << 20,
        "subscribers": 2,
        "seconds": {"kafka": [0.1, 0.2, 0.3], "kafka-python": [0.2, 0.2, 0.3]},
        "subscriber_cpu_s": {"kafka": [0.05, 0.04, 0.06], "kafka-python": [0.07, None, 0.05]},
        "subscriber_minflt": {"kafka": [100.0, 300.0, 200.0], "kafka-python": [50.0, None, 70.0]},
    }
    line = fanout.summary(cell)
    assert line.startswith("| 16MB | 2 | kafka 200 ms | kafka-python 200 ms | 1.00x [1.00-2.00] |")
    assert line.endswith("| 50 ms, 200 faults / 60 ms, 60 faults |")
    cell["subscriber_cpu_s"] = {"kafka": [None] * 3, "kafka-python": [None] * 3}  # /proc told nothing
    assert fanout.summary(cell).endswith("| - / - |")
