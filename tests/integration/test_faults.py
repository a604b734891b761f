"""Faults mid-stream, each bounded in count and time: nothing lost, nothing corrupted.

Each test prints its report (sent, received, lost, duplicated to the application, corrupted).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.transports.socket import READ_ACKS_EVERY, SocketProducer
from tests import faults, node_loss
from tests.conftest import endpoint_url
from tests.waiting import wait_for

COUNT = 1000
ROOT = Path(__file__).parents[2]
BROKERS_SH = node_loss.BROKERS_SH


def run_stream_with_fault(
    url: str,
    tmp_path: Path,
    fault: str,
    consumer_options: dict,
    producer_options: dict,
    consumer_url: str | None = None,
) -> dict[str, int]:
    """Start a consumer and a producer, inject `fault` once a third has arrived, and report."""
    log, progress = tmp_path / "received.log", tmp_path / "progress"
    consumer = faults.start(faults.consume, consumer_url or url, str(log), consumer_options)
    time.sleep(1.0 if consumer_url else 0.5)
    producer = faults.start(faults.produce, url, COUNT, producer_options, str(progress))
    try:
        wait_for(lambda: len(faults.lines(log)) >= COUNT // 3, 120, "a third of the stream")
        if fault == "kill-consumer":
            os.kill(consumer.pid, signal.SIGKILL)
            consumer.join(10)
            consumer = faults.start(faults.consume, consumer_url or url, str(log), consumer_options)
        else:
            subprocess.run(["bash", BROKERS_SH, "restart", fault], check=True, timeout=120)
        wait_for(lambda: faults.report(log, COUNT)["lost"] == 0, 240, "every tensor")
        producer.join(60)
        assert producer.exitcode == 0, f"producer exited with {producer.exitcode}"
    finally:
        for process in (producer, consumer):
            if process.is_alive():
                process.kill()
    time.sleep(0.5)  # let late duplicates show up before counting
    result = faults.report(log, COUNT)
    print(f"\n{fault} over {url.split('://')[0]}://: {result}")
    return result


def test_tcp_consumer_killed_and_restarted_mid_stream(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{faults.free_port()}"
    result = run_stream_with_fault(url, tmp_path, "kill-consumer", {}, {"reconnect_timeout_s": 60})
    assert result["lost"] == 0 and result["corrupted"] == 0 and result["consumer_processes"] == 2
    # the killed process handed some tensors to its application whose acks the producer had not read
    # yet; those are sent again, and the new process has no memory of them. The producer reads acks
    # every READ_ACKS_EVERY frames and the consumer sends them every ack_every_frames, which bounds the repeats:
    assert result["duplicated"] <= READ_ACKS_EVERY + SocketProducer.Options().ack_every_frames


def test_tcp_consumer_restarted_on_its_dedup_file_drops_what_its_predecessor_delivered(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{faults.free_port()}"
    options = {"dedup_file": str(tmp_path / "delivered.ids")}
    result = run_stream_with_fault(url, tmp_path, "kill-consumer", options, {"reconnect_timeout_s": 60})
    assert result["lost"] == 0 and result["corrupted"] == 0 and result["consumer_processes"] == 2
    # the consumer writes a tensor's id to the file as it hands the tensor over, before the application
    # notes it: no tensor the application noted is handed to it again by the successor
    assert faults.handed_out_twice(tmp_path / "received.log") == 0
    # (tensors that were in the killed consumer's table but not yet handed over are taken again)
    assert result["duplicated"] <= READ_ACKS_EVERY + SocketProducer.Options().ack_every_frames


@pytest.mark.broker
def test_rabbitmq_restarted_mid_stream(tmp_path: Path) -> None:
    url = endpoint_url("amqp")
    result = run_stream_with_fault(url, tmp_path, "rabbitmq", {}, {})
    assert result == {**result, "lost": 0, "corrupted": 0, "duplicated": 0, "received": COUNT}


@pytest.mark.broker
def test_kafka_restarted_mid_stream(tmp_path: Path) -> None:
    url = endpoint_url("kafka")
    result = run_stream_with_fault(url, tmp_path, "kafka", {}, {})
    assert result == {**result, "lost": 0, "corrupted": 0, "duplicated": 0, "received": COUNT}


def test_chunked_tensor_missing_its_last_chunk_is_freed_and_later_tensors_flow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with tb.Consumer("tcp://127.0.0.1:0", reassembly_timeout_s=0.5) as consumer:
        frame = tb.encode(np.zeros(1_000_000), key="torso", message_id=("p", 1))
        chunks = tb.split(frame, max_chunk_bytes=1 << 20, message_id=("p", 1), key="torso")
        with tb.Producer(consumer.address) as producer:
            for chunk in chunks[:-1]:
                producer.transport.send(chunk, key="torso")
            # (expired, not held_bytes > 0 first: the bytes are held for only reassembly_timeout_s)
            reassembler = consumer.intake.reassembler
            wait_for(lambda: reassembler.stats["expired"] == 1, 10, "the partial tensor to expire")
            assert consumer.intake.reassembler.held_bytes == 0  # its buffer freed (expire frees, then counts)
            producer.flush(10)  # the given-up chunks are acknowledged, so the producer does not resend them
            producer.send("later", np.ones(5))
        assert np.array_equal(consumer.recv("later", timeout=10), np.ones(5))
        assert consumer.intake.reassembler.stats["expired"] == 1
        with pytest.raises(tb.Timeout):
            consumer.recv("torso", timeout=0.2)
    assert "dropped incomplete message" in caplog.text


def _take_one_then_hold(url: str, dedup_file: str, ready: Any) -> None:
    consumer = tb.Consumer(url, dedup_file=dedup_file)
    consumer.recv("k0", timeout=20)  # handed to the application: recorded in the file
    wait_for(lambda: len(consumer.table) == 4, 20, "the other four to arrive")  # received, not taken
    ready.set()
    time.sleep(60)  # killed here


def test_a_dedup_file_records_what_was_handed_out_not_what_merely_arrived(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{faults.free_port()}"
    dedup_file = str(tmp_path / "delivered.ids")
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    first = context.Process(target=_take_one_then_hold, args=(url, dedup_file, ready))
    first.start()
    with tb.Producer(url, reconnect_timeout_s=30) as producer:
        for i in range(5):  # fewer than an ack's worth: none of them is acknowledged before the kill
            producer.send(f"k{i}", np.full(2, i))
        assert ready.wait(30)
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
        with tb.Consumer(url, dedup_file=dedup_file) as successor:
            producer.flush(30)  # all five come again
            assert [int(successor.recv(f"k{i}", timeout=10)[0]) for i in range(1, 5)] == [1, 2, 3, 4]
            assert successor.stats["duplicates"] == 1  # k0, which the application had
