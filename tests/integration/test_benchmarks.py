"""The stand-alone benchmarks still speak the current protocol (a smoke run, not a measurement)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import numpy as np
import pytest

import tensorbus as tb
from benchmarks import (
    aio_loop_stalls,
    aio_memory,
    aio_ping_cpu,
    amqp_large,
    consumer_floor,
    fanout_threads,
    ledger_take,
    metrics_cost,
    native_speedup,
    socket_cpu,
)
from tensorbus.codec import native
from tensorbus.transports import stream
from tests.conftest import AMQP_URL, require_broker, require_native


def test_the_aio_memory_benchmark_streams_and_echoes_through_one_loop() -> None:
    tensor = np.ones(1024, np.float32)
    assert asyncio.run(aio_memory.stream_rate(tensor, 50)) > 0
    assert asyncio.run(aio_memory.round_trip(tensor, 20)) > 0


def test_the_loop_stalls_benchmark_times_the_heartbeat_while_each_tensor_crosses() -> None:
    tensors = [np.ones(size << 18, np.float32) for size in (8, 2, 12, 6, 16, 4)]  # (MB: more sizes than pooled)
    beats = asyncio.run(aio_loop_stalls.latest_beats("tcp://127.0.0.1:0", tensors))
    assert len(beats) == len(tensors) and max(beats) > 0  # (beats were timed while tensors crossed)


def test_the_consumer_floor_benchmark_reads_a_real_producers_stream() -> None:
    for reader in (consumer_floor.tensorbus_reader, consumer_floor.minimal_reader):
        assert reader(64 << 10, 50) > 0  # each reader takes all 250 tensors, CRC checked, and gets the flush through


@pytest.mark.broker
def test_the_large_amqp_benchmark_runs_each_way_through_the_broker() -> None:
    require_broker(AMQP_URL)
    for way in amqp_large.WAYS:  # 17 MiB: two chunks each
        result = amqp_large.one_run(way, 17 << 20, 3, "quorum")
        assert result["gbps"] > 0 and result["consumer_cpu_s"] > 0 and result["producer_cpu_s"] > 0, way
    assert amqp_large._broker_cpu_s(os.getpid()) > 0  # (read from /proc as for the broker's PID)


def test_the_native_speedup_benchmark_runs_both_ways() -> None:
    require_native(stream.NATIVE_STREAM is not None and native.NATIVE is not None, "the C paths")
    for native_paths in (True, False):
        result = native_speedup.one_run(native_paths, 64 << 10, 50, 20)  # in a fresh interpreter each
        assert result.keys() == {"gbps", "consumer_us", "producer_us", "rtt_us"}
        assert all(value > 0 for value in result.values())


@pytest.mark.parametrize(
    ("api", "loop", "transport"),
    [
        ("aio", "asyncio", "tcp"),
        ("aio", "uvloop", "unix"),
        ("blocking", "asyncio", "tcp"),
        ("blocking", "asyncio", "shm"),
    ],
)
def test_the_ping_cpu_benchmark_plays_its_rounds_between_two_processes(api: str, loop: str, transport: str) -> None:
    result = aio_ping_cpu.run(api, 20, 64, 0.0, loop, transport)
    assert result.p50 > 0 and result.ping_cpu > 0 and result.echo_cpu > 0 and 0 < result.send_p50 < result.p50


def test_the_metrics_cost_benchmark_times_each_stream_in_turn() -> None:
    rows = metrics_cost.run(4096, 20, 2)  # (with the warm-up blocks: 100 tensors on each stream)
    assert set(rows) == set(metrics_cost.CASES)
    assert all(len(results) == 2 and all(x > 0 for result in results for x in result) for results in rows.values())


@pytest.mark.parametrize(
    ("transport", "aio", "aio_producer"),
    [("tcp", False, False), ("unix", False, False), ("shm", False, False), ("tcp", True, False), ("tcp", False, True)],
)
def test_the_socket_cpu_benchmark_times_each_side_of_a_real_stream(
    transport: str, aio: bool, aio_producer: bool
) -> None:
    sides = socket_cpu.one_round(transport, 4096, 200, {"aio": True} if aio else None, aio_producer)
    assert sides.keys() == {"producer", "consumer"}
    assert all(cpu > 0 and wall > 0 and faults >= 0 for cpu, wall, faults in sides.values())


def test_the_ledger_take_benchmark_receives_what_it_delivered_both_ways() -> None:
    require_native(native.NATIVE is not None, "the C delivery")
    for how in ("hook", "none"):
        made, ledger_stream = ledger_take.intake(how)
        assert ledger_take.one_round(made, ledger_stream, 50, 0) > 0
        with pytest.raises(tb.Timeout):  # (every tensor delivered was taken)
            made.table.recv_message("k", 0.01)


def test_the_fanout_threads_benchmark_splits_a_process_cpu_by_thread() -> None:
    pid = os.getpid()
    before = fanout_threads.threads(pid)
    np.ones(1 << 22).sum()  # (this thread's own work)
    # (a running thread's schedstat is brought up to date when the scheduler next accounts for it: a tick, which
    # a busy VM may not deliver within the work, or a sleep, which it always does)
    time.sleep(0.01)
    roles = fanout_threads.by_role(pid, before, fanout_threads.threads(pid))
    assert roles.keys() == {"main", "busiest other (I/O)", "rest"}
    assert roles["main"][0] > 0
    assert (fanout_threads.process_cpu(pid) or 0) > 0 and fanout_threads.process_cpu(None) is None


def _producer_that_leaves_at_once(address: str, size: int, count: int) -> threading.Thread:
    """In place of `consumer_floor._start_producer`: a producer that sends its frames (a warm-up and `count`),
    takes the ack for all of them, then sends two ack requests and closes in the same segment: whatever
    answers them writes to a peer that is already gone."""

    frames = consumer_floor.WARMUP + count

    def run() -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            stream.handshake_as_producer(sock, None, address)
            array = np.ones(size // 4, np.float32)
            sock.sendall(b"".join(tb.dumps(array, key="bench", metadata={"i": i}) for i in range(frames)))
            acked = 0
            while acked < frames:  # (all of them: no ack left unread, so the close is a FIN, not a reset)
                acked = stream.ACK.unpack(sock.recv(stream.ACK.size, socket.MSG_WAITALL))[0]
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)  # the requests and the FIN in one segment
            sock.sendall(stream.ACK_REQUEST_MARKER * 2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_minimal_reader_lets_a_producer_leave_before_it_answers_its_last_ack_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the first answer reaches a closed socket (which resets the connection), the second then
    # failed with BrokenPipeError: the producer's leaving must end the reading, however it shows
    monkeypatch.setattr(consumer_floor, "_start_producer", _producer_that_leaves_at_once)
    tensors = 32 * 8 - consumer_floor.WARMUP  # (a whole number of the reader's acks: one covers the last frame)
    assert consumer_floor.minimal_reader(4 << 10, tensors) > 0
