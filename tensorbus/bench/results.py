"""What a benchmark run produces: the methods it tried and one `Cell` per (method, metric, size)."""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..transports import resolve_transport
from .config import BenchConfig, format_size


@dataclass
class Method:
    """A tensorbus transport or a baseline, as the table and the plot name it."""

    name: str
    kind: str  # "tensorbus" or "baseline"
    impl: str  # which Link runs it (see links.IMPLEMENTATIONS)
    family: str  # memory, tcp, unix, amqp, kafka
    url: str
    in_process: bool = False
    chunk_bytes: int | None = None
    #: the baselines this tensorbus transport is held against
    compare: list[str] = field(default_factory=list)
    status: str = "ok"  # ok, skipped, failed
    reason: str = ""

    @property
    def through_broker(self) -> bool:
        """Whether its tensors go through a broker (its family's transport `persists` them: amqp, kafka):
        rounds, budgets and cleanup of their own."""
        return _persists(self.family)


@dataclass
class Cell:
    """One method at one tensor size: throughput rounds (GB/s) or round-trip samples (seconds)."""

    method: str
    metric: str  # "throughput" or "latency"
    nbytes: int
    rounds: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)
    tensors_per_round: int = 0
    verified: int = 0
    failures: int = 0
    problem: str | None = None
    error: str | None = None
    stopped_by: str | None = None  # "budget" or "cap" when fewer rounds than asked for ran
    spent_s: float = 0.0
    peak_rss_mib: float | None = None

    @property
    def ok(self) -> bool:
        """Measured, and nothing went wrong."""
        return bool(self.rounds) and self.error is None and self.failures == 0

    @property
    def gbps(self) -> float | None:
        """Median throughput over the timed rounds, GB/s (1e9 bytes of tensor data per second)."""
        return statistics.median(self.rounds) if self.metric == "throughput" and self.rounds else None

    @property
    def tensors_per_s(self) -> float | None:
        """Median tensors per second."""
        gbps = self.gbps
        return None if gbps is None else gbps * 1e9 / self.nbytes

    def percentile_us(self, q: float) -> float | None:
        """Round-trip time percentile over all timed samples, microseconds."""
        if self.metric != "latency" or not self.samples:
            return None
        return float(np.percentile(np.asarray(self.samples), q)) * 1e6

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (latency samples are summarised, not listed)."""
        out: dict[str, Any] = {
            "method": self.method,
            "metric": self.metric,
            "size": format_size(self.nbytes),
            "size_bytes": self.nbytes,
            "rounds": len(self.rounds),
            "tensors_per_round": self.tensors_per_round,
            "verified": self.verified,
            "failures": self.failures,
            "problem": self.problem,
            "error": self.error,
            "stopped_by": self.stopped_by,
            "spent_s": round(self.spent_s, 3),
            "peak_rss_mib": None if self.peak_rss_mib is None else round(self.peak_rss_mib, 1),
        }
        if self.metric == "throughput":
            out["gbps_median"] = self.gbps
            out["gbps_min"] = min(self.rounds) if self.rounds else None
            out["gbps_max"] = max(self.rounds) if self.rounds else None
            out["tensors_per_s"] = self.tensors_per_s
            out["gbps_rounds"] = [round(r, 6) for r in self.rounds]
        else:
            out["p50_us"] = self.percentile_us(50)
            out["p99_us"] = self.percentile_us(99)
            out["samples"] = len(self.samples)
            out["round_p50_us"] = [round(r * 1e6, 2) for r in self.rounds]
        return out


@dataclass
class Results:
    """A whole run."""

    config: BenchConfig
    methods: list[Method]
    cells: list[Cell] = field(default_factory=list)
    started: float = 0.0
    duration_s: float = 0.0
    environment: dict[str, Any] = field(default_factory=dict)

    def cell(self, method: str, metric: str, nbytes: int) -> Cell | None:
        """The cell of `method` at `nbytes` for `metric`, if it was attempted."""
        for cell in self.cells:
            if cell.method == method and cell.metric == metric and cell.nbytes == nbytes:
                return cell
        return None

    def method(self, name: str) -> Method | None:
        """The method called `name`."""
        return next((m for m in self.methods if m.name == name), None)


@functools.cache
def _persists(family: str) -> bool:
    """Whether the transport of a method family (its URL scheme) keeps frames in a broker."""
    try:
        transport, _ = resolve_transport(f"{family}://bench")
    except ConfigError:
        return False
    return transport.persists
