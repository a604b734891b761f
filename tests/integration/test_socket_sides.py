"""A socket Producer holds only the producer side of the endpoint, a Consumer only the consumer side."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.transports import ConsumerSide, ProducerSide, Transport, resolve_transport
from tensorbus.transports.socket import SocketConsumer, SocketProducer


@pytest.mark.parametrize("scheme", ["tcp", "unix"])
def test_each_end_holds_only_its_sides_object(scheme: str, tmp_path: Path) -> None:
    url = "tcp://127.0.0.1:0" if scheme == "tcp" else f"unix://{tmp_path}/sides.sock"
    with tb.Consumer(url) as consumer, tb.Producer(consumer.address) as producer:
        assert type(consumer.transport) is SocketConsumer and type(producer.transport) is SocketProducer
        assert isinstance(consumer.transport, ConsumerSide) and not isinstance(consumer.transport, ProducerSide)
        assert isinstance(producer.transport, ProducerSide) and not isinstance(producer.transport, ConsumerSide)
        assert not hasattr(consumer.transport, "send_message") and not hasattr(producer.transport, "listen")
        producer.send("t", np.arange(3))
        assert consumer.recv("t", timeout=10).tolist() == [0, 1, 2]


def test_the_registry_names_each_sides_class_and_one_class_for_transports_with_one() -> None:
    assert resolve_transport("tcp://127.0.0.1:1")[0] is SocketProducer
    assert resolve_transport("tcp://127.0.0.1:1", "consumer")[0] is SocketConsumer
    memory = resolve_transport("memory://x", "consumer")[0]
    assert memory is resolve_transport("memory://x")[0] and issubclass(memory, Transport)
