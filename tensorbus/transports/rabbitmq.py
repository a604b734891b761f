"""`amqp://user:pass@host:port/vhost?queue=NAME` (and `amqps://`): tensors through a RabbitMQ queue.

Each frame (or chunk frame) is one persistent message on the endpoint's durable queue, published
with confirms. The consumer acks a message only once its whole tensor reached the rendezvous
table, so a consumer that dies loses nothing: the broker redelivers to its successor, and
redelivered duplicates are dropped by message id above this layer.

pika is not thread-safe and only answers heartbeats while its thread is inside pika, so every
connection lives on an I/O thread of its own; the application talks to it through queues and
`add_callback_threadsafe`, and a slow application never starves the heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions as px
from pika.adapters.utils import connection_workflow as workflow

from ..codec.frame import Buffer, Limits, MessageId
from ..errors import ConfigError, TransportError
from .base import Deliver, Transport, TransportOptions, backoff_s
from .rabbitmq_publisher import Publisher

log = logging.getLogger(__name__)
CONTENT_TYPE = "application/vnd.tensorbus.frame"
_STOP = object()
#: AMQP carries prefetch_count in 16 bits
MAX_PREFETCH = 65535


class _Fatal(TransportError):
    retriable = False


#: TLS failures that are configuration mistakes (an untrusted certificate, TLS to a plain port)
_TLS_MISTAKES = ("CERTIFICATE_VERIFY_FAILED", "WRONG_VERSION_NUMBER")


@contextlib.contextmanager
def map_errors(address: str) -> Iterator[None]:
    """Translate pika's exceptions into tensorbus's, marking which ones a retry can fix."""
    try:
        yield
    except (px.ProbableAuthenticationError, px.ProbableAccessDeniedError, px.AuthenticationError) as exc:
        raise _Fatal(f"RabbitMQ at {address} refused the credentials or vhost: {exc!r}") from None
    except px.ChannelClosedByBroker as exc:
        hint = " (the broker's max_message_size; lower max_frame_bytes)" if "max size" in exc.reply_text else ""
        raise _Fatal(f"RabbitMQ at {address} closed the channel: {exc.reply_code} {exc.reply_text}{hint}") from None
    except (px.UnroutableError, px.NackError) as exc:
        raise _Fatal(f"RabbitMQ at {address} did not accept a message: {exc!r}") from None
    except (px.AMQPError, OSError) as exc:
        if any(reason in repr(exc) for reason in _TLS_MISTAKES):  # a retry cannot fix these
            raise _Fatal(
                f"TLS with RabbitMQ at {address} failed (check ssl_cafile, and that the port speaks TLS): {exc!r}"
            ) from None
        raise TransportError(f"connection to RabbitMQ at {address} failed: {exc!r}") from None


@dataclass(frozen=True, kw_only=True)
class RabbitMQOptions(TransportOptions):
    """The options of amqp:// and amqps:// endpoints."""

    queue: str | None = None
    max_frame_bytes: int | None = 16 * 1024 * 1024 - 4096
    durable: bool = True
    persistent: bool = True
    prefetch_count: int = 16
    heartbeat_s: int = 30
    connect_timeout_s: float = 10.0
    reconnect_timeout_s: float = 60.0
    max_pending_bytes: int = 256 * 1024 * 1024
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None


class RabbitMQTransport(Transport):
    """A durable queue per endpoint; a publisher I/O thread or a consumer I/O thread per instance."""

    schemes = ("amqp", "amqps")
    acknowledges = True
    persists = True
    Options = RabbitMQOptions
    options: RabbitMQOptions

    def __init__(self, url: urllib.parse.SplitResult, options: RabbitMQOptions) -> None:
        super().__init__(url, options)
        if not options.queue:
            raise ConfigError(
                f"AMQP URL needs a queue, e.g. amqp://guest:guest@127.0.0.1:5672/%2F?queue=tensors; "
                f"got {urllib.parse.urlunsplit(url)!r}"
            )
        if not 1 <= options.prefetch_count <= MAX_PREFETCH:
            raise ConfigError(
                f"prefetch_count must be 1 to {MAX_PREFETCH} (AMQP's limit), got {options.prefetch_count}"
            )
        self.queue: str = options.queue
        self.shown = f"{url.scheme}://{url.hostname}:{url.port or 5672}{url.path or '/'}?queue={self.queue}"
        self.params = self._parameters()
        self.content_type = CONTENT_TYPE
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: TransportError | None = None
        self._publisher: Publisher | None = None

    @property
    def address(self) -> str:
        return urllib.parse.urlunsplit(self.url._replace(query=f"queue={urllib.parse.quote(self.queue)}"))

    def _parameters(self) -> pika.ConnectionParameters:
        url, o = self.url, self.options
        ssl_options = None
        if url.scheme == "amqps":
            context = ssl.create_default_context(cafile=o.ssl_cafile)
            if o.ssl_certfile:
                context.load_cert_chain(o.ssl_certfile, o.ssl_keyfile)
            ssl_options = pika.SSLOptions(context, url.hostname)
        vhost = urllib.parse.unquote(url.path[1:]) if len(url.path) > 1 else "/"
        return pika.ConnectionParameters(
            host=url.hostname or "127.0.0.1",
            port=url.port or (5671 if ssl_options else 5672),
            virtual_host=vhost,
            ssl_options=ssl_options,
            heartbeat=o.heartbeat_s,
            blocked_connection_timeout=o.reconnect_timeout_s,
            socket_timeout=o.connect_timeout_s,
            stack_timeout=o.connect_timeout_s * 2,
            connection_attempts=1,
            credentials=pika.PlainCredentials(
                urllib.parse.unquote(url.username or "guest"), urllib.parse.unquote(url.password or "guest")
            ),
        )

    def _connect(self) -> tuple[pika.BlockingConnection, Any]:
        """Open a connection and a confirming channel with the endpoint's queue declared, retrying with backoff."""
        deadline = time.monotonic() + self.options.reconnect_timeout_s
        for delay in backoff_s(0.1, 2.0):
            try:
                with map_errors(self.shown):
                    connection = pika.BlockingConnection(self.params)
                    channel = connection.channel()
                    self.declare(channel)
                    return connection, channel
            except _Fatal:
                raise
            except TransportError as exc:
                if self._stop.is_set() or time.monotonic() + delay > deadline:
                    raise
                log.info("%s; retrying in %.1fs", exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _start(self, target: Any, *args: Any) -> None:
        """Run `target` on the I/O thread and wait until it is connected (or failed to connect)."""
        self._thread = threading.Thread(target=target, args=args, daemon=True, name=f"tensorbus-amqp-{self.queue}")
        self._thread.start()
        o = self.options
        if not self._ready.wait(o.reconnect_timeout_s + 3 * o.connect_timeout_s):
            self._stop.set()
            raise TransportError(f"RabbitMQ at {self.shown} did not answer in time")
        if self._error is not None:
            raise self._error

    # -- producer side -------------------------------------------------------------------------------

    def send(self, frame: list[Buffer], *, key: str | None) -> None:
        """Queue one frame for the publisher thread; blocks only while max_pending_bytes are unconfirmed."""
        if self._publisher is None:
            self._publisher = Publisher(self)
        self._publisher.send(b"".join(frame), key)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the broker has confirmed every queued frame; raise the first failure."""
        if self._publisher is not None:
            self._publisher.flush(timeout)

    def declare(self, channel: Any, **callback: Any) -> None:
        """Declare the endpoint's queue on a blocking channel, or on an async one with `callback=`."""
        channel.queue_declare(self.queue, durable=self.options.durable, **callback)

    def as_error(self, exc: BaseException) -> TransportError:
        """The tensorbus error for a pika exception, as `map_errors` translates it."""
        if isinstance(exc, TransportError):
            return exc
        if isinstance(exc, workflow.AMQPConnectionWorkflowFailed):  # unwrapped as BlockingConnection does
            exc = exc.exceptions[-1]
            if isinstance(exc, workflow.AMQPConnectorSocketConnectError):
                exc = px.AMQPConnectionError(exc)
            elif isinstance(exc, workflow.AMQPConnectorPhaseErrorBase):
                exc = exc.exception
        try:
            with map_errors(self.shown):
                raise exc
        except TransportError as mapped:
            return mapped
        except Exception:
            return TransportError(f"RabbitMQ at {self.shown}: {exc!r}")

    # -- consumer side -------------------------------------------------------------------------------

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        """Consume the queue on an I/O thread; a worker thread delivers and posts acks back."""
        inbox: queue.Queue[Any] = queue.Queue()
        self._worker = threading.Thread(
            target=self._work, args=(inbox, deliver), daemon=True, name=f"tensorbus-amqp-deliver-{self.queue}"
        )
        self._worker.start()
        self._inbox = inbox
        self._start(self._consume_loop, inbox)

    def _consume_loop(self, inbox: queue.Queue[Any]) -> None:
        generation = 0
        while not self._stop.is_set():
            try:
                with map_errors(self.shown):
                    connection, channel = self._connect()
                    generation += 1
                    self._connection, self._channel, self._generation = connection, channel, generation
                    self._pending_chunks = 0
                    self._window = self.options.prefetch_count
                    self._cancelled = False
                    channel.add_on_cancel_callback(lambda _frame: setattr(self, "_cancelled", True))
                    channel.basic_qos(prefetch_count=self._window, global_qos=True)
                    channel.basic_consume(
                        self.queue,
                        lambda ch, method, props, body, g=generation: inbox.put((g, method.delivery_tag, body)),
                    )
                    self._ready.set()
                    while not self._stop.is_set():
                        connection.process_data_events(time_limit=0.2)
                        if self._cancelled:  # the queue was deleted: declare it again on a new connection
                            raise TransportError(f"RabbitMQ cancelled the consumer of {self.shown}")
                    connection.process_data_events(time_limit=0)  # the acks `close` waited for go out
            except Exception as exc:  # whatever failed, reconnect: a dead I/O thread would stop all delivery
                if not isinstance(exc, TransportError):
                    log.exception("the RabbitMQ consumer thread of %s failed", self.shown)
                error = self.as_error(exc)
                if not self._ready.is_set():
                    self._error = error
                    self._ready.set()
                    return
                if not self._stop.is_set():
                    log.warning("%s; reconnecting (unacked messages will be redelivered)", error)
                    with contextlib.suppress(Exception):
                        self._connection.close()
        with contextlib.suppress(Exception):
            self._connection.close()

    def _work(self, inbox: queue.Queue[Any], deliver: Deliver) -> None:
        """Deliver each message; ack every message of a tensor once the tensor is complete."""
        waiting: dict[MessageId | None, list[tuple[int, int]]] = {}
        while True:
            try:
                item = inbox.get(timeout=1.0)
            except queue.Empty:
                item = None
            for message_id in [m for m in waiting if not deliver.is_pending(m)]:
                held = waiting.pop(message_id)  # expired: the tensor was given up on, its chunks go
                self._call(self._ack, held, len(held))
            if item is None:
                continue
            if item is _STOP:
                return
            generation, tag, body = item
            result = deliver(body)
            if result.turned_away:  # aborted: take nothing more; what is unacked goes back to the queue
                self._stop.set()  # the I/O thread closes the connection (after the acks posted before this)
                return
            if not result.done:
                waiting.setdefault(result.message_id, []).append((generation, tag))
                self._call(self._grow_window, 1, generation)
                continue
            held = waiting.pop(result.message_id, [])
            self._call(self._ack, [*held, (generation, tag)], len(held))

    def _call(self, fn: Any, *args: Any) -> None:
        with contextlib.suppress(Exception):  # connection gone: unacked messages come back anyway
            self._connection.add_callback_threadsafe(lambda: fn(*args))

    def _grow_window(self, delta: int, generation: int) -> None:
        """Keep the prefetch window above the chunks held for incomplete tensors, so they cannot starve it.

        Only chunks of the current channel count (`generation`): after a reconnect the broker
        redelivers the older ones, which are counted again as they come. `basic_qos` is a synchronous
        round trip to the broker (most of the consumer's time when it ran once per held chunk of a
        large tensor), so the window moves in steps of half `prefetch_count` and shrinks
        only once it is two steps too large; AMQP caps it at 65535.
        """
        if generation != self._generation:
            return
        self._pending_chunks = max(0, self._pending_chunks + delta)
        needed = self.options.prefetch_count + self._pending_chunks
        step = max(1, self.options.prefetch_count // 2)
        if needed > self._window or needed + 2 * step <= self._window:
            self._window = min(-(-needed // step) * step, MAX_PREFETCH)
            self._channel.basic_qos(prefetch_count=self._window, global_qos=True)

    def _ack(self, tags: list[tuple[int, int]], released: int) -> None:
        """Ack the tags of the current channel (older ones were requeued); the first `released` were held chunks."""
        for generation, tag in tags:
            if generation == self._generation:
                self._channel.basic_ack(tag)
        held_here = sum(generation == self._generation for generation, _ in tags[:released])
        if held_here:
            self._grow_window(-held_here, self._generation)

    def close(self) -> None:
        """Stop the I/O thread(s); the publisher first publishes what is queued, the consumer acks what it delivered."""
        if self._publisher is not None:
            self._publisher.close(timeout=30)
        if self._thread is None:
            return
        if self._ready.is_set():
            self._inbox.put(_STOP)
            self._worker.join(timeout=10)  # its last acks are posted before the I/O thread stops
        self._stop.set()
        self._thread.join(timeout=30)
        self._thread = None
