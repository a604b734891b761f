"""The background reader's timer: idle once the application has not led for `linger_s`.

`check_timer` runs against the Python `IdleClock` here and against the C `IdleTimer` in
test_native_stream.py. Waits are short and their bounds loose: these check what a wait returns,
not how fast.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from tensorbus.transports.reactor import IdleClock


def check_timer(make: Callable[[], Any]) -> None:
    """What both timers must do."""
    timer = make()
    assert timer.wait(0) is True  # nobody has led yet: idle from the start

    timer.touch(60)
    started = time.monotonic()
    assert timer.wait(0.05) is False  # led just now: not idle, and the wait times out
    assert time.monotonic() - started >= 0.04

    started = time.monotonic()  # (before the touch: taken after it, a preempted thread may take it late)
    timer.touch(0.05)
    assert timer.wait(10) is True  # idle once the linger passes, long before the timeout
    assert 0.04 <= time.monotonic() - started < 5

    timer.touch(60)
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(timer.wait(30)))
    waiter.start()
    time.sleep(0.05)
    started = time.monotonic()
    timer.wake()
    waiter.join(5)
    assert results == [False] and time.monotonic() - started < 2  # woken: False, at once
    assert timer.wait(30) is False  # and every later wait too, without sleeping


def test_python_idle_clock() -> None:
    check_timer(IdleClock)
