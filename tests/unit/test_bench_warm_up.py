"""`tensorbus bench`'s warm-up sizes the timed rounds from steady work, not from a client's one-off setup.

A fake pair of workers on a fake clock: each step costs a fixed `STEP_S` plus `PER_TENSOR_S` a tensor, and the
first (the probe) also a one-off `SETUP_S`, as a kafka:// producer's first send connects its client.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from tensorbus.bench import runner
from tensorbus.bench.config import BenchConfig
from tensorbus.bench.results import Method

SETUP_S, STEP_S, PER_TENSOR_S = 0.35, 0.01, 20e-6


class FakePair:
    """A producer and consumer worker pair whose steps take time on the fake clock `now`."""

    def __init__(self, now: list[float], setup_s: float) -> None:
        self.now, self.setup_s = now, setup_s
        self.method = Method("fake", "tensorbus", "tensorbus", "kafka", "kafka://127.0.0.1:9092")
        self.broken: str | None = None
        self.next_index = 0
        self.sizes: list[int] = []  # the tensors of each step, in order
        self._n = 0

    def send(self, role: str, command: str, **args: Any) -> None:
        self._n = args["n"]

    def wait(self, role: str, command: str, timeout: float) -> dict[str, Any]:
        if role == "A":  # (the sender's report: its step starts now)
            return {"t_start": self.now[0]}
        if not self.sizes:
            self.now[0] += self.setup_s
        self.sizes.append(self._n)
        self.now[0] += STEP_S + self._n * PER_TENSOR_S
        return {"t_last": self.now[0], "peak_rss_mib": 1.0, "failures": 0, "problem": None}


@pytest.mark.parametrize("setup_s", [0.0, SETUP_S], ids=["no setup", "a one-off setup"])
def test_rounds_are_sized_from_steady_steps_whatever_the_probe_cost(
    monkeypatch: pytest.MonkeyPatch, setup_s: float
) -> None:
    now = [0.0]
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(monotonic=lambda: now[0]))  # (the runner's alone)
    config = BenchConfig(repeats=3, budget_s=30.0, warmup_s=0.3, broker_round_s=0.5, max_tensors_per_round=100_000)
    pair = FakePair(now, setup_s)
    bench = runner.Runner(config)
    bench._measure([pair], 4096, "throughput")  # type: ignore[list-item]
    cell = bench.results.cells[0]
    steady = round(0.5 / (PER_TENSOR_S + STEP_S / 15_000))  # (a step of ~0.3 s: the fixed cost is a few %)
    assert cell.tensors_per_round >= 0.9 * steady  # (a probe of 0.35 s sized rounds of ~1,300 tensors)
    assert len(pair.sizes) <= 2 + runner.WARM_UPS + 3 and len(cell.rounds) == 3
