"""The intake: the one place where a frame that arrived becomes a delivered message.

A transport reports each received frame to the consumer's `Intake` (the `Deliver` protocol of
transports/base.py). The intake decodes or reassembles it, drops it if its id was seen (dedup), puts
it in the rendezvous table (which fences stale incarnations), holds it back while the table is full
or its producer has its share of it (backpressure: `max_buffered_bytes_per_producer`, where the
transport names the producer a frame came from: `source`), and expires chunked messages whose
chunks stopped coming. Plain frames of one ndarray may take the C delivery instead (`fast`,
`_intake.c`), which does the same to the same state (intake_state.py) and leaves every other case
to the Python code here.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .codec import Limits, Message, MessageId, Reassembler
from .codec.frame import Buffer, decoded_size, is_chunk, peek_message
from .dedup import SeenIds
from .errors import Aborted, CallbackInterrupted, CodecError, ConfigError, TensorBusError
from .intake_state import FAST, IntakeState
from .ledger import AckMode, Ledger
from .logs import LogLimiter
from .rendezvous import Rendezvous, message_nbytes
from .transports import Delivered
from .transports.base import Held

log = logging.getLogger(__name__)


class Intake:
    """Turns received frames into messages in `table`: dedup, reassembly, admission, holds, expiry."""

    def __init__(
        self,
        *,
        limits: Limits,
        max_buffered_bytes: int,
        max_reassembly_bytes: int,
        reassembly_timeout_s: float,
        dedup_window: int,
        dedup_file: str | Path | None,
        signing_key: bytes | None,
        like: str,
        name: str,
        whole_signing_key: bytes | None = None,
        unclaimed_timeout_s: float | None = None,
        sender: Callable[[], str | None] = lambda: None,
        max_buffered_bytes_per_producer: int | None = None,
        ack: AckMode = "take",
    ) -> None:
        #: bad frames are logged a few per sender and window, the rest counted in a summary line
        self._rejections = LogLimiter(log, "frames rejected")
        self.name = name  # for logs: the consumer's URL without secrets
        self._sender = sender  # who sent the frame being delivered, where the transport knows
        self._unclaimed_timeout_s = unclaimed_timeout_s
        self.table = Rendezvous(
            max_buffered_bytes=max_buffered_bytes, max_buffered_bytes_per_producer=max_buffered_bytes_per_producer
        )
        self.reassembler = Reassembler(
            max_bytes=max_reassembly_bytes,
            timeout_s=reassembly_timeout_s,
            limits=limits,
            signing_key=signing_key,
            like=like,
            whole_signing_key=whole_signing_key,
        )
        state = self.state = IntakeState()
        state.lock = self._lock = threading.Lock()
        state.seen = collections.OrderedDict()
        state.window = dedup_window
        state.reassembling = False
        state.interrupted = None
        state.stats = self.stats = collections.Counter[str]()
        state.table = self.table
        self._seen = SeenIds(dedup_window, dedup_file, ids=state.seen)
        #: what the transport may acknowledge: frames whose tensor was taken (or dropped for a reason)
        self.ledger = Ledger(ack)
        self.reassembler.on_given_up = self.ledger.dropped
        self._dedup_file = dedup_file is not None  # ids recorded when the application takes a tensor, not on arrival
        self.table.on_delivered_to_application = self._taken
        self.table.on_refused_back = lambda message: self.ledger.dropped(message.message_id)
        #: ack="manual": the bytes each message handed out and not yet acknowledged counts in the table
        self._unacked: dict[MessageId, int] = {}
        self._held_up = 0  # deliveries waiting for room in the table (or held back by the transport)
        self._held_bytes = 0  # the frames held back undecoded (`Held`): they count against max_buffered_bytes
        self._limits = limits
        #: the C delivery of plain frames (`fast(frame, crc, source)`: the Message it delivered, or None to
        #: deliver the frame with `__call__`), for transports that read frames in C; None where it cannot serve
        self.fast: Callable[[memoryview, int | None, object], Message | None] | None = None
        self.fast_delivery: Any = None  # (`_intake.FastDelivery`: its `taken` counts the frames it delivered)
        #: `fast` over a run of broker records (transports.base.Deliver); None where `fast` is
        self.take_records: Callable[[Any, object, int], list[MessageId]] | None = None
        if FAST is not None and limits.native and like == "numpy" and signing_key is None:
            self.fast_delivery = FAST.FastDelivery(
                state, limits.max_header_bytes, limits.max_payload_bytes, limits.max_ndim
            )
            self.fast = self.fast_delivery.take
            self.take_records = self.fast_delivery.take_records
        self._stopping = threading.Event()
        self._expiry = threading.Thread(target=self._expire_loop, daemon=True, name="tensorbus-expiry")

    @property
    def name(self) -> str:
        """The consumer's URL without secrets (with the port a listener bound, once it did), for logs."""
        return self._name

    @name.setter
    def name(self, name: str) -> None:
        self._name = name
        self._rejections.what = f"frames rejected by {name}"

    def start(self) -> None:
        """Start expiring partly received tensors (once the transport delivers here)."""
        self._expiry.start()

    # -- what transports call (transports.base.Deliver) -------------------------------------------

    def __call__(
        self,
        frame: Buffer,
        crc: int | None = None,
        *,
        may_hold: bool = False,
        source: object = None,
        redelivered: bool = False,
        appended_at: float | None = None,
    ) -> Delivered:
        """One received frame; never raises. See `Deliver` for `may_hold`, `source`, `redelivered` and
        `appended_at`."""
        message: Message | None
        state = self.state
        with self._lock:
            try:
                interrupted = state.interrupted
                if interrupted is not None and interrupted[0] is frame:  # the same frame again: decoded already
                    message, state.interrupted = interrupted[1], None  # (kept until then: others may come first)
                else:
                    held = self._hold_undecoded(frame, crc, may_hold, source)
                    if held is not None:
                        return held
                    message = self._feed(frame, crc, redelivered, appended_at)
            except Exception as exc:  # (a CodecError, a MemoryError, a decoder's bug: `_not_decoded`)
                return self._not_decoded(exc)
            settled = self._settle(message, may_hold, source)
            if settled is not None:
                return settled
        assert message is not None
        return self._take_in(frame, message, may_hold, source)

    def deliver_decoded_apart(
        self, frame: Buffer, crc: int | None = None, *, may_hold: bool = False, source: object = None
    ) -> Delivered:
        """`__call__` (without `redelivered` or `appended_at`: a socket's frame) for a thread that may take its
        time (tensorbus.aio's decoding thread): a whole message's frame is decoded outside the intake's lock,
        so a 256 MB signature check or decompression holds up no other delivery, expiry or manual ack meanwhile.
        A chunk changes the reassembler, and a frame whose admission was interrupted is decoded already:
        `__call__` takes those, under the lock."""
        if is_chunk(memoryview(frame).cast("B")):
            return self(frame, crc, may_hold=may_hold, source=source)
        with self._lock:
            interrupted = self.state.interrupted
            again = interrupted is not None and interrupted[0] is frame  # (decoded already: `__call__` takes it)
            held = None if again else self._hold_undecoded(frame, crc, may_hold, source)
        if again:
            return self(frame, crc, may_hold=may_hold, source=source)
        if held is not None:
            return held
        try:
            message = self.reassembler.decode_whole(frame, crc=crc)
        except Exception as exc:  # (a CodecError, a MemoryError, a decoder's bug: `_not_decoded`)
            with self._lock:
                return self._not_decoded(exc)
        with self._lock:
            settled = self._settle(message, may_hold, source)
        return settled if settled is not None else self._take_in(frame, message, may_hold, source)

    def _hold_undecoded(self, frame: Buffer, crc: int | None, may_hold: bool, source: object) -> Delivered | None:
        """Hold a whole message's frame back undecoded (`Delivered.held`) when the table, or its source's share of
        it, is full and the caller may hold it (caller holds `_lock`); None to decode it now."""
        if may_hold and source is not None and self._full():
            self._evict_for(frame, source)
        if may_hold and (self._full() or self.table.at_share(source)):
            held = self._held(frame, crc, source)
            if held is not None:
                return Delivered(held.message_id, False, held=held)
        return None

    def _not_decoded(self, exc: BaseException) -> Delivered:
        """A frame the decoder raised on (caller holds `_lock`): refused and counted; a MemoryError raised on."""
        if isinstance(exc, MemoryError):
            raise exc  # not the frame's fault: the transport drops the connection and the frame comes again
        self.stats["rejected"] += 1
        if isinstance(exc, CodecError):
            self.stats["rejected " + exc.reason_label] += 1  # (by reason: for metrics)
            self._log_rejection("dropped a bad frame", exc)
            return Delivered(None, True, refused=str(exc))
        # a decoder bug must cost this one frame, not the connection or a recv
        log.error("%s: dropped a frame the decoder failed on", self._name, exc_info=exc)
        return Delivered(None, True, refused="the consumer's decoder failed on it (see its log)")

    def _settle(self, message: Message | None, may_hold: bool, source: object) -> Delivered | None:
        """What a decoded frame comes to before admission (caller holds `_lock`): turned away, a chunk, a
        duplicate, or held back decoded; None when it goes on into the table (marked as seen)."""
        message_id = self.reassembler.last_message_id if message is None else message.message_id
        if self.table.aborted is not None:
            # every frame, before dedup: a broker may hand a turned-away tensor to this consumer
            # again (kafka:// after a rebalance), and it must not then pass for one already taken
            return Delivered(message_id, False, turned_away=True)
        if message is None:
            self.stats["chunks"] += 1
            return Delivered(message_id, not self.reassembler.is_pending(message_id))
        if self._is_duplicate(message_id):
            return Delivered(message_id, True, duplicate=True)
        if (
            may_hold
            and (self._full() or self.table.at_share(source))
            and not self.table.has_room_for(message.key, source)
        ):
            self._hold()  # not yet seen: a copy sent again meanwhile is taken instead, and this one dropped
            held = Held(None, None, message.key, message_id, message=message, source=source)
            return Delivered(message_id, False, held=held)
        if message_id is not None:
            self._seen.add(message_id)
        return None

    def _take_in(self, frame: Buffer, message: Message, may_hold: bool, source: object) -> Delivered:
        """Admit a settled message (`_settle`), waiting for room first unless the caller may hold (backpressure)."""
        try:
            if not may_hold and self._full() and not self.table.has_room_for(message.key):
                self._wait_for_room(message.key)
            return self._admit(message, source)
        except CallbackInterrupted:  # in a recv_async callback, which had the message: it was delivered
            raise
        except BaseException:  # e.g. Ctrl-C on a thread reading for its recv: the transport offers the frame again
            self._forget(message.message_id)
            self.state.interrupted = (frame, message)  # (the reassembler is done with a chunked one: keep what it made)
            raise

    def taken_count(self) -> int:
        """How many messages receives have taken from the table so far (`Rendezvous.taken_count`)."""
        return self.table.taken_count()

    def fits(self, held: Held) -> bool:
        """Whether the table has room for a held message now (`release` would take it)."""
        return self.table.has_room_for(held.key, held.source)

    def release(self, held: Held, apart: bool = False) -> Delivered | None:
        """A held message offered again: decoded and taken (or turned away, or a duplicate, or refused)
        once it fits; else None (or held again: `Delivered.held`). `apart`: decoded outside the intake's
        lock (`deliver_decoded_apart`)."""
        if not self.fits(held):
            return None
        if held.frame is None:
            assert held.message is not None
            return self._release_decoded(held.message, held.source)
        with self._lock:
            self._held_bytes -= held.nbytes
            self._unhold()
        deliver = self.deliver_decoded_apart if apart else self
        try:
            result = deliver(held.frame, held.crc, may_hold=True, source=held.source)
        except CallbackInterrupted:  # in a recv_async callback, which had the message: taken
            raise
        except BaseException:  # still held: offered again later (decoded already: see `state.interrupted`)
            with self._lock:
                self._held_bytes += held.nbytes
                self._hold()
            raise
        return result  # (held again, its `held` says how, when the room went meanwhile)

    def _release_decoded(self, message: Message, source: object) -> Delivered:
        """A held message (decoded: a chunked one) that now fits: taken, turned away, or a duplicate."""
        message_id = message.message_id
        with self._lock:
            if self._is_duplicate(message_id):
                self._unhold()
                return Delivered(message_id, True)
            if message_id is not None:
                self._seen.add(message_id)
        try:
            result = self._admit(message, source)
        except CallbackInterrupted:  # in a recv_async callback, which had the message: taken
            with self._lock:
                self._unhold()
            raise
        except BaseException:  # still held: offered again later
            self._forget(message_id)
            raise
        with self._lock:
            self._unhold()
        return result

    # -- the steps ------------------------------------------------------------------------------------

    def _feed(
        self, data: Buffer, crc: int | None, redelivered: bool = False, appended_at: float | None = None
    ) -> Message | None:
        """The reassembler's answer for a frame (caller holds `_lock`); keeps `state.reassembling` true to it."""
        reassembler, state = self.reassembler, self.state
        try:  # (transports hand their buffers over)
            message = reassembler.feed(data, crc=crc, owned=True, redelivered=redelivered, appended_at=appended_at)
        except BaseException:
            state.reassembling = reassembler.pending > 0  # (a chunked message may have been given up on)
            raise
        if message is None or state.reassembling:  # a chunk, or what may have completed a chunked message
            state.reassembling = reassembler.pending > 0
        return message

    def _full(self) -> bool:
        """The table, with the frames held back, is at its limit (read without its lock: a quick look
        before asking properly)."""
        return self.table.buffered_bytes + self._held_bytes >= self.table.max_buffered_bytes

    def _held(self, frame: Buffer, crc: int | None, source: object) -> Held | None:
        """Hold a whole message's frame back undecoded while the table (or its source's share of it) has
        no room for it (caller holds `_lock`): a small compressed frame that expands to gigabytes then
        costs its size on the wire.
        None to decode it now: a chunk, a frame whose header does not parse, one seen already, or room."""
        peeked = peek_message(frame, self._limits)
        if peeked is None or (peeked[1] is not None and peeked[1] in self._seen):
            return None
        key, message_id = peeked
        if self.table.has_room_for(key, source):
            return None
        nbytes = memoryview(frame).nbytes
        self._held_bytes += nbytes
        self._hold()  # not yet seen: a copy sent again meanwhile is taken instead, and this one dropped
        return Held(frame, crc, key, message_id, nbytes, source=source)

    def _evict_for(self, frame: Buffer, source: object) -> None:
        """The table is full and `frame` would keep `source` within its share: drop the other producers'
        tensors that are larger than a share on their own (nobody's yet), so that one cannot keep the others
        out (logged, counted). A frame that would take its own producer over its share makes no room: it waits."""
        size = decoded_size(frame, self._limits)
        if size is None or self.table.source_bytes(source) + size > self.table.max_source_bytes:
            return
        dropped = self.table.evict_over_share(source)
        if dropped:
            self.stats["evicted"] += len(dropped)
            keys = ", ".join(sorted({str(message.key) for message in dropped})[:5])
            log.warning(
                "%s: dropped %d tensors larger than a producer's share that nobody received, to make room for another "
                "producer (keys %s)", self._name, len(dropped), keys,
            )  # fmt: skip

    def _is_duplicate(self, message_id: MessageId | None) -> bool:
        """Whether this message was seen already (then counted); caller holds `_lock`."""
        if message_id is not None and message_id in self._seen:
            self.stats["duplicates"] += 1
            return True
        return False

    def _forget(self, message_id: MessageId | None) -> None:
        """A message marked as seen did not reach the table after all: a copy sent again is not a duplicate."""
        if message_id is not None:
            with self._lock:
                self._seen.discard(message_id)

    def _taken(self, message: Message) -> None:
        """The application has `message` (on the receiving thread): its frames may be acknowledged, and
        with a dedup file its id is recorded there, so a successor drops its resends."""
        message_id = message.message_id
        if message_id is None:
            return
        if self.ledger.mode == "manual":  # it still counts, until the application acknowledges it
            message.acknowledger = self  # (for `message.ack()` and `message.reject()`)
            nbytes = message_nbytes(message)
            with self._lock:
                self._unacked[message_id] = self._unacked.get(message_id, 0) + nbytes
            self.table.charge(nbytes)
            return
        if self._dedup_file:
            with self._lock:
                self._seen.persist(message_id)
        self.ledger.taken(message_id)

    def acknowledge(self, message: Message) -> None:
        """ack="manual": the application is done with `message`: acknowledge it (and record it in the dedup file)."""
        nbytes = self._settle_unacked(message)
        if nbytes is None:
            return  # (acknowledged already, or never handed out: nothing to do)
        if self._dedup_file and message.message_id is not None:
            with self._lock:
                self._seen.persist(message.message_id)
        self.ledger.acked(message.message_id)

    def reject(self, message: Message) -> None:
        """ack="manual": the application gives `message` back: it is delivered again, first in line."""
        if self._settle_unacked(message) is not None:
            self.table.put_back(message)  # (not acknowledged: its frames stay unreleased, unless now stale)

    def _settle_unacked(self, message: Message) -> int | None:
        """Stop counting a message handed out unacknowledged; the bytes it counted, or None if it did not."""
        if self.ledger.mode != "manual":
            raise ConfigError(f"ack() and reject() need ack='manual' (this consumer has ack={self.ledger.mode!r})")
        with self._lock:
            nbytes = None if message.message_id is None else self._unacked.pop(message.message_id, None)
        if nbytes is not None:
            self.table.discharge(nbytes)
        return nbytes

    def _admit(self, message: Message, source: object) -> Delivered:
        """Put a decoded message (already marked as seen) in the table, counted against `source`."""
        message_id = message.message_id
        try:
            self.table.put(message, source=source)
        except CallbackInterrupted:  # in a recv_async callback, which had it: received all the same
            with self._lock:  # (the counts: the C delivery and other threads' deliveries change them too)
                self.stats["received"] += 1
            raise
        except Aborted:
            return Delivered(message_id, False, turned_away=True)
        except TensorBusError as exc:
            with self._lock:
                self.stats["refused"] += 1
                self.stats["rejected " + getattr(exc, "reason_label", "refused")] += 1  # (by reason: for metrics)
            self._log_rejection(f"refused message {message_id}", exc)
            return Delivered(message_id, True, refused=str(exc))
        with self._lock:
            self.stats["received"] += 1
        return Delivered(message_id, True, admitted=True)

    def _wait_for_room(self, key: str | None) -> None:
        """Backpressure: hold this delivery (so the transport reads no more) until the table has room
        or someone waits for `key`."""
        with self._lock:
            self._hold()
        try:
            self.table.wait_for_room(key=key)
        finally:
            with self._lock:
                self._unhold()

    def _hold(self) -> None:
        """A delivery is held up (caller holds `_lock`). Partly received tensors do not age meanwhile:
        their chunks are not late, this consumer just is not reading them, and expiring them would
        drop tensors the broker delivered whole."""
        if not self._held_up:
            self.reassembler.pause()
        self._held_up += 1

    def _unhold(self) -> None:
        """A held-up delivery went through (caller holds `_lock`)."""
        self._held_up -= 1
        if not self._held_up:
            self.reassembler.resume()

    def _log_rejection(self, what: str, exc: Exception) -> None:
        """Log a frame refused, naming its sender where the transport knows it; rate-limited per sender."""
        sender = self._sender()
        where = f" from {sender}" if sender else ""
        self._rejections.error("%s: %s%s: %s", self._name, what, where, exc, source=sender or "")

    def _expire_loop(self) -> None:
        """Run `expire` every `expiry_interval_s` until the intake closes."""
        while not self._stopping.wait(self.expiry_interval_s):
            self.expire()

    @property
    def expiry_interval_s(self) -> float:
        """How often `expire` runs: often enough for the reassembly and unclaimed timeouts it enforces."""
        unclaimed_s = self._unclaimed_timeout_s
        return max(0.05, min(self.reassembler.timeout_s / 4, 5.0, unclaimed_s / 4 if unclaimed_s else 5.0))

    def expire(self) -> None:
        """Free partly received tensors whose chunks stopped coming, even when no other frame arrives,
        and (with `unclaimed_timeout_s`) received ones nobody takes; log the rejections counted since."""
        if self._stopping.is_set():
            return
        with self._lock:
            self.reassembler.expire()  # (nothing while a delivery is held up: see `_hold`)
            self.state.reassembling = self.reassembler.pending > 0
        self._rejections.flush()
        if self._unclaimed_timeout_s is not None:
            self._drop_unclaimed(self._unclaimed_timeout_s)

    def _drop_unclaimed(self, timeout_s: float) -> None:
        """Drop the tensors nobody received within `timeout_s` of their arrival (logged and counted)."""
        dropped = self.table.drop_unclaimed(timeout_s)
        for message in dropped:
            self.ledger.dropped(message.message_id)
        if dropped:
            self.stats["unclaimed"] += len(dropped)
            keys = sorted({str(message.key) for message in dropped})
            shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
            log.warning(
                "%s: dropped %d tensors nobody received within unclaimed_timeout_s=%g (keys %s)",
                self._name, len(dropped), timeout_s, shown,
            )  # fmt: skip

    def close(self) -> None:
        """Stop expiring, let go of incomplete chunked messages and close the dedup file (after the
        transport stopped delivering); the expiry thread is gone when it returns."""
        self._stopping.set()
        if self._expiry.ident is not None and self._expiry is not threading.current_thread():
            self._expiry.join(timeout=5.0)  # (it wakes at once: between two runs of `expire`, or after one)
        self._rejections.flush(final=True)
        with self._lock:
            self.reassembler.close()
            self.state.reassembling = False
            self.state.interrupted = None
            self._seen.close()
