"""The behaviour suite, written once and run against every transport, through the blocking API and
through the asyncio one (tensorbus.aio, behind the blocking methods: tests/aio_bridge.py).

Producers run in separate processes for every transport that crosses one (all but memory://).
Adding a transport is one entry in TRANSPORTS.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tests.aio_bridge import AioConsumer
from tests.conftest import endpoint_url
from tests.peers import Peer, make_tensor, same
from tests.waiting import wait_for

TRANSPORTS = ["memory", "tcp", "unix", "shm", "amqp", "kafka", "kafka-confluent"]
BROKERS = {"amqp", "kafka", "kafka-confluent"}
APIS = {"blocking": tb.Consumer, "aio": AioConsumer}


@pytest.fixture(
    params=[
        pytest.param((t, api), id=t if api == "blocking" else f"{t}-{api}", marks=[pytest.mark.broker] * (t in BROKERS))
        for api in APIS
        for t in TRANSPORTS
    ]
)
def consumer(request: pytest.FixtureRequest) -> Any:
    transport, api = request.param
    with APIS[api](endpoint_url(transport)) as c:
        yield c


def run_peer(consumer: tb.Consumer, plan: list[tuple[str, dict]], **options: Any) -> Peer:
    return Peer(consumer.address, plan, **options)


def test_send_before_recv(consumer: tb.Consumer) -> None:
    run_peer(consumer, [("a", {"seed": 1})]).join()
    deadline = time.monotonic() + 30
    while len(consumer.table) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(consumer.table) == 1  # buffered before anyone asked
    assert same(consumer.recv("a", timeout=10), make_tensor({"seed": 1}))


def test_recv_before_send(consumer: tb.Consumer) -> None:
    got: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: got.setdefault("t", consumer.recv("late", timeout=60)))
    waiter.start()
    wait_for(lambda: consumer.table.awaited_keys().get("late") == 1, 30, "the recv to wait")  # (else: send first)
    run_peer(consumer, [("late", {"seed": 2})]).join()
    waiter.join(60)
    assert same(got["t"], make_tensor({"seed": 2}))


def test_fifo_per_key(consumer: tb.Consumer) -> None:
    plan = [("k", {"seed": i}) for i in range(10)] + [("other", {"seed": 99})]
    run_peer(consumer, plan).join()
    assert same(consumer.recv("other", timeout=30), make_tensor({"seed": 99}))
    for i in range(10):
        message = consumer.recv_message("k", timeout=30)
        assert message.metadata == {"spec": {"seed": i}}
        assert same(message.tensor, make_tensor({"seed": i}))


def test_timeout_names_the_key(consumer: tb.Consumer) -> None:
    started = time.monotonic()
    with pytest.raises(tb.Timeout, match="'never'") as info:
        consumer.recv("never", timeout=0.3)
    assert isinstance(info.value, TimeoutError) and time.monotonic() - started >= 0.3


def test_recv_async_delivers_once_and_cancel_reports_cancellation(consumer: tb.Consumer) -> None:
    results: list[tuple[Any, Any]] = []
    done = threading.Event()

    def callback(message: tb.Message | None, error: BaseException | None) -> None:
        results.append((message, error))
        done.set()

    cancelled: list[BaseException | None] = []
    handle = consumer.recv_async("never", lambda m, e: cancelled.append(e))
    assert handle.cancel() is True and handle.cancel() is False
    assert len(cancelled) == 1 and isinstance(cancelled[0], tb.Cancelled)

    consumer.recv_async("x", callback)
    run_peer(consumer, [("x", {"seed": 5})]).join()
    assert done.wait(30)
    time.sleep(0.1)
    assert len(results) == 1 and results[0][1] is None and same(results[0][0].tensor, make_tensor({"seed": 5}))


def test_abort_fails_pending_and_later_calls(consumer: tb.Consumer) -> None:
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            consumer.recv("pending", timeout=30)
        except tb.TensorBusError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_for(lambda: consumer.table.awaited_keys().get("pending") == 1, 30, "the recv to wait")  # (pending, not later)
    async_errors: list[BaseException | None] = []
    consumer.recv_async("pending2", lambda m, e: async_errors.append(e))
    consumer.abort("shutting down for maintenance")
    waiter.join(10)
    assert isinstance(errors[0], tb.Aborted) and "maintenance" in str(errors[0])
    assert isinstance(async_errors[0], tb.Aborted)
    with pytest.raises(tb.Aborted, match="maintenance"):
        consumer.recv("anything", timeout=1)


def test_bundles_and_sparse(consumer: tb.Consumer) -> None:
    plan = [("params", {"kind": "bundle", "n": 12}), ("grad", {"kind": "sparse", "n": 40, "seed": 3})]
    run_peer(consumer, plan).join()
    assert same(consumer.recv("params", timeout=30), make_tensor(plan[0][1]))
    assert same(consumer.recv("grad", timeout=30), make_tensor(plan[1][1]))


def test_large_tensor(consumer: tb.Consumer) -> None:
    spec = {"n": 16 << 20, "seed": 8}  # 64 MB of float32
    run_peer(consumer, [("big", spec)]).join()
    assert same(consumer.recv("big", timeout=120), make_tensor(spec))


def test_many_producers(consumer: tb.Consumer) -> None:
    peers = [run_peer(consumer, [(f"p{p}", {"seed": p * 100 + i, "n": 1000 + i}) for i in range(15)]) for p in range(4)]
    for peer in peers:
        peer.join()
    for p in range(4):
        for i in range(15):
            assert same(consumer.recv(f"p{p}", timeout=30), make_tensor({"seed": p * 100 + i, "n": 1000 + i}))


def test_iteration_yields_arrival_order(consumer: tb.Consumer) -> None:
    plan = [(f"job{i}", {"seed": i}) for i in range(8)]
    run_peer(consumer, plan).join()
    keys = []
    for message in consumer:
        keys.append(message.key)
        assert same(message.tensor, make_tensor({"seed": int(message.key[3:])}))
        if len(keys) == 8:
            break
    assert keys == [f"job{i}" for i in range(8)]


def test_chunked_frames_through_the_whole_stack(consumer: tb.Consumer) -> None:
    spec = {"n": 600_000, "seed": 4}
    run_peer(consumer, [("chunky", spec)], max_frame_bytes=256 * 1024).join()
    assert same(consumer.recv("chunky", timeout=60), make_tensor(spec))
    assert consumer.stats["chunks"] >= 9


def test_duplicate_message_ids_are_dropped(consumer: tb.Consumer) -> None:
    with tb.Producer(consumer.address) as producer:
        frame = tb.encode(np.arange(3), key="dup", message_id=("fixed", 1))
        producer.transport.send(frame, key="dup")
        producer.transport.send(frame, key="dup")
        producer.send("after", np.arange(2))
        producer.flush(10)
    assert same(consumer.recv("after", timeout=30), np.arange(2))
    assert same(consumer.recv("dup", timeout=5), np.arange(3))
    with pytest.raises(tb.Timeout):
        consumer.recv("dup", timeout=0.5)
    assert consumer.stats["duplicates"] == 1
