"""kafka:// on a three-broker cluster: a broker killed (SIGKILL) mid-stream loses, repeats and corrupts nothing.

Each test runs once per Kafka client (`kafka_client`: kafka-python, confluent).

Needs the cluster of `bash scripts/brokers.sh cluster up` (kafka1..3 on 127.0.0.1:9191..9193); the
tests kill and restart its brokers through the same script, and leave all three running.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.transports.kafka_python import KafkaAdminClient, ke
from tests import kafka_log, node_loss
from tests.conftest import IN_CI, reachable, with_query
from tests.node_loss import Fault, NodeLossResult, run, table
from tests.waiting import wait_for

CLUSTER_URL = os.environ.get(
    "TENSORBUS_KAFKA_CLUSTER_URL", "kafka://127.0.0.1:9191,127.0.0.1:9192,127.0.0.1:9193"
).rstrip("/")
SERVERS = urllib.parse.urlsplit(CLUSTER_URL).netloc.split(",")
#: broker id -> host:port, as `brokers.sh cluster up` numbers them (node ids 1, 2, 3 in URL order)
BROKERS = {i + 1: server for i, server in enumerate(SERVERS)}
#: tensors per node-loss case (4 KB..4 MB, three of 24 MB), and after how many received a broker is killed and
#: started again: the kill lands mid-stream at both ends (`check` asserts it) with a quarter of the stream done;
#: the start, once the stream has gone on past the kill, runs beside it (`Fault.background`), so the broker
#: rejoins its ISRs while tensors still flow
COUNT = 400
KILL_AT, START_AT = COUNT // 4, COUNT // 4 + COUNT // 10
#: the cluster's __consumer_offsets partitions (scripts/kafka/cluster.properties: offsets.topic.num.partitions)
OFFSETS_PARTITIONS = 10

pytestmark = [pytest.mark.broker, pytest.mark.cluster, pytest.mark.slow]


def require_cluster() -> None:
    """Fail in CI, skip (saying why) elsewhere, unless all three brokers answer."""
    missing = [server for server in SERVERS if not reachable(f"kafka://{server}")]
    if len(SERVERS) == 3 and not missing:
        return
    message = f"the Kafka cluster at {CLUSTER_URL} is not all up (start it with: bash scripts/brokers.sh cluster up)"
    if IN_CI:
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


def cluster(verb: str, broker: int) -> None:
    """`brokers.sh cluster kill|start kafkaN`: kill is SIGKILL (and the broker is checked to stop answering);
    start returns once the broker is back in sync."""
    node_loss.cluster(verb, f"kafka{broker}")
    if verb == "kill":  # (its listener may take a moment longer than its threads to go)
        wait_for(lambda: not reachable(f"kafka://{BROKERS[broker]}"), 10, f"killed kafka{broker} to stop answering")


def start_the_stopped() -> None:
    """Start every broker that does not answer, side by side (each start waits for its broker to be back in sync)."""
    stopped = [broker for broker, server in BROKERS.items() if not reachable(f"kafka://{server}")]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(stopped))) as pool:
        for started in [pool.submit(cluster, "start", broker) for broker in stopped]:
            started.result()


def admin() -> KafkaAdminClient:
    return KafkaAdminClient(bootstrap_servers=SERVERS, request_timeout_ms=10000)


def described(client: KafkaAdminClient, topic: str) -> dict:
    """The topic's description, once the broker asked knows it: a new topic's metadata reaches each broker a
    moment after its first write is acknowledged, and one still without it describes no partitions."""
    found: list[dict] = []

    def known() -> bool:
        found[:] = client.describe_topics([topic])
        return bool(found[0]["partitions"]) and all(p["leader_id"] >= 0 for p in found[0]["partitions"])

    wait_for(known, 30, f"every broker to know topic {topic}")
    return found[0]


def leader(topic: str) -> int:
    """The broker that leads the topic's partition 0 now."""
    client = admin()
    try:
        return int(described(client, topic)["partitions"][0]["leader_id"])
    finally:
        client.close()


def java_hash(text: str) -> int:
    """Java's String.hashCode, which Kafka uses to place a group on a __consumer_offsets partition."""
    h = 0
    for unit in np.frombuffer(text.encode("utf-16-be"), ">u2"):
        h = (31 * h + int(unit)) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def group_coordinated_by(broker: int) -> str:
    """A fresh group name whose coordinator is `broker` (the leader of its __consumer_offsets partition)."""
    client = admin()
    try:
        deadline = time.monotonic() + 60
        while True:  # the offsets topic is created by the first group lookup, then needs its leaders
            with contextlib.suppress(ke.RetriableError):  # e.g. NotCoordinatorError while leaders move
                client.list_group_offsets({f"probe-{uuid.uuid4().hex[:6]}": None})
            described = {t["name"]: t for t in client.describe_topics(["__consumer_offsets"])}
            partitions = described.get("__consumer_offsets", {}).get("partitions") or []
            led = {p["partition_index"] for p in partitions if p["leader_id"] == broker}
            if len(partitions) == OFFSETS_PARTITIONS and led:
                break
            assert time.monotonic() < deadline, f"no __consumer_offsets partition led by kafka{broker}: {partitions}"
            time.sleep(0.5)
    finally:
        client.close()
    while True:
        group = f"tb-group-{uuid.uuid4().hex[:8]}"
        h = java_hash(group)
        if (0 if h == -(1 << 31) else abs(h)) % OFFSETS_PARTITIONS in led:
            return group


@pytest.fixture
def topic() -> Iterator[str]:
    """A fresh topic name, leaders back on their preferred brokers; afterwards every broker runs, the topic is gone."""
    require_cluster()
    client = admin()
    try:  # a broker restarted by an earlier test leads nothing until this (or the broker's own check, every 5 min)
        client.elect_leaders(0, None, raise_errors=False)
    finally:
        client.close()
    name = f"tb-cluster-{uuid.uuid4().hex[:10]}"
    yield name
    start_the_stopped()
    client = admin()
    try:
        if name in client.list_topics():
            client.delete_topics([name])
    finally:
        client.close()


def check(result: NodeLossResult, topic: str) -> None:
    """Print the table; require every tensor once, intact, every fault mid-stream, from a topic on 3 replicas needing
    2 in sync."""
    print()
    print(table([result]))
    if not result.ok:  # where the tensors the consumer never had are in the topic's log, if anywhere
        pytest.fail(f"{table([result])}\nthe topic's log:\n{kafka_log.report(SERVERS, topic, result.missing)}")
    assert result.sent == result.received == COUNT
    assert result.mid_stream and all(result.mid_stream), f"a fault ran after an end had finished: {result.faults}"
    assert topic_layout(topic) == (3, "2")  # the transport's defaults on a three-broker cluster


def in_child(target: Callable[[str], None], url: str) -> None:
    """Run `target(url)` in a process of its own, as an application would; fail if it raised.

    kafka-python 3.0 leaves each socket whose connection was refused to the garbage collector, whose
    ResourceWarnings this suite turns into errors: clients that meet a dead broker run apart.
    """
    child = multiprocessing.get_context("spawn").Process(target=target, args=(url,))
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        child.join(5)
    assert child.exitcode == 0, f"{target.__name__} failed (exit code {child.exitcode}; its traceback is above)"


def test_killing_the_bootstrap_broker_and_group_coordinator_mid_stream_loses_nothing(
    topic: str, kafka_client: str
) -> None:
    """kafka1 is first in the URL and coordinates the group, kafka2 leads the partition: kafka1 dies, returns.

    The topic exists beforehand (replicas placed so that kafka2 leads), so this also shows an existing topic used.
    """
    group = group_coordinated_by(1)
    client = admin()
    try:
        spec = {"assignments": {0: [2, 3, 1]}, "configs": {"min.insync.replicas": "2"}}
        client.create_topics({topic: spec}, wait_for_metadata=True)
    finally:
        client.close()
    url = with_query(f"{CLUSTER_URL}/{topic}", f"client={kafka_client}")
    killed: list[int] = []

    def kill() -> None:
        assert leader(topic) != 1, "kafka1 leads the partition: this case is about the brokers around it"
        cluster("kill", 1)
        killed.append(1)

    result = run(
        url,
        name=f"kafka ({kafka_client}): bootstrap broker + group coordinator killed, restarted",
        count=COUNT,
        faults=[
            Fault(KILL_AT, kill, "kill kafka1"),
            Fault(START_AT, lambda: cluster("start", 1), "start kafka1", background=True),
        ],
        consumer_options={"group": group},
    )
    assert killed == [1]
    check(result, topic)


def test_killing_the_partition_leader_mid_stream_loses_nothing(topic: str, kafka_client: str) -> None:
    url = with_query(f"{CLUSTER_URL}/{topic}", f"client={kafka_client}")
    victim: list[int] = []

    def kill_leader() -> None:
        victim.append(leader(topic))
        cluster("kill", victim[0])

    result = run(
        url,
        name=f"kafka ({kafka_client}): partition leader killed, restarted",
        count=COUNT,
        faults=[
            Fault(KILL_AT, kill_leader, "kill the leader"),
            Fault(START_AT, lambda: cluster("start", victim[0]), "start", background=True),
        ],
    )
    check(result, topic)


def test_a_broker_down_until_the_end_loses_nothing(topic: str, kafka_client: str) -> None:
    """One follower dies for good: two replicas remain, min.insync.replicas=2 is still met, writes go on."""
    url = with_query(f"{CLUSTER_URL}/{topic}", f"client={kafka_client}")
    victim: list[int] = []

    def kill_follower() -> None:
        victim.append(max(set(BROKERS) - {leader(topic)}))
        cluster("kill", victim[0])

    result = run(
        url,
        name=f"kafka ({kafka_client}): a broker down until the end",
        count=COUNT,
        faults=[Fault(KILL_AT, kill_follower, "kill a follower")],
    )
    assert victim and not reachable(f"kafka://{BROKERS[victim[0]]}"), "the killed broker came back on its own"
    cluster("start", victim[0])  # before this process's admin client asks the cluster (see `in_child`)
    check(result, topic)


def _short_of_replicas(url: str) -> None:
    """Send one tensor, kill both followers, send another: flush must raise within the delivery timeout."""
    with tb.Producer(url, delivery_timeout_s=8.0) as producer:
        producer.send("before", np.arange(10))
        producer.flush(timeout=30)
        survivor = leader(urllib.parse.urlsplit(url).path.lstrip("/"))
        for broker in sorted(set(BROKERS) - {survivor}):
            cluster("kill", broker)
        producer.send("after", np.arange(10))
        started = time.monotonic()
        with pytest.raises(tb.TransportError, match="did not acknowledge"):
            producer.flush(timeout=60)
        assert time.monotonic() - started < 30


def test_a_producer_that_cannot_reach_min_insync_replicas_raises(topic: str, kafka_client: str) -> None:
    """Two brokers down: no acks=all write can be acknowledged, and the producer says so instead of losing it.

    What it had flushed before is still there once the brokers are back. The producer runs in a process of
    its own (see `in_child`).
    """
    url = with_query(f"{CLUSTER_URL}/{topic}", f"client={kafka_client}")
    in_child(_short_of_replicas, url)
    start_the_stopped()
    with tb.Consumer(url) as consumer:
        assert (consumer.recv("before", timeout=30) == np.arange(10)).all()


def topic_layout(topic: str) -> tuple[int, str]:
    """The topic's replica count and its min.insync.replicas."""
    from kafka.admin import ConfigResource, ConfigResourceType  # (imported by the transport, warnings silenced)

    client = admin()
    try:
        replicas = len(described(client, topic)["partitions"][0]["replica_nodes"])
        resource = ConfigResource(ConfigResourceType.TOPIC, topic, ["min.insync.replicas"])
        configs: dict = {}

        def known() -> bool:  # (a broker that does not know the topic yet answers no configs, and no error)
            configs.update(client.describe_configs([resource]).get("topic", {}).get(topic, {}))
            return "min.insync.replicas" in configs

        wait_for(known, 30, f"the configs of topic {topic}")
    finally:
        client.close()
    return replicas, configs["min.insync.replicas"]["value"]


def test_replication_options_in_the_url_shape_a_new_topic_and_not_an_existing_one(
    topic: str, kafka_client: str
) -> None:
    url = with_query(f"{CLUSTER_URL}/{topic}", f"client={kafka_client}")
    with tb.Producer(with_query(url, "replication_factor=2&min_insync_replicas=1")) as producer:
        producer.send("t", np.arange(3))
        producer.flush(30)
    assert topic_layout(topic) == (2, "1")
    with tb.Producer(url) as producer, tb.Consumer(url) as consumer:  # the defaults would be (3, "2"): not applied
        producer.send("u", np.arange(4))
        assert (consumer.recv("t", timeout=30) == np.arange(3)).all()
        assert (consumer.recv("u", timeout=30) == np.arange(4)).all()
    assert topic_layout(topic) == (2, "1")


def _round_trip(url: str) -> None:
    """A consumer and a producer on `url`: one tensor through (in a process of its own, as an application)."""
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        producer.send("t", np.arange(5))
        producer.flush(30)
        assert (consumer.recv("t", timeout=30) == np.arange(5)).all()


def test_clients_started_while_the_first_broker_of_the_url_is_down_use_the_others(
    topic: str, kafka_client: str
) -> None:
    """A new topic then gets as many replicas as the cluster counts live brokers: two once kafka1 is fenced."""
    cluster("kill", 1)
    in_child(_round_trip, with_query(f"{CLUSTER_URL}/{topic}", f"client={kafka_client}"))
    cluster("start", 1)  # (before this process's admin client asks the cluster)
    assert topic_layout(topic) in {(2, "1"), (3, "2")}  # (3 while the controller has not fenced kafka1 yet)
