"""OpenTelemetry spans of sends and receives, with the producer's trace carried in the frame.

Named as OpenTelemetry's semantic conventions for messaging name them: `send {destination}` (kind
PRODUCER) around `Producer.send`, whose W3C trace context (`traceparent`, `tracestate`) travels in
the frame header's optional `trace` field (docs/FORMAT.md); on the consumer, on the application's
own thread, `receive {destination}` (CONSUMER) spans the `recv` call and links to the producer's
span, and `process {destination}` (CONSUMER, the producer's span its parent) is the current span
while the application handles the tensor: from `recv`'s return to that thread's next `recv` (or
the consumer's close). The extra `tracing` (`pip install 'tensorbus[tracing]'`) installs
opentelemetry-api; spans go wherever the application's tracer provider sends them.
"""

from __future__ import annotations

import functools
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .codec.frame import Message, TraceCarrier
from .metrics import endpoint_label
from .rendezvous import tensor_nbytes

if TYPE_CHECKING:
    from .api import Consumer, Producer

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # the extra is not installed: tracing stays off (monitoring.py checks)
    trace = None  # type: ignore[assignment]

_SYSTEMS = {"amqp": "rabbitmq", "amqps": "rabbitmq", "kafka": "kafka", "kafkas": "kafka"}


def _message_id(message_id: Any) -> str:
    return "" if message_id is None else f"{message_id[0]}:{message_id[1]}"


def _tensor_attributes(key: str | None, tensor: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = {"messaging.message.body.size": tensor_nbytes(tensor)}
    if key is not None:
        attributes["tensorbus.key"] = key
    dtype, shape = getattr(tensor, "dtype", None), getattr(tensor, "shape", None)
    if dtype is not None and shape is not None:
        attributes["tensorbus.dtype"], attributes["tensorbus.shape"] = str(dtype), list(shape)
    return attributes


class Tracing:
    """The spans of one Producer or Consumer."""

    def __init__(self, endpoint: Producer | Consumer) -> None:
        self._endpoint = endpoint
        self.tracer = trace.get_tracer("tensorbus")
        #: the `process` span current on each receiving thread, with its context token, until its next recv
        self._processing = threading.local()

    @functools.cached_property
    def attributes(self) -> dict[str, Any]:
        """The endpoint's own attributes (read at the first span: a consumer's port is bound by then)."""
        address = self._endpoint.transport.address
        parts = urllib.parse.urlsplit(address)
        attributes: dict[str, Any] = {
            "messaging.system": _SYSTEMS.get(parts.scheme, "tensorbus"),
            "messaging.destination.name": endpoint_label(address),
        }
        if parts.hostname and "," not in parts.netloc:
            attributes["server.address"] = parts.hostname
            if parts.port is not None:
                attributes["server.port"] = parts.port
        return attributes

    @property
    def destination(self) -> str:
        return str(self.attributes["messaging.destination.name"])

    def send(
        self, send: Callable[..., None], tensor: Any, key: str | None, metadata: Any, message_id: Any, *rest: Any
    ) -> None:
        """`send(tensor, key, metadata, message_id, *rest)` in a `send` span; its context goes in the frame's header."""
        attributes = {
            **self.attributes,
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "messaging.message.id": _message_id(message_id),
            **_tensor_attributes(key, tensor),
        }
        with self.tracer.start_as_current_span(
            f"send {self.destination}", kind=trace.SpanKind.PRODUCER, attributes=attributes
        ):
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            send(tensor, key, TraceCarrier(metadata, carrier), message_id, *rest)

    def recv(self, receive: Callable[..., Message], *args: Any) -> Message:
        """`receive(*args)` in a `receive` span, then a `process` span current on this thread until its next recv."""
        self.done_processing()
        parent = otel_context.get_current()  # the application's (no longer this thread's `process` span)
        started = time.time_ns()
        message = receive(*args)
        waited_ns = time.time_ns() - started
        producer = trace.get_current_span(propagate.extract(getattr(message, "trace", {}) or {}))
        context = producer.get_span_context()
        links = [trace.Link(context)] if context.is_valid else []
        attributes = {
            **self.attributes,
            "messaging.message.id": _message_id(message.message_id),
            "tensorbus.wait_s": waited_ns / 1e9,
            **_tensor_attributes(message.key, message.tensor),
        }
        span = self.tracer.start_span(
            f"receive {self.destination}",
            context=parent,
            kind=trace.SpanKind.CONSUMER,
            links=links,
            start_time=started,
            attributes={**attributes, "messaging.operation.type": "receive", "messaging.operation.name": "recv"},
        )
        span.end()
        process = self.tracer.start_span(
            f"process {self.destination}",
            context=trace.set_span_in_context(producer) if context.is_valid else None,
            kind=trace.SpanKind.CONSUMER,
            links=[trace.Link(span.get_span_context())],
            attributes={**attributes, "messaging.operation.type": "process", "messaging.operation.name": "process"},
        )
        self._processing.span = process
        self._processing.token = otel_context.attach(trace.set_span_in_context(process))
        return message

    def done_processing(self) -> None:
        """End this thread's `process` span, if it has one (its next recv, or the consumer's close).

        Its context is detached only while it is still the current one: once the application has
        left the context it was attached in (`with tracer.start_as_current_span("step"): recv()`),
        detaching out of order would make that context's ended span current again.
        """
        span = getattr(self._processing, "span", None)
        if span is not None:
            self._processing.span = None
            if trace.get_current_span() is span:
                otel_context.detach(self._processing.token)
            span.end()
