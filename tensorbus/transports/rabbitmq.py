"""`amqp://user:pass@host:port[,host:port...]/vhost?queue=NAME` (and `amqps://`): tensors through a RabbitMQ queue.

Each frame (or chunk frame) is one persistent message on the endpoint's durable queue, published
with confirms. The consumer acks a message only once its whole tensor reached the rendezvous
table, so a consumer that dies loses nothing: the broker redelivers to its successor, and
redelivered duplicates are dropped by message id above this layer.

A URL may name several nodes of a cluster: connections go to the first that answers and, when
it is lost, to the next. A queue that exists is used as it is (a passive declare finds it); a
missing one is declared as `queue_type` (quorum, classic or stream).

pika is not thread-safe and only answers heartbeats while its thread is inside pika, so every
connection lives on an I/O thread of its own; the application talks to it through queues and
`add_callback_threadsafe`, and a slow application never starves the heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions as px
from pika.adapters.utils import connection_workflow as workflow

from ..codec.frame import Buffer, Limits
from ..errors import ConfigError, TransportError
from .base import Deliver, Transport, TransportOptions, backoff_s
from .rabbitmq_consumer import QueueConsumer
from .rabbitmq_publisher import Publisher
from .tls import context_from_files

log = logging.getLogger(__name__)
CONTENT_TYPE = "application/vnd.tensorbus.frame"
#: AMQP carries prefetch_count in 16 bits
MAX_PREFETCH = 65535
QUEUE_TYPES = ("quorum", "classic", "stream")
STREAM_OFFSETS = ("first", "next", "last")


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


def stream_offset(value: Any) -> str | int:
    """Where a stream consumer starts: first, next (the default), last, or an offset (a number, 0 or more)."""
    if value is None:
        return "next"
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if value in STREAM_OFFSETS or (type(value) is int and value >= 0):
        return value
    raise ConfigError(f"offset must be first, next, last or a stream offset (0 or more), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RabbitMQOptions(TransportOptions):
    """The options of amqp:// and amqps:// endpoints."""

    queue: str = ""  # (required)
    queue_type: str = "quorum"
    offset: str | int | None = None
    max_frame_bytes: int | None = 16 * 1024 * 1024 - 4096
    durable: bool = True
    persistent: bool = True
    prefetch_count: int = 16
    heartbeat_s: int = 30
    connect_timeout_s: float = 10.0
    reconnect_timeout_s: float = 60.0
    confirm_timeout_s: float = 60.0
    close_timeout_s: float = 30.0
    max_pending_bytes: int = 256 * 1024 * 1024
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    def __post_init__(self) -> None:
        if not self.queue:
            raise ConfigError(
                "an AMQP endpoint needs a queue: add ?queue=NAME to its URL, "
                "e.g. amqp://guest:guest@127.0.0.1:5672/%2F?queue=tensors (or pass queue=NAME)"
            )
        if not 1 <= self.prefetch_count <= MAX_PREFETCH:
            raise ConfigError(f"prefetch_count must be 1 to {MAX_PREFETCH} (AMQP's limit), got {self.prefetch_count}")
        if self.queue_type not in QUEUE_TYPES:
            raise ConfigError(f"queue_type must be one of {', '.join(QUEUE_TYPES)}, got {self.queue_type!r}")
        if self.queue_type != "classic" and not self.durable:
            raise ConfigError(f"a {self.queue_type} queue is always durable: durable=False needs queue_type=classic")
        if self.queue_type == "stream":
            object.__setattr__(self, "offset", stream_offset(self.offset))
        elif self.offset is not None:
            raise ConfigError("offset is a position in a stream: it needs queue_type=stream")


class RabbitMQTransport(Transport):
    """A durable queue per endpoint; a publisher I/O thread or a consumer I/O thread per instance."""

    persists = True
    Options = RabbitMQOptions
    options: RabbitMQOptions

    def __init__(self, url: urllib.parse.SplitResult, options: RabbitMQOptions) -> None:
        super().__init__(url, options)
        #: where a stream consumer starts (first, next, last or an offset); None: not a stream
        self.offset = options.offset
        self.queue = options.queue
        self.hosts = _hosts(url)
        self.shown = f"{url.scheme}://{','.join(f'{h}:{p}' for h, p in self.hosts)}{url.path or '/'}?queue={self.queue}"
        self._params = [self._parameters(host, port) for host, port in self.hosts]
        self._host = 0  # the node connections go to now
        self._failed = 0  # nodes that failed in a row
        self._connects = 0  # connections made so far (metrics count those after the first)
        self.content_type = CONTENT_TYPE
        self._publisher: Publisher | None = None
        self.consumer: QueueConsumer | None = None

    @property
    def address(self) -> str:
        return urllib.parse.urlunsplit(self.url._replace(query=f"queue={urllib.parse.quote(self.queue)}"))

    def signing_identity(self, consumer: bool) -> tuple[str, bytes]:
        """amqp:VHOST/QUEUE (amqps:// and every node alike: the queue is the endpoint, not how it is reached)."""
        return f"amqp:{self.params.virtual_host}/{self.queue}", b""

    @property
    def params(self) -> pika.ConnectionParameters:
        """The connection parameters of the node to connect to now."""
        return self._params[self._host]

    def connected(self) -> None:
        """A connection to the current node is up: the next failure starts a new round of the nodes."""
        self._failed = 0
        self.tally.reconnects += self._connects > 0  # (the endpoint's one I/O thread calls this)
        self._connects += 1

    def counts(self) -> dict[str, int]:
        """Whether the endpoint's connection is open now (a snapshot of the I/O thread's)."""
        side: Any = self.consumer if self.consumer is not None else self._publisher
        connection = None if side is None else side._connection
        return {"connections": int(connection is not None and connection.is_open)}

    def fail_over(self) -> bool:
        """The current node failed: move to the next one; True once every node failed in this round (back off)."""
        self._host = (self._host + 1) % len(self._params)
        self._failed += 1
        return self._failed % len(self._params) == 0

    def _parameters(self, host: str, port: int | None) -> pika.ConnectionParameters:
        url, o = self.url, self.options
        ssl_options = None
        if url.scheme == "amqps":
            context = context_from_files(o.ssl_cafile, o.ssl_certfile, o.ssl_keyfile)
            ssl_options = pika.SSLOptions(context, host)
        vhost = urllib.parse.unquote(url.path[1:]) if len(url.path) > 1 else "/"
        user, _, password = url.netloc.rpartition("@")[0].partition(":")
        return pika.ConnectionParameters(
            host=host,
            port=port or (5671 if ssl_options else 5672),
            virtual_host=vhost,
            ssl_options=ssl_options,
            heartbeat=o.heartbeat_s,
            blocked_connection_timeout=o.reconnect_timeout_s,
            socket_timeout=o.connect_timeout_s,
            stack_timeout=o.connect_timeout_s * 2,
            connection_attempts=1,
            credentials=pika.PlainCredentials(
                urllib.parse.unquote(user or "guest"), urllib.parse.unquote(password or "guest")
            ),
        )

    @property
    def arguments(self) -> dict[str, Any] | None:
        """The arguments a missing queue is declared with (its type)."""
        queue_type = self.options.queue_type
        return None if queue_type == "classic" else {"x-queue-type": queue_type}

    def channel(self, connection: pika.BlockingConnection) -> Any:
        """A channel on `connection` with the endpoint's queue there: found by a passive declare, else declared."""
        channel = connection.channel()
        try:
            channel.queue_declare(self.queue, passive=True)
            return channel
        except px.ChannelClosedByBroker as exc:
            if exc.reply_code != 404:
                raise
        channel = connection.channel()
        self.declare(channel)
        return channel

    def declare(self, channel: Any, **callback: Any) -> None:
        """Declare the endpoint's queue as `queue_type` on a blocking channel, or on an async one with `callback=`."""
        channel.queue_declare(self.queue, durable=self.options.durable, arguments=self.arguments, **callback)

    def connect(self, stop: Any) -> tuple[pika.BlockingConnection, Any]:
        """Open a connection to the first node that answers and a channel with the queue, retrying with backoff."""
        deadline = time.monotonic() + self.options.reconnect_timeout_s
        delays = backoff_s(0.1, 2.0)
        while True:
            try:
                with map_errors(self.shown):
                    connection = pika.BlockingConnection(self.params)
                    try:
                        channel = self.channel(connection)
                    except BaseException:
                        with contextlib.suppress(Exception):
                            connection.close()
                        raise
                    self.connected()
                    return connection, channel
            except _Fatal:
                raise
            except TransportError as exc:
                if not self.fail_over():
                    continue  # the next node, at once
                delay = min(next(delays), deadline - time.monotonic())  # (the last attempt at the deadline)
                if stop.is_set() or delay <= 0:
                    raise
                log.info("%s; retrying in %.1fs", exc, delay)
                time.sleep(delay)

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
        self.consumer = QueueConsumer(self, deliver)
        o = self.options
        if not self.consumer.ready.wait(o.reconnect_timeout_s + 3 * o.connect_timeout_s):
            self.consumer.give_up()
            raise TransportError(f"RabbitMQ at {self.shown} did not answer in time")
        if self.consumer.error is not None:
            self.consumer.close()  # (its worker thread)
            raise self.consumer.error

    def close(self) -> None:
        """Stop the I/O thread(s); the publisher first publishes what is queued, the consumer acks what it delivered."""
        if self._publisher is not None:
            self._publisher.close(timeout=self.options.close_timeout_s)
        if self.consumer is not None:
            self.consumer.close()


def _hosts(url: urllib.parse.SplitResult) -> list[tuple[str, int | None]]:
    """The (host, port) pairs of a URL's comma-separated node list."""
    hosts = []
    for item in url.netloc.rpartition("@")[2].split(","):
        try:
            parts = urllib.parse.urlsplit(f"//{item.strip()}")
            hosts.append((parts.hostname or "127.0.0.1", parts.port))
        except ValueError as exc:
            raise ConfigError(f"bad host:port {item!r} in an amqp URL: {exc}") from None
    return hosts
