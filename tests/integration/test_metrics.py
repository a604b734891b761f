"""The Prometheus exposition after a known traffic pattern: exact counts, over tcp:// and RabbitMQ."""

from __future__ import annotations

import contextlib
import gc
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import require_module

require_module("prometheus_client", "metrics")  # CI installs every extra: there a missing one fails
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import tensorbus as tb
from tensorbus.codec.frame import CRC_AT
from tensorbus.metrics import Meter, endpoint_label
from tests.conftest import endpoint_url
from tests.integration.test_socket import raw_peer
from tests.waiting import wait_for

TENSOR = np.arange(1024, dtype=np.float32)  # 4 KB
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels` (an error if none or several match)."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, (
        f"{len(found)} samples of {name} with {labels}: {sorted(k for k in samples if k[0] == name)}"
    )
    return found[0]


def fenced_pair(producer: tb.Producer) -> None:
    """A key of incarnation 2 of a source, then one of incarnation 1: the second is refused as stale."""
    producer.send(tb.make_key("trainer", 2, "saver", "w"), TENSOR)
    producer.send(tb.make_key("trainer", 1, "saver", "w"), TENSOR)


def receive_one_after_waiting(consumer: tb.Consumer, producer: tb.Producer, delay_s: float) -> None:
    """A recv that waits: its tensor is sent `delay_s` after the recv is queued in the table."""

    def send_late() -> None:
        wait_for(lambda: consumer.table._waiters, 30, "the recv waiting in the table")
        time.sleep(delay_s)  # (what the recv waits: the point of the test, not a wait for something)
        producer.send("late", TENSOR)

    sender = threading.Thread(target=send_late)
    sender.start()
    assert consumer.recv("late", timeout=60)[0] == 0
    sender.join()


def test_tcp_counts_tensors_bytes_rejections_by_reason_and_a_recv_that_waited() -> None:
    registry = CollectorRegistry()
    monitored: dict[str, Any] = {"metrics": True, "metrics_registry": registry}
    with tb.Consumer("tcp://127.0.0.1:0", max_ndim=2, **monitored) as consumer:
        port = tb.serve_metrics(0, registry=registry)
        with tb.Producer(consumer.address, **monitored) as producer, tb.Producer(consumer.address) as misfit:
            for _ in range(3):
                producer.send("t", TENSOR)
            producer.send(tb.make_key("trainer", 2, "saver", "w"), TENSOR)
            wait_for(lambda: len(consumer.table) == 4, 30, "4 tensors in the table")
            misfit.send(tb.make_key("trainer", 1, "saver", "w"), TENSOR)  # stale: incarnation 2 came first
            misfit.send("cube", np.ones((2, 2, 2)))  # over the consumer's max_ndim
            for _ in range(2):  # (a socket producer is told of each refusal once)
                with pytest.raises(tb.Rejected):
                    misfit.flush(30)
            with contextlib.closing(raw_peer(consumer.address)) as peer:
                bad = bytearray(tb.dumps(TENSOR, key="bad", message_id=("raw", 1)))
                struct.pack_into("<I", bad, CRC_AT, 12345)
                peer.sendall(bytes(bad))
                wait_for(lambda: consumer.stats["rejected"] + consumer.stats["refused"] == 3, 30, "3 frames refused")
            for _ in range(3):
                consumer.recv("t", timeout=30)
            consumer.recv(tb.make_key("trainer", 2, "saver", "w"), timeout=30)
            receive_one_after_waiting(consumer, producer, 0.2)
            producer.flush(30)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
                samples = parse(response.read().decode())
    where = consumer.address.removeprefix("tcp://")
    producer_labels = {"role": "producer", "transport": "tcp", "endpoint": where}
    consumer_labels = {"role": "consumer", "transport": "tcp", "endpoint": where}
    assert value(samples, "tensorbus_sent_tensors_total", **producer_labels) == 5
    assert value(samples, "tensorbus_sent_bytes_total", **producer_labels) == 5 * 4096
    assert value(samples, "tensorbus_received_tensors_total", **consumer_labels) == 5
    assert value(samples, "tensorbus_received_bytes_total", **consumer_labels) == 5 * 4096
    assert value(samples, "tensorbus_delivered_tensors_total", **consumer_labels) == 5
    rejected = {
        reason: value(samples, "tensorbus_rejected_frames_total", **consumer_labels, reason=reason)
        for reason in ("checksum", "limit", "stale", "signature", "replay", "malformed")
    }
    assert rejected == {"checksum": 1, "limit": 1, "stale": 1, "signature": 0, "replay": 0, "malformed": 0}
    assert value(samples, "tensorbus_recv_wait_seconds_count", **consumer_labels) == 5
    assert value(samples, "tensorbus_recv_wait_seconds_sum", **consumer_labels) >= 0.2
    assert value(samples, "tensorbus_recv_wait_seconds_bucket", **consumer_labels, le="0.1") <= 4  # the late one waited
    assert value(samples, "tensorbus_tensor_bytes_bucket", **consumer_labels, le="4096.0") == 5
    assert value(samples, "tensorbus_unacked_bytes", **producer_labels) == 0  # (flushed)
    assert value(samples, "tensorbus_buffered_bytes", **consumer_labels) == 0


def test_a_resend_after_a_consumer_restart_and_the_tensors_an_abort_dropped_are_counted() -> None:
    registry = CollectorRegistry()
    monitored: dict[str, Any] = {"metrics": True, "metrics_registry": registry}
    consumer = tb.Consumer("tcp://127.0.0.1:0", **monitored)
    address = consumer.address
    producer = tb.Producer(address, reconnect_timeout_s=20, **monitored)
    for i in range(5):
        producer.send(f"a{i}", TENSOR)
    wait_for(lambda: len(consumer.table) == 5, 30, "5 tensors in the table")  # never received by the application
    consumer.abort("step failed")  # drops them: never acknowledged
    before = parse(generate_latest(registry).decode())
    consumer.close()
    successor = tb.Consumer(address, **monitored)
    producer.flush(30)
    assert [successor.recv(f"a{i}", timeout=30)[0] for i in range(5)] == [0] * 5
    after = parse(generate_latest(registry).decode())
    producer.close()
    successor.close()
    assert value(before, "tensorbus_dropped_tensors_total", role="consumer", reason="abort") == 5
    assert value(after, "tensorbus_resent_frames_total", role="producer") == 5
    assert value(after, "tensorbus_reconnects_total", role="producer") == 1
    assert value(after, "tensorbus_received_tensors_total", role="consumer") == 5  # the successor's only
    assert (
        value(after, "tensorbus_dropped_tensors_total", role="consumer", reason="abort") == 5
    )  # (the closed one's, kept: a counter never goes down)


@pytest.mark.broker
def test_rabbitmq_counts_tensors_bytes_and_rejections_by_reason() -> None:
    url = endpoint_url("amqp")
    registry = CollectorRegistry()
    monitored: dict[str, Any] = {"metrics": True, "metrics_registry": registry}
    with tb.Consumer(url, signing_key="k1", **monitored) as consumer:
        with tb.Producer(url, signing_key="k1", **monitored) as producer, tb.Producer(url, signing_key="k2") as forger:
            for _ in range(3):
                producer.send("t", TENSOR)
            fenced_pair(producer)
            forger.send("t", TENSOR)  # (no metrics of its own: the producer counts are the first one's)
            producer.flush(30)
            forger.flush(30)
            wait_for(lambda: consumer.stats["rejected"] + consumer.stats["refused"] == 2, 60, "two frames refused")
            for _ in range(3):
                consumer.recv("t", timeout=60)
            consumer.recv(tb.make_key("trainer", 2, "saver", "w"), timeout=60)
            samples = parse(generate_latest(registry).decode())
    queue = url.rpartition("queue=")[2]
    producer_labels = {"role": "producer", "transport": "amqp", "endpoint": queue}
    consumer_labels = {"role": "consumer", "transport": "amqp", "endpoint": queue}
    assert value(samples, "tensorbus_sent_tensors_total", **producer_labels) == 5
    assert value(samples, "tensorbus_sent_bytes_total", **producer_labels) == 5 * 4096
    assert value(samples, "tensorbus_received_tensors_total", **consumer_labels) == 4
    assert value(samples, "tensorbus_received_bytes_total", **consumer_labels) == 4 * 4096
    assert value(samples, "tensorbus_rejected_frames_total", **consumer_labels, reason="signature") == 1
    assert value(samples, "tensorbus_rejected_frames_total", **consumer_labels, reason="stale") == 1
    assert value(samples, "tensorbus_rejected_frames_total", **consumer_labels, reason="checksum") == 0
    assert value(samples, "tensorbus_recv_wait_seconds_count", **consumer_labels) == 4


def test_a_key_label_splits_the_tensor_counts_and_two_endpoints_with_the_same_labels_are_summed() -> None:
    registry = CollectorRegistry()
    labelled: dict[str, Any] = {"metrics": True, "metrics_registry": registry}
    url = endpoint_url("memory")
    with tb.Consumer(url, metrics_key_label=lambda key: key.split("/")[0], **labelled) as consumer:
        with tb.Producer(url, **labelled) as first, tb.Producer(url, **labelled) as second:
            first.send("layer1/w", TENSOR)
            second.send("layer1/b", TENSOR)
            first.send("layer2/w", TENSOR)
            for key in ("layer1/w", "layer1/b", "layer2/w"):
                consumer.recv(key, timeout=30)
            samples = parse(generate_latest(registry).decode())
    assert value(samples, "tensorbus_sent_tensors_total", role="producer") == 3  # two producers, one series
    assert value(samples, "tensorbus_received_tensors_total", role="consumer", key="layer1") == 2
    assert value(samples, "tensorbus_received_tensors_total", role="consumer", key="layer2") == 1


def test_metrics_off_costs_no_monitor_and_bad_monitoring_options_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORBUS_METRICS", raising=False)
    monkeypatch.delenv("TENSORBUS_TRACING", raising=False)
    url = endpoint_url("memory")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        assert consumer._monitor is None and producer._monitor is None
    with pytest.raises(tb.ConfigError, match="metrics_registry"):
        tb.Producer(url, metrics=True, metrics_registry="not a registry")
    with pytest.raises(tb.ConfigError, match="metrics_key_label"):
        tb.Producer(url, metrics=True, metrics_key_label="first")
    monkeypatch.setenv("TENSORBUS_METRICS", "1")
    registry = CollectorRegistry()
    with tb.Producer(url, metrics_registry=registry) as producer:
        assert isinstance(producer._monitor, Meter)  # (metrics alone: the meter is the monitor)
        producer.send("k", TENSOR)
        assert value(parse(generate_latest(registry).decode()), "tensorbus_sent_tensors_total") == 1
    closed = parse(generate_latest(registry).decode())  # its counters stay (a counter never goes down)
    assert value(closed, "tensorbus_sent_tensors_total") == 1


def test_save_follow_serves_its_metrics_on_the_port_given(tmp_path: Path) -> None:
    output = tmp_path / "params.npz"
    command = ["save", "tcp://127.0.0.1:0", "params", "-o", str(output), "--follow", "--max-versions", "3"]
    saver = subprocess.Popen(
        [sys.executable, "-m", "tensorbus", *command, "--timeout", "60", "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert saver.stdout is not None
    metrics_url = saver.stdout.readline().rsplit(" ", 1)[1].strip()
    address = saver.stdout.readline().rsplit(" on ", 1)[1].strip()
    with tb.Producer(address) as producer:
        for version in range(2):
            producer.send("params", {"w": np.full(1024, version, np.float32)})
        wait_for(lambda: len(list(tmp_path.glob("params-*.npz"))) == 2, 60, "two versions saved")
        with urllib.request.urlopen(metrics_url, timeout=30) as response:
            samples = parse(response.read().decode())
        producer.send("params", {"w": np.full(1024, 2, np.float32)})  # the third: save stops
    _, err = saver.communicate(timeout=60)
    assert saver.returncode == 0, err
    assert value(samples, "tensorbus_received_tensors_total", role="consumer", transport="tcp") == 2
    assert value(samples, "tensorbus_received_bytes_total", role="consumer", transport="tcp") == 2 * 4096


@pytest.mark.parametrize(
    ("url", "label"),
    [
        ("amqp://user:secret@127.0.0.1:5672/%2F?queue=jobs&heartbeat_s=5", "jobs"),
        ("kafka://a:9092,b:9092/grads", "grads"),
        ("tcp://127.0.0.1:5555?auth_secret=hush", "127.0.0.1:5555"),
        ("unix:///tmp/tb.sock", "/tmp/tb.sock"),
        ("memory://demo", "demo"),
    ],
)
def test_the_endpoint_label_names_the_queue_topic_or_place_and_never_a_secret(url: str, label: str) -> None:
    assert endpoint_label(url) == label


def test_the_counts_of_threads_that_ended_are_kept_and_their_cells_freed() -> None:
    registry = CollectorRegistry()
    url = endpoint_url("memory")
    with tb.Consumer(url) as consumer, tb.Producer(url, metrics=True, metrics_registry=registry) as producer:
        threads = [threading.Thread(target=producer.send, args=(f"k{i}", TENSOR)) for i in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        del threads, thread  # (a thread's counts are folded in when its Thread object goes)
        meter = producer._monitor
        assert isinstance(meter, Meter)
        wait_for(lambda: gc.collect() >= 0 and not meter.cells, 30, "the ended threads' cells folded in")
        samples = parse(generate_latest(registry).decode())
        assert value(samples, "tensorbus_sent_tensors_total") == 20
        assert value(samples, "tensorbus_sent_bytes_total") == 20 * 4096
        wait_for(lambda: len(consumer.table) == 20, 30, "every tensor in the table")  # (memory:// reads when idle)


def test_a_closed_endpoint_leaves_no_cell_on_the_thread_that_counted() -> None:
    """The main thread never ends: an endpoint it sent on must not stay referenced by it after close."""
    registry = CollectorRegistry()
    url = endpoint_url("memory")
    with tb.Consumer(url) as consumer:
        producer = tb.Producer(url, metrics=True, metrics_registry=registry)
        producer.send("k", TENSOR)
        meter = producer._monitor
        assert isinstance(meter, Meter) and len(meter.cells) == 1
        cell = weakref.ref(meter.cells[0])
        producer.close()
        del producer, meter
        gc.collect()
        assert cell() is None
        assert value(parse(generate_latest(registry).decode()), "tensorbus_sent_tensors_total") == 1
        wait_for(lambda: len(consumer.table) == 1, 30, "the tensor in the table")


def test_counters_never_go_down_when_an_endpoint_sharing_their_labels_closes() -> None:
    registry = CollectorRegistry()
    url = endpoint_url("memory")
    metered: dict[str, Any] = {"metrics": True, "metrics_registry": registry}

    def scrape() -> tuple[float, float]:
        samples = parse(generate_latest(registry).decode())
        return value(samples, "tensorbus_sent_tensors_total"), value(samples, "tensorbus_tensor_bytes_count")

    with tb.Consumer(url) as consumer:
        first, second = tb.Producer(url, **metered), tb.Producer(url, **metered)
        for i in range(2):
            first.send(f"a{i}", TENSOR)
        for i in range(3):
            second.send(f"b{i}", TENSOR)
        assert scrape() == (5, 5)
        first.close()
        assert scrape() == (5, 5)  # (the closed producer's 2 are kept)
        second.send("b3", TENSOR)
        assert scrape() == (6, 6)
        second.close()
        assert scrape() == (6, 6)
        with tb.Producer(url, **metered) as third:  # a new endpoint with the same labels counts on from there
            third.send("c", TENSOR)
            assert scrape() == (7, 7)
        wait_for(lambda: len(consumer.table) == 7, 30, "the 7 tensors in the table")


def test_a_consumer_that_could_not_listen_leaves_no_series_behind() -> None:
    """A second consumer of one memory:// name is refused at `listen`: it never ran, so once the first closes
    no gauge of either is left in the exposition (the refused one's would read a table nobody fills)."""
    registry = CollectorRegistry()
    url = endpoint_url("memory")
    metered: dict[str, Any] = {"metrics": True, "metrics_registry": registry}
    with tb.Consumer(url, **metered):
        with pytest.raises(tb.TransportError, match="already has a consumer") as refused:
            tb.Consumer(url, **metered)
    gauges = [name for name, _ in parse(generate_latest(registry).decode()) if name == "tensorbus_buffered_bytes"]
    assert gauges == [], refused  # (`refused` keeps the refused consumer alive, as a caller's traceback would)
