"""`tensorbus save --subscribe [--follow]` against a tb.Publisher, and `inspect` showing versions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.files import read_tensor
from tests.conftest import KAFKA_URL, require_broker
from tests.integration.test_cli import finish, listen, tensorbus


def test_save_follow_writes_each_new_version_atomically_under_its_version(tmp_path: Path) -> None:
    with tb.Publisher("tcp://127.0.0.1:0") as pub:
        pub.publish("params", {"w": np.full((4, 4), 10, np.float32)}, version=10)
        saver, _ = listen(
            "save", pub.address, "params", "-o", str(tmp_path / "p.safetensors"),
            "--subscribe", "--follow", "--max-versions", "2", "--timeout", "30",
        )  # fmt: skip
        assert saver.stdout is not None
        assert "saved version 10" in saver.stdout.readline()  # the latest at once, for a late joiner
        pub.publish("params", {"w": np.full((4, 4), 20, np.float32)}, version=20)
        assert "saved version 20" in finish(saver)
    for version in (10, 20):
        saved = read_tensor(tmp_path / f"p-{version:06d}.safetensors")
        assert np.array_equal(saved["w"], np.full((4, 4), version, np.float32))
    assert not list(tmp_path.glob(".*"))  # no temp files left behind


def test_inspect_shows_the_version_of_a_saved_frame(tmp_path: Path) -> None:
    with tb.Publisher("tcp://127.0.0.1:0") as pub:
        pub.publish("w", np.arange(3), version=7)
        result = tensorbus("save", pub.address, "w", "-o", str(tmp_path / "w.tbf"), "--subscribe", "--timeout", "30")
        assert result.returncode == 0, result.stderr
    shown = tensorbus("inspect", str(tmp_path / "w.tbf"))
    assert shown.returncode == 0 and "key='w', version=7," in shown.stdout, shown.stdout


def test_bench_fanout_measures_tcp_against_pub_sub(tmp_path: Path) -> None:
    result = tensorbus(
        "bench", "--fanout", "--transports", "tcp", "--sizes", "64KB", "--subscribers", "2", "--repeats", "3",
        "--json", str(tmp_path / "fanout.json"), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "| 64KB | 2 | tcp " in result.stdout and " zmq " in result.stdout
    cells = json.loads((tmp_path / "fanout.json").read_text())
    assert [len(cells[0]["seconds"][m]) for m in ("tcp", "zmq")] == [3, 3]
    assert all(0 < s < 60 for m in ("tcp", "zmq") for s in cells[0]["seconds"][m])
    for counts in ("subscriber_cpu_s", "subscriber_minflt"):  # each round: what a subscriber process spent in it
        assert all(len(cells[0][counts][m]) == 3 for m in ("tcp", "zmq")), cells[0][counts]
    # (the last round may tell nothing: a subscriber ends its threads once it has the last version)
    assert all(0 < cpu < 60 for m in ("tcp", "zmq") for cpu in cells[0]["subscriber_cpu_s"][m][:2])


def test_bench_fanout_refuses_a_transport_it_has_no_baseline_for() -> None:
    result = tensorbus("bench", "--fanout", "--transports", "unix")
    assert result.returncode == 2 and "--fanout compares tcp, kafka, kafka-confluent; not unix" in result.stderr


@pytest.mark.broker
def test_bench_fanout_measures_kafka_on_the_confluent_client_against_raw_kafka_python(tmp_path: Path) -> None:
    require_broker(KAFKA_URL)
    result = tensorbus(
        "bench", "--fanout", "--transports", "kafka-confluent", "--sizes", "64KB", "--subscribers", "1",
        "--repeats", "3", "--kafka-url", KAFKA_URL, "--json", str(tmp_path / "fanout.json"), timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    cells = json.loads((tmp_path / "fanout.json").read_text())
    assert cells[0]["pair"] == ["kafka-confluent", "kafka-python"]
    assert all(0 < s < 60 for m in cells[0]["pair"] for s in cells[0]["seconds"][m])
