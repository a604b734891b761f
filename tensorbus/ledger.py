"""The acknowledgement ledger: which received frames a transport may now acknowledge, for every transport.

A transport numbers the frames it receives on each of its streams (`Stream`: a socket connection
and its frame index, a Kafka partition and its offsets, an AMQP channel and its delivery tags, a
memory endpoint and its slots) and records each one here with what the consumer made of it (the
intake's `Delivered`; a plain tensor the C delivery took, with `record_admitted`: the same record in
the fewest steps, a small tensor's time being mostly such steps). The ledger says which positions
are *released*: the transport turns those, and only those, into its own ack or commit. The rule,
in one place:

- a frame is released once the application has its tensor (`recv`, `recv_message`, iteration, a
  `recv_async` callback), or once its tensor was dropped for a stated reason (a duplicate, a refusal,
  a chunked tensor given up on, `unclaimed_timeout_s`); with `ack="arrival"`, already once the
  tensor is in the rendezvous table (what tensorbus did before: what a closed or killed consumer
  had not handed out is lost); with `ack="manual"`, only once the application called `Consumer.ack`;
- the frames of a chunked tensor are released together, with the tensor;
- a frame the consumer turned away (aborted or closing) is never released, and neither is an
  untaken tensor's: the next consumer of the endpoint gets them.

A stream also says which frames are *received* (in the table, or settled), for the transports
whose producers count credit and `flush` by that (sockets): everything before the oldest frame
whose tensor still waits for chunks, is held back (the table was full), or was turned away.

One lock guards the whole ledger; it is taken for short, non-blocking steps only, and a stream's
`on_release` callback is called after it is let go (it must not block: it posts an ack).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Literal, TypeGuard

from .codec.frame import MessageId
from .errors import ConfigError
from .transports.base import Delivered

#: when a consumer acknowledges a tensor: once the application took it (the default), once it reached
#: the table (`arrival`: what a closed or killed consumer had not handed out is lost), or once the
#: application acknowledged it itself (`manual`: `Consumer.ack`; what it did not is delivered again)
AckMode = Literal["take", "arrival", "manual"]
ACK_MODES: tuple[str, ...] = ("take", "arrival", "manual")
#: ids taken before their frame was recorded (the C delivery hands a tensor to a waiting `recv`
#: before the transport records its frame), at most: each is consumed by the record that follows
EARLY_TAKES = 4096

Position = Hashable


def check_ack(mode: str) -> AckMode:
    """`mode` if it is an acknowledgement mode, else a `ConfigError` naming the choices."""
    if mode not in ACK_MODES:
        raise ConfigError(f"ack must be one of {', '.join(ACK_MODES)}; got {mode!r}")
    return mode  # type: ignore[return-value]


class _Message:
    """The open positions of one message, and whether it is in the table waiting to be taken."""

    __slots__ = ("admitted", "positions")

    def __init__(self) -> None:
        self.positions: list[tuple[Stream, Position]] = []
        self.admitted = False


class Stream:
    """One ordered sequence of positions (a connection, a partition, a channel): what is released of it.

    Positions are recorded in increasing order (any hashable for `released`, ints for `first_open`
    and `first_unreceived`, which are cumulative).
    """

    def __init__(self, ledger: Ledger, on_release: Callable[[list[Position]], None] | None) -> None:
        self._ledger = ledger
        self._on_release = on_release
        #: positions not released, oldest first, each with what the transport keeps until then (`record`'s
        #: `kept`: a memory:// frame, to queue again if the stream closes first; else None)
        self._open: dict[Position, object] = {}
        #: positions whose message is not received yet (chunks missing, held back, turned away), oldest first
        self._waiting: dict[Position, None] = {}
        self._next: Position | None = None  # the position after the last recorded one (ints only)
        self.closed = False

    def record(self, position: Position, result: Delivered, kept: object = None) -> bool:
        """Record a received frame at `position` with what became of it; True if it is released at once.
        `kept`: what the transport keeps of it until it is released (`close_kept` gives it back)."""
        ledger = self._ledger
        with ledger._lock:
            if isinstance(position, int):
                self._next = position + 1
            released = ledger._record(self, position, result, kept)
        ledger._notify(released)
        return any(stream is self and position in positions for stream, positions in released)

    def record_admitted(self, position: int, message_id: MessageId | None, kept: object = None) -> None:
        """`record(position, Delivered(message_id, True, admitted=True), kept)` of the commonest frame, in
        the fewest steps: a whole tensor that went into the table (or straight to a waiting `recv`), its id
        not open here (the C delivery's frames; a small tensor's time is mostly such steps)."""
        ledger = self._ledger
        with ledger._lock:
            self._next = position + 1
            if self.closed:
                return
            if ledger._single(message_id):
                self._open[position] = kept
                ledger._singles[message_id] = (self, position)
                return
            released = ledger._record(self, position, Delivered(message_id, True, admitted=True), kept)
        ledger._notify(released)

    def record_admitted_run(self, first: int, message_ids: Sequence[MessageId | None]) -> None:
        """`record_admitted(first + i, message_ids[i])` of each, in order, under one lock: a run of frames the
        C delivery took one after the other (`StreamReader.read_taken`). What they release is told after."""
        ledger = self._ledger
        released: list[tuple[Stream, list[Position]]] = []
        with ledger._lock:
            self._next = first + len(message_ids)
            if self.closed:
                return
            single, singles, opened = ledger._single, ledger._singles, self._open
            position = first
            for message_id in message_ids:
                if single(message_id):
                    opened[position] = None
                    singles[message_id] = (self, position)
                else:
                    released += ledger._record(self, position, Delivered(message_id, True, admitted=True))
                position += 1
        ledger._notify(released)

    def first_open(self) -> int:
        """The first position not released (every one before it is): a cumulative ack's count, a commit's offset."""
        with self._ledger._lock:
            return next(iter(self._open), self._next or 0)  # type: ignore[return-value]

    def first_unreceived(self) -> int:
        """The first position whose tensor is not in the table or settled yet (every one before it is)."""
        with self._ledger._lock:
            return next(iter(self._waiting), self._next or 0)  # type: ignore[return-value]

    def unreleased(self) -> list[Position]:
        """The positions not released, oldest first."""
        with self._ledger._lock:
            return list(self._open)

    def close(self) -> list[Position]:
        """The stream ended (connection dropped, partition revoked): forget it; its unreleased positions."""
        return [position for position, _ in self.close_kept()]

    def close_kept(self) -> list[tuple[Position, object]]:
        """`close`, each unreleased position with what the transport kept of it (`record`'s `kept`)."""
        with self._ledger._lock:
            self.closed = True
            left = list(self._open.items())
            self._open.clear()
            self._waiting.clear()
            return left


class Ledger:
    """One consumer's acknowledgement ledger (see the module): its streams, and the messages they carry."""

    def __init__(self, mode: AckMode = "take") -> None:
        self.mode: AckMode = check_ack(mode)
        self._lock = threading.Lock()
        #: message id -> its open positions (chunks waiting, held back, or in the table untaken)
        self._messages: dict[MessageId, _Message] = {}
        #: message id -> the one position of a whole tensor in the table untaken (`record_admitted`): a
        #: `_Message` in fewer steps, made one (`_promote`) when anything but its take comes for it
        self._singles: dict[MessageId, tuple[Stream, Position]] = {}
        #: ids taken (or dropped) before their last frame was recorded, newest last
        self._early: collections.OrderedDict[MessageId, None] = collections.OrderedDict()
        self._stats = collections.Counter[str]()  # what became of messages (`stats`), but for `_single_takes`
        self._single_takes = 0  # the commonest take, counted in an int: a Counter's step costs a take a quarter
        self.released_frames = 0  # positions released to their transports so far (metrics; under the lock)

    @property
    def stats(self) -> collections.Counter[str]:
        """What became of messages: how many were taken, acked, dropped (a copy)."""
        with self._lock:
            counts = collections.Counter(self._stats)
            if self._single_takes:
                counts["taken"] += self._single_takes
        return counts

    def stream(self, on_release: Callable[[list[Position]], None] | None = None) -> Stream:
        """A new stream; `on_release(positions)` is called (without the lock held) as positions are released."""
        return Stream(self, on_release)

    # -- what the intake and the table report ---------------------------------------------------------

    def taken(self, message_id: MessageId | None) -> None:
        """The application has the message: its frames are released (ack="take")."""
        if message_id is None or self.mode != "take":
            return
        with self._lock:
            single = self._singles.pop(message_id, None)
            if single is None:
                on_release = None
            else:  # (the commonest take: one whole frame, recorded by `record_admitted`)
                self._single_takes += 1
                stream, position = single
                if stream.closed:
                    return
                del stream._open[position]
                self.released_frames += 1
                on_release = stream._on_release
        if single is None:
            self._settle(message_id, "taken")
        elif on_release is not None:
            on_release([position])

    def acked(self, message_id: MessageId | None) -> None:
        """The application acknowledged the message itself (ack="manual"): its frames are released."""
        if message_id is not None:
            self._settle(message_id, "acked")

    def dropped(self, message_id: MessageId | None) -> None:
        """The message was dropped for a stated reason (given up on, unclaimed): its frames are released."""
        if message_id is not None:
            self._settle(message_id, "dropped")

    def apply(self, result: Delivered) -> None:
        """What became of a message held back earlier (no new frame): recorded as for its frames."""
        with self._lock:
            released = self._apply(result)
        self._notify(released)

    # -- inside (caller holds the lock) --------------------------------------------------------------

    def _promote(self, message_id: MessageId | None) -> None:
        """Make a single (`_singles`) a `_Message`, for the steps that handle every case."""
        single = self._singles.pop(message_id, None) if message_id is not None else None
        if single is not None:
            message = self._messages[message_id] = _Message()  # type: ignore[index]
            message.positions.append(single)
            message.admitted = True

    def _settle(self, message_id: MessageId, how: str) -> None:
        with self._lock:
            self._promote(message_id)
            message = self._messages.get(message_id)
            if message is None or not message.admitted:
                # its last frame is being recorded right now (the C delivery handed it to a waiting recv,
                # or a callback had it): released as it is, and the frames known so far go now
                self._early[message_id] = None
                if len(self._early) > EARLY_TAKES:
                    self._early.popitem(last=False)
            released = self._release(message_id)
            self._stats[how] += 1
        self._notify(released)

    def _single(self, message_id: MessageId | None) -> TypeGuard[MessageId]:
        """(under `_lock`) Whether a frame admitted whole with this id is the commonest one, booked in the
        fewest steps (`Stream.record_admitted`): acknowledged on take, its id open nowhere yet."""
        return (
            self.mode == "take"
            and message_id is not None
            and message_id not in self._messages
            and message_id not in self._singles
            and message_id not in self._early
        )

    def _record(
        self, stream: Stream, position: Position, result: Delivered, kept: object = None
    ) -> list[tuple[Stream, list[Position]]]:
        if stream.closed:
            return []
        message_id = result.message_id
        self._promote(message_id)
        settled = result.done and not result.admitted and not result.turned_away
        open_here = None if message_id is None else self._messages.get(message_id)
        if settled and result.refused is None and open_here is not None:
            stream._open[position] = kept
            open_here.positions.append((stream, position))
            if open_here.admitted or not result.duplicate:
                # a copy of a message still open here (in the table untaken, say, or held back for room, and
                # sent again on a new connection, or redelivered by a broker): released with it, not before
                # (nor does it release it)
                return []
            # the last chunk of a copy of a message released already, whose earlier chunks opened it here
            # again (the reassembler had forgotten the first copy's id; the intake had not): all of it goes
            assert message_id is not None  # (open here: it has one)
            return self._release(message_id)
        if message_id is None or (settled and result.refused is None):
            # a duplicate of a message released already, a frame without an id, a chunk of a message done
            # or given up: only this frame goes
            self.released_frames += 1
            return [(stream, [position])]
        stream._open[position] = kept
        if not (result.done and result.admitted):
            stream._waiting[position] = None
        message = self._messages.get(message_id)
        if message is None:
            message = self._messages[message_id] = _Message()
        message.positions.append((stream, position))
        return self._apply(result)

    def _apply(self, result: Delivered) -> list[tuple[Stream, list[Position]]]:
        message_id = result.message_id
        if message_id is None:
            return []
        self._promote(message_id)
        message = self._messages.get(message_id)
        if message is None:
            return []
        if result.turned_away or result.held is not None or not result.done:
            return []  # not received: its frames wait (turned away: for good)
        if result.refused is not None:
            return self._release(message_id)
        if result.admitted:
            message.admitted = True
            for stream, position in message.positions:
                stream._waiting.pop(position, None)
            if self.mode == "arrival" or self._early.pop(message_id, 0) is None:
                return self._release(message_id)
        return []

    def _release(self, message_id: MessageId) -> list[tuple[Stream, list[Position]]]:
        message = self._messages.pop(message_id, None)
        if message is None:
            return []
        by_stream: dict[Stream, list[Position]] = {}
        for stream, position in message.positions:
            if not stream.closed:
                stream._open.pop(position, None)
                stream._waiting.pop(position, None)
                by_stream.setdefault(stream, []).append(position)
                self.released_frames += 1
        return list(by_stream.items())

    @staticmethod
    def _notify(released: list[tuple[Stream, list[Position]]]) -> None:
        """Tell each stream's transport what was released (without the lock: it posts acks)."""
        for stream, positions in released:
            if stream._on_release is not None and positions:
                stream._on_release(positions)
