"""Witnesses of the whole machine stopping, for tests that time an event loop's beats.

One process per CPU (MOST_WITNESSES at most), pinned to it, does nothing but sleep 1 ms at a time and notes
every beat (from one waking to the next) that took longer for a reason not its own: longer by more than the time
the kernel kept it waiting for a CPU (its schedstat). A moment that every witness lost so, each on its own CPU,
is one the whole machine lost: a VM the host paused (which the guest need not count as steal), not anything a
process on it did. A loop thread's beat late across such moments is excused them; a witness alone late (its
vCPU taken while the other ran, or an interrupt's work charged to it: this VM's kernel has no IRQ time
accounting) excuses nothing, so a loop that tensorbus holds while it keeps the other CPU busy still counts in
full.

On the 2-vCPU VM a lone sleeper woke 5-19 ms late a few times a minute that way, charged up to 13 ms "on a CPU"
for a 1 ms sleep (docs/TESTING.md). Linux only (/proc, CPU affinity); elsewhere no witness runs and nothing is
excused.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
from collections.abc import Sequence

#: a stall of a witness shorter than this is not noted (a 1 ms sleep wakes up to ~1 ms late on a busy machine)
NOTED_FROM_S = 0.002
#: how long a witness may take to start, and to end once told
WITNESS_WAIT_S = 30.0
#: witnesses at most, on the first CPUs (a pause of the VM stops them all; on a machine of many CPUs, one per CPU
#: would cost a core or more of wake-ups)
MOST_WITNESSES = 4

#: a witness: pinned to its CPU, beats until its stdin closes (or `limit` seconds), then prints "woke late stall"
#: per stall noted; its own session, so a Ctrl-C meant for the tests does not end it first
_CODE = r"""
import os, select, sys, threading, time
limit, noted_from, cpu = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
os.sched_setaffinity(0, {cpu})
schedstat = open(f"/proc/self/task/{threading.get_native_id()}/schedstat", "rb")
def waited():
    schedstat.seek(0)
    return int(schedstat.read().split()[1]) / 1e9
stalls, end, beats = [], time.perf_counter() + limit, 0
# (a beat runs from one waking to the next: a stop anywhere in it counts)
woke, waited_then = time.perf_counter(), waited()
print("ready", flush=True)
while woke < end:
    time.sleep(0.001)
    waited_before, now, waited_after = waited(), time.perf_counter(), waited()
    late = now - woke - 0.001
    # (a wait between the two readings is left out of this beat and of the next: either may have had it)
    stall = late - (waited_after - waited_then)
    if stall >= noted_from:
        stalls.append((now, late, stall))
    woke, waited_then = now, waited_before
    beats += 1
    if beats % 50 == 0 and select.select([sys.stdin], [], [], 0)[0]:
        break
print("\n".join(f"{now!r} {late!r} {stall!r}" for now, late, stall in stalls), flush=True)
"""

#: a stall: (when the witness woke, how late its beat was, how much of that was not its wait for a CPU), on
#: `time.perf_counter`'s clock (CLOCK_MONOTONIC on Linux: one clock for every process)
Stall = tuple[float, float, float]


def witnesses_run_here() -> bool:
    """Whether witnesses can run on this machine (Linux's /proc and CPU affinity)."""
    return hasattr(os, "sched_getaffinity") and os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat")


class MachineWitness:
    """The witnesses, one per CPU this process may run on (MOST_WITNESSES at most), from `start` to `stop` (a
    context manager); `stalls` (one list per witness) once stopped."""

    def __init__(self, limit_s: float = 600.0) -> None:
        self._limit_s = limit_s
        self._processes: list[subprocess.Popen[str]] = []
        self.stalls: list[list[Stall]] = []

    def start(self) -> MachineWitness:
        cpus = sorted(os.sched_getaffinity(0))[:MOST_WITNESSES] if witnesses_run_here() else []
        try:
            for cpu in cpus:
                args = [sys.executable, "-c", _CODE, str(self._limit_s), str(NOTED_FROM_S), str(cpu)]
                self._processes.append(
                    subprocess.Popen(
                        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
                    )
                )
            for process in self._processes:
                assert process.stdout is not None
                with selectors.DefaultSelector() as selector:
                    selector.register(process.stdout, selectors.EVENT_READ)
                    assert selector.select(WITNESS_WAIT_S), f"no witness started within {WITNESS_WAIT_S} s"
                ready = process.stdout.readline()  # (it beats from here on)
                assert ready == "ready\n", f"a witness did not start: {ready!r}"
        except BaseException:
            self._end()
            raise
        return self

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def stop(self) -> list[list[Stall]]:
        """Ends the witnesses (each reads its closed stdin within 50 beats) and returns their stalls."""
        try:
            outs = [process.communicate(timeout=WITNESS_WAIT_S)[0] for process in self._processes]
            failed = [process.returncode for process in self._processes if process.returncode != 0]
            assert not failed, f"a witness failed ({failed})"
        finally:
            self._end()
        self.stalls = [
            [(float(a), float(b), float(c)) for a, b, c in (line.split() for line in out.split("\n") if line)]
            for out in outs
        ]
        return self.stalls

    def _end(self) -> None:
        """Kills the witnesses still running and reaps them all."""
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            process.communicate()
        self._processes = []

    def __enter__(self) -> MachineWitness:
        return self.start()

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.stop()
        else:  # (the test's own error is the one to see)
            self._end()


def witness_took(start: float, end: float, stalls: Sequence[Stall]) -> float:
    """How much of the span from `start` to `end` one witness's stalls say were lost for certain. A stall lies
    somewhere in its beat (`woke - late - 1 ms` to `woke`), beside the rest of the beat: it counts only as far
    as the span overlaps the beat by more than that rest, and up to its length."""
    took = 0.0
    for woke, late, stall in stalls:
        overlap = min(end, woke) - max(start, woke - late - 0.001)
        took += min(stall, max(overlap - (late + 0.001 - stall), 0.0))
    return max(min(took, end - start), 0.0)


def machine_took(start: float, end: float, stalls: Sequence[Sequence[Stall]]) -> float:
    """What every witness lost for certain in the span from `start` to `end`, each on its CPU: the machine's
    loss (the least of theirs; nothing without witnesses)."""
    return min((witness_took(start, end, one) for one in stalls), default=0.0)
