"""`tensorbus bench` against the real brokers: the broker transports and raw clients it compares, and their rounds."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorbus.bench import broker_baselines
from tensorbus.bench.links import make_link
from tensorbus.cli import main
from tests.conftest import AMQP_URL, KAFKA_URL, require_broker

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_broker_cells_are_measured_and_large_ones_get_their_own_rounds_budget_and_round_size(tmp_path: Path) -> None:
    require_broker(AMQP_URL)
    require_broker(KAFKA_URL)
    settings = tmp_path / "bench.toml"
    # 64KB counts as large here: its broker cells get 2 rounds of 1 MiB (16 tensors, where 1 ms rounds
    # would have one or two) within 60 s; the rest `budget_s` and rounds of about `broker_round_s`
    settings.write_text(
        'broker_cap_from = "64KB"\nbroker_max_rounds = 2\nbroker_budget_s = 60.0\nbroker_round_bytes = "1MB"\n'
        "repeats = 3\nbudget_s = 0.5\nwarmup_s = 0.05\nround_s = 0.05\nbroker_round_s = 0.001\n"
    )
    out = tmp_path / "bench.json"
    code = main([
        "bench", "--config", str(settings), "--transports", "amqp-quorum,amqp-classic,kafka",
        "--baselines", "pika,pika-classic,kafka-python", "--sizes", "4KB,64KB", "--latency-sizes", "4KB",
        "--amqp-url", AMQP_URL, "--kafka-url", KAFKA_URL, "--timeout-s", "60", "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert code == 0
    cells = json.loads(out.read_text())["throughput"]
    methods = {"amqp-quorum", "amqp-classic", "kafka", "pika", "pika-classic", "kafka-python"}
    assert {c["method"] for c in cells} == methods
    for cell in cells:
        assert cell["status"] == "ok" and cell["failures"] == 0 and cell["verified"] > 0, cell
        if cell["size"] == "64KB":  # the broker budget, not budget_s, bounds them: the cap stops them
            assert (cell["rounds"], cell["stopped_by"]) == (2, "cap"), cell
            assert cell["tensors_per_round"] == 16, cell
        else:
            assert cell["rounds"] >= 1 and cell["stopped_by"] in (None, "budget"), cell


def _rewind_to_the_start(link: Any) -> None:
    """What a rebalance does to a group member: fetched records dropped, reading again from the last
    commit (none here: the topic's start)."""
    link.records.clear()
    if isinstance(link.consumer.assignment(), set):  # kafka-python
        from kafka import TopicPartition

        link.consumer.seek(TopicPartition(link.name, 0), 0)
    else:
        from confluent_kafka import TopicPartition

        link.consumer.seek(TopicPartition(link.name, 0, 0))


@pytest.mark.parametrize("impl", ["kafka-python", "confluent-kafka"])
def test_a_raw_kafka_baseline_skips_the_records_its_group_delivers_again(impl: str) -> None:
    require_broker(KAFKA_URL)
    spec = {"impl": impl, "tag": f"again-{uuid.uuid4().hex[:8]}", "url": KAFKA_URL, "timeout_s": 30.0}
    link = make_link({**spec, "chunk_bytes": 1_000_000}, "B")
    try:
        link.connect(link.open())  # the link reads the topic it writes to
        link.prepare(4096)
        for index in range(3):
            link.send(np.full(1024, index, np.float32), index)
        link.finish(30)
        assert [link.recv(30)[0] for _ in range(2)] == [0, 1]
        _rewind_to_the_start(link)
        index, body = link.recv(30)
        assert index == 2 and np.frombuffer(body, np.float32)[0] == 2
    finally:
        link.close()


def test_a_raw_kafka_python_consumer_that_gets_no_partition_is_made_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """kafka-python 3.0 was seen to wait out the bench's 90 s for an assignment the broker had sent: the
    baseline's link makes its consumer again after JOIN_ATTEMPT_S, and the new one gets the partition."""
    require_broker(KAFKA_URL)
    import kafka

    made: list[Any] = []

    class FirstGetsNothing(kafka.KafkaConsumer):  # the real client; the first one never sees its partition
        def __init__(self, *topics: str, **configs: Any) -> None:
            super().__init__(*topics, **configs)
            made.append(self)

        def assignment(self) -> set[Any]:
            return set() if self is made[0] else super().assignment()

    monkeypatch.setattr(kafka, "KafkaConsumer", FirstGetsNothing)
    monkeypatch.setattr(broker_baselines, "JOIN_ATTEMPT_S", 2.0)
    spec = {"impl": "kafka-python", "tag": f"join-{uuid.uuid4().hex[:8]}", "url": KAFKA_URL, "timeout_s": 30.0}
    link = make_link({**spec, "chunk_bytes": 1_000_000}, "B")
    try:
        link.connect(link.open())  # the link reads the topic it writes to
        assert len(made) == 2 and made[1].assignment()
        link.prepare(4096)
        link.send(np.full(1024, 7, np.float32), 0)
        link.finish(30)
        index, body = link.recv(30)
        assert index == 0 and np.frombuffer(body, np.float32)[0] == 7
    finally:
        link.close()
