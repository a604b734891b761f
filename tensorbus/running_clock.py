"""A clock that stands still while the process does: `time.monotonic()` less the time the process was stopped.

A consumer whose process is stopped (SIGSTOP, a debugger's breakpoint, a frozen container) keeps its partly
reassembled tensors; when it runs again their remaining chunks are usually right there (in the broker's log, in
the socket's buffer). Measured on the monotonic clock those tensors would look late and be dropped the moment the
process resumes; measured on this clock they are not. A ticker thread (`tensorbus-running-clock`) wakes every
`TICK_S`; whatever it wakes late by, past `SLACK_S`, counts as time the process stood still (strictly: time the
ticker could not run, which a C call holding the interpreter lock for seconds would count too; that only makes
expiry later). It starts with the first `now()` and runs until the process exits (one wake-up a second); a forked
child starts its own, the clock going on from the parent's reading.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)
#: how often the ticker wakes
TICK_S = 1.0
#: how late past its tick the ticker may be before the lateness counts as time the process stood still (a busy
#: machine delays a wake-up by milliseconds, not by this)
SLACK_S = 1.0


class RunningClock:
    """`now()`: monotonic seconds, less the stops the ticker saw (and the one it is overdue by, if it is: a reader
    that runs first after a stop must not see the stop as time passed)."""

    def __init__(self, tick_s: float = TICK_S, slack_s: float = SLACK_S) -> None:
        self.tick_s, self.slack_s = tick_s, slack_s
        self._lock = threading.Lock()  # guards every field below (the ticker writes them, readers read them)
        self._stood = 0.0  # seconds the process stood still, as the ticker measured
        self._ticked = 0.0  # monotonic time of the ticker's last wake-up
        self._pid = 0  # the process whose ticker was started (0: none yet)
        self._ticking = False  # the ticker runs (only then does its lateness count)

    def forked(self) -> None:
        """In a forked child: the parent's ticker is not there (nor, maybe, its hold of the lock): start afresh,
        keeping what was measured (the clock goes on from the parent's reading)."""
        self._lock = threading.Lock()
        self._pid, self._ticking = 0, False

    def now(self) -> float:
        """The monotonic time less the time the process stood still."""
        with self._lock:
            if self._pid != os.getpid():
                self._start()
            now = time.monotonic()
            return now - self._stood - self._overdue(now)

    def stood_still(self) -> float:
        """Seconds the process is known to have stood still since the ticker started."""
        with self._lock:
            return self._stood + (self._overdue(time.monotonic()) if self._pid == os.getpid() else 0.0)

    def _overdue(self, now: float) -> float:
        """How far past its tick and slack the ticker is (caller holds `_lock`); 0 when none runs."""
        return max(0.0, now - self._ticked - self.tick_s - self.slack_s) if self._ticking else 0.0

    def _start(self) -> None:
        """Start this process's ticker (caller holds `_lock`): the first read, or the first in a forked child.
        The new thread sleeps before it takes the lock. If none can start, no stop is counted (the clock is then
        the monotonic one), rather than every second after counting as one."""
        self._pid, self._ticked = os.getpid(), time.monotonic()
        try:
            threading.Thread(target=self._tick, daemon=True, name="tensorbus-running-clock").start()
        except RuntimeError as exc:  # (no thread to be had)
            log.warning("no running clock (%s): time a stopped process stood still counts against expiry", exc)
            return
        self._ticking = True

    def _tick(self) -> None:
        """The ticker: wake every `tick_s`, counting a late wake-up's lateness past `slack_s` as standing still."""
        while True:
            time.sleep(self.tick_s)
            with self._lock:
                now = time.monotonic()
                self._stood += self._overdue(now)
                self._ticked = now


#: the process's running clock (one ticker for every consumer in it)
CLOCK = RunningClock()
if hasattr(os, "register_at_fork"):  # (no fork: Windows)
    os.register_at_fork(after_in_child=CLOCK.forked)
