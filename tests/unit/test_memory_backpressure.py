"""memory:// holds back producers as the socket transports do: its queue is bounded, and a send waits for room."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.transports.memory import HUB

MIB = 1 << 20


def test_sends_nobody_receives_wait_then_fail_naming_the_consumer_with_the_queue_bounded() -> None:
    tensor = np.zeros(MIB, np.uint8)
    options = {"max_unacked_bytes": 4 * MIB, "send_timeout_s": 0.3}
    with tb.Producer("memory://nobody-reads", **options) as producer:
        queue = HUB.endpoint("nobody-reads")
        sent = 0
        started = time.monotonic()
        with pytest.raises(
            tb.TransportError, match=r"memory://nobody-reads has had \d+ bytes waiting for its consumer"
        ):
            for _ in range(2000):  # (unbounded, this reached 2 GB)
                producer.send("w", tensor)
                sent += 1
                assert queue.nbytes < options["max_unacked_bytes"] + 2 * tensor.nbytes
        assert sent == 4  # four fill the queue; the fifth waits send_timeout_s, then fails
        assert 0.3 <= time.monotonic() - started < 10


def test_a_consumer_whose_table_is_full_holds_its_producers_back_and_lets_them_go_as_it_receives() -> None:
    tensor = np.zeros(MIB, np.uint8)
    with tb.Consumer("memory://slow", max_buffered_bytes=MIB) as consumer:
        with tb.Producer("memory://slow", max_unacked_bytes=2 * MIB, send_timeout_s=0.3) as producer:
            with pytest.raises(tb.TransportError, match="max_unacked_bytes=2097152"):
                for _ in range(2000):
                    producer.send("w", tensor)
            # what is held: a table at its limit, one frame being delivered, the queue at its limit
            assert consumer.table.buffered_bytes <= 2 * MIB and HUB.endpoint("slow").nbytes <= 3 * MIB
            received = 0

            def receive() -> None:
                nonlocal received
                for _ in range(50):
                    consumer.recv("w", timeout=30)
                    received += 1

            receiving = threading.Thread(target=receive)
            receiving.start()
            # a receiver makes room: these go through (a producer of its own, whose send_timeout_s a receiving
            # thread kept off the CPU on a loaded machine does not run out; one holding back for ever would)
            with tb.Producer("memory://slow", max_unacked_bytes=2 * MIB, send_timeout_s=60) as patient:
                for i in range(50 - 4):
                    patient.send("w", np.full(MIB, i % 256, np.uint8))
            receiving.join(60)
            assert received == 50


def test_a_message_larger_than_the_bound_still_goes_out_whole() -> None:
    with tb.Consumer("memory://big") as consumer, tb.Producer("memory://big", max_unacked_bytes=MIB) as producer:
        big = np.arange(3 * MIB // 8, dtype=np.float64)
        producer.send("big", big)
        assert np.array_equal(consumer.recv("big", timeout=30), big)
