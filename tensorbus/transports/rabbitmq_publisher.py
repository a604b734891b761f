"""The amqp:// producer's I/O thread: publishes with confirms, many messages in flight at once.

pika's BlockingChannel waits for each confirm before the next publish: one broker round trip per
message. This publisher runs a `SelectConnection` on a thread of its own and keeps up to
IN_FLIGHT_BYTES unconfirmed, which is several times the blocking rate for small messages and
still faster for large chunks (docs/PERFORMANCE.md); too many large chunks in flight are slower.
Messages are confirmed in any order the broker likes; after a lost connection or channel every
unconfirmed one is published again (duplicates are dropped by message id on the consumer side),
through the next node of the URL when it names several. When no confirm comes for
`confirm_timeout_s` (e.g. a quorum queue that lost the majority of its nodes cannot take
messages), `send` and `flush` raise instead of waiting on.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import threading
import time
from typing import TYPE_CHECKING, Any

import pika
import pika.exceptions as px
import pika.spec

from ..errors import TransportError
from .base import backoff_s

if TYPE_CHECKING:
    from .rabbitmq import RabbitMQTransport

log = logging.getLogger(__name__)
#: unconfirmed bytes kept in flight (always at least one message)
IN_FLIGHT_BYTES = 64 << 20
#: unconfirmed messages kept in flight
IN_FLIGHT_MESSAGES = 256
#: how long a close that gave up on confirms waits for the I/O thread to close its connection and end
GIVE_UP_S = 5.0
_MESSAGE_SIZE = re.compile(r"message size (\d+)")


class Publisher:
    """Publishes queued frames on its own thread; `send` blocks only while max_pending_bytes are unconfirmed."""

    def __init__(self, transport: RabbitMQTransport) -> None:
        self.t = transport  # its connection parameters, options, queue name and error mapping (`as_error`)
        #: frames waiting to be published: the sending threads append, the I/O thread takes (both under `_pending`)
        self._outbox: collections.deque[tuple[bytes, str | None]] = collections.deque()
        self._in_flight: dict[int, tuple[bytes, str | None]] = {}  # delivery tag -> frame, in publish order
        self._in_flight_bytes = 0
        #: the most messages that were unconfirmed at once (1 would mean one broker round trip per message)
        self.peak_in_flight = 0
        self._pending = threading.Condition()  # (an RLock underneath: `_confirmed` is called with it held too)
        self._pending_bytes = 0
        self._unconfirmed = 0
        self._progress_at = time.monotonic()  # when the last confirm came (or the first unconfirmed frame went)
        self._error: TransportError | None = None
        self._returned: TransportError | None = None  # an unroutable message, reported with its confirm
        self._connection: pika.SelectConnection | None = None
        self._channel: Any = None
        self._next_tag = 1
        #: the connection a wake-up is posted to (set by a sending thread, cleared by the I/O thread: under `_pending`)
        self._wake_posted: pika.SelectConnection | None = None
        self._open_error: BaseException | None = None  # why the connection ended (or never opened)
        self._refused: BaseException | None = None  # the broker refused to set up the channel
        self._passive: Any = None  # the channel whose passive declare is looking for the queue
        #: messages the broker refused (Basic.Nack) and that were published again
        self.nacks = 0
        self._delays = backoff_s(0.1, 2.0)  # between reconnects; restarts once a channel is ready
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"tensorbus-amqp-{transport.queue}")
        self._thread.start()
        self._ready.wait()
        self.raise_error()

    # -- application threads --------------------------------------------------------------------

    def send(self, body: bytes, key: str | None) -> None:
        """Queue one frame; blocks while max_pending_bytes are queued or unconfirmed."""
        with self._pending:
            self.raise_error()
            since = waited_from = time.monotonic()
            while self._pending_bytes and self._pending_bytes + len(body) > self.t.options.max_pending_bytes:
                self._pending.wait(1.0)
                waited_from = self.t.tally.blocked(waited_from)  # (the seconds waited, counted as they pass)
                self.raise_error()
                self._check_progress(since)
            self._pending_bytes += len(body)
            if not self._unconfirmed:
                self._progress_at = time.monotonic()
            self._unconfirmed += 1
            self._outbox.append((body, key))  # under the lock: `_fail_all` cannot miss it
        self._wake()

    def flush(self, timeout: float | None) -> None:
        """Wait until the broker has confirmed every queued frame; raise the first failure."""
        since = time.monotonic()
        deadline = None if timeout is None else since + timeout
        with self._pending:
            while self._unconfirmed and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TransportError(f"{self._unconfirmed} frames unconfirmed by {self.t.shown} after {timeout}s")
                self._pending.wait(1.0 if remaining is None else min(remaining, 1.0))
                self._check_progress(since)
            self.raise_error()

    def _check_progress(self, since: float) -> None:
        """Raise when frames wait for a confirm and none came for confirm_timeout_s, neither since the last one
        nor since this wait began at `since` (caller holds `_pending`)."""
        waited = time.monotonic() - max(self._progress_at, since)
        if self._unconfirmed and self._error is None and waited > self.t.options.confirm_timeout_s:
            raise TransportError(
                f"{self._unconfirmed} frames unconfirmed by {self.t.shown}, no confirm for {waited:.0f}s "
                f"(confirm_timeout_s, {self.nacks} refused with a nack so far): are its nodes down, has a quorum "
                f"queue lost the majority of its nodes, or is the queue full?"
            )

    def raise_error(self) -> None:
        """Raise (once) the first failure the I/O thread recorded."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self, timeout: float) -> None:
        """Publish what is queued, wait for its confirms (up to `timeout`), then close the connection; what is
        still unconfirmed then is given up on, said in the log (a `flush` before `close` raises it instead)."""
        self._stop.set()
        self._wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return
        log.warning("%s: closing with messages not confirmed within close_timeout_s=%g", self.t.shown, timeout)
        with self._pending:
            connection = self._connection
        if connection is not None:  # (its I/O thread then sees the connection closed, and stopped: it ends)
            with contextlib.suppress(Exception):
                connection.ioloop.add_callback_threadsafe(connection.close)
        self._thread.join(GIVE_UP_S)

    def _wake(self) -> None:
        """Have the I/O thread publish what is queued (one wake-up at a time)."""
        with self._pending:
            connection = self._connection
            if connection is None or self._wake_posted is connection:
                return  # connecting: the new channel publishes the outbox once it is ready
            self._wake_posted = connection  # (one posted to a connection that has since closed does not count)
        with contextlib.suppress(Exception):  # closing: the reconnect publishes the outbox
            connection.ioloop.add_callback_threadsafe(self._publish)

    # -- the I/O thread -------------------------------------------------------------------------

    def _run(self) -> None:
        """Connect, run the connection's I/O loop until it closes, reconnect with backoff."""
        try:
            self._connect_until_stopped()
        except BaseException as exc:  # a bug here must not leave send, flush and close waiting forever
            log.exception("the amqp publisher thread failed")
            self._fail_all(TransportError(f"the publisher for {self.t.shown} failed: {exc!r}"))
            self._ready.set()

    def _connect_until_stopped(self) -> None:
        deadline = time.monotonic() + self.t.options.reconnect_timeout_s
        while True:
            self._open_error = self._refused = self._returned = None
            connection = pika.SelectConnection(
                self.t.params,
                on_open_callback=lambda c: c.channel(on_open_callback=self._on_channel),
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_closed,
            )
            self._connection = connection
            try:
                connection.ioloop.start()
            finally:
                self._connection = self._channel = None
                connection.ioloop.close()  # its wake-up socket pair
            with self._pending:
                self._outbox.extendleft(reversed(self._in_flight.values()))  # published again, in order
                left = bool(self._outbox)
            self._in_flight.clear()
            self._in_flight_bytes = 0
            if self._stop.is_set() and not left:
                return
            error = self.t.as_error(self._refused or self._open_error or TransportError("connection lost"))
            first = not self._ready.is_set()
            delay = next(self._delays) if self.t.fail_over() else 0.0  # the next node at once, then back off
            if first:  # (the last attempt at the deadline, not a backoff step before it)
                delay = min(delay, max(0.0, deadline - time.monotonic()))
            if not error.retriable or self._stop.is_set() or (first and time.monotonic() >= deadline):
                self._fail_all(error)  # e.g. wrong credentials: nothing will ever be published
                if first or self._stop.is_set():
                    self._ready.set()
                    return
            log.warning("%s; reconnecting in %.1fs", error, delay)
            time.sleep(delay)

    def _on_open_error(self, connection: pika.SelectConnection, error: BaseException) -> None:
        self._open_error = error
        connection.ioloop.stop()

    def _on_closed(self, connection: pika.SelectConnection, reason: BaseException) -> None:
        self._open_error = self._open_error or reason  # (closed after a nack: that is the reason)
        connection.ioloop.stop()

    def _on_channel(self, channel: Any, passive: bool = True) -> None:
        """Set up a new channel: find the queue (a passive declare; declared as `queue_type` when missing), confirms."""
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        confirm = lambda _: channel.confirm_delivery(self._on_confirm, callback=lambda _: self._on_ready(channel))  # noqa: E731
        if passive:
            self._passive = channel
            channel.queue_declare(self.t.queue, passive=True, callback=confirm)
        else:
            self.t.declare(channel, callback=confirm)

    def _on_ready(self, channel: Any) -> None:
        self._channel, self._next_tag = channel, 1
        self.t.tally.forget_timing()  # (delivery tags start again)
        self._delays = backoff_s(0.1, 2.0)
        self.t.connected()
        self._ready.set()
        self._publish()

    def _publish(self) -> None:
        """Publish from the outbox while the in-flight window has room; close once stopping and all is confirmed."""
        with self._pending:
            self._wake_posted = None
        channel = self._channel
        if channel is None or not channel.is_open:
            return
        properties = pika.BasicProperties(
            content_type=self.t.content_type, delivery_mode=2 if self.t.options.persistent else 1
        )
        while (item := self._next_to_publish()) is not None:
            body, key = item
            properties.headers = {"tensorbus-key": key} if key is not None else None
            channel.basic_publish("", self.t.queue, body, properties=properties, mandatory=True)
            self.t.tally.timing(self._next_tag)
            self._in_flight[self._next_tag] = (body, key)
            self._in_flight_bytes += len(body)
            self._next_tag += 1
        self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))
        with self._pending:
            idle = not self._outbox and not self._in_flight
        if self._stop.is_set() and idle and self._connection is not None:
            self._connection.close()

    def _next_to_publish(self) -> tuple[bytes, str | None] | None:
        """The next frame of the outbox, while the in-flight window has room for it (else None)."""
        with self._pending:
            if self._outbox and (
                not self._in_flight
                or (
                    self._in_flight_bytes + len(self._outbox[0][0]) <= IN_FLIGHT_BYTES
                    and len(self._in_flight) < IN_FLIGHT_MESSAGES
                )
            ):
                return self._outbox.popleft()
        return None

    def _on_confirm(self, frame: Any) -> None:
        """Basic.Ack or Basic.Nack for one delivery tag, or (multiple) for every tag up to it."""
        method = frame.method
        if method.multiple:
            tags = [tag for tag in self._in_flight if tag <= method.delivery_tag]
        else:
            tags = [method.delivery_tag] if method.delivery_tag in self._in_flight else []
        refused = []
        for tag in tags:
            frame_and_key = self._in_flight.pop(tag)
            self._in_flight_bytes -= len(frame_and_key[0])
            if isinstance(method, pika.spec.Basic.Nack):
                refused.append(frame_and_key)
                continue
            error, self._returned = self._returned, None
            self._confirmed(len(frame_and_key[0]), error)
        if refused:
            # A quorum queue nacks what reaches it between two leaders, and a channel that first published
            # then keeps the dead leader and nacks everything after (RabbitMQ 3.10): a new connection (and
            # channel) publishes them again, with everything else unconfirmed.
            self.nacks += len(refused)
            with self._pending:
                self._outbox.extendleft(reversed(refused))
            log.info("RabbitMQ at %s refused %d messages (nack); publishing them again", self.t.shown, len(refused))
            if self._connection is not None and self._connection.is_open:
                self._channel = None
                self._open_error = TransportError(f"RabbitMQ at {self.t.shown} refused {len(refused)} messages (nack)")
                self._connection.close()
            return
        tag = method.delivery_tag
        self.t.tally.acked(len(tags), through=tag + 1 if method.multiple else None, at=tag)
        self._publish()

    def _on_return(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        """An unroutable message (its queue was deleted): reported with the confirm that follows it.

        The queue is declared again, so the frames after it reach a queue (as after a reconnect).
        """
        self._returned = TransportError(
            f"RabbitMQ at {self.t.shown} could not route a message to queue {self.t.queue!r}: {method.reply_text}"
        )
        if channel.is_open:
            self.t.declare(channel)

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        """The broker closed the channel over one message (e.g. over max_message_size): fail it, resend the rest."""
        if not isinstance(reason, px.ChannelClosedByBroker) or self._connection is None:
            return  # closed by this side, or with the connection: `_run` reconnects
        if self._channel is not channel:  # refused while being set up
            if channel is self._passive and reason.reply_code == 404:  # no such queue: declare it
                self._connection.channel(on_open_callback=lambda c: self._on_channel(c, passive=False))
                return
            self._refused = reason  # e.g. a queue_type the broker does not know
            self._connection.close()
            return
        self._channel, self._returned = None, None
        culprit = next(iter(self._in_flight), None)
        size = _MESSAGE_SIZE.search(reason.reply_text)
        if size is not None:
            culprit = next((t for t, (body, _) in self._in_flight.items() if len(body) == int(size[1])), culprit)
        if culprit is not None:
            body, _ = self._in_flight.pop(culprit)
            self._confirmed(len(body), self.t.as_error(reason))
        with self._pending:
            self._outbox.extendleft(reversed(self._in_flight.values()))
        self._in_flight.clear()
        self._in_flight_bytes = 0
        self._connection.channel(on_open_callback=self._on_channel)

    def _confirmed(self, nbytes: int, error: TransportError | None) -> None:
        with self._pending:
            self._pending_bytes -= nbytes
            self._unconfirmed -= 1
            self._progress_at = time.monotonic()
            if error is not None and self._error is None:
                self._error = error
            self._pending.notify_all()

    def _fail_all(self, error: TransportError) -> None:
        """Give up on every queued frame (flush raises `error`)."""
        with self._pending:
            while self._outbox:
                body, _ = self._outbox.popleft()
                self._confirmed(len(body), None)
            if self._error is None:
                self._error = error
            self._pending.notify_all()
