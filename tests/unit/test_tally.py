"""A transport's tally (transports/tally.py): send to acknowledgement timed one frame at a time, bucketed as
Prometheus reads a histogram (a wait on a bucket's bound is in that bucket)."""

from __future__ import annotations

import pytest

from tensorbus.transports import tally


def test_send_to_ack_is_timed_one_frame_at_a_time_into_the_bucket_of_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(tally, "_clock", lambda: now[0])
    counts = tally.Tally()
    assert counts.timing(0) and not counts.timing(1)  # frame 1 goes while frame 0 is timed: not timed
    now[0] = 0.001  # a bucket's bound (`le`)
    counts.acked(1, through=1)
    assert counts.ack_waits == [0, 1, 0, 0, 0, 0, 0, 0] and counts.ack_wait_s == 0.001
    counts.acked(1, through=2)
    assert sum(counts.ack_waits) == 1 and counts.acked_frames == 2 and counts.timed is None


def test_a_timing_follows_its_frame_to_its_new_position_after_a_reconnect(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(tally, "_clock", lambda: now[0])
    counts = tally.Tally()
    assert counts.timing(5)
    counts.renumber(3, 4)  # frames 3..6 resent as 0..3: frame 5 is now 2
    now[0] = 0.5
    counts.acked(2, through=2)
    assert sum(counts.ack_waits) == 0  # frames 0 and 1 only
    counts.acked(1, through=3)
    assert counts.ack_waits[tally.ACK_BUCKETS.index(1.0)] == 1 and counts.ack_wait_s == 0.5
    assert counts.timing(9)
    counts.renumber(0, 3)  # frame 9 is not among those resent (it was dropped): its timing ends
    assert counts.timed is None
