"""Drive the benchmark: plan the methods, run worker pairs, interleave timed rounds within budgets.

For each tensor size every method first gets a probe and a warm-up (untimed), then the timed rounds
run interleaved: round 1 of every method, round 2 of every method (in rotated order), ... so that
a slow spell of the machine hits all methods alike; each transport's round is followed by those of
the baselines it is compared with (`plan.round_order`), except in the round whose rotation starts
between them. A cell stops when its next round would overrun
its time budget (after at least one timed round). Every wait on a worker has a deadline; a worker
pair that misses one is killed, its cell marked, and the pair restarted for the next size.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import plan
from .config import BenchConfig, format_size
from .pairs import Pair, StepFailed
from .results import Cell, Method, Results

if TYPE_CHECKING:
    from .exposition import BenchExposition

Progress = Callable[[int, int, str], None]
_GRACE_S = 5.0


@dataclass
class _CellRun:
    """Bookkeeping for one cell while its rounds are interleaved with other cells'."""

    pair: Pair
    cell: Cell
    target: int
    #: seconds this cell may take, warm-up included
    budget: float
    #: seconds this cell's own steps took (other cells' interleaved rounds do not count)
    spent: float = 0.0
    wall_per_tensor: float = 0.0
    n: int = 1
    done: bool = False


#: warm-up steps a cell takes at most (`Runner._warm_up`)
WARM_UPS = 3


def _probe_count(nbytes: int, metric: str) -> int:
    return 20 if metric == "latency" else max(1, min(64, (1 << 20) // nbytes))


class Runner:
    """Runs a `BenchConfig`, reporting progress as (steps done, steps planned, what is running)."""

    def __init__(
        self,
        config: BenchConfig,
        progress: Progress | None = None,
        verbose: bool = False,
        exposition: BenchExposition | None = None,
    ) -> None:
        self.config = config
        self.exposition = exposition  # with `--metrics-port`: the endpoints' metrics on, served from here
        self.progress = progress or (lambda done, total, text: None)
        self.verbose = verbose
        self.run_id = uuid.uuid4().hex[:8]
        self.pairs: dict[str, Pair] = {}
        self.generation = itertools.count()
        self.results = Results(config=config, methods=[])
        self._done = self._total = 0

    # -- worker pairs ---------------------------------------------------------------------------

    def _spec(self, method: Method) -> dict[str, Any]:
        tag = f"{self.run_id}-{re.sub(r'[^A-Za-z0-9]+', '-', method.name).strip('-')}-{next(self.generation)}"
        return {
            "method": method.name,
            "impl": method.impl,
            "url": method.url,
            "tag": tag,
            "dtype": self.config.dtype,
            "verify": self.config.verify,
            "event_loop": self.config.event_loop,
            "timeout_s": self.config.timeout_s,
            "chunk_bytes": method.chunk_bytes,
            "verbose": self.verbose,
            "metrics": self.exposition is not None,
        }

    def _start(self, methods: list[Method]) -> None:
        """Spawn every pair at once (imports overlap), then open and connect each; failures skip the method."""
        fresh = []
        for method in methods:
            if method.status == "ok" and method.name not in self.pairs:
                pair = Pair(method, self._spec(method), self.exposition)
                pair.start()
                self.pairs[method.name] = pair
                fresh.append(pair)
        timeout = self.config.timeout_s
        for pair in fresh:
            try:
                pair.send("B", "open")
                pair.send("A", "open")
                pair.opened = True
                address_b = pair.wait("B", "open", timeout)
                address_a = pair.wait("A", "open", timeout)
                pair.send("A", "connect", address=address_b)
                pair.send("B", "connect", address=address_a)
                pair.wait("A", "connect", timeout)
                pair.wait("B", "connect", timeout)
            except StepFailed as exc:
                pair.broken = str(exc)
                pair.kill()
                del self.pairs[pair.method.name]
                measured = any(cell.method == pair.method.name for cell in self.results.cells)
                pair.method.status = "failed" if measured else "skipped"  # failed: restarting after an error
                pair.method.reason = f"setup failed: {exc}"

    def _restart_broken(self, methods: list[Method]) -> None:
        for method in methods:
            pair = self.pairs.get(method.name)
            if pair is not None and pair.broken:
                pair.kill()
                del self.pairs[method.name]
        self._start(methods)

    # -- measuring ------------------------------------------------------------------------------

    def run(self) -> Results:
        """Run everything; worker processes are always stopped before this returns or raises."""
        cfg = self.config
        results = self.results
        results.started = time.time()
        t0 = time.monotonic()
        results.methods = plan.plan(cfg)
        results.environment = plan.environment(cfg, results.methods)
        if self.exposition is not None:
            results.environment["metrics"] = self.exposition.url
        sizes = sorted(set(cfg.sizes) | set(cfg.latency_sizes))
        try:
            self._start(results.methods)
            live = [m for m in results.methods if m.status == "ok"]
            cells = [(n, "throughput") for n in cfg.sizes] + [(n, "latency") for n in cfg.latency_sizes]
            self._total = sum(2 + self._rounds_and_budget(m, n, metric)[0] for m in live for n, metric in cells)
            order = plan.round_order(results.methods)
            for nbytes in sizes:
                self._restart_broken(results.methods)
                pairs = [self.pairs[m.name] for m in order if m.status == "ok" and m.name in self.pairs]
                self._prepare(pairs, nbytes)
                if nbytes in cfg.sizes:
                    self._measure(pairs, nbytes, "throughput")
                if nbytes in cfg.latency_sizes:
                    self._measure(pairs, nbytes, "latency")
                for pair in pairs:
                    if not pair.broken:
                        try:
                            pair.call("A", "release", cfg.timeout_s)
                            pair.call("B", "release", cfg.timeout_s)
                        except StepFailed as exc:
                            pair.broken = str(exc)
        except BaseException:  # Ctrl-C or a bug: workers may be mid-step, do not wait for them
            for pair in self.pairs.values():
                pair.broken = pair.broken or "interrupted"
            raise
        finally:
            for pair in self.pairs.values():  # ask all at once, then wait: broker cleanup runs in parallel
                pair.request_close()
            for pair in self.pairs.values():
                pair.finish_close(15.0)
            self.pairs.clear()
        results.duration_s = time.monotonic() - t0
        return results

    def _large_broker_cell(self, method: Method, nbytes: int, metric: str) -> bool:
        """A broker throughput cell from `broker_cap_from` up: rounds, budget and round size of its own."""
        return metric == "throughput" and method.through_broker and nbytes >= self.config.broker_cap_from

    def _rounds_and_budget(self, method: Method, nbytes: int, metric: str) -> tuple[int, float]:
        """The timed rounds a cell asks for and its time budget (`broker_max_rounds` and
        `broker_budget_s` for a large broker cell)."""
        cfg = self.config
        if self._large_broker_cell(method, nbytes, metric):
            return min(cfg.repeats, cfg.broker_max_rounds), cfg.broker_budget_s
        return cfg.repeats, cfg.budget_s

    def _tensors_per_round(self, method: Method, nbytes: int, metric: str, wall_per_tensor: float) -> int:
        """Enough tensors for a round of about `round_s` (`broker_round_s`); a large broker cell's
        round carries at least `broker_round_bytes`, so that every round of every method takes its
        share of the broker's periodic work (a quorum queue's log rolling over) and not every other one."""
        cfg = self.config
        round_s = cfg.broker_round_s if method.through_broker else cfg.round_s
        n = max(1, min(cfg.max_tensors_per_round, round(round_s / max(wall_per_tensor, 1e-9))))
        if self._large_broker_cell(method, nbytes, metric):
            n = max(n, min(cfg.max_tensors_per_round, -(-cfg.broker_round_bytes // nbytes)))
        return n

    def _tick(self, steps: int, text: str) -> None:
        self._done += steps
        self._total = max(self._total, self._done)
        self.progress(self._done, self._total, text)

    def _prepare(self, pairs: list[Pair], nbytes: int) -> None:
        """Make the sender's tensors and the receiver's buffers for this size (a failure breaks the pair)."""
        for pair in pairs:
            try:
                crcs = pair.call("A", "prepare", self.config.timeout_s, nbytes=nbytes)
                pair.call("B", "prepare", self.config.timeout_s, nbytes=nbytes, crcs=crcs)
            except StepFailed as exc:
                self._fail(pair, exc)

    def _fail(self, pair: Pair, exc: Exception) -> None:
        pair.broken = str(exc)
        pair.kill()

    def _measure(self, pairs: list[Pair], nbytes: int, metric: str) -> None:
        """Probe and warm up every pair, then run their timed rounds interleaved."""
        cfg = self.config
        runs: list[_CellRun] = []
        for pair in pairs:
            cell = Cell(pair.method.name, metric, nbytes)
            self.results.cells.append(cell)
            run = _CellRun(pair, cell, *self._rounds_and_budget(pair.method, nbytes, metric))
            label = f"{format_size(nbytes)} {metric}: {pair.method.name}"
            if pair.broken:
                cell.error = f"not measured: {pair.broken}"
                self._tick(2 + run.target, label)
                continue
            try:
                n = _probe_count(nbytes, metric)
                self._step(run, n, cfg.timeout_s, timed=False)
                self._tick(1, f"{label} probe")
                if run.target == cfg.repeats:  # (a capped broker cell: the probe was the warm-up)
                    self._warm_up(run)
                self._tick(1, f"{label} warm-up")
            except StepFailed as exc:
                cell.error = str(exc)
                self._fail(pair, exc)
                self._tick(run.target, label)
                continue
            run.n = self._tensors_per_round(pair.method, nbytes, metric, run.wall_per_tensor)
            cell.tensors_per_round = run.n
            runs.append(run)
        for r in range(max((run.target for run in runs), default=0)):
            for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
                if run.done or r >= run.target:
                    continue
                label = f"{format_size(nbytes)} {metric}: {run.pair.method.name} round {r + 1}/{run.target}"
                if r >= 1 and run.spent + run.n * run.wall_per_tensor > run.budget:
                    run.done, run.cell.stopped_by = True, "budget"
                    self._tick(run.target - r, label)
                    continue
                try:
                    self._step(run, run.n, self._timeout(run, run.n), timed=True)
                except StepFailed as exc:
                    run.cell.error, run.done = str(exc), True
                    self._fail(run.pair, exc)
                    self._tick(run.target - r, label)
                    continue
                self._tick(1, label)
        for run in runs:
            run.cell.spent_s = run.spent
            if run.cell.stopped_by is None and run.target < cfg.repeats:
                run.cell.stopped_by = "cap"

    def _warm_up(self, run: _CellRun) -> None:
        """Warm-up steps of about `warmup_s`, each sized from the step before (the probe first), until one lasts at
        least half that (WARM_UPS at most). A probe slowed by a one-off setup (a client's first connection: ~0.35 s
        for kafka:// on librdkafka) sizes the first too small, and a short step's time is mostly the fixed cost
        of a round, which sized the timed rounds too small in turn: a third to a fifth of the other side's."""
        cfg = self.config
        for _ in range(WARM_UPS):
            n_warm = min(cfg.max_tensors_per_round, int(cfg.warmup_s / max(run.wall_per_tensor, 1e-9)))
            if n_warm < 1:
                return
            self._step(run, n_warm, self._timeout(run, n_warm), timed=False)
            if n_warm * run.wall_per_tensor >= cfg.warmup_s / 2 or n_warm == cfg.max_tensors_per_round:
                return

    def _timeout(self, run: _CellRun, n: int) -> float:
        return min(self.config.timeout_s, max(10.0, 10 * n * run.wall_per_tensor + 5))

    def _step(self, run: _CellRun, n: int, timeout: float, *, timed: bool) -> None:
        """One round of n tensors (or n round trips); updates the cell and the time-per-tensor estimate."""
        pair, cell = run.pair, run.cell
        first = pair.next_index
        pair.next_index += n
        started = time.monotonic()
        if cell.metric == "throughput":
            pair.send("B", "recv", n=n, first=first, timeout=timeout)
            pair.send("A", "send", n=n, first=first, timeout=timeout)
            sent = pair.wait("A", "send", timeout + _GRACE_S)
            got = pair.wait("B", "recv", timeout + _GRACE_S)
            elapsed = max(got["t_last"] - sent["t_start"], 1e-9)
            if timed:
                cell.rounds.append(n * cell.nbytes / elapsed / 1e9)
            cell.peak_rss_mib = got["peak_rss_mib"]
            failures, problem = got["failures"], got["problem"]
        else:
            pair.send("B", "echo", n=n, first=first, timeout=timeout)
            pair.send("A", "ping", n=n, first=first, timeout=timeout)
            pinged = pair.wait("A", "ping", timeout + _GRACE_S)
            echoed = pair.wait("B", "echo", timeout + _GRACE_S)
            if timed:
                cell.samples.extend(pinged["rtts"])
                cell.rounds.append(sorted(pinged["rtts"])[len(pinged["rtts"]) // 2])
            failures = pinged["failures"] + echoed["failures"]
            problem = pinged["problem"] or echoed["problem"]
        cell.verified += n if cell.metric == "throughput" else 2 * n  # a round trip verifies at both ends
        cell.failures += failures
        cell.problem = cell.problem or problem
        wall = time.monotonic() - started
        run.spent += wall
        run.wall_per_tensor = wall / n
