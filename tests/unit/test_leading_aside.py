"""The background reader steps aside while the application receives from the table (leading.py, `received`).

An application that drains a table the background thread filled never leads (its receives find their tensors),
so before, the background read on beside it: two threads passing the GIL to and fro. Now a receive that took
a tensor counts as leading, for at most ASIDE_AT_MOST_S at a time. The count of receives here is a stand-in the
background alone reads: one that grows at every look (an application always receiving), or one that never does.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import pytest

from tensorbus.transports import leading
from tensorbus.transports.leading import Leadership
from tests.waiting import wait_for

LINGER_S = 0.01


class Background:
    """A Leadership with its background thread running `step`, which counts the steps it led; `received`
    also counts the background's looks at it."""

    def __init__(self, received: Callable[[], int] | None) -> None:
        self.steps = self.looks = 0  # (the background thread's alone: read by the test only)
        self.stamps: list[float] = []  # when each step began (the background thread's alone, as the counts)
        self._received = received
        self.leadership = Leadership(LINGER_S, lambda: None, None if received is None else self.received)
        self.thread = threading.Thread(target=self.leadership.run_in_background, args=(self.step,), daemon=True)
        self.thread.start()

    def received(self) -> int:
        assert self._received is not None
        self.looks += 1
        return self._received()

    def step(self, deadline: float | None, stop: Callable[[], bool]) -> bool:
        self.stamps.append(time.monotonic())
        self.steps += 1
        time.sleep(0.001)  # (a step reads for a while: librdkafka's wait, at most WAIT_S)
        return True

    def close(self) -> None:
        self.leadership.stop()
        self.thread.join(10)

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def always_receiving() -> Callable[[], int]:
    """An application that took another tensor before every look."""
    return itertools.count().__next__


@pytest.mark.parametrize(
    "received",
    [lambda: 0, None],
    ids=["the application neither leads nor receives", "without a count of receives"],
)
def test_the_background_leads_step_after_step(received: Callable[[], int] | None) -> None:
    """It leads while the application neither leads nor receives, and reads on where no count of receives is kept."""
    with Background(received) as background:
        wait_for(lambda: background.steps >= 5, 30, "the background to lead step after step")


def test_the_background_steps_aside_while_the_application_takes_from_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leading, "ASIDE_AT_MOST_S", 30.0)
    with Background(always_receiving()) as background:
        wait_for(lambda: background.looks >= 20, 30, "the background to look 20 times")
        assert background.steps == 0  # without `received`: a step a look


def test_the_background_still_leads_a_step_every_aside_at_most_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leading, "ASIDE_AT_MOST_S", 0.2)
    with Background(always_receiving()) as background:
        wait_for(lambda: background.steps >= 3, 30, "the background to lead three steps")
        # one per ASIDE_AT_MOST_S, not one per look (timed where the steps began, not where the test saw them)
        assert background.stamps[2] - background.stamps[0] >= 2 * 0.2 * 0.9, background.stamps
