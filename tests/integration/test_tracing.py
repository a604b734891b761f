"""A trace follows a tensor: the consumer's spans carry the producer's, over tcp://, RabbitMQ and Kafka."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.conftest import require_module

require_module("opentelemetry.sdk", "dev")  # CI installs every extra: there a missing one fails
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tensorbus as tb
from tensorbus.codec.frame import NATIVE, TRACE, TraceCarrier
from tests.conftest import endpoint_url

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def _provider() -> None:
    """The SDK's provider, exporting to memory (set once per process: OpenTelemetry allows no other)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def named(spans: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [span for span in spans.get_finished_spans() if span.name.startswith(prefix)]


SYSTEMS = {"tcp": "tensorbus", "amqp": "rabbitmq", "kafka": "kafka", "kafka-confluent": "kafka"}


@pytest.mark.parametrize(
    "transport",
    ["tcp", *(pytest.param(t, marks=pytest.mark.broker) for t in ("amqp", "kafka", "kafka-confluent"))],
)
def test_the_consumers_spans_carry_the_producers_trace(transport: str, spans: InMemorySpanExporter) -> None:
    url = endpoint_url(transport)
    tracer = trace.get_tracer("test")
    with tb.Consumer(url, tracing=True) as consumer:
        with tb.Producer(consumer.address, tracing=True) as producer:
            with tracer.start_as_current_span("training step") as step:
                message_id = producer.send("w", np.arange(1024, dtype=np.float32), metadata={"step": 3})
            producer.flush(60)
        message = consumer.recv_message("w", timeout=60)
        assert message.metadata == {"step": 3}  # (the trace context is not the application's metadata)
        current = trace.get_current_span()  # what the application's own spans would be children of
        assert current.get_span_context().trace_id == step.get_span_context().trace_id
    (send,) = named(spans, "send ")
    (receive,) = named(spans, "receive ")
    (process,) = named(spans, "process ")  # (ended by the consumer's close)
    assert current.get_span_context().span_id == process.context.span_id
    assert send.parent is not None and send.parent.span_id == step.get_span_context().span_id
    assert send.kind == trace.SpanKind.PRODUCER and receive.kind == process.kind == trace.SpanKind.CONSUMER
    assert [link.context.span_id for link in receive.links] == [send.context.span_id]
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert process.context.trace_id == send.context.trace_id == step.get_span_context().trace_id
    for span in (send, receive, process):
        assert span.attributes is not None
        assert span.attributes["messaging.system"] == SYSTEMS[transport]
        assert span.attributes["messaging.message.id"] == f"{message_id[0]}:{message_id[1]}"
        assert span.attributes["messaging.message.body.size"] == 4096
        assert span.attributes["tensorbus.key"] == "w"
        assert span.attributes["tensorbus.dtype"] == "float32"
    assert send.attributes is not None and receive.attributes is not None
    assert send.attributes["messaging.destination.name"] == receive.attributes["messaging.destination.name"]
    assert receive.attributes["messaging.operation.type"] == "receive"


def test_a_recv_ends_the_previous_process_span_of_its_thread(spans: InMemorySpanExporter) -> None:
    url = endpoint_url("memory")
    with tb.Consumer(url, tracing=True) as consumer, tb.Producer(url, tracing=True) as producer:
        for i in range(3):
            producer.send("k", np.full(4, i))
        for _ in range(3):
            consumer.recv("k", timeout=30)
            assert len(named(spans, "process ")) == len(named(spans, "receive ")) - 1  # the last still open
    assert len(named(spans, "process ")) == 3
    sends = {span.context.span_id for span in named(spans, "send ")}
    assert {span.parent.span_id for span in named(spans, "process ") if span.parent is not None} == sends


def test_each_receive_span_is_a_child_of_the_step_span_around_its_recv(spans: InMemorySpanExporter) -> None:
    """The `process` span left current by one recv does not leak into the next step's spans."""
    url = endpoint_url("memory")
    tracer = trace.get_tracer("test")
    steps = []
    with tb.Consumer(url, tracing=True) as consumer, tb.Producer(url, tracing=True) as producer:
        for i in range(4):
            producer.send("k", np.full(4, i))
        for _ in range(2):
            with tracer.start_as_current_span("step") as step:
                consumer.recv("k", timeout=30)
            steps.append(step.get_span_context().span_id)
        for _ in range(2):  # then outside any span: each receive is a root, not the previous process's child
            consumer.recv("k", timeout=30)
    assert trace.get_current_span() is trace.INVALID_SPAN  # (no ended span made current again by the close)
    receives = named(spans, "receive ")
    assert [span.parent.span_id if span.parent is not None else None for span in receives] == [*steps, None, None]
    assert len(named(spans, "process ")) == 4


def test_the_trace_header_field_is_optional_and_ignored_by_readers_that_do_not_know_it() -> None:
    array = np.arange(16, dtype=np.float32)
    carried = TraceCarrier({"step": 1}, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    traced = tb.dumps(array, key="k", metadata=carried, message_id=("p", 1))
    plain = tb.dumps(array, key="k", metadata={"step": 1}, message_id=("p", 1))
    assert bytes(traced) != bytes(plain)
    if NATIVE is not None:  # the C decoder takes only the header it knows, and leaves this one to Python
        assert NATIVE.decode(memoryview(plain), None, 1 << 20, 1 << 40, 32) is not None
        assert NATIVE.decode(memoryview(traced), None, 1 << 20, 1 << 40, 32) is None
    message = tb.decode(traced)
    assert message.metadata == {"step": 1} and np.array_equal(message.tensor, array)
    assert getattr(message, "trace", None) == dict(carried.trace)
    assert not hasattr(tb.decode(plain), "trace")
    odd = TraceCarrier({}, {"traceparent": 7})  # type: ignore[dict-item]  # (not a string: ignored, not refused)
    assert not hasattr(tb.decode(tb.dumps(array, metadata=odd)), "trace")
    assert TRACE == "trace"


def test_metrics_and_tracing_together_count_and_span_each_tensor(spans: InMemorySpanExporter) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from tests.integration.test_metrics import parse, value

    registry = CollectorRegistry()
    both = {"tracing": True, "metrics": True, "metrics_registry": registry}
    url = endpoint_url("memory")
    with tb.Consumer(url, **both) as consumer, tb.Producer(url, **both) as producer:
        for i in range(2):
            producer.send("k", np.full(4, i, np.float32))
        assert [consumer.recv("k", timeout=30)[0] for _ in range(2)] == [0, 1]
        exposition = generate_latest(registry).decode()
    assert len(named(spans, "send ")) == len(named(spans, "receive ")) == len(named(spans, "process ")) == 2
    samples = parse(exposition)
    assert value(samples, "tensorbus_sent_tensors_total") == value(samples, "tensorbus_received_tensors_total") == 2
    assert value(samples, "tensorbus_received_bytes_total") == 2 * 16
