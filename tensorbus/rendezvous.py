"""The key-matching table: sends never block, receives wait (or call back) until their key arrives.

Semantics follow TensorFlow's Rendezvous: a consumer may ask for a key before or after it is
produced, each key is a FIFO, a waiting consumer can time out or be cancelled, and `abort` fails
everything pending and everything later.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .codec import Message, SparseTensor
from .errors import Aborted, CallbackInterrupted, Cancelled, ConfigError, StaleIncarnation, Timeout, brief
from .intake_state import ANY, Callback, Handoff, TableState, Waiter
from .keys import MAX_KEY_CHARS, check_key, may_name_incarnation, parse_key
from .options import finite_timeout

log = logging.getLogger(__name__)

#: sources whose newest incarnation the table remembers for fencing (the least recently seen are forgotten)
MAX_SOURCES = 65536


def tensor_nbytes(tensor: Any) -> int:
    """Bytes of array memory a received object holds (what the buffer limit counts)."""
    if isinstance(tensor, np.ndarray):
        return tensor.nbytes
    if isinstance(tensor, SparseTensor):
        return tensor.indices.nbytes + tensor.values.nbytes
    if isinstance(tensor, (dict, list, tuple)):  # a bundle or a structure (its depth bounded when decoded)
        return sum(tensor_nbytes(v) for v in (tensor.values() if isinstance(tensor, dict) else tensor))
    return int(getattr(tensor, "nbytes", 0))  # a torch tensor; 0 for a structure's scalars (counted with its header)


def message_nbytes(message: Message) -> int:
    """What a buffered message counts against the limit: its arrays, plus its frame's header (metadata)."""
    return tensor_nbytes(message.tensor) + message.header_bytes


def per_producer_limit(max_buffered_bytes: int, per_producer: int | None) -> int:
    """The bytes one producer may have buffered: `per_producer`, by default half the table; a
    `ConfigError` for a limit that is not positive or one above the table's (it would never bind)."""
    if max_buffered_bytes <= 0:
        raise ConfigError(f"max_buffered_bytes must be positive, got {max_buffered_bytes}")
    if per_producer is None:
        return max(1, max_buffered_bytes // 2)
    if per_producer <= 0 or per_producer > max_buffered_bytes:
        raise ConfigError(
            f"max_buffered_bytes_per_producer must be positive and at most max_buffered_bytes "
            f"({max_buffered_bytes}), got {per_producer}"
        )
    return per_producer


#: `wait_for_room` without a message's key: only room will do
_ANY_ROOM = object()


class RecvHandle:
    """Returned by `recv_async`; `cancel()` withdraws the request if it has not been served yet."""

    def __init__(self, table: Rendezvous, waiter: Waiter) -> None:
        self._table, self._waiter = table, waiter

    def cancel(self) -> bool:
        """Cancel; the callback then receives a `Cancelled` error. False if it already ran."""
        return self._table._fail_waiter(self._waiter, Cancelled(f"recv of {self._waiter.key!r} was cancelled"))


class Rendezvous(TableState):
    """A thread-safe table that matches sent messages with receivers by key.

    Unmatched messages are buffered up to `max_buffered_bytes`; past it, `send` still succeeds but
    `wait_for_room` blocks, which is how transports stop reading from the network (backpressure).
    A transport that can stop reading one producer alone names it (`source`) with each message: a
    producer with `max_buffered_bytes_per_producer` or more buffered has no room, whatever the others have.
    Its queues and counts are its `TableState` (intake_state.py): the intake's C delivery puts
    messages there too, under `_lock`, as `put` does.
    """

    def __init__(
        self, *, max_buffered_bytes: int = 1 << 30, max_buffered_bytes_per_producer: int | None = None
    ) -> None:
        self.max_buffered_bytes = max_buffered_bytes
        self.max_source_bytes = per_producer_limit(max_buffered_bytes, max_buffered_bytes_per_producer)
        self.buffered_bytes = 0
        #: source -> bytes its buffered messages count (only sources with some; None is no source)
        self._by_source: dict[object, int] = {}
        #: guards everything below; `with self._lock` rather than `with self._cond`: a Condition's
        #: `__enter__` is a Python-level call, and this lock is taken twice per tensor
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        #: buffered messages by arrival number, each with the bytes it counts (as counted when it came:
        #: a dict sent in-process may change later, and the count must come back down to zero) and its source
        self._arrivals: collections.OrderedDict[int, tuple[Message, int, object]] = collections.OrderedDict()
        self._by_key: dict[str | None, collections.deque[int]] = {}
        self._waiters: dict[object, collections.deque[Waiter]] = {}
        #: hash of a source name -> its newest incarnation, newest use last (names come from peers and
        #: may be long: only their hashes are kept, at a fixed cost per source)
        self._incarnations: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._counter = 0
        #: messages receives took from the table (not handed to them as they waited): a sign the application
        #: receives, for a transport's background reading (`taken_count`)
        self._taken = 0
        #: (arrival number, time) at each `drop_unclaimed`: every message up to that number had come by then
        self._marks: collections.deque[tuple[int, float]] = collections.deque()
        self._aborted: Aborted | None = None
        #: messages `abort` dropped unreceived (a transport must not acknowledge them on the way out)
        self.dropped = 0
        self.stats = collections.Counter[str]()
        #: set by a consumer whose transport can read on the waiting thread: `read_while_waiting(done,
        #: deadline)` waits for the waiter's lock `done` (True) or the deadline (False), reading frames meanwhile
        self.read_while_waiting: Callable[[threading.Lock, float | None], bool] | None = None
        #: set by a consumer whose transport holds messages that did not fit: called (under the
        #: table's lock, so it must not block) when room opens or a receiver starts waiting
        self.room_opened: Callable[[], None] | None = None
        #: called with each message as it is handed to the application (a recv returning it, a
        #: callback about to get it), on the receiving thread: a consumer records it as delivered
        self.on_delivered_to_application: Callable[[Message], None] | None = None
        #: called with a message the table refused on its way back in (a newer incarnation arrived
        #: meanwhile): it was dropped for that reason, so its frames may be acknowledged
        self.on_refused_back: Callable[[Message], None] | None = None

    # -- producing ------------------------------------------------------------------------------

    def send(self, key: str, tensor: Any, *, metadata: dict[str, Any] | None = None) -> None:
        """Hand a tensor to whoever receives `key`, now or later; never blocks."""
        check_key(key)
        self.put(Message(key, tensor, dict(metadata or {})))

    def put(self, message: Message, *, first: bool = False, source: object = None) -> None:
        """Deliver a decoded message (what transports call); never blocks. `first`: ahead of those buffered;
        `source`: the producer it counts against while buffered (None: none)."""
        waiter = stale = None
        key = message.key
        with self._lock:
            self._raise_if_aborted()
            if may_name_incarnation(key):
                stale = self._fence(key)
            waiters = self._waiters
            for wanted in ((key,) if stale is not None else (key, ANY)) if waiters else ():
                queue = waiters.get(wanted)
                if queue:
                    waiter = queue.popleft()
                    if not queue:
                        del waiters[wanted]
                    break
            if waiter is None and stale is None:
                self._counter += 1
                nbytes = message_nbytes(message)
                self._arrivals[self._counter] = (message, nbytes, source)
                numbers = self._by_key.get(key)
                if numbers is None:
                    numbers = self._by_key[key] = collections.deque()
                if first:
                    self._arrivals.move_to_end(self._counter, last=False)
                    numbers.appendleft(self._counter)
                else:
                    numbers.append(self._counter)
                self.buffered_bytes += nbytes
                if source is not None:
                    self._by_source[source] = self._by_source.get(source, 0) + nbytes
                self.stats["buffered"] += 1
                return
        if stale is not None:  # a receiver of the key fails now: the tensor it waits for will never come
            if waiter is not None:
                self._complete(waiter, StaleIncarnation(*stale.args))
            raise stale
        assert waiter is not None
        self._complete(waiter, message)

    def _fence(self, key: str) -> StaleIncarnation | None:
        """The error for a key that names an older incarnation of a source than one already seen, else None."""
        try:
            parsed = parse_key(key)
        except ConfigError:
            return None
        source = hash(parsed.src)
        newest = self._incarnations.get(source, -1)
        if parsed.src_incarnation < newest:
            self.stats["stale"] += 1
            return StaleIncarnation(
                f"key {brief(key)} names incarnation {parsed.src_incarnation:x} of {brief(parsed.src)}, "
                f"but incarnation {newest:x} has already been seen"
            )
        self._incarnations[source] = parsed.src_incarnation
        self._incarnations.move_to_end(source)
        if len(self._incarnations) > MAX_SOURCES:  # sources are chosen by peers: forget the longest quiet
            self._incarnations.popitem(last=False)
        return None

    # -- consuming -------------------------------------------------------------------------------

    def recv(self, key: str, timeout: float | None = None) -> Any:
        """Return the next tensor sent under `key`, waiting up to `timeout` seconds (None: forever)."""
        return self.recv_message(key, timeout).tensor

    def recv_message(self, key: str, timeout: float | None = None) -> Message:
        """Like `recv`, but return the whole `Message` (key, tensor, metadata, message id)."""
        if type(key) is not str or len(key) > MAX_KEY_CHARS:  # (a plain key, the commonest, needs no call)
            check_key(key)  # (None: the messages sent with no key)
        take = self._take_buffered  # (a message buffered already, taken in C where built: intake_state.py)
        if take is not None and (message := take(key, timeout)) is not None:
            on_taken = self.on_delivered_to_application  # (`_hand_out`)
            if on_taken is not None:
                on_taken(message)
            return message
        return self._wait(key, timeout)

    def next_message(self, timeout: float | None = None) -> Message:
        """Return the oldest unclaimed message of any key (arrival order), waiting if there is none."""
        return self._wait(ANY, timeout)

    def recv_async(self, key: str, callback: Callback) -> RecvHandle:
        """Call `callback(message, None)` once `key` arrives, or `callback(None, error)`; never blocks."""
        check_key(key)  # (None: the messages sent with no key)
        if not callable(callback):  # (here, not as a traceback logged when the tensor comes)
            raise ConfigError(f"recv_async needs a callable callback(message, error), got {brief(callback)}")
        return self.wait_async(key, callback)

    def wait_async(self, key: object, callback: Callback) -> RecvHandle:
        """`recv_async` of a checked key, or of ANY (the oldest message of any key)."""
        waiter = Waiter(key, callback)
        with self._lock:
            message = self._take(key) if self._aborted is None else None
            if message is None and self._aborted is None:
                self._add_waiter(waiter)
                return RecvHandle(self, waiter)
        self._complete(waiter, message if message is not None else self._abort_error())
        return RecvHandle(self, waiter)

    def _add_waiter(self, waiter: Waiter) -> None:
        """Queue a receiver (caller holds the lock); wakes a transport waiting for room for this key."""
        queue = self._waiters.get(waiter.key)
        if queue is None:  # (not `setdefault`: that would make a deque for every receive)
            queue = self._waiters[waiter.key] = collections.deque()
        queue.append(waiter)
        if self.buffered_bytes >= self.max_buffered_bytes:
            self._room_opened()
        elif self._by_source and self.room_opened is not None:  # a producer at its share may hold this key
            self.room_opened()

    def _take(self, key: object) -> Message | None:
        """Pop the oldest buffered message for `key` (ANY: of any key). Caller holds the lock."""
        if key is ANY:
            if not self._arrivals:
                return None
            _, (message, nbytes, source) = self._arrivals.popitem(last=False)
            numbers = self._by_key[message.key]
            numbers.popleft()
        else:
            numbers = self._by_key.get(key)  # type: ignore[call-overload]  # (key is a str here: not ANY)
            if not numbers:
                return None
            message, nbytes, source = self._arrivals.pop(numbers.popleft())
        if not numbers:
            del self._by_key[message.key]
        self._taken += 1
        self.buffered_bytes -= nbytes
        opened = self.buffered_bytes + nbytes >= self.max_buffered_bytes > self.buffered_bytes
        if source is not None:
            opened = self._uncount(source, nbytes) or opened
        if opened:
            self._room_opened()
        return message

    def taken_count(self) -> int:
        """How many messages receives have taken from the table so far (those handed to a waiting receive
        aside): it grows while the application receives without waiting."""
        with self._lock:
            return self._taken

    def _uncount(self, source: object, nbytes: int) -> bool:
        """A buffered message of `source` left the table (caller holds the lock); True if that gave the
        source room again."""
        left = self._by_source[source] - nbytes
        if left > 0:
            self._by_source[source] = left
        else:
            del self._by_source[source]
        return left < self.max_source_bytes <= left + nbytes

    def _room_opened(self) -> None:
        """Wake whatever waits for room (a transport in `wait_for_room`, or one holding messages back)."""
        self._cond.notify_all()
        if self.room_opened is not None:
            self.room_opened()

    def _wait(self, key: object, timeout: float | None) -> Message:
        """Take the oldest message of `key` (ANY: of any key), waiting (and reading, where the transport
        can) until `timeout`. A message buffered already costs no call beyond `_take` and the take's hook:
        a small tensor's receive is mostly such steps."""
        timeout = finite_timeout(timeout)
        with self._lock:
            if self._aborted is not None:
                raise self._abort_error()
            message = self._take(key)
            if message is None:
                waiter = Waiter(key, None)
                self._add_waiter(waiter)
        if message is not None:
            on_taken = self.on_delivered_to_application  # (`_hand_out`)
            if on_taken is not None:
                on_taken(message)
            return message
        assert waiter.done is not None
        try:
            if self.read_while_waiting is not None:
                deadline = None if timeout is None else time.monotonic() + max(timeout, 0)
                served = self.read_while_waiting(waiter.done, deadline)
            else:
                served = waiter.done.acquire(timeout=-1 if timeout is None else max(timeout, 0))
        except BaseException as exc:  # e.g. Ctrl-C: a waiter left queued would swallow the next tensor
            if not self._fail_waiter(waiter, exc):
                self._requeue(waiter)
            raise
        if not served:
            what = "no message" if key is ANY else f"no tensor for key {key!r}"
            if not self._fail_waiter(waiter, Timeout(f"{what} within {timeout}s")):
                waiter.done.acquire()  # served just as the time ran out: the result is being handed over
        if isinstance(waiter.result, BaseException):
            raise waiter.result
        assert waiter.result is not None
        return self._hand_out(waiter.result)

    def take_now(self, key: object) -> Message | None:
        """The oldest message of `key` (ANY: of any key) buffered now, handed out (taken); None when none
        is, or the table was aborted (a wait says so). A receive that need not wait (tensorbus.aio); a key's
        taken in C where built, as `recv_message` takes it."""
        take = self._take_buffered
        if take is not None and key is not ANY and (message := take(key, None)) is not None:  # type: ignore[arg-type]
            return self._hand_out(message)
        with self._lock:
            message = self._take(key) if self._aborted is None else None
        return None if message is None else self._hand_out(message)

    def hand_out(self, message: Message) -> Message:
        """A message a `Handoff` callback had is now the application's (recorded as taken)."""
        return self._hand_out(message)

    def put_back(self, message: Message) -> None:
        """A message a `Handoff` callback had, whose receiver went away: first in line again, not taken."""
        self._put_back(message)

    def _put_back(self, message: Message) -> None:
        """`message` first in line again; one now stale is dropped (and said so), one after an abort is gone anyway."""
        try:
            self.put(message, first=True)
        except StaleIncarnation:
            if self.on_refused_back is not None:
                self.on_refused_back(message)
        except Aborted:
            pass

    def _hand_out(self, message: Message) -> Message:
        if self.on_delivered_to_application is not None:
            self.on_delivered_to_application(message)
        return message

    def _requeue(self, waiter: Waiter) -> None:
        """A receive interrupted just as it was served: its message goes back, first in line."""
        assert waiter.done is not None
        waiter.done.acquire(timeout=1.0)  # `_complete` sets the result, then releases it (unless we hold it)
        if isinstance(waiter.result, Message):
            self._put_back(waiter.result)  # (the interruption is what the caller hears of)

    def _fail_waiter(self, waiter: Waiter, error: BaseException) -> bool:
        with self._lock:
            queue = self._waiters.get(waiter.key)
            if queue is None or waiter not in queue:
                return False
            queue.remove(waiter)
            if not queue:
                del self._waiters[waiter.key]
        self._complete(waiter, error)
        return True

    def _complete(self, waiter: Waiter, result: Message | BaseException | None) -> None:
        waiter.result = result
        if waiter.done is not None:
            waiter.done.release()
            return
        assert waiter.callback is not None
        try:
            if isinstance(result, BaseException):
                waiter.callback(None, result)
            else:
                handed = result if isinstance(waiter.callback, Handoff) else self._hand_out(result)  # type: ignore[arg-type]
                waiter.callback(handed, None)
        except BaseException as exc:  # even SystemExit: the thread delivering is a transport's, not the callback's
            log.exception("recv_async callback for %s raised", brief(waiter.key))
            if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                # Ctrl-C while the application's own thread was delivering: it is the application's,
                # and the callback had the message (whoever delivered it must not offer it again)
                raise CallbackInterrupted(*exc.args) from exc

    # -- flow control and shutdown ----------------------------------------------------------------

    def wait_for_room(self, timeout: float | None = None, *, key: object = _ANY_ROOM) -> bool:
        """Block while the buffered bytes are at the limit; True once there is room (or aborted).

        With `key` (a message's key), also True as soon as a receiver waits for it: that message
        is handed over, not buffered, so it needs no room.
        """
        timeout = finite_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._has_room_for(key):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def has_room_for(self, key: str | None, source: object = None) -> bool:
        """Whether a message of `key` (from `source`, if named) can be put now without going over the
        limit or the source's share of it (or is awaited)."""
        with self._lock:
            return self._has_room_for(key, source)

    def at_share(self, source: object) -> bool:
        """Whether `source` has its share buffered already (read without the lock: a quick look before
        asking `has_room_for` properly)."""
        return source is not None and self._by_source.get(source, 0) >= self.max_source_bytes

    def source_bytes(self, source: object) -> int:
        """The bytes `source`'s buffered messages count."""
        with self._lock:
            return self._by_source.get(source, 0)

    def _has_room_for(self, key: object, source: object = None) -> bool:
        if self._aborted is not None:
            return True
        if self.buffered_bytes < self.max_buffered_bytes and not self.at_share(source):
            return True
        return key is not _ANY_ROOM and bool(self._waiters.get(key) or self._waiters.get(ANY))

    def charge(self, nbytes: int) -> None:
        """Count bytes the application holds unacknowledged (ack="manual") against `max_buffered_bytes`."""
        with self._lock:
            if self._aborted is None:
                self.buffered_bytes += nbytes

    def discharge(self, nbytes: int) -> None:
        """Bytes `charge` counted are acknowledged (or given back): room may open."""
        with self._lock:
            if self._aborted is not None:
                return
            self.buffered_bytes -= nbytes
            if self.buffered_bytes + nbytes >= self.max_buffered_bytes > self.buffered_bytes:
                self._room_opened()

    def drop_unclaimed(self, timeout_s: float, now: float | None = None) -> list[Message]:
        """Drop the buffered messages nobody received for `timeout_s` (measured from one call to the
        next: call it every so often), and return them. Called by a consumer with `unclaimed_timeout_s`."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._marks.append((self._counter, now))
            cutoff = 0
            while self._marks and self._marks[0][1] <= now - timeout_s:
                cutoff = self._marks.popleft()[0]
            dropped = self._drop([number for number in self._arrivals if number <= cutoff])
            self.stats["unclaimed"] += len(dropped)
        return dropped

    def evict_over_share(self, source: object) -> list[Message]:
        """Make room for `source`, a producer under its share, while the table is full: drop the buffered
        messages larger than a producer's share on their own (one enters when its producer has nothing
        buffered) of other producers, oldest first, until there is room. The dropped messages are returned."""
        with self._lock:
            if source is None or self.at_share(source) or self.buffered_bytes < self.max_buffered_bytes:
                return []
            room_after, evict = self.buffered_bytes, []
            for number, (_, nbytes, owner) in self._arrivals.items():
                if room_after < self.max_buffered_bytes:
                    break
                if nbytes > self.max_source_bytes and owner is not None and owner != source:
                    evict.append(number)
                    room_after -= nbytes
            dropped = self._drop(evict)
            self.stats["evicted"] += len(dropped)
        return dropped

    def _drop(self, numbers: list[int]) -> list[Message]:
        """Remove these buffered messages (caller holds the lock), waking what waits for room if that opened some."""
        if not numbers:
            return []
        opened = False
        was_full = self.buffered_bytes >= self.max_buffered_bytes
        dropped = []
        for number in numbers:
            message, nbytes, source = self._arrivals.pop(number)
            self.buffered_bytes -= nbytes
            if source is not None:
                opened = self._uncount(source, nbytes) or opened
            dropped.append(message)
        for key in {message.key for message in dropped}:
            kept = [number for number in self._by_key[key] if number in self._arrivals]
            self._by_key[key].clear()  # (in place: the C delivery holds these)
            self._by_key[key].extend(kept)
            if not kept:
                del self._by_key[key]
        if opened or (was_full and self.buffered_bytes < self.max_buffered_bytes):
            self._room_opened()
        return dropped

    def abort(self, reason: str) -> None:
        """Fail every pending receive, drop what is buffered, and make every later call raise `Aborted`."""
        with self._lock:
            if self._aborted is None:
                self._aborted = Aborted(reason)
            waiters = [w for queue in self._waiters.values() for w in queue]
            self._waiters.clear()
            self.dropped += len(self._arrivals)
            self._arrivals.clear()
            self._by_key.clear()
            self._by_source.clear()
            self.buffered_bytes = 0
            self._room_opened()  # what waits for room is turned away now
        for waiter in waiters:
            self._complete(waiter, self._abort_error())

    @property
    def aborted(self) -> Aborted | None:
        """The `Aborted` error once `abort` was called, else None."""
        return self._aborted

    def _abort_error(self) -> Aborted:
        """A fresh `Aborted` with the reason: each thread raises its own (one shared object would
        collect every thread's traceback, and keep their frames alive)."""
        assert self._aborted is not None
        return Aborted(*self._aborted.args)

    def _raise_if_aborted(self) -> None:
        if self._aborted is not None:
            raise self._abort_error()

    def __len__(self) -> int:
        with self._lock:
            return len(self._arrivals)

    def buffered_keys(self) -> dict[str | None, int]:
        """How many buffered (arrived, not yet received) messages each key has."""
        with self._lock:
            return {key: len(numbers) for key, numbers in self._by_key.items()}

    def awaited_keys(self) -> dict[object, int]:
        """How many receivers (`recv`, `recv_async`, `next_message`: key ANY) wait for each key."""
        with self._lock:
            return {key: len(waiters) for key, waiters in self._waiters.items()}
