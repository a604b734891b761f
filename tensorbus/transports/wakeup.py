"""A receive's wait for another thread of its process to ring (`Wakeup`): C where built, else `PyWakeup`.

memory://'s waiting receive sleeps until a producer's `put` rings it (memory_frames.py). Both threads share
one interpreter lock, and a thread asleep on a lock wakes late (~100 µs on an idle vCPU of a VM), then
waits once more for the interpreter lock its waker holds until that waker blocks in turn. The C `Wakeup`
(`_intake.c`) spins first, for `spin_s`, without the interpreter lock, and once rung spins on until its
ringer let go of it (or 50 µs passed): a hand-over with no sleep on either side while replies come quickly.
`PyWakeup` is its readable twin: a lock, which sleeps at once (a spin in Python would hold the interpreter
lock the ringer needs), used where the C extension is not built or `TENSORBUS_NATIVE=0`.
"""

from __future__ import annotations

import threading
from typing import Protocol

from ..codec.native import load


class Waking(Protocol):
    """What `Frames` rings and waits on."""

    def ring(self) -> None: ...

    def wait(self, timeout_s: float | None = None, spin_s: float = 0.0) -> bool: ...


class PyWakeup:
    """`ring()` makes the wait waiting now, or else the next one, return True (a ring while rung already is one
    ring); `wait(timeout_s)` returns False once `timeout_s` passed unrung (None: no limit). `spin_s` is taken
    and not used: this wait sleeps at once."""

    def __init__(self) -> None:
        self._rung = threading.Lock()  # released: rung; a wait takes it (the ring consumed)
        self._rung.acquire()
        self._ringing = threading.Lock()  # (two rings at once release `_rung` once)

    def ring(self) -> None:
        with self._ringing:
            if self._rung.locked():
                self._rung.release()

    def wait(self, timeout_s: float | None = None, spin_s: float = 0.0) -> bool:
        if timeout_s is not None and timeout_s != timeout_s:
            raise ValueError("Wakeup.wait: NaN seconds")
        if timeout_s is None or timeout_s < 0:
            return self._rung.acquire()
        return self._rung.acquire(timeout=min(timeout_s, threading.TIMEOUT_MAX))


def _wakeup() -> type[Waking]:
    """The C `Wakeup` where `_intake` is built, current and enabled; else `PyWakeup`."""
    module = load(f"{__package__.rpartition('.')[0]}._intake")
    return PyWakeup if module is None else module.Wakeup


#: the wait memory://'s queue rings (C: spins without the interpreter lock first; Python: sleeps at once)
Wakeup = _wakeup()
