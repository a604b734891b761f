"""The state the intake shares with its C delivery, field by field, and the one place that picks C or Python.

Two objects, and nothing else of any class, are what `_intake.c`'s `FastDelivery` reads and writes
(besides a waiter in the table's queues: `Waiter`, and the class of a callback it serves, `Handoff`):

- an `IntakeState`, owned by the `Intake` (intake.py): the ids seen, whether a chunked message is
  part way, an interrupted frame, the intake's counts, its lock, and the table;
- a `TableState`, the base of the `Rendezvous` (rendezvous.py): the table's queues and counts, its lock.
  The C type also takes a receive's message that is buffered already (`_take_buffered`, as `Rendezvous._wait`
  would, leaving every case with more to decide to it).

With the extension built (and TENSORBUS_NATIVE not 0) both are the C types, whose fields C reads as a
struct; otherwise they are the Python classes below, with the same fields, and there is no C delivery
(`FAST` is None). tests/unit/test_fast_delivery.py checks the two sets of fields are the same.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .codec.frame import CHUNK_MARK, NATIVE, Message, MessageId
from .codec.native import load
from .keys import INCARNATION_SEPARATORS

#: the waiter key of arrival-order receivers (`next_message`)
ANY = object()

Callback = Callable[[Message | None, BaseException | None], None]


class Waiter:
    """A receiver in the table's queue. The C delivery reads `callback` (it serves waiters without one, and
    those with a `Handoff`), sets `result` and releases `done` (or has `Rendezvous._complete` call the Handoff)."""

    __slots__ = ("callback", "done", "key", "result")

    def __init__(self, key: object, callback: Callback | None) -> None:
        self.key, self.callback = key, callback
        self.done: threading.Lock | None = None  # held until the result is in (a lock is cheaper than an Event)
        if callback is None:
            self.done = threading.Lock()
            self.done.acquire()
        self.result: Message | BaseException | None = None


class Handoff:
    """A `recv_async` callback that takes a message without it being handed out: its caller hands it
    out (`Rendezvous.hand_out`) once its receiver really has it, or puts it back (`Rendezvous.put_back`)
    when the receiver went away meanwhile (an asyncio task cancelled as the message came). The C
    delivery serves a waiter with one, calling `Rendezvous._complete` once it let go of the locks."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callback) -> None:
        self.callback = callback

    def __call__(self, message: Message | None, error: BaseException | None) -> None:
        self.callback(message, error)


class PyTableState:
    """The table's queues and counts; all read and written under `_lock`."""

    __slots__ = ("_aborted", "_arrivals", "_by_key", "_by_source", "_counter", "_lock", "_taken", "_waiters",
                 "buffered_bytes", "max_buffered_bytes", "max_source_bytes", "stats")  # fmt: skip
    #: guards everything here (an RLock)
    _lock: threading.RLock
    #: receivers waiting, by key (ANY: arrival order), oldest first
    _waiters: dict[object, collections.deque[Waiter]]
    #: buffered messages by arrival number, each with the bytes it counts (as counted when it came)
    #: and the source (producer) it counts against, or None
    _arrivals: collections.OrderedDict[int, tuple[Message, int, object]]
    #: the arrival numbers of each key's buffered messages, oldest first
    _by_key: dict[str | None, collections.deque[int]]
    #: the bytes each source's buffered messages count (sources with none are not there)
    _by_source: dict[object, int]
    buffered_bytes: int
    max_buffered_bytes: int
    #: a source with this many bytes buffered has no room (`max_buffered_bytes_per_producer`)
    max_source_bytes: int
    #: the last arrival number given
    _counter: int
    #: messages receives took from the table (not handed to them as they waited): a sign the application
    #: receives, for a transport's background reading (`Rendezvous.taken_count`)
    _taken: int
    #: None, or the error `abort` made (every later call raises its like)
    _aborted: Any
    stats: collections.Counter[str]
    #: the C take of a receive whose message is buffered already (`_intake.c`'s `TableState._take_buffered`:
    #: the message, or None where Python decides); the Python twin has none, and `Rendezvous._wait` does it all
    _take_buffered: Callable[[str | None, object], Message | None] | None = None


class PyIntakeState:
    """What the intake shares with its C delivery; all read and written under `lock`."""

    __slots__ = ("interrupted", "lock", "reassembling", "seen", "stats", "table", "window")
    #: guards everything here (a Lock); taken before the table's
    lock: threading.Lock
    #: the ids of messages taken, oldest first, at most `window` (dedup.SeenIds keeps them)
    seen: collections.OrderedDict[MessageId, None]
    window: int
    #: True while the reassembler holds part of a chunked message (the C delivery leaves frames to
    #: Python meanwhile: feeding the reassembler is what expires stale ones)
    reassembling: bool
    #: a frame whose delivery was interrupted, with its message decoded, to be delivered again first
    interrupted: Any
    stats: collections.Counter[str]
    #: the table messages are put in
    table: Any


def _fast() -> ModuleType | None:
    """`_intake` configured, if it and the codec's C decoding are there; else None."""
    module = load(f"{__package__}._intake")
    if module is None or NATIVE is None:
        return None
    module.configure(
        NATIVE.decode_message,
        ANY,
        collections.deque,
        INCARNATION_SEPARATORS,
        NATIVE.aligned_copy,
        *CHUNK_MARK,
        Handoff,
    )
    return module


#: the C extension (`FastDelivery` and the state types); None: the Python twins, no C delivery
FAST = _fast()

if TYPE_CHECKING or FAST is None:
    TableState = PyTableState
    IntakeState = PyIntakeState
else:
    TableState = FAST.TableState
    IntakeState = FAST.IntakeState
