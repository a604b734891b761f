"""`amqp://.../VHOST?queue=NAME` (RabbitMQ): a stream queue, read from its start, keeping the latest of each key.

The publisher sends through the RabbitMQ transport's publisher (confirms), chunked past
`max_frame_bytes`, into a stream queue (declared as one if missing; another type of queue is refused,
see `check_stream`). The stream's retention
(`x-max-length-bytes`, `x-max-age`, set when the stream is declared) bounds what a new subscriber
replays; RabbitMQ has no per-key compaction, so keep it above a few versions of every key.

A subscriber is one stream consumer from offset `first` (its acks are the stream's flow-control
credit: nothing is removed or committed). It answers `latest` once it has read up to where the
stream ended when it joined (see `_StreamReader`). A publisher reads the stream the same way when
it starts, to learn the versions already published.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import pika.exceptions as px

from ..errors import CodecError, ConfigError, TensorBusError
from ..transports.rabbitmq import RabbitMQOptions, RabbitMQTransport
from .api import Receiver
from .broker import BrokerPublishingSide
from .retained import Published, Retained

log = logging.getLogger(__name__)
#: the publisher keeps no frames for late joiners: the stream does (`max_retained_bytes` does not apply)
KEEPS_FRAMES = False
OFFSET = "x-stream-offset"
#: how a reader's marker begins (a frame begins "TBUS")
MARKER = b"TBMK"


def endpoint(url: urllib.parse.SplitResult) -> str:
    """What frames are signed for: the queue."""
    return f"fanout-amqp:{urllib.parse.parse_qs(url.query).get('queue', [''])[-1]}"


def _stream(url: urllib.parse.SplitResult, options: RabbitMQOptions) -> RabbitMQTransport:
    """The transport for the endpoint's queue, declared a stream if it is missing."""
    return RabbitMQTransport(url, dataclasses.replace(options, queue_type="stream", offset="first"))


#: RabbitMQ's answer to a declare whose argument differs from the queue's: "... inequivalent arg 'NAME' ...
#: received none but current is the value 'VALUE' of type 'TYPE'"
_OTHER_ARG = re.compile(r"inequivalent arg '([^']+)'.*received none but current is the value '(.*)' of type '(\w+)'")
_NUMBERS = {"signedint", "long", "short", "byte", "unsignedbyte", "unsignedshort", "unsignedint"}


def check_stream(connection: Any, transport: RabbitMQTransport) -> None:
    """Make sure the endpoint's queue is a stream (declared as one if missing), else `ConfigError`.

    A fan-out reader acks what it reads: on a stream that is flow-control credit, on any other queue
    it deletes the messages. AMQP cannot ask a queue's type, so the queue is declared a stream with
    the arguments RabbitMQ reports it already has (a stream's retention): a queue of another type, or
    not durable, is refused with 406 PRECONDITION_FAILED naming `x-queue-type` or `durable`.
    """
    arguments: dict[str, Any] = {"x-queue-type": "stream"}
    for _ in range(16):  # (a queue has a few arguments at most)
        channel = connection.channel()
        try:
            channel.queue_declare(transport.queue, durable=True, arguments=arguments)
            channel.close()
            return
        except px.ChannelClosedByBroker as exc:
            if exc.reply_code != 406:
                raise
            found = _OTHER_ARG.search(exc.reply_text)
            if found is None or found[1] in arguments:
                raise ConfigError(
                    f"{transport.shown}: queue {transport.queue!r} exists and is not a stream queue; fan-out needs one "
                    f"(it reads a stream from its start; on another queue it would consume the messages) "
                    f"(RabbitMQ: {exc.reply_text})"
                ) from None
            name, value, kind = found[1], found[2], found[3]
            arguments[name] = int(value) if kind in _NUMBERS else value
    raise ConfigError(f"{transport.shown}: queue {transport.queue!r} has too many arguments to check it is a stream")


def _marker() -> bytes:
    """A message that only says "the stream reached here" (not a frame: readers skip it)."""
    return MARKER + os.urandom(16)


class _StreamReader:
    """Reads a stream from its start on the calling thread; `caught_up` is called once it read its own marker.

    RabbitMQ tells no consumer where a stream ends, so a reader that joins appends a marker (a few
    bytes, kept by the stream's retention like the rest) and has caught up when it reads it back.
    """

    def __init__(
        self,
        transport: RabbitMQTransport,
        take: Callable[[bytes], object],
        caught_up: Callable[[], None],
        retry: bool = True,
        fail: Callable[[TensorBusError], None] | None = None,
    ) -> None:
        self.t, self._take, self._caught_up = transport, take, caught_up
        self._fail = fail  # told of a `ConfigError` (not a stream), which no retry mends
        self._retry = retry  # False: a failure is raised (a publisher starting), not retried
        self.stop = threading.Event()
        self._marker: bytes | None = None  # ours, until read back

    def run(self) -> None:
        """Consume until `stop`; on a lost connection, again from the start (versions held are not taken twice)."""
        while not self.stop.is_set():
            try:
                connection, channel = self.t.connect(self.stop)
            except TensorBusError as exc:
                if not self._retry:
                    raise
                log.warning("%s; trying again", exc)
                self.stop.wait(1.0)
                continue
            try:
                check_stream(connection, self.t)
                self._consume(connection, channel)
            except ConfigError as exc:
                if self._fail is None:
                    raise
                self._fail(exc)
                return
            except Exception as exc:  # pika's connection errors: connect again
                if not self._retry:
                    raise self.t.as_error(exc) from None
                log.warning("%s: %r; reading the stream again", self.t.shown, exc)
            finally:
                with contextlib.suppress(Exception):  # (already closed)
                    connection.close()

    def _consume(self, connection: Any, channel: Any) -> None:
        if self._marker is None and not self.stop.is_set():
            marker = _marker()
            channel.confirm_delivery()
            channel.basic_publish("", self.t.queue, marker, mandatory=True)
            self._marker = marker
        channel.basic_qos(prefetch_count=self.t.options.prefetch_count)

        def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
            ch.basic_ack(method.delivery_tag)  # (a stream's credit: nothing is removed)
            if not body.startswith(MARKER):
                self._take(body)
            elif body == self._marker:
                self._caught_up()

        channel.basic_consume(self.t.queue, on_message, arguments={OFFSET: "first"})
        while not self.stop.is_set():
            connection.process_data_events(time_limit=0.2)


class PublishingSide(BrokerPublishingSide):
    """Learns the versions in the stream, then sends each version's frames (chunked past `max_frame_bytes`)."""

    def __init__(
        self,
        url: urllib.parse.SplitResult,
        options: RabbitMQOptions,
        retained: Retained,
        signing_key: bytes | None = None,
    ) -> None:
        super().__init__(_stream(url, options), options.max_frame_bytes, signing_key)
        learn = self.learner(retained, signing_key)
        reader = _StreamReader(_stream(url, options), learn, lambda: reader.stop.set(), retry=False)
        reader.run()

    def publish(self, published: Published) -> None:
        for chunk in self.chunks(published):
            self._transport.send(chunk, key=published.key)


class SubscribingSide:
    """A stream consumer from the start, on a thread of its own."""

    def __init__(self, url: urllib.parse.SplitResult, options: RabbitMQOptions, receive: Receiver) -> None:
        self._receive = receive
        self._reader = _StreamReader(
            _stream(url, options), self._take, receive.latest.release, fail=receive.latest.fail
        )
        receive.latest.hold()
        self._thread = threading.Thread(target=self._reader.run, daemon=True, name="tensorbus-fanout-amqp")
        self._thread.start()

    def _take(self, body: bytes) -> None:
        try:
            self._receive(body)
        except CodecError as exc:
            log.error("%s: a message failed its checks, skipped: %s", self._reader.t.shown, exc)

    def close(self) -> None:
        self._reader.stop.set()
        self._thread.join(30)
