"""The amqp:// consumer: an I/O thread consumes the queue, a worker thread delivers frames and posts acks.

Each delivery is acked once the consumer's ledger releases it (ledger.py): once the application
took its tensor (by default), or it was settled (a duplicate, refused, dropped). So untaken tensors
and the chunks of an incomplete one stay unacked and count against the consumer's prefetch window. Quorum queues
and streams know only a per-consumer prefetch, which cannot be widened for a consumer that already
runs: so once the deliveries held by the current consumer fill its window, a fresh consumer (same
channel, same prefetch) takes over and the old one is cancelled. (Not sooner: deliveries still on
their way to a cancelled consumer go back to the queue and travel again.) What the old one holds stays
unacked on the channel until its tensor completes (or the connection drops and the broker
redelivers it); the reassembler's byte limit bounds how much that can be. The same works on
classic queues, so there is one design for every queue type.

Acks cost little per tensor: the worker (and the ledger, on the thread that took a tensor) posts holds
and acks to one list, and one wake-up of the I/O thread (`add_callback_threadsafe`) drains whatever was
posted meanwhile; a run of released deliveries with nothing unacked before it goes as one `multiple` ack.

Streams keep their messages, so an ack there only grants credit for the next one: each delivery
is acked once it was delivered. The consumer keeps its position in memory (the offset after the
last frame delivered, or the first chunk of a tensor still incomplete) and, after a lost
connection, consumes again from there; a new consumer starts at `offset`.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import pika.exceptions as px
import pika.spec

from ..errors import TransportError
from .base import Deliver, backoff_s

if TYPE_CHECKING:
    from .rabbitmq import RabbitMQTransport

log = logging.getLogger(__name__)
_STOP = object()
_HOLD, _ACK = object(), object()  # what `_post` hands the I/O thread: a delivery to hold, released ones to ack
#: (channel generation, delivery tag, consumer tag) of one delivery
Delivery = tuple[int, int, str]
#: a connection that failed sooner than this after it was made is made again only after a backoff (0.1 s doubling
#: to 5 s): one refused at once (credentials, a vhost, a 403 on consume) would otherwise be retried in a tight loop
QUICK_FAILURE_S = 10.0
#: bytes the consumer's connection reads from its socket at a time: two of the largest AMQP frames.
#: pika reads 4 KiB and appends each read to its frame buffer, a copy of that buffer, so a full
#: body frame costs 32 reads and about 16 copies of itself; read two frames at once, about one.
RECV_BYTES = 2 * pika.spec.FRAME_MAX_SIZE


def read_in_large_pieces(connection: Any) -> bool:
    """Make a pika connection read RECV_BYTES per socket read; False if this pika has no such setting.

    (`_MAX_RECV_BYTES` is an attribute of pika's socket transport, read on every read.)
    """
    transport: Any = getattr(getattr(connection, "_impl", None), "_transport", None)
    if not isinstance(getattr(transport, "_MAX_RECV_BYTES", None), int):
        return False
    transport._MAX_RECV_BYTES = RECV_BYTES
    return True


class QueueConsumer:
    """Consumes the endpoint's queue on an I/O thread, reconnecting (to the next node) when the connection drops."""

    def __init__(self, transport: RabbitMQTransport, deliver: Deliver) -> None:
        self.t = transport  # its queue, options, error mapping and nodes (`connect`, `fail_over`)
        self.deliver = deliver
        self.stream = transport.offset is not None
        self.ready, self.stop = threading.Event(), threading.Event()
        #: set by the worker when a delivery failed for want of memory: the I/O thread reconnects, and RabbitMQ
        #: delivers again what this consumer had not acknowledged (as a socket consumer drops the connection)
        self.again = threading.Event()
        self.error: TransportError | None = None
        #: channels opened so far; deliveries of an older one cannot be acked (the broker requeued them)
        self.generation = 0
        #: consumers that took over from one whose window was full of held chunks
        self.rolls = 0
        #: consumer tag -> deliveries it made that are not acked yet: untaken, or chunks waiting for the rest of
        #: their tensor (I/O thread only, as are the two sets below)
        self.held = collections.Counter[str]()
        self._unacked: set[Delivery] = set()  # the deliveries `held` counts
        self._acked_early: set[Delivery] = set()  # released (and acked) before their `_hold` ran
        #: delivery tags of the current channel handed to `on_message` and not acked yet, oldest first (I/O
        #: thread): a run of released ones at its head is acked with one `multiple` ack
        self._outstanding: dict[int, None] = {}
        #: holds and acks the worker (and the ledger) posted for the I/O thread, oldest first, and whether a
        #: `_drain` of them is scheduled on the connection; both, and `_connection`, under `_posting`
        self._posted: list[tuple[Any, Any]] = []
        self._drain_scheduled = False
        self._posting = threading.Lock()
        #: stream: the offset to consume from after a reconnect
        self.position: str | int | None = transport.offset
        self._tag: str | None = None
        self._connection: Any = None
        self._channel: Any = None
        self._cancelled = False
        self._inbox: queue.Queue[Any] = queue.Queue()
        self.worker = threading.Thread(target=self._work, daemon=True, name=f"tensorbus-amqp-deliver-{transport.queue}")
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"tensorbus-amqp-{transport.queue}")
        self.worker.start()
        self.thread.start()

    # -- the I/O thread -------------------------------------------------------------------------

    def _run(self) -> None:
        delays = backoff_s(0.1, 5.0)
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self._serve()
            except Exception as exc:  # whatever failed, reconnect: a dead I/O thread would stop all delivery
                if not isinstance(exc, (TransportError, px.AMQPError, OSError)):
                    log.exception("the RabbitMQ consumer thread of %s failed", self.t.shown)
                error = self.t.as_error(exc)
                if not self.ready.is_set():
                    self.error = error
                    self.ready.set()
                    return
                if not self.stop.is_set():
                    log.warning("%s; reconnecting (unacked messages will be redelivered)", error)
                    with contextlib.suppress(Exception):
                        self._connection.close()
                    self.t.fail_over()  # the node may be gone: the next one first
                    if time.monotonic() - started >= QUICK_FAILURE_S:  # (it served a while: again at once)
                        delays = backoff_s(0.1, 5.0)
                    else:  # (refused at once, say: credentials, a vhost, a 403 on consume): not in a tight loop
                        self.stop.wait(next(delays))
        with contextlib.suppress(Exception):
            self._connection.close()

    def _serve(self) -> None:
        """Connect, consume, and process the connection's events until stopped (or it fails)."""
        connection, channel = self.t.connect(self.stop)
        read_in_large_pieces(connection)
        self.generation += 1
        with self._posting:  # (a drain scheduled on the old connection never runs: what it had is moot)
            self._connection, self._channel = connection, channel
            self._posted.clear()
            self._drain_scheduled = False
        self.held.clear()
        self._unacked.clear()
        self._acked_early.clear()
        self._outstanding.clear()
        self._cancelled = False
        channel.add_on_cancel_callback(lambda _frame: setattr(self, "_cancelled", True))
        channel.basic_qos(prefetch_count=self.t.options.prefetch_count)  # per consumer
        self._tag = self._consume()
        self.ready.set()
        while not self.stop.is_set():
            connection.process_data_events(time_limit=0.2)
            if self._cancelled:  # e.g. the queue was deleted: declare it again on a new connection
                raise TransportError(f"RabbitMQ cancelled the consumer of {self.t.shown}")
            if channel.is_closed:  # by the broker (e.g. `consumer_timeout`, 406): it requeued what was unacked
                raise TransportError(f"RabbitMQ closed the channel of {self.t.shown} (pika logged why)")
            if self.again.is_set():
                self.again.clear()
                raise TransportError(f"{self.t.shown}: a message could not be delivered for want of memory")
        connection.process_data_events(time_limit=0)  # the acks `close` waited for go out

    def _consume(self) -> str:
        """Start a consumer on the current channel (a stream's from the consumer's position); its tag."""
        generation, inbox, outstanding = self.generation, self._inbox, self._outstanding
        arguments = {"x-stream-offset": self.position} if self.stream else None

        def on_message(_channel: Any, method: Any, properties: Any, body: bytes) -> None:
            offset = (properties.headers or {}).get("x-stream-offset") if self.stream else None
            self.t.tally.redeliveries += method.redelivered  # (the I/O thread's count)
            outstanding[method.delivery_tag] = None
            inbox.put(((generation, method.delivery_tag, method.consumer_tag), offset, body, method.redelivered))

        tag: str = self._channel.basic_consume(self.t.queue, on_message, arguments=arguments)
        return tag

    def _hold(self, delivery: Delivery) -> None:
        """Count a delivery left unacked (untaken, or a chunk waiting for its tensor); hand over to a fresh
        consumer once they fill the window, so they never keep the queue from a tensor a `recv` waits for."""
        generation, _, tag = delivery
        if generation != self.generation:
            return
        if delivery in self._acked_early:  # released before this was posted (taken at once)
            self._acked_early.discard(delivery)
            return
        self._unacked.add(delivery)
        self.held[tag] += 1
        if tag == self._tag and self.held[tag] >= self.t.options.prefetch_count:
            old, self._tag = self._tag, self._consume()
            self._channel.basic_cancel(old)  # (pika requeues what reaches it for `old` from now on)
            self.rolls += 1

    def _ack(self, deliveries: list[Delivery], tags: set[int]) -> None:
        """Count off the deliveries the ledger released, of the current channel (older ones were requeued),
        adding their delivery tags to `tags` (acked by `_send_acks`)."""
        for delivery in deliveries:
            generation, delivery_tag, tag = delivery
            if generation != self.generation:
                continue
            tags.add(delivery_tag)
            if self.stream:  # (never held: see `_work`)
                continue
            if delivery not in self._unacked:
                self._acked_early.add(delivery)
                continue
            self._unacked.discard(delivery)
            self.held[tag] -= 1
            if self.held[tag] <= 0 and tag != self._tag:
                del self.held[tag]

    def _send_acks(self, tags: set[int]) -> None:
        """Ack released delivery tags: those at the head of `_outstanding` (every older tag released too)
        with one `multiple` ack up to the last of them, any others one by one."""
        run = 0
        top = None
        for delivery_tag in self._outstanding:
            if delivery_tag not in tags:
                break
            run, top = run + 1, delivery_tag
        channel = self._channel
        if top is not None:
            for delivery_tag in list(itertools.islice(self._outstanding, run)):
                del self._outstanding[delivery_tag]
                tags.discard(delivery_tag)
            channel.basic_ack(top, multiple=run > 1)
        for delivery_tag in sorted(tags):
            if delivery_tag in self._outstanding:
                del self._outstanding[delivery_tag]
                channel.basic_ack(delivery_tag)

    def _drain(self) -> None:
        """Run the holds and acks posted so far, in order; the acks go out as few frames as they can."""
        with self._posting:
            posted, self._posted = self._posted, []
            self._drain_scheduled = False
        tags: set[int] = set()
        for fn, arg in posted:
            if fn is _HOLD:
                self._hold(arg)
            else:
                self._ack(arg, tags)
        if tags:
            self._send_acks(tags)

    # -- the worker thread ----------------------------------------------------------------------

    def _work(self) -> None:
        """Deliver each message and record it in the ledger, which acks it (`_ack`) once it is released."""
        if self.stream:  # streams keep every message: an ack is credit for the next; the ledger keeps the position
            positions = self.deliver.ledger.stream()
        else:
            positions = self.deliver.ledger.stream(lambda released: self._post(_ACK, released))
        resume_at: int | None = None  # a stream's offset whose delivery failed (for want of memory): read again
        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            delivery, offset, body, redelivered = item
            try:
                result = self.deliver(body, redelivered=bool(redelivered))  # (RabbitMQ's mark: see `Deliver`)
            except Exception as exc:  # (no memory for it: not the message's fault; anything else: a bug of ours)
                if not isinstance(exc, MemoryError):
                    log.exception("%s: delivering a message failed", self.t.shown)
                if self.stream and isinstance(offset, int):  # (a stream is read again from it, not past it)
                    resume_at = offset if resume_at is None else min(resume_at, offset)
                    self.position = resume_at
                self.again.set()  # unacknowledged, it comes again on the next connection; this thread goes on
                continue
            if result.turned_away:  # aborted: take nothing more; what is unacked goes back to the queue
                self.stop.set()  # the I/O thread closes the connection (after the acks posted before this)
                return
            if self.stream:
                self._post(_ACK, [delivery])
                if isinstance(offset, int):
                    positions.record(offset, result)
                    if resume_at is not None and offset <= resume_at:  # (the one that failed, read again)
                        resume_at = None
                    # (in memory, for this consumer's reconnects only: what is in its table is not read again)
                    self.position = positions.first_unreceived() if resume_at is None else resume_at
            else:
                # held even when released at once: its `_ack`, posted first, left it in `_acked_early`,
                # which this hold clears (a hold posted only for unreleased ones let that set grow)
                positions.record(delivery, result)
                self._post(_HOLD, delivery)

    def _post(self, what: object, arg: Any) -> None:
        """Hand a hold or an ack to the I/O thread: one wake-up of it (`add_callback_threadsafe`) runs
        everything posted until it drains them (any thread: the worker's holds, the ledger's releases)."""
        with self._posting:
            self._posted.append((what, arg))
            if self._drain_scheduled or self._connection is None:
                return
            self._drain_scheduled = True
            connection = self._connection
        try:
            connection.add_callback_threadsafe(self._drain)
        except Exception:  # connection gone: unacked messages come back anyway (a new one resets the flag)
            pass

    def give_up(self) -> None:
        """Stop both threads without waiting for them (it never got to consume: nothing to deliver or ack)."""
        self.stop.set()
        self._inbox.put(_STOP)

    def close(self) -> None:
        """Deliver what is queued and post its acks, then stop the I/O thread (which sends them)."""
        self._inbox.put(_STOP)
        if self.ready.is_set():
            self.worker.join(timeout=10)  # its last acks are posted before the I/O thread stops
        self.stop.set()
        self.thread.join(timeout=30)
