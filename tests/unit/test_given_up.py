"""Incomplete (chunked) tensors still expire, and transports look for the ones given up only after one was."""

from __future__ import annotations

import numpy as np

import tensorbus as tb
from tensorbus.codec import encode_chunks
from tensorbus.codec.frame import MessageId
from tensorbus.transports.base import GivenUp
from tensorbus.transports.memory import HUB
from tests.waiting import wait_for


class FakeConsumer:
    """The two `Deliver` methods `GivenUp` asks, counting how often it asks whether a message is pending."""

    def __init__(self) -> None:
        self.pending: set[MessageId | None] = set()
        self.count = 0
        self.asked = 0

    def given_up(self) -> int:
        return self.count

    def is_pending(self, message_id: MessageId | None) -> bool:
        self.asked += 1
        return message_id in self.pending


def test_kept_messages_are_looked_at_only_after_the_consumer_gave_one_up() -> None:
    consumer = FakeConsumer()
    kept: list[MessageId | None] = [("p", 1), ("p", 2), ("p", 3)]
    consumer.pending = set(kept)
    given_up = GivenUp(consumer)  # type: ignore[arg-type]  # (only what it asks)
    for _ in range(1000):  # (a frame each)
        assert given_up.among(kept) == []
    assert consumer.asked == 0
    consumer.pending.discard(("p", 2))
    consumer.count += 1  # ("p", 2) expired
    assert given_up.among(kept) == [("p", 2)] and consumer.asked == 3
    assert given_up.among(kept) == [] and consumer.asked == 3  # (nothing given up since)


def test_an_incomplete_message_on_memory_expires_and_the_endpoint_goes_on() -> None:
    name = "expiring-chunks"
    with tb.Consumer(f"memory://{name}", reassembly_timeout_s=0.3) as consumer:
        with tb.Producer(f"memory://{name}", max_frame_bytes=16384) as producer:
            parts = encode_chunks(np.zeros(20_000), max_chunk_bytes=16384, key="lost", message_id=("gone", 1))
            assert len(parts) > 2
            for part in parts[:-1]:  # its last chunk never comes
                producer.transport.send(part, key="lost")
            reassembler = consumer.intake.reassembler
            wait_for(lambda: reassembler.stats["expired"] == 1, 30, "the incomplete tensor to expire")
            assert reassembler.pending == 0 and reassembler.held_bytes == 0 and reassembler.given_up == 1
            producer.send("whole", np.arange(3))
            producer.send("chunked", np.arange(5000.0))
            assert consumer.recv("whole", timeout=30).tolist() == [0, 1, 2]
            assert np.array_equal(consumer.recv("chunked", timeout=30), np.arange(5000.0))
            assert "lost" not in consumer.table.buffered_keys()
    assert len(HUB.endpoint(name)) == 0  # the expired tensor's chunks are not kept for a next consumer
