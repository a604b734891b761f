"""Taking turns on the event loop.

A send that finds room, or a receive whose tensor is there already, completes without suspending:
ten thousand of them in a row would hold the loop for as long. Each end keeps a `Turns`, and yields
once (before its next call begins, so a cancellation there cancels nothing done) when the ends of its
thread's loop have run `SLICE_S` without suspending.

The clock is the thread's (an event loop runs on one thread), shared by every end on it: in a
ping-pong the receive suspends each round, so the send beside it need not yield too (a send that
yielded every SLICE_S went out a turn late, after the acks and upkeep queued meanwhile).

So is what its sends tell its receives: a receive that waits after a send on its thread (`sent`,
`replying`) most likely waits for a reply, which a peer gives promptly (socket_reading.py spins
longer for one); a receive with no send since its last (a stream's) waits for what a producer sends
at its own pace. memory:// tells its receives the same (memory_frames.py).
"""

from __future__ import annotations

import threading
import time

#: how long the ends on a loop run without suspending before they let the loop's other tasks run
SLICE_S = 0.001


class _Clock(threading.local):
    def __init__(self) -> None:
        self.since = time.perf_counter()  # when an end on this thread's loop last suspended
        self.sent = False  # a producer on this thread sent since a receive last began to wait (`replying`)


_clock = _Clock()


def sent() -> None:
    """A producer on this thread sends (`Producer.send`)."""
    _clock.sent = True


def replying() -> bool:
    """Whether a producer on this thread sent since the last call (a receive that begins to wait asks)."""
    was, _clock.sent = _clock.sent, False
    return was


class Turns:
    """One end's turns: `due` once the ends on this thread's loop have run SLICE_S since one suspended."""

    def waited(self) -> None:
        """The end just resumed from a suspension (it awaited something that was not ready)."""
        _clock.since = time.perf_counter()

    def due(self) -> bool:
        """Whether the ends on this thread's loop have run SLICE_S without suspending: then the caller
        yields (`await asyncio.sleep(0)`), the clock restarted now (a task cancelled in its turn must not
        take another at once). A plain call, not a coroutine: most calls find no turn due."""
        now = time.perf_counter()
        if now - _clock.since < SLICE_S:
            return False
        _clock.since = now
        return True
