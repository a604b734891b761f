"""A witness of the machine's own stalls, for tests that time an event loop's beats.

A separate process does nothing but sleep 1 ms at a time and notes every beat (from one waking to the next)
that took longer for a reason not its own: longer by more than the time the kernel kept it waiting for a CPU
(its schedstat). A process that only sleeps is late so only when the machine stopped it: the hypervisor took
its vCPU or paused the VM, or the kernel charged it an interrupt's work (this kernel has no IRQ time
accounting). On the 2-vCPU VM a lone sleeper woke 5-19 ms late that way a few times a minute, its thread
charged up to 13 ms "on a CPU" for a 1 ms sleep (docs/TESTING.md); a beat of the loop under test that was
late across the same moments lost that time to the machine, not to tensorbus, which cannot stop another
process.

Linux only (/proc); elsewhere the witness notes nothing and excuses nothing.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable

#: a stall of the witness shorter than this is not noted (a 1 ms sleep wakes up to ~1 ms late on a busy machine)
NOTED_FROM_S = 0.002

#: the witness: beats until its stdin closes (or `limit` seconds), then prints "end late stall" per stall noted
_CODE = r"""
import os, select, sys, threading, time
limit, noted_from = float(sys.argv[1]), float(sys.argv[2])
path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
if not os.path.exists(path):
    print("ready", flush=True); sys.stdin.read(); sys.exit(0)
schedstat = open(path, "rb")
def waited():
    schedstat.seek(0)
    return int(schedstat.read().split()[1]) / 1e9
stalls, end, beats = [], time.perf_counter() + limit, 0
# (a beat runs from one waking to the next: a stop anywhere in it counts)
woke, waited_then = time.perf_counter(), waited()
print("ready", flush=True)
while woke < end:
    time.sleep(0.001)
    now, waited_now = time.perf_counter(), waited()
    late = now - woke - 0.001
    stall = late - (waited_now - waited_then)
    if stall >= noted_from:
        stalls.append((now, late, stall))
    woke, waited_then = now, waited_now
    beats += 1
    if beats % 50 == 0 and select.select([sys.stdin], [], [], 0)[0]:
        break
print("\n".join(f"{now!r} {late!r} {stall!r}" for now, late, stall in stalls), flush=True)
"""


class MachineWitness:
    """The witness process, from `start` to `stop` (a context manager); `stalls` once stopped."""

    def __init__(self, limit_s: float = 600.0) -> None:
        self._limit_s = limit_s
        self._process: subprocess.Popen[str] | None = None
        #: (when it woke, how late, how much of that was the machine's), on `time.perf_counter`'s clock
        #: (CLOCK_MONOTONIC on Linux: one clock for every process)
        self.stalls: list[tuple[float, float, float]] = []

    def start(self) -> MachineWitness:
        args = [sys.executable, "-c", _CODE, str(self._limit_s), str(NOTED_FROM_S)]
        self._process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        ready = self._process.stdout.readline()  # (it beats from here on)
        assert ready == "ready\n", f"the witness did not start: {ready!r}"
        return self

    @property
    def pid(self) -> int:
        assert self._process is not None, "the witness is not running"
        return self._process.pid

    def stop(self) -> list[tuple[float, float, float]]:
        """Ends the witness (it reads its closed stdin within 50 beats) and returns its stalls."""
        if self._process is None:
            return self.stalls
        out, _ = self._process.communicate(timeout=30)
        assert self._process.returncode == 0, f"the witness failed ({self._process.returncode})"
        self._process = None
        self.stalls = [(float(a), float(b), float(c)) for a, b, c in (line.split() for line in out.split("\n") if line)]
        return self.stalls

    def __enter__(self) -> MachineWitness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def machine_took(start: float, end: float, stalls: Iterable[tuple[float, float, float]]) -> float:
    """How much of the span from `start` to `end` the witness's stalls say the machine took: each stall counts
    up to its length and up to how far the time the witness woke late (`end - late` to its `end`) overlaps."""
    took = 0.0
    for woke, late, stall in stalls:
        overlap = min(end, woke) - max(start, woke - late)
        if overlap > 0:
            took += min(stall, overlap)
    return min(took, end - start)
