"""Taking turns on the event loop.

A send that finds room, or a receive whose tensor is there already, completes without suspending:
ten thousand of them in a row would hold the loop for as long. Each end keeps a `Turns`, and yields
once (before its next call begins, so a cancellation there cancels nothing done) when it has run
`SLICE_S` without suspending.
"""

from __future__ import annotations

import asyncio
import time

#: how long an end runs without suspending before it lets the loop's other tasks run
SLICE_S = 0.001


class Turns:
    """When this end last suspended; `take` yields once it has run SLICE_S since."""

    def __init__(self) -> None:
        self._since = time.perf_counter()

    def waited(self) -> None:
        """The end just suspended (awaited something that was not ready)."""
        self._since = time.perf_counter()

    async def take(self) -> None:
        """Yield to the loop if this end has run SLICE_S without suspending."""
        now = time.perf_counter()
        if now - self._since >= SLICE_S:
            self._since = now  # (first: a task cancelled in its turn must not take another at once)
            await asyncio.sleep(0)
