"""The memory:// consumer's delivery: frames handed to the intake, by the producer's `put` or from the queue.

A frame the intake's C delivery takes as it is (a plain tensor with room), while nothing is queued, is
delivered by the producer's `put` itself (`deliver_now`): that costs no thread hand-over at all, and a
receive waiting for it is woken once. Every other frame is queued, and a waiting `recv` delivers it on
its own thread (leading.py), so that hand-over costs one thread wake-up (the producer's `put` waking the
receiver), not two, and none while the receive's wait still spins (`spin_s`, wakeup.py); the thread
`tensorbus-memory-NAME` delivers while no `recv` waits, so `recv_async` callbacks and held-back tensors
are served on a reading thread, never on a producer's. Each frame
delivered either way is kept until the ledger releases it; on close what it did not release goes back to
the front of the queue, for the next consumer of the name.
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
    from .memory_frames import Frames

log = logging.getLogger(__name__)

#: after a `recv` delivered frames itself, how long the background thread waits before it takes over
LINGER_S = 0.002
#: frames delivered in one step at most: the first, waited for, and those queued behind it already
BATCH = 16


class MemoryReader:
    """Delivers the frames of queue `frames` to `deliver`, on a waiting receive's thread or on its own."""

    def __init__(
        self, name: str, frames: Frames, deliver: Deliver, on_stopped: Callable[[], None], spin_s: float = 0.0
    ) -> None:
        self.name, self._frames, self._deliver, self._on_stopped = name, frames, deliver, on_stopped
        self._spin_s = spin_s  # how long a waiting receive's wait for a frame spins before it sleeps (wakeup.py)
        # the leader's, all of them (leading.py: one thread at a time)
        self._held: dict[object, Held] = {}  # source -> the message the consumer holds back (its share is full)
        #: each frame's position, kept there with its source until the ledger releases it (nothing to
        #: acknowledge: a released frame is just let go, and counted as taken for the producers' pace)
        self._stream = deliver.ledger.stream(frames.pace.released)
        self._stop = threading.Event()
        self.leadership = Leadership(LINGER_S, frames.step_aside)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"tensorbus-memory-{name}")
        frames.deliver_with(self._deliver_now)
        self._thread.start()

    def wait(self, done: threading.Lock, deadline: float | None) -> bool:
        """Wait for a receive's `done`, delivering frames on this thread meanwhile."""
        return self.leadership.wait(done, deadline, self._receive_step)

    def _receive_step(self, deadline: float | None, stop: Callable[[], bool]) -> bool:
        """`_step` of a waiting receive: woken too when a producer's `put` delivered a frame itself."""
        return self._step(deadline, stop, receiving=True)

    def _deliver_now(self, frame: Buffer, source: object, position: int, crc: int | None) -> bool:
        """Deliver `frame` on the producer's thread (`Frames.put`, under the queue's lock) if the C delivery
        takes it as it is, booked at `position`: True then; False, with nothing changed, to queue it. `crc`:
        its CRC32C where the producer computed it over this very buffer (None: the delivery computes it)."""
        fast = self._deliver.fast  # (the Python delivery may run callbacks: never on a producer's thread)
        if fast is None or self._stop.is_set():
            return False
        try:
            taken = fast(memoryview(frame), crc, source)
        except Exception:  # (e.g. a MemoryError part way: queued, the Python delivery decides, dropping a copy taken)
            log.debug("memory://%s: the C delivery failed; the frame is queued", self.name, exc_info=True)
            return False
        if taken is None:
            return False
        self._stream.record_admitted(position, taken.message_id, (position, source, frame))
        return True

    def _run(self) -> None:
        try:
            self.leadership.run_in_background(self._step)
        finally:
            with self.leadership.last_lead():
                self._finish()

    def _step(self, deadline: float | None, stop: Callable[[], bool], receiving: bool = False) -> bool:
        """Offer held messages again, then deliver the next frame, waiting for one until `deadline`, and
        those queued behind it, up to `BATCH` (the receives that follow then find them in the table, with
        no lead to take); False once the consumer closed or turned a frame away."""
        if self._held and self._release():
            return False
        for _ in range(BATCH):
            item = self._frames.get(self._stop, deadline, receiving=receiving, spin_s=self._spin_s)
            if item is None:  # stopped, asked to step aside, room for a message held back, or the deadline
                return not self._stop.is_set()
            if not self._deliver_frame(item):
                return False
            if self._held:  # (a message held back: offered again first)
                break
            deadline = 0.0  # (after the first: only the frames queued already)
        return True

    def _deliver_frame(self, item: tuple[int, object, Buffer]) -> bool:
        """Deliver one frame taken from the queue and book it in the ledger; False once the consumer turned it away."""
        position, source, frame = item
        fast = self._deliver.fast
        try:
            taken = fast(memoryview(frame), None, source) if fast is not None else None
            result = self._deliver(frame, may_hold=True, source=source) if taken is None else None
        except Exception:  # (a callback's own errors, even SystemExit, are caught where it is called)
            log.exception("memory://%s: delivering a frame failed", self.name)
            taken, result = None, Delivered(None, True)
        if result is None:  # a plain tensor the C delivery took: booked in the fewest steps
            self._stream.record_admitted(position, taken.message_id, item)  # type: ignore[union-attr]
            self._frames.received(source)
            return True
        self._stream.record(position, result, item)
        if result.refused is not None:
            self._frames.refused(source, result.refused, frame)
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
            if result.refused is not None:  # (a chunked message is held decoded: no frame, its names)
                self._frames.refused(source, result.refused, message.frame, (message.key, message.message_id))
            self._frames.received(source)
            self._deliver.ledger.apply(result)
            if result.turned_away:
                return True
        return False

    def _finish(self) -> None:
        """What the ledger did not release goes back to the queue, in order; held producers are read again."""
        self._frames.deliver_with(None)  # (first: a `put` delivering now finishes, and books its frame, before)
        back = [cast(tuple[int, object, Buffer], kept) for _, kept in self._stream.close_kept()]
        for _, source, frame in reversed(back):  # first in line for the next consumer of the name
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
