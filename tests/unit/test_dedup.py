"""Message ids already delivered: a bounded window, kept across restarts when given a file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.dedup import SeenIds


def delivered(path: Path, window: int, count: int) -> SeenIds:
    """A file-backed window that has seen and persisted ids ("p", 0) .. ("p", count - 1)."""
    seen = SeenIds(window=window, path=path)
    for seq in range(count):
        seen.add(("p", seq))
        seen.persist(("p", seq))
    return seen


def test_the_window_forgets_the_oldest_ids() -> None:
    seen = SeenIds(window=3)
    for seq in range(5):
        seen.add(("p", seq))
    assert ("p", 1) not in seen and ("p", 2) in seen and ("p", 4) in seen and len(seen) == 3


def test_persisted_ids_survive_a_restart_and_a_torn_last_record(tmp_path: Path) -> None:
    path = tmp_path / "ids"
    delivered(path, window=100, count=10).close()
    with path.open("ab") as f:
        f.write(b"\x92\xa1")  # a record cut short by a kill
    again = SeenIds(window=100, path=path)
    assert all(("p", seq) in again for seq in range(10)) and ("p", 10) not in again


def test_the_file_is_compacted_to_the_window(tmp_path: Path) -> None:
    path = tmp_path / "ids"
    delivered(path, window=50, count=1000)
    size = path.stat().st_size
    assert size < 100 * 12, size  # at most twice the window of ~10-byte records
    again = SeenIds(window=50, path=path)
    assert ("p", 999) in again and ("p", 949) not in again


def test_a_damaged_file_keeps_the_ids_before_the_damage(tmp_path: Path) -> None:
    path = tmp_path / "ids"
    delivered(path, window=10, count=2).close()
    with path.open("ab") as f:
        f.write(b"\xc1" * 8)  # 0xc1 is never valid msgpack
    again = SeenIds(window=10, path=path)
    assert ("p", 1) in again


def test_a_restarted_consumer_on_the_same_file_drops_a_resent_message(tmp_path: Path) -> None:
    frame = b"".join(tb.encode(np.arange(4), key="k", message_id=("producer", 7)))
    options = {"dedup_file": str(tmp_path / "ids")}
    with tb.Consumer("memory://dedup-a", **options) as first:
        first.intake(frame)
        assert first.recv("k", timeout=1).tolist() == [0, 1, 2, 3]
    with tb.Consumer("memory://dedup-b", **options) as second:
        second.intake(frame)  # what a producer resends after reconnecting
        assert second.stats["duplicates"] == 1 and second.stats["received"] == 0


def test_a_failing_file_degrades_to_memory_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen = SeenIds(window=10, path=tmp_path / "ids")
    os.close(seen._fd)  # type: ignore[arg-type]  # as if the disk had gone away
    seen.add(("p", 1))
    seen.persist(("p", 1))  # logs, does not raise: the tensor was delivered all the same
    assert ("p", 1) in seen and "dedup is in memory only" in caplog.text
    seen.persist(("p", 2))
