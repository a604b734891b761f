"""The memory:// consumer's delivery: frames taken from the endpoint's queue and handed to the intake.

A waiting `recv` delivers on its own thread (leading.py), so an in-process hand-over costs one
thread wake-up (the producer's `put` waking the receiver), not two; the thread
`tensorbus-memory-NAME` delivers while no `recv` waits. Each frame delivered is kept until the ledger
releases it; on close what it did not release goes back to the front of the queue, for the next
consumer of the name.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from ..codec.frame import Buffer
from .base import Deliver, Delivered, Held
from .leading import Leadership

if TYPE_CHECKING:
    from .memory import Frames

log = logging.getLogger(__name__)

#: after a `recv` delivered frames itself, how long the background thread waits before it takes over
LINGER_S = 0.002
#: frames delivered in one step at most: the first, waited for, and those queued behind it already
BATCH = 16


class MemoryReader:
    """Delivers the frames of queue `frames` to `deliver`, on a waiting receive's thread or on its own."""

    def __init__(self, name: str, frames: Frames, deliver: Deliver, on_stopped: Callable[[], None]) -> None:
        self.name, self._frames, self._deliver, self._on_stopped = name, frames, deliver, on_stopped
        # the leader's, all of them (leading.py: one thread at a time)
        self._held: dict[object, Held] = {}  # source -> the message the consumer holds back (its share is full)
        self._position = 0
        #: each frame's position, kept there with its source until the ledger releases it (nothing to
        #: acknowledge: a released frame is just let go)
        self._stream = deliver.ledger.stream()
        self._stop = threading.Event()
        self.leadership = Leadership(LINGER_S, frames.step_aside)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"tensorbus-memory-{name}")
        self._thread.start()

    def wait(self, done: threading.Lock, deadline: float | None) -> bool:
        """Wait for a receive's `done`, delivering frames on this thread meanwhile."""
        return self.leadership.wait(done, deadline, self._step)

    def _run(self) -> None:
        try:
            self.leadership.run_in_background(self._step)
        finally:
            with self.leadership.last_lead():
                self._finish()

    def _step(self, deadline: float | None, stop: Callable[[], bool]) -> bool:
        """Offer held messages again, then deliver the next frame, waiting for one until `deadline`, and
        those queued behind it, up to `BATCH` (the receives that follow then find them in the table, with
        no lead to take); False once the consumer closed or turned a frame away."""
        if self._held and self._release():
            return False
        for _ in range(BATCH):
            item = self._frames.get(self._stop, deadline)
            if item is None:  # stopped, asked to step aside, room for a message held back, or the deadline
                return not self._stop.is_set()
            if not self._deliver_frame(item):
                return False
            if self._held:  # (a message held back: offered again first)
                break
            deadline = 0.0  # (after the first: only the frames queued already)
        return True

    def _deliver_frame(self, item: tuple[object, Buffer]) -> bool:
        """Deliver one frame and book it in the ledger; False once the consumer turned it away."""
        source, frame = item
        self._position += 1
        fast = self._deliver.fast
        try:
            taken = fast(memoryview(frame), None, source) if fast is not None else None
            result = self._deliver(frame, may_hold=True, source=source) if taken is None else None
        except Exception:  # (a callback's own errors, even SystemExit, are caught where it is called)
            log.exception("memory://%s: delivering a frame failed", self.name)
            taken, result = None, Delivered(None, True)
        if result is None:  # a plain tensor the C delivery took: booked in the fewest steps
            self._stream.record_admitted(self._position, taken.message_id, item)  # type: ignore[union-attr]
            self._frames.received(source)
            return True
        self._stream.record(self._position, result, item)
        if result.held is not None:
            self._held[source] = result.held
            self._frames.hold(source)  # (then offered again at once: the room may have opened meanwhile)
        elif not result.turned_away:  # (a frame turned away goes back to the queue, in `_finish`)
            self._frames.received(source)
        return not result.turned_away

    def _release(self) -> bool:
        """Offer the messages held back again; read their producers again once they are taken. True when
        one was turned away (the consumer is closing)."""
        for source, message in list(self._held.items()):
            try:
                result = self._deliver.release(message)
            except Exception:  # (as in `_step`)
                log.exception("memory://%s: delivering a frame failed", self.name)
                continue
            if result is None:  # no room yet
                continue
            if result.held is not None:  # held again: the room went meanwhile
                self._held[source] = result.held
                continue
            del self._held[source]
            self._frames.received(source)
            self._deliver.ledger.apply(result)
            if result.turned_away:
                return True
        return False

    def _finish(self) -> None:
        """What the ledger did not release goes back to the queue, in order; held producers are read again."""
        back = [cast(tuple[object, Buffer], kept) for _, kept in self._stream.close_kept()]
        for source, frame in reversed(back):  # first in line for the next consumer of the name
            self._frames.put(frame, source=source, front=True)
        self._frames.ended()  # the next consumer reads them all
        self._on_stopped()  # here, not in close: close may run on a delivering thread (in a callback)

    def room_opened(self) -> None:
        """The consumer may have room for a message held back: offer it again (under the table's lock: no waiting)."""
        if self._held:
            self._frames.wake_up()

    def close(self) -> None:
        """Stop delivering. From a callback on a delivering thread it returns at once: the delivery stops,
        and frees the name, once the callback returns."""
        self._stop.set()
        self.leadership.stop()
        if threading.current_thread() is self._thread or self.leadership.is_leading():
            return
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            log.error("memory://%s: the delivering thread has not stopped; the name is taken until it does", self.name)
