"""A consumer's tensors handed to the next consumer of its endpoint, on every transport that keeps them
for it: a killed consumer's incomplete chunked tensor, and what an aborted consumer turned away."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.transports.kafka import KafkaTransport
from tests.conftest import endpoint_url
from tests.integration.test_kafka import committed, topic_of
from tests.peers import same
from tests.waiting import wait_for

BROKERS = [pytest.param(transport, marks=pytest.mark.broker) for transport in ("amqp", "kafka", "kafka-confluent")]


def _victim(url: str, ready: Any) -> None:
    """Read the first chunks (and, on Kafka, commit what came before them), then wait to be killed."""
    consumer = tb.Consumer(url, **({"session_timeout_s": 6.0} if url.startswith("kafka") else {}))
    wait_for(lambda: consumer.stats["chunks"] >= 5, 60, "the first chunks")
    if isinstance(consumer.transport, KafkaTransport):
        consumer.recv("before", timeout=60)  # taken: so committed
        offsets = consumer.transport._offsets

        def all_committed() -> bool:  # (a commit interval, then the broker's answer: slow on a loaded machine)
            return offsets is not None and bool(offsets._committed) and not offsets.committable()

        wait_for(all_committed, 60, "its progress committed")  # before it dies
    ready.set()
    time.sleep(600)  # killed long before this


@pytest.mark.parametrize("transport", BROKERS)
def test_a_killed_consumer_hands_its_chunked_tensor_to_the_next(transport: str) -> None:
    url = endpoint_url(transport)
    kafka = transport.startswith("kafka")
    tensor = np.arange(2_000_000, dtype=np.float32)
    frame = tb.encode(tensor, key="survivor", message_id=("p", 1))
    chunks = tb.split(frame, max_chunk_bytes=512 * 1024, message_id=("p", 1), key="survivor")
    context = multiprocessing.get_context("spawn")
    with tb.Producer(url) as producer:
        if kafka:
            producer.send("before", np.arange(3))  # offset 0: complete and taken, so committed
        for chunk in chunks[:5]:  # an incomplete tensor: never acknowledged (on Kafka offsets 1-5, never committed)
            producer.transport.send(chunk, key="survivor")
        producer.flush(30)
        ready = context.Event()
        victim = context.Process(target=_victim, args=(url, ready))
        victim.start()
        try:
            assert ready.wait(60), "the first consumer never received the first chunks"
        finally:
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]  # dies holding the 5 chunks
            victim.join(10)
        if kafka:
            assert committed(f"tensorbus-{topic_of(url)}", topic_of(url)) == {0: 1}  # up to the first pending chunk
        for chunk in chunks[5:]:
            producer.transport.send(chunk, key="survivor")
        producer.flush(30)
    with tb.Consumer(url) as successor:
        assert same(successor.recv("survivor", timeout=60), tensor)
        if kafka:
            with pytest.raises(tb.Timeout):
                successor.recv("before", timeout=0.5)  # committed by the victim: not read again
    if kafka:
        assert committed(f"tensorbus-{topic_of(url)}", topic_of(url)) == {0: 1 + len(chunks)}  # committed on close


@pytest.mark.parametrize("transport", ["memory", *BROKERS])
def test_an_aborted_consumers_tensors_reach_its_successor(transport: str) -> None:
    """Abort fails this consumer's receives; what it reads meanwhile is not acknowledged, so a successor
    gets it, while the aborted one is still open (on Kafka it leaves the group for that)."""
    url = endpoint_url(transport)
    first = tb.Consumer(url)
    try:
        with tb.Producer(url) as producer:
            producer.send("warm", np.ones(1))
            producer.flush(30)
        first.recv("warm", timeout=30)
        first.abort("step failed")
        read, feed = [], first.intake.reassembler.feed  # the frames the aborted consumer reads (and turns away)

        def counted_feed(*args: Any, **kwargs: Any) -> Any:
            read.append(1)
            return feed(*args, **kwargs)

        first.intake.reassembler.feed = counted_feed  # type: ignore[method-assign]
        big = np.arange(500_000, dtype=np.float32)  # 2 MB in 512 KB chunks: some go to the aborted table
        with tb.Producer(url, max_frame_bytes=512 << 10) as producer:
            for i in range(3):
                producer.send(f"k{i}", np.full(3, i))
            producer.send("big", big)
            if transport != "memory":  # (a memory:// flush waits for a consumer to take them: the successor, below)
                producer.flush(30)
        wait_for(lambda: read, 30, "the aborted consumer to read one of them (and turn it away)")
        with tb.Consumer(url) as successor:
            assert [successor.recv(f"k{i}", timeout=30)[0] for i in range(3)] == [0, 1, 2]
            assert np.array_equal(successor.recv("big", timeout=30), big)
            if isinstance(first.transport, KafkaTransport):
                assert not first.transport.assignment  # it left the group
    finally:
        first.close()
