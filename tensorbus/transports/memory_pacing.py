"""How far a memory:// producer that delivers on its own thread may get ahead of a receive taking its tensors.

Producer and receive share one interpreter lock. A producer sending in a loop lets go of it only every
switch interval (5 ms) or when it waits; a receive lets go of it whenever a call of its own does (a large
tensor's CRC32C, say), and the producer then has it for the next 5 ms. Unpaced, a producer delivering
straight into the consumer's table (memory_frames.py) got up to 2,000 tensors of 64 KB ahead of the receive
taking them (128 MB: fresh pages faulted in, out of the caches), and the receive took about one per switch
interval (docs/PERFORMANCE.md). So while a receive takes tensors, a producer that delivered `BURST` frames
it has not taken (fewer large ones: `BURST_BYTES` of them) pauses until the receive took half of them, or
waits for more, and `BURST_WAIT_S` at most (it looks every eighth of a burst). A consumer that takes nothing
(none for `BURST_WAIT_S`, and no receive woken by the producer waiting to run) never pauses a producer: the
table and `max_unacked_bytes` bound it, as before. Tensors another key's receive has not taken do not count:
they are set aside each time a receive waits for more (`waiting`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Hashable

#: frames a producer delivers ahead of a receive taking them before it pauses ...
BURST = 128
#: ... or fewer, so that they hold at most this many bytes (a memory:// producer's pool recycles as many)
BURST_BYTES = 4 << 20
#: a pause lasts this long at most (the interpreter's switch interval, after which the receive would run anyway)
BURST_WAIT_S = 0.005


class Pace:
    """The positions one endpoint's consumer took, against those handed to it: when a producer pauses.

    Positions are those `Frames` numbers (every frame handed to the consumer, by `put` or `get`); the caller
    passes how many it handed so far, and asks `check` only every few frames (a small tensor's time is
    mostly such steps). Its own lock is a leaf: nothing else is taken while it is held.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)  # (taken, or a receive waits for more)
        self._taken = 0  # positions released by the consumer's ledger: their tensors taken (under the lock)
        #: `_taken` as a producer's `check` last saw it, and when it last saw it grow (monotonic): a receive
        #: is taking tensors while that is recent (under the lock; a take itself only counts)
        self._seen, self._seen_grow = 0, -math.inf
        #: positions handed and not taken when a receive last waited for more: another key's, not counted
        self._aside = 0
        self._waits = 0  # times a receive waited for more (under the lock)
        self._pausing = 0  # producers pausing (under the lock)
        #: `_taken` from which a release wakes the pausing producers (the earliest one's; each looks again
        #: whether it may go on), while any pauses (under the lock)
        self._resume_at = math.inf
        #: a pause a producer on an event loop owes (`owe`): the taken count it waits for, `_waits` then, and
        #: until when (monotonic); None when none is owed (under the lock)
        self._owed: tuple[int, int, float] | None = None

    def released(self, positions: list[Hashable]) -> None:
        """The consumer's ledger released `positions` (its receives took their tensors): the ledger's
        `on_release`, on the taking thread (or a producer's, inside `put`, when a waiting receive took it first)."""
        self._lock.acquire()
        try:
            self._taken += len(positions)
            if self._taken >= self._resume_at:
                self._progress.notify_all()
        finally:
            self._lock.release()

    def waiting(self, handed: int) -> None:
        """A receive waits for more (or the consumer stopped), `handed` positions handed so far: what it left
        untaken is set aside, and a pausing producer goes on."""
        self._lock.acquire()
        try:
            self._aside = handed - self._taken
            self._waits += 1
            if self._pausing:
                self._progress.notify_all()
        finally:
            self._lock.release()

    def check(self, handed: int, nbytes: int, woke: bool) -> tuple[int | None, int]:
        """After a producer handed a frame of `nbytes` to the consumer itself (`handed` positions so far): the
        count of taken positions to pause for (None: go on), and in how many frames to check again (an
        eighth of a burst). `woke`: a receive it woke has not run yet."""
        budget = max(2, min(BURST, BURST_BYTES // max(nbytes, 1)))
        self._lock.acquire()
        try:
            now = time.monotonic()
            if self._taken != self._seen:
                self._seen, self._seen_grow = self._taken, now
            if handed - self._taken - self._aside < budget or not (woke or now - self._seen_grow < BURST_WAIT_S):
                return None, max(1, budget // 8)  # (a burst ahead of nobody taking: the table bounds it)
            return self._taken + budget // 2, max(1, budget // 8)
        finally:
            self._lock.release()

    def owe(self, until: int) -> None:
        """A producer on an event loop's thread, which must not wait there, owes the pause `check` asked for: it is
        held back (`holds_back`) while `pause(until)` would still wait, and a thread that may wait `pay`s it (a
        tensorbus.aio producer's worker thread, to which its sends go meanwhile)."""
        with self._lock:
            self._owed = (until, self._waits, time.monotonic() + BURST_WAIT_S)

    def holds_back(self, handed: int) -> bool:
        """Whether a producer that must not wait (an event loop's) should send from a thread that may: a pause it
        owes (`owe`) has not ended yet (as `pause` would end it: by takes, a receive waiting for more, or
        BURST_WAIT_S), or the consumer has a whole `BURST` of the `handed` positions not taken (another key's set
        aside: a receive on another thread may not have run at all yet)."""
        self._lock.acquire()
        try:
            owed = self._owed
            if owed is not None:
                until, waits, deadline = owed
                if self._taken >= until or self._waits != waits or time.monotonic() >= deadline:
                    self._owed = None
                else:
                    return True
            return handed - self._taken - self._aside >= BURST
        finally:
            self._lock.release()

    def pay(self) -> None:
        """Wait out a pause owed (`owe`), if one is, on a thread that may wait: as `pause` would have, counted from
        when it was owed."""
        with self._progress:
            owed, self._owed = self._owed, None
            if owed is not None:
                until, waits, deadline = owed
                self._wait(until, waits, deadline - time.monotonic())

    def pause(self, until: int) -> None:
        """Wait until `until` positions are taken, a receive waits for more, or `BURST_WAIT_S` passed (the
        caller holds no other lock: the receive needs them)."""
        with self._progress:
            self._wait(until, self._waits, BURST_WAIT_S)

    def _wait(self, until: int, waits: int, timeout: float) -> None:
        """`pause`'s wait, from when `_waits` was `waits`, for `timeout` seconds at most (the caller holds the lock)."""
        self._pausing += 1
        self._resume_at = min(self._resume_at, until)
        try:
            self._progress.wait_for(lambda: self._taken >= until or self._waits != waits, max(0.0, timeout))
        finally:
            self._pausing -= 1
            if not self._pausing:
                self._resume_at = math.inf
