"""A three-node RabbitMQ cluster loses a node mid-stream: nothing lost, duplicated or corrupted.

Needs `bash scripts/brokers.sh cluster up` (nodes rabbit1..3 on 127.0.0.1:5681..5683); each test
leaves every node running again. The tables printed here are the README's reliability table.
"""

from __future__ import annotations

import os
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pika
import pytest

import tensorbus as tb
from tests import node_loss
from tests.conftest import require_broker

pytestmark = [pytest.mark.broker, pytest.mark.cluster, pytest.mark.timeout(240)]

CLUSTER_URL = os.environ.get(
    "TENSORBUS_AMQP_CLUSTER_URL", "amqp://guest:guest@127.0.0.1:5681,127.0.0.1:5682,127.0.0.1:5683/%2F"
)
NODES = ("rabbit1", "rabbit2", "rabbit3")


cluster = node_loss.cluster


def port_of(node: str) -> int:
    hosts = urllib.parse.urlsplit(CLUSTER_URL).netloc.rpartition("@")[2].split(",")
    return int(hosts[NODES.index(node)].rpartition(":")[2])


#: tensors per node-loss case, and after how many received a node is killed and started again: mid-stream at
#: both ends (`report` asserts it); the start runs beside the stream (`Fault.background`), so the node rejoins
#: while tensors still flow
COUNT = 400
KILL_AT, START_AT = COUNT // 4, COUNT // 4 + COUNT // 10


@pytest.fixture
def queue() -> Iterator[str]:
    """A fresh queue name; every node is running again after the test (started here if a test left one down)."""
    for node in NODES:  # (fails under CI=true when the cluster is not up)
        require_broker(f"amqp://127.0.0.1:{port_of(node)}")
    name = f"tb-cluster-{uuid.uuid4().hex[:12]}"
    yield name
    with ThreadPoolExecutor(len(NODES)) as pool:
        list(pool.map(lambda node: cluster("start", node), NODES))  # (a no-op for a running node)
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port_of("rabbit1"))) as connection:
        connection.channel().queue_delete(name)


def report(result: node_loss.NodeLossResult) -> None:
    print(f"\n{node_loss.table([result])}\nfaults: {', '.join(result.faults)}")
    assert result.mid_stream and all(result.mid_stream), f"a fault ran after an end had finished: {result.faults}"


def test_the_node_both_ends_are_connected_to_is_killed_and_nothing_is_lost(queue: str) -> None:
    # both connect to the first node of the URL, rabbit1, which also leads the queue (declared there)
    result = node_loss.run(
        f"{CLUSTER_URL}?queue={queue}",
        name="amqp quorum: kill the connected node (rabbit1), start it later",
        faults=[
            node_loss.Fault(KILL_AT, lambda: cluster("kill", "rabbit1"), "kill rabbit1"),
            node_loss.Fault(START_AT, lambda: cluster("start", "rabbit1"), "start rabbit1", background=True),
        ],
        count=COUNT,
    )
    report(result)
    assert result.ok, result
    assert result.received == result.sent == COUNT


def test_the_quorum_queues_leader_is_killed_and_nothing_is_lost(queue: str) -> None:
    # the queue is declared through rabbit2, so rabbit2 leads it; both ends connect to rabbit1
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port_of("rabbit2"))) as connection:
        connection.channel().queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
    leader = cluster("leader", queue)
    assert leader != "rabbit1", "the leader must be a node the clients are not connected to"
    result = node_loss.run(
        f"{CLUSTER_URL}?queue={queue}",
        name=f"amqp quorum: kill the queue's leader ({leader}), start it later",
        faults=[
            node_loss.Fault(KILL_AT, lambda: cluster("kill", leader), f"kill {leader}"),
            node_loss.Fault(START_AT, lambda: cluster("start", leader), f"start {leader}", background=True),
        ],
        count=COUNT,
    )
    report(result)
    assert result.ok, result
    assert result.received == result.sent == COUNT
    assert cluster("leader", queue) in NODES


def test_a_quorum_queue_without_a_majority_fails_the_producer_loudly(queue: str) -> None:
    # two of three nodes gone: the queue cannot take a message; the producer must say so, not lose it
    url = f"{CLUSTER_URL}?queue={queue}"
    with tb.Producer(url, confirm_timeout_s=8) as producer:
        producer.send("before", np.arange(10.0))
        producer.flush(30)
        cluster("kill", "rabbit2")
        cluster("kill", "rabbit3")
        started = time.monotonic()
        with pytest.raises(tb.TransportError, match=r"no confirm for .* lost the majority"):
            for i in range(1000):  # until the unconfirmed bytes fill max_pending_bytes, or the flush below
                producer.send("during", np.full(100_000, i, np.float32))
            producer.flush(60)
        assert time.monotonic() - started < 45
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda node: cluster("start", node), ("rabbit2", "rabbit3")))
        producer.flush(60)  # the majority is back: what waited is confirmed after all
    with tb.Consumer(url) as consumer:
        assert np.array_equal(consumer.recv("before", timeout=30), np.arange(10.0))
        assert consumer.recv("during", timeout=30)[0] == 0
