"""A receive that waits long leaves the background thread asleep (leading.py), and its end wakes it.

While an application thread waits in `recv`, it leads: the background thread has nothing to do. It used to
look again every `linger_s` (1 ms) for as long as the receive waited, a thousand wake-ups a second from a
consumer that only waits. Now, while the same receive goes on waiting, each look waits twice as long as the
last, up to POLL_S, and the end of each of the receive's leads (a POLL_S slice, or the receive) wakes the
background thread at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from tensorbus.transports import leading
from tensorbus.transports.leading import Leadership
from tests.waiting import wait_for

LINGER_S = 0.001


class CountingCondition(threading.Condition):
    """The Leadership's condition, counting the background thread's waits on it (the only thread that waits)
    and the wake-ups sent to it (both under its lock)."""

    waits = notified = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


class Endpoint:
    """A Leadership whose background thread counts the steps it leads; an application's step waits until its
    deadline (a receive that finds nothing)."""

    def __init__(self) -> None:
        self.leadership = Leadership(LINGER_S, lambda: None)
        self.condition = CountingCondition(self.leadership._state_lock)
        self.leadership._state = self.condition
        self.background_steps = 0  # (the background thread's alone)
        self.thread = threading.Thread(target=self.leadership.run_in_background, args=(self.step,), daemon=True)
        self.thread.start()

    def step(self, deadline: float | None, stop: Callable[[], bool]) -> bool:
        if threading.current_thread() is self.thread:
            self.background_steps += 1
            end = time.monotonic() + 0.01
            while not stop() and time.monotonic() < end:  # (steps aside once a receive asks to lead)
                time.sleep(0.001)
        elif deadline is not None:
            time.sleep(max(deadline - time.monotonic(), 0.0))
        return True

    def receive(self, seconds: float) -> bool:
        """A receive whose tensor never comes: it leads for `seconds`, then times out (False)."""
        done = threading.Lock()
        done.acquire()  # (released when its tensor comes: never, here)
        return self.leadership.wait(done, time.monotonic() + seconds, self.step)

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leadership.stop()
        self.thread.join(10)


def test_a_receive_waiting_a_second_wakes_the_background_a_few_times_not_every_linger_s() -> None:
    with Endpoint() as endpoint:
        wait_for(lambda: endpoint.background_steps >= 1, 10, "the background to lead")
        before = endpoint.condition.waits
        assert endpoint.receive(1.0) is False
        woken = endpoint.condition.waits - before
        # every linger_s: ~1,000 looks; doubling up to POLL_S (0.05 s): ~25, at most two a slice after that
        assert woken < 200, f"the background looked {woken} times while one receive waited a second"


def test_the_end_of_a_long_receive_wakes_the_background_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leading, "POLL_S", 30.0)  # (the receive is one lead; a background left to its look: late)
    with Endpoint() as endpoint:
        wait_for(lambda: endpoint.background_steps >= 1, 10, "the background to lead")
        assert endpoint.receive(1.0) is False  # (the background's look is ~0.5 s long by then)
        assert endpoint.condition.notified == 1  # the receive's end woke it
        steps = endpoint.background_steps
        wait_for(lambda: endpoint.background_steps > steps, 10, "the background to lead after the receive")
