"""The running clock: a process stopped (SIGSTOP) mid-tensor keeps its incomplete tensor, whose chunks come after."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tensorbus.running_clock import CLOCK, RunningClock
from tests.waiting import child_exit_code

#: a child that holds a chunked tensor incomplete, waits for a line, then feeds its last chunk (the clock it
#: measures expiry on named by argv[1]); prints whether the tensor came out whole, how many tensors expired, and
#: the time the process stood still
CHILD = """
import sys, time
import numpy as np
import tensorbus as tb
from tensorbus.running_clock import RunningClock

running = RunningClock(tick_s=0.1, slack_s=0.2)
clock = running.now if sys.argv[1] == "running" else time.monotonic
reassembler = tb.Reassembler(timeout_s=2.0, clock=clock)
array = np.arange(100_000, dtype=np.float64)
frame = tb.encode(array, key="k", message_id=("p", 1))
chunks = [b"".join(c) for c in tb.split(frame, max_chunk_bytes=30_000, message_id=("p", 1), key="k")]
for chunk in chunks[:-1]:
    assert reassembler.feed(chunk) is None
print("holding", flush=True)
sys.stdin.readline()
message = reassembler.feed(chunks[-1])
whole = message is not None and bool((message.tensor == array).all())
print("whole" if whole else "dropped", reassembler.stats["expired"], f"{running.stood_still():.2f}", flush=True)
"""

#: the stop: longer than the child's timeout (2 s) and its ticker's tick and slack (0.3 s), which leaves the
#: child 1.7 s of its own for the rest (a busy machine's scheduling)
STOPPED_S = 4.0


def _stopped_midway(clock: str) -> list[str]:
    """Run the child, stop it for STOPPED_S once it holds the tensor incomplete, go on: what it printed."""
    command = [sys.executable, "-c", CHILD, clock]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == "holding"
            os.kill(child.pid, signal.SIGSTOP)
            time.sleep(STOPPED_S)  # (the stop itself, not a wait for something)
            os.kill(child.pid, signal.SIGCONT)
            child.stdin.write("go\n")
            child.stdin.flush()
            return child.stdout.readline().split()
        finally:
            child.kill()


def test_a_tensor_held_incomplete_through_a_stop_longer_than_its_timeout_completes() -> None:
    outcome, expired, stood = _stopped_midway("running")
    assert (outcome, expired) == ("whole", "0")
    assert float(stood) >= STOPPED_S - 0.5  # the ticker saw the stop (less its tick and slack)


def test_on_the_monotonic_clock_the_same_stop_drops_it() -> None:
    outcome, expired, _ = _stopped_midway("monotonic")
    assert (outcome, expired) == ("dropped", "1")


def test_the_clock_runs_with_the_process() -> None:
    started = time.monotonic()
    before = CLOCK.now()
    time.sleep(0.05)
    ran = CLOCK.now() - before
    # as far as the monotonic clock went meanwhile, no further (a bound that holds however late this thread ran)
    assert 0.04 <= ran <= time.monotonic() - started


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="forks, and waits on the child through a pidfd (Linux)")
def test_a_forked_child_starts_its_own_ticker_and_its_clock_goes_on_from_the_parents() -> None:
    before = CLOCK.now()  # the parent's ticker runs
    pid = os.fork()
    if pid == 0:  # the child: its clock answers (no lock held over from the parent) and a ticker of its own runs
        ok = False
        try:
            ok = CLOCK.now() >= before and any(t.name == "tensorbus-running-clock" for t in threading.enumerate())
        finally:
            os._exit(0 if ok else 1)
    assert child_exit_code(pid) == 0


def test_with_no_ticker_to_be_had_the_clock_is_the_monotonic_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that cannot start must not freeze the clock (every second after it counted as a stop)."""

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    clock = RunningClock(tick_s=0.01, slack_s=0.01)
    first = clock.now()
    time.sleep(0.1)  # (far past the tick and slack of a ticker that never ran)
    assert clock.now() - first >= 0.09 and clock.stood_still() == 0.0
