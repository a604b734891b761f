"""The meter counts a thread's tensors as runs of one size: exact tensors, bytes and size buckets however the
sizes change, and no counter going down between scrapes."""

from __future__ import annotations

import numpy as np

from tests.conftest import require_module

require_module("prometheus_client", "metrics")  # CI installs every extra: there a missing one fails
from prometheus_client import CollectorRegistry, generate_latest

import tensorbus as tb
from tests.conftest import endpoint_url
from tests.integration.test_metrics import parse, value
from tests.waiting import wait_for

SIZES = [4096, 4096, 0, 1 << 20, 4096, 4096, 300, 1 << 20]  # bytes of the tensors, in the order sent


def test_tensors_of_changing_sizes_are_counted_exactly_by_size_bucket_and_never_go_down() -> None:
    registry = CollectorRegistry()
    url = endpoint_url("memory")
    seen: list[tuple[float, float]] = []
    with tb.Consumer(url) as consumer, tb.Producer(url, metrics=True, metrics_registry=registry) as producer:
        for i, nbytes in enumerate(SIZES):
            producer.send(f"t{i}", np.zeros(nbytes, np.uint8))
            samples = parse(generate_latest(registry).decode())
            seen.append((value(samples, "tensorbus_sent_tensors_total"), value(samples, "tensorbus_sent_bytes_total")))
        wait_for(lambda: len(consumer.table) == len(SIZES), 30, "every tensor in the table")
    assert seen == [(i + 1, sum(SIZES[: i + 1])) for i in range(len(SIZES))]  # (each scrape: every tensor so far)
    buckets = {le: value(samples, "tensorbus_tensor_bytes_bucket", le=le) for le in ("1024.0", "4096.0", "1048576.0")}
    assert buckets == {
        "1024.0": 2,
        "4096.0": 6,
        "1048576.0": 8,
    }  # (cumulative: 0 and 300 B; four of 4 KB; two of 1 MiB)
    assert value(samples, "tensorbus_tensor_bytes_sum") == sum(SIZES)
