"""The node-loss harness itself, over a plain tcp:// endpoint: it counts every tensor and runs its faults."""

from __future__ import annotations

import threading
import urllib.parse

import numpy as np
import pytest

import tensorbus as tb
from tests import faults, kafka_log, node_loss
from tests.conftest import endpoint_url, with_query


def test_the_harness_counts_a_clean_stream_and_runs_each_fault_once_at_its_point() -> None:
    ran: list[str] = []
    lock = threading.Lock()

    def note(name: str) -> None:
        with lock:
            ran.append(name)

    url = f"tcp://127.0.0.1:{faults.free_port()}"
    result = node_loss.run(
        url,
        name="tcp, no fault",
        count=120,
        large_count=1,  # (in place of one of the 120)
        large_bytes=6 << 20,
        faults=[node_loss.Fault(30, lambda: note("a"), "a"), node_loss.Fault(90, lambda: note("b"), "b")],
        timeout_s=60.0,
        drain_s=0.2,
    )
    print(node_loss.table([result]))
    assert result.ok, result
    assert (result.sent, result.received, result.lost, result.duplicated, result.corrupted) == (120, 120, 0, 0, 0)
    assert ran == ["a", "b"]
    assert result.mid_stream == [True, True]  # neither end had finished when a fault ran
    assert "| tcp, no fault |" in node_loss.table([result])
    assert result.consumer_stats["received"] == 121  # (the tensors and the end marker, as the consumer counted them)
    assert "never received" not in node_loss.table([result])
    assert set(result.logs) == {"producer", "consumer"}  # (each side's log tail came back; shown only on a failure)
    assert "log lines" not in node_loss.table([result])


def test_a_background_fault_runs_beside_the_stream_and_what_it_raises_fails_the_run() -> None:
    later_ran = threading.Event()

    def start() -> None:  # (as a node's start: returns long after it began, here once a later fault ran)
        assert later_ran.wait(30), "the stream did not go on while a background fault ran"
        raise RuntimeError("the node did not start")

    plan = [node_loss.Fault(10, start, "start", background=True), node_loss.Fault(40, later_ran.set, "later")]
    url = f"tcp://127.0.0.1:{faults.free_port()}"
    with pytest.raises(RuntimeError, match="the node did not start"):
        node_loss.run(url, count=60, large_count=0, faults=plan, timeout_s=60.0, drain_s=0.2)
    assert later_ran.is_set()


def test_a_failed_case_names_what_was_lost_and_repeated_and_what_the_consumer_counted() -> None:
    result = node_loss.NodeLossResult(
        "case", 10, 9, 2, 1, 0, 0.5, 3.0, missing=[3, 4, 5, 9], repeated=[7], consumer_stats={"duplicates": 4},
        logs={"consumer": ["12 ms MainThread tensorbus.x: something happened"]},
    )  # fmt: skip
    lines = node_loss.table([result]).splitlines()
    assert lines[-2:] == [
        "case: the consumer's last tensorbus log lines (INFO and up):",
        "12 ms MainThread tensorbus.x: something happened",
    ]
    assert "case: never received 3-5, 9; received twice or more 7" in lines
    assert "case: the consumer counted {'duplicates': 4}" in lines


@pytest.mark.broker
def test_a_kafka_cases_log_scan_says_where_each_missing_tensor_sits_in_the_topic_or_that_it_is_not_there() -> None:
    """`kafka_log.report`, which a failed Kafka node-loss case adds to its report, read on the single-node broker."""
    url = with_query(endpoint_url("kafka"), "max_frame_bytes=200000")  # (so that one tensor goes in chunks)
    sizes = [4096, 4096, 1 << 20, 4096]
    with tb.Producer(url) as producer:
        for index, nbytes in enumerate(sizes):
            producer.send(node_loss.KEY, np.zeros(nbytes, np.uint8), metadata={"i": index})
        producer.send(node_loss.END_KEY, np.zeros(1, np.uint8), metadata={"end": True})
        producer.flush(30)
    parts = urllib.parse.urlsplit(url)
    report = kafka_log.report(parts.netloc.split(","), parts.path.lstrip("/"), [1, 7])
    lines = report.splitlines()
    assert lines[0] == "tensor 1: in the log at partition 0 offset 1", report
    assert lines[1] == "tensor 7: not in the log as a whole record", report
    chunks = (1 << 20) // 200000 + 1
    assert lines[2].startswith(
        f"partition 0: {4 + chunks} records from offset 0; the first: 0: i=0, 1: i=1, 2: chunk 0 of"
    ), report
    assert f"{2 + chunks}: i=3, {3 + chunks}: end" in lines[2], report
