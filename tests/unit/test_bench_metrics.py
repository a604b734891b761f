"""`tensorbus bench --metrics-port`: the endpoints measured count, and the main process serves every row's series."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import require_module

require_module("prometheus_client", "metrics")  # CI installs every extra: there a missing one fails

from tensorbus.bench import config
from tensorbus.bench.exposition import BenchExposition
from tensorbus.bench.runner import Runner
from tensorbus.cli import main
from tests.integration.test_metrics import Samples, parse
from tests.unit.test_bench import SHIPPED

TINY = [
    "bench", "--config", str(SHIPPED), "--transports", "memory,tcp", "--baselines", "socket", "--sizes", "4KB",
    "--latency-sizes", "4KB", "--repeats", "2", "--budget-s", "1", "--warmup-s", "0.05", "--round-s", "0.05",
    "--timeout-s", "30", "--no-progress",
]  # fmt: skip


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (a row's two endpoints of a kind)."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def test_the_bench_serves_each_rows_metrics_and_its_table_says_they_were_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    assert main([*TINY, "--metrics-port", "0", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "metrics on" in printed.out
    url = re.search(r"http://127\.0\.0\.1:\d+/metrics", printed.err)
    assert url is not None, printed.err
    with urllib.request.urlopen(url.group(0), timeout=30) as response:  # (served as long as this process runs)
        samples = parse(response.read().decode())
    data = json.loads(out.read_text())
    assert data["environment"]["metrics"] == url.group(0)
    for method in ("memory", "tcp"):  # every tensor a row's workers sent (a round trip: two), each verified
        cells = [c for c in data["throughput"] + data["latency"] if c["method"] == method]
        assert {c["status"] for c in cells} == {"ok"}
        verified = sum(c["verified"] for c in cells)
        labels = {"method": method, "transport": method}
        assert verified > 0
        assert total(samples, "tensorbus_sent_tensors_total", role="producer", **labels) == verified
        assert total(samples, "tensorbus_received_tensors_total", role="consumer", **labels) == verified
        assert total(samples, "tensorbus_sent_bytes_total", role="producer", **labels) == verified * 4096
    assert not [name for name, labels in samples if dict(labels).get("method") == "socket"]  # (a baseline: none)
    assert not [name for name, _ in samples if name == "tensorbus_connections"]  # (the workers ended)


def test_without_the_flag_the_workers_count_nothing_and_the_table_says_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*TINY, "--transports", "tcp", "--latency-sizes", ""]) == 0
    assert "metrics" not in capsys.readouterr().out


def test_a_scrape_during_the_run_finds_the_live_endpoints() -> None:
    """Scraped between two steps (the progress callback runs there): the row's counts so far, its open
    connections among them."""
    exposition = BenchExposition()
    port = exposition.serve(0)
    seen: list[Samples] = []

    def scrape_once(done: int, planned: int, text: str) -> None:
        if not seen and "round" in text:  # (after a timed round: the pair is connected and has sent)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
                seen.append(parse(response.read().decode()))

    cfg = config.BenchConfig(
        transports=["tcp"], baselines=[], sizes=[4096], latency_sizes=[], repeats=2, budget_s=1.0, warmup_s=0.05,
        round_s=0.05, timeout_s=30.0,
    )  # fmt: skip
    results = Runner(cfg, scrape_once, exposition=exposition).run()
    assert results.environment["metrics"] == exposition.url and seen
    during = seen[0]
    assert total(during, "tensorbus_connections", method="tcp", role="consumer") >= 1  # (live: the sender's)
    assert 0 < total(during, "tensorbus_sent_tensors_total", method="tcp") <= results.cells[0].verified
