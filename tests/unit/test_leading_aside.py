"""The background reader steps aside while the application receives from the table (leading.py, `received`).

An application that drains a table the background thread filled never leads (its receives find their tensors),
so before, the background read on beside it: two threads passing the GIL to and fro. Now a receive that took
a tensor counts as leading, for at most ASIDE_AT_MOST_S at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tensorbus.transports import leading
from tensorbus.transports.leading import Leadership
from tests.waiting import wait_for

LINGER_S = 0.01


class Background:
    """A Leadership with its background thread running `step`, which counts the steps it led."""

    def __init__(self, received: Callable[[], int] | None) -> None:
        self.steps = 0
        self.leadership = Leadership(LINGER_S, lambda: None, received)
        self.thread = threading.Thread(target=self.leadership.run_in_background, args=(self.step,), daemon=True)
        self.thread.start()

    def step(self, deadline: float | None, stop: Callable[[], bool]) -> bool:
        self.steps += 1  # (the background thread's alone)
        time.sleep(0.001)  # (a step reads for a while: librdkafka's wait, at most WAIT_S)
        return True

    def close(self) -> None:
        self.leadership.stop()
        self.thread.join(10)


class Receiving:
    """An application taking tensors from the table on its own thread (a counter of takes) until stopped."""

    def __init__(self) -> None:
        self.taken = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def count(self) -> int:
        with self._lock:
            return self.taken

    def _run(self) -> None:
        while not self._stop.wait(0.0002):
            with self._lock:
                self.taken += 1

    def __enter__(self) -> Receiving:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self.thread.join(10)


@pytest.fixture
def receiving() -> Iterator[Receiving]:
    with Receiving() as application:
        yield application


def test_the_background_leads_while_the_application_neither_leads_nor_receives() -> None:
    quiet = Receiving()  # (never started: takes nothing)
    background = Background(quiet.count)
    try:
        wait_for(lambda: background.steps >= 5, 30, "the background to lead step after step")
    finally:
        background.close()


def test_the_background_steps_aside_while_the_application_takes_from_the_table(
    receiving: Receiving, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leading, "ASIDE_AT_MOST_S", 30.0)
    background = Background(receiving.count)
    try:
        wait_for(lambda: receiving.count() >= 20, 30, "the application to take tensors")
        led, taken = background.steps, receiving.count()
        wait_for(lambda: receiving.count() >= taken + 300, 30, "the application to take 300 more")
        assert background.steps - led <= 3  # (a take a LINGER_S apart on a loaded machine may not show); before: 30
    finally:
        background.close()


def test_without_a_count_of_receives_the_background_reads_on_beside_them(receiving: Receiving) -> None:
    background = Background(None)
    try:
        wait_for(lambda: background.steps >= 5, 30, "the background to lead step after step")
    finally:
        background.close()


def test_the_background_still_leads_a_step_every_aside_at_most_s(
    receiving: Receiving, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leading, "ASIDE_AT_MOST_S", 0.2)
    background = Background(receiving.count)
    try:
        wait_for(lambda: receiving.count() >= 20, 30, "the application to take tensors")
        led = background.steps
        wait_for(lambda: background.steps >= led + 1, 30, "the background to lead a step")
        started = time.monotonic()
        wait_for(lambda: background.steps >= led + 3, 30, "the background to lead two more steps")
        assert time.monotonic() - started >= 2 * 0.2 * 0.9  # one per ASIDE_AT_MOST_S, not one per LINGER_S
    finally:
        background.close()
