"""A memory:// endpoint's queue of frames (`Frames`), and its rule for delivering on the producer's thread.

The transport (memory.py) puts its producers' frames here; the consumer's delivery (memory_reading.py)
takes them, or has `put` deliver them itself while nothing is queued.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import weakref
from collections.abc import Callable

from ..codec.frame import Buffer, MessageId
from .memory_pacing import Pace
from .refusals import Refusals
from .tally import Tally
from .wakeup import Wakeup

#: `Frames._next_source` when no frame can be read
_NOTHING = object()

#: per thread, `sent` is true once it put a frame (into any endpoint) since it last waited in `get`: such a
#: receive waits for a reply (a round trip), which comes quickly, so its wait spins; one that only receives
#: (a stream) sleeps at once, as its producer sends on and lets go of the interpreter lock only every burst
_SENDING = threading.local()


def _on_event_loop() -> bool:
    """Whether this thread runs an event loop: a producer there never pauses for a receive (`Pace`), which may
    be a task of that very loop; it owes the pause (`Pace.owe`), and its next sends go where they may wait."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Frames:
    """One endpoint's frames, queued per producer (`source`) and taken oldest first; a frame the
    closing consumer turned away goes back to the front.

    While nothing is queued or being delivered, a frame the consumer's C delivery takes as it is (a
    plain tensor with room in the table) is delivered by `put` itself, on the producer's thread, under
    this queue's lock (`deliver_now`): a hand-over to the delivering thread costs more than the
    delivery. Every other frame is queued, and so is every frame behind a queued one, so each
    producer's frames keep their order; both ways number the frames under the lock (`position`).

    Producer and consumer threads share one interpreter lock: a receive woken by `put`, or taking what
    `put` delivered, runs only while the producer lets go of it, which a producer sending in a loop does
    only every switch interval (5 ms), by when hundreds of tensors wait in the table, out of the caches,
    and survive into the older garbage collector generations (their cost grows with that backlog). So a
    producer that delivered a burst ahead of the receive taking them pauses after its `put` (`pace`,
    memory_pacing.py): the receive then takes them while they are fresh.

    A producer whose tensor the consumer holds back (`hold`: its share of the table is full) is not
    read meanwhile, as a socket consumer stops reading one connection; the others are. The bytes each
    producer has queued are counted, so that it can wait for room (backpressure, as a socket's
    unacknowledged bytes bound a producer there), and so are those the consumer took and its table has
    not (being delivered, or held back), so that a flush waits for them too.
    """

    def __init__(self) -> None:
        #: source -> its frames, each with its arrival number (lower: older), oldest first
        self._queues: dict[object, collections.deque[tuple[int, Buffer]]] = {}
        #: queued bytes per source (plain dicts, not Counters: a Counter's `del` and missing keys are
        #: Python-level calls, and these change twice per frame); sources with none are not there
        self._bytes: dict[object, int] = {}
        #: bytes per source the consumer took and its table did not yet (being delivered, or held back)
        self._unreceived: dict[object, int] = {}
        self._newest = self._oldest = 0  # arrival numbers given at the back and at the front
        self._held: set[object] = set()  # sources not read while the consumer holds their tensor back
        #: `get` returns: `wake_up` (to offer held tensors again), `step_aside`, or a `put` that delivered a frame
        #: a waiting receive may want, was called
        self._woken = False
        #: guards everything here; `with self._lock` where nothing waits (a Condition's `__enter__` is a
        #: Python-level call, and this lock is taken three times per frame)
        self._lock = threading.Lock()
        #: rung (under `_lock`) to wake the thread waiting in `get`: there is one, the leader (leading.py), so
        #: this does what a Condition would, without its Python-level wait and notify (each a small tensor's
        #: cost); a waiting receive's wait spins first, without the interpreter lock (wakeup.py)
        self._ready = Wakeup()
        self._room = threading.Condition(self._lock)  # (a frame went)
        #: threads waiting in `get` and on `_room` (under the lock): a wake-up with nobody waiting is skipped
        self._getting = self._wanting_room = 0
        #: the thread waiting in `get` is a waiting receive (`get(..., receiving=True)`), which a frame
        #: `deliver_now` took may be for; the background thread is not woken for those (under the lock)
        self._receiving = False
        #: the listening consumer's delivery of a frame on the producer's thread (`deliver_now(frame, source,
        #: position, crc)`, called under the lock: True once delivered and booked), while it listens; else None
        self.deliver_now: Callable[[Buffer, object, int, int | None], bool] | None = None
        self._position = 0  # the position of the last frame delivered or taken (under the lock)
        #: `put` woke the waiting receive, which has not run since (under the lock)
        self._woke_receive = False
        #: when a producer delivering itself pauses for the receive taking its tensors (its own lock, taken
        #: inside this one; the consumer's ledger tells it what was taken: `Pace.released`)
        self.pace = Pace()
        self._unchecked = 1  # frames `put` delivers before it asks `pace` again (under the lock)
        #: source -> its producer's record of refused messages (`refused` tells it; its own lock), while it lives
        self._refusals: weakref.WeakValueDictionary[object, Refusals] = weakref.WeakValueDictionary()

    @property
    def nbytes(self) -> int:
        """Bytes of the frames queued, of every producer."""
        with self._lock:
            return sum(self._bytes.values())

    def put(
        self,
        frame: Buffer,
        *,
        source: object = None,
        front: bool = False,
        nbytes: int | None = None,
        crc: int | None = None,
    ) -> None:
        """Queue `frame` of `source` (`nbytes` long, and its CRC32C `crc`, if the caller knows), at the back or,
        `front`, first in line; or deliver it now (`deliver_now`), then pause if the receive taking what
        producers delivered themselves fell a burst behind (`pace`)."""
        _SENDING.sent = True
        until = self._deliver_or_queue(frame, source, front, nbytes, crc)
        if until is None:
            return
        if _on_event_loop():  # (its receive may be a task of this very loop, which a pause here would hold)
            self.pace.owe(until)
        else:  # (without this queue's lock: the receive needs it)
            self.pace.pause(until)

    def _deliver_or_queue(
        self, frame: Buffer, source: object, front: bool, nbytes: int | None, crc: int | None
    ) -> int | None:
        """`put` under the lock: after delivering it now, the taken count to pause for (`Pace.check`)."""
        with self._lock:
            if self.deliver_now is not None and not front and not self._queues and not self._unreceived:
                # (nothing of any producer queued, being delivered or held back: none is overtaken)
                if self.deliver_now(frame, source, self._position + 1, crc):
                    self._position += 1
                    if self._getting and self._receiving and not self._woke_receive:  # (it may be the one it waits for)
                        self._woken = True
                        self._wake_getter()
                        self._woke_receive = True
                    self._unchecked -= 1
                    if self._unchecked > 0:
                        return None
                    size = memoryview(frame).nbytes if nbytes is None else nbytes
                    until, self._unchecked = self.pace.check(self._position, size, self._woke_receive)
                    return until
            if nbytes is None:
                nbytes = memoryview(frame).nbytes
            queue = self._queues.get(source)
            if queue is None:
                queue = self._queues[source] = collections.deque()
            if front:
                self._oldest -= 1
                queue.appendleft((self._oldest, frame))
            else:
                self._newest += 1
                queue.append((self._newest, frame))
            self._bytes[source] = self._bytes.get(source, 0) + nbytes
            self._wake_getter()
            return None

    def get(
        self, stop: threading.Event, deadline: float | None = None, *, receiving: bool = False, spin_s: float = 0.0
    ) -> tuple[int, object, Buffer] | None:
        """The oldest frame of a producer not held back, with its position and source, waiting for one until
        `deadline` (monotonic; None: no limit); None once `stop` is set (the frames stay queued), `wake_up`
        or `step_aside` was called, the deadline passed, or (`receiving`: the caller is a waiting receive)
        `put` delivered a frame itself. A waiting receive whose thread sent a frame since it last waited here
        (it waits for the reply) spins `spin_s` before it sleeps (wakeup.py)."""
        if receiving and getattr(_SENDING, "sent", False):
            _SENDING.sent = False
        else:
            spin_s = 0.0
        with self._lock:
            self._receiving = receiving
            while (source := self._next_source()) is _NOTHING and not stop.is_set() and not self._woken:
                if deadline is not None and (left := deadline - time.monotonic()) <= 0:
                    break
                self._getting += 1
                if receiving:  # (it caught up: what it left in the table is another key's)
                    self.pace.waiting(self._position)
                self._lock.release()
                try:
                    came = self._ready.wait(None if deadline is None else left, spin_s)
                finally:
                    self._lock.acquire()
                    self._getting -= 1
                    if receiving:  # (woken by `put`, if it was: it runs now)
                        self._woke_receive = False
                if not came:
                    break
            self._woken = False
            if stop.is_set() or source is _NOTHING:
                return None
            queue = self._queues[source]
            frame = queue.popleft()[1]
            if not queue:
                del self._queues[source]
            nbytes = memoryview(frame).nbytes
            queued = self._bytes[source] - nbytes
            if queued:
                self._bytes[source] = queued
            else:
                del self._bytes[source]
            self._unreceived[source] = self._unreceived.get(source, 0) + nbytes
            self._room_went()
            self._position += 1
            return self._position, source, frame

    def _next_source(self) -> object:
        """The source of the oldest frame not held back (caller holds the lock), else `_NOTHING`."""
        if len(self._queues) == 1 and not self._held:  # (the commonest: one producer)
            return next(iter(self._queues))
        oldest, found = None, _NOTHING
        for source, queue in self._queues.items():
            if source not in self._held and (oldest is None or queue[0][0] < oldest):
                oldest, found = queue[0][0], source
        return found

    def deliver_with(self, deliver_now: Callable[[Buffer, object, int, int | None], bool] | None) -> None:
        """Let `put` deliver frames itself with `deliver_now` (a listening consumer's), or no longer (None)."""
        with self._lock:
            self.deliver_now = deliver_now

    def hold(self, source: object) -> None:
        """Stop reading `source`: the consumer holds its tensor back (its bytes stay unreceived)."""
        with self._lock:
            self._held.add(source)

    def tell_refusals(self, source: object, refusals: Refusals) -> None:
        """Where to tell the producer `source` of its messages the consumer refused (for as long as it lives)."""
        with self._lock:
            self._refusals[source] = refusals

    def refused(
        self,
        source: object,
        reason: str,
        frame: Buffer | None,
        names: tuple[str | None, MessageId | None] | None = None,
    ) -> None:
        """The consumer refused a message of `source` for `reason` (its `frame`, or where that is gone its `names`,
        key and message id): its producer's next send or flush raises `Rejected` (told before `received`, so that
        a flush ended by it sees the refusal)."""
        with self._lock:
            refusals = self._refusals.get(source)
        if refusals is not None:
            refusals.add(reason, frame, names)

    def received(self, source: object) -> None:
        """The consumer's table took (or settled) what the consumer had taken of `source`: read it again."""
        with self._lock:
            if self._held:
                self._held.discard(source)
            self._unreceived.pop(source, None)
            self._room_went()

    def _wake_getter(self) -> None:
        """Wake the thread waiting in `get`, if one is (caller holds the lock). A ring the getter did not
        take (it stopped waiting meanwhile) is not lost: its next wait returns at once, and it looks again."""
        if self._getting:
            self._ready.ring()

    def _room_went(self) -> None:
        """Wake the threads waiting for room or for their frames to be received (caller holds the lock)."""
        if self._wanting_room:
            self._room.notify_all()

    def ended(self) -> None:
        """The consumer stopped, and what it did not release is queued again: nothing is held or taken by it."""
        with self._lock:
            self._held.clear()
            self._unreceived.clear()
            self._room_went()
            self.pace.waiting(self._position)  # (what it did not take is queued again: not ahead of anyone)

    def wait_for_room(
        self, limit: int, timeout: float | None, source: object = None, tally: Tally | None = None
    ) -> bool:
        """Wait while `source` has `limit` bytes or more queued: True once fewer, False after `timeout` seconds.
        The seconds waited go to `tally` (its `blocked_s` is written under this queue's lock)."""
        if self._bytes.get(source, 0) < limit:  # a quick look without the lock first: the common case on every send
            return True
        return self._wait_for_room(lambda: self._bytes.get(source, 0) < limit, timeout, tally)

    def wait_until_received(self, timeout: float | None, source: object) -> bool:
        """Wait until every frame of `source` is in the consumer's table (or settled): True then, False after
        `timeout` seconds. A frame the consumer holds back (its table is full) is not, as on a socket."""
        return self._wait_for_room(lambda: not self._bytes.get(source) and not self._unreceived.get(source), timeout)

    def _wait_for_room(self, predicate: Callable[[], bool], timeout: float | None, tally: Tally | None = None) -> bool:
        with self._room:
            self._wanting_room += 1
            started = time.monotonic()
            try:
                return self._room.wait_for(predicate, timeout)
            finally:
                self._wanting_room -= 1
                if tally is not None:  # (backpressure: the seconds waited, counted under this lock)
                    tally.blocked(started)

    def has_room(self, limit: int, source: object) -> bool:
        """Whether a send of `source` would go out at once, for a caller that must not wait to know (an event
        loop): fewer than `limit` bytes queued (`wait_for_room`), the pace not holding it back (`Pace.holds_back`:
        a pause owed, or a burst ahead of the receives, which a receive on another thread may not run to take
        while the loop's thread sends on), and this queue's lock free now (another thread may hold it while it
        delivers a large frame itself). False if unsure."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._bytes.get(source, 0) < limit and not self.pace.holds_back(self._position)
        finally:
            self._lock.release()

    def queued(self, source: object) -> int:
        """Bytes `source` has queued."""
        with self._lock:
            return self._bytes.get(source, 0)

    def unreceived(self, source: object) -> int:
        """Bytes of `source` not in the consumer's table yet: queued, being delivered, or held back."""
        with self._lock:
            return self._bytes.get(source, 0) + self._unreceived.get(source, 0)

    def wake_up(self) -> None:
        """Make a waiting `get` return (None) while a source is held back: the consumer may have room for its tensor."""
        with self._lock:
            if self._held:
                self._woken = True
                self._wake_getter()

    def step_aside(self) -> None:
        """Make a waiting `get` return (None): another thread is to deliver (leading.py)."""
        with self._lock:
            self._woken = True
            self._wake_getter()

    def __len__(self) -> int:
        """Frames waiting to be delivered."""
        with self._lock:
            return sum(len(queue) for queue in self._queues.values())
