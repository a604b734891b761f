"""Turn `Results` into the terminal table (rich, or plain text), ratios, target verdicts, JSON and CSV."""

from __future__ import annotations

import csv
import datetime
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .config import format_size, parse_size
from .results import Cell, Method, Results

DISPLAY = {
    "socket": "bare socket",
    "zmq": "pyzmq",
    "zmq-recipe": "pyzmq send_array",
    "zmq-frame": "pyzmq one frame",
    "zmq-asyncio": "pyzmq.asyncio",
    "pickle": "pickle5",
    "pika": "raw pika (quorum queue)",
    "pika-classic": "raw pika (classic queue)",
    "kafka-python": "raw kafka-python",
    "confluent-kafka": "raw confluent-kafka",
}


def display(name: str) -> str:
    """The name a method goes by in the table and the plot."""
    return DISPLAY.get(name, name)


# -- numbers ------------------------------------------------------------------------------------


def fmt_gbps(value: float) -> str:
    """GB/s with about three significant digits."""
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    if value >= 0.1:
        return f"{value:.3f}"
    return f"{value:.4f}"


def fmt_rate(value: float) -> str:
    """Tensors per second: 12.3k/s."""
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{unit}/s"
    return f"{value:.3g}/s"


def fmt_us(value: float) -> str:
    """A duration in microseconds, as µs or ms."""
    return f"{value / 1000:.3g} ms" if value >= 10_000 else f"{value:.0f} µs"


# -- comparisons --------------------------------------------------------------------------------


@dataclass
class Ratio:
    """A tensorbus transport's median against a baseline's, at one size (throughput) or as RTT p50."""

    transport: str
    baseline: str
    metric: str  # "throughput" (higher is better) or "latency" (p50 RTT ratio, lower is better)
    size: str
    #: median of per-round ratios (round r of both ran in the same interleaved sweep)
    ratio: float
    #: ratio of the two medians
    ratio_of_medians: float


def ratios(results: Results) -> list[Ratio]:
    """Every ratio both sides of which were measured cleanly."""
    out: list[Ratio] = []
    for method in results.methods:
        for baseline in method.compare:
            for cell in (c for c in results.cells if c.method == method.name and c.ok):
                other = results.cell(baseline, cell.metric, cell.nbytes)
                if other is None or not other.ok:
                    continue
                if cell.metric == "throughput":
                    of_medians = cell.gbps / other.gbps  # type: ignore[operator]
                else:
                    of_medians = cell.percentile_us(50) / other.percentile_us(50)  # type: ignore[operator]
                paired = [a / b for a, b in zip(cell.rounds, other.rounds, strict=False)]
                value = statistics.median(paired) if paired else of_medians
                out.append(Ratio(method.name, baseline, cell.metric, format_size(cell.nbytes), value, of_medians))
    return out


@dataclass
class Target:
    """One speed target from the issues, and whether this run met it."""

    name: str
    verdict: str  # "met", "missed", "n/a"
    detail: str


def _ratio(found: list[Ratio], transport: str, baseline: str, metric: str, size: str) -> float | None:
    return next(
        (r.ratio for r in found if (r.transport, r.baseline, r.metric, r.size) == (transport, baseline, metric, size)),
        None,
    )


#: the rows that run on an event loop (`BenchConfig.event_loop` picks which)
ON_A_LOOP = ("tensorbus-aio", "zmq-asyncio")

#: what the verdict lines are (a missed goal is not a failed run: the exit status says that)
GOALS_TITLE = "tensorbus's speed goals (from its design issues), judged on this run:"


def targets(results: Results) -> list[Target]:
    """The speed goals, judged on this run's medians."""
    found = ratios(results)
    sizes = [format_size(n) for n in results.config.sizes]

    def judge(name: str, transport: str, baseline: str, metric: str, wanted: list[str], ok: Any) -> Target | None:
        if results.method(transport) is None or results.method(baseline) is None:
            return None  # not asked for in this run
        wanted = [s for s in wanted if s in sizes or metric == "latency"]
        values = {s: _ratio(found, transport, baseline, metric, s) for s in wanted}
        measured = {s: v for s, v in values.items() if v is not None}
        if not wanted or not measured:
            return Target(name, "n/a", f"{transport} or {display(baseline)} not measured cleanly at these sizes")
        detail = ", ".join(f"{s} {v:.2f}x" for s, v in measured.items())
        missing = [s for s in wanted if s not in measured]
        if any(not ok(v) for v in measured.values()):
            return Target(name, "missed", detail)
        if missing:
            return Target(name, "n/a", f"{detail}; not measured: {', '.join(missing)}")
        return Target(name, "met", detail)

    def from_size(limit: str) -> list[str]:
        return [s for s in sizes if parse_size(s) >= parse_size(limit)]

    found_targets = [
        judge("tcp ≥ 0.9x bare socket at 16MB and 256MB", "tcp", "socket", "throughput", ["16MB", "256MB"],
              lambda v: v >= 0.9),
        judge("tcp faster than pyzmq at every size from 64KB", "tcp", "zmq", "throughput", from_size("64KB"),
              lambda v: v > 1.0),
        judge("tcp 4KB round trip (p50) ≤ 1.5x bare socket's", "tcp", "socket", "latency", ["4KB"],
              lambda v: v <= 1.5),
        judge("tcp ≥ 0.8x bare socket at 4KB and 64KB", "tcp", "socket", "throughput", ["4KB", "64KB"],
              lambda v: v >= 0.8),
        judge("tcp ≥ 1.0x pyzmq's send_array recipe at every size", "tcp", "zmq-recipe", "throughput", sizes,
              lambda v: v >= 1.0),
        judge("tcp ≥ 0.6x bare pyzmq (one frame) at 4KB", "tcp", "zmq-frame", "throughput", ["4KB"],
              lambda v: v >= 0.6),
        judge("unix ≥ 1.0x tcp at every size", "unix", "tcp", "throughput", sizes, lambda v: v >= 1.0),
        judge("memory ≥ 1.0x tcp at every size", "memory", "tcp", "throughput", sizes, lambda v: v >= 1.0),
        judge("memory 4KB round trip (p50) ≤ tcp's", "memory", "tcp", "latency", ["4KB"], lambda v: v <= 1.0),
        judge("aio-tcp ≥ 0.8x tcp from 64KB", "aio-tcp", "tcp", "throughput", from_size("64KB"),
              lambda v: v >= 0.8),
        judge("aio-tcp ≥ 1.0x pyzmq.asyncio from 64KB", "aio-tcp", "zmq-asyncio", "throughput", from_size("64KB"),
              lambda v: v >= 1.0),
        judge("aio-tcp 4KB round trip (p50) ≤ 1.5x tcp's", "aio-tcp", "tcp", "latency", ["4KB"],
              lambda v: v <= 1.5),
        judge("amqp ≥ 0.9x raw pika on a quorum queue from 1MB", "amqp", "pika", "throughput", from_size("1MB"),
              lambda v: v >= 0.9),
        judge("amqp-quorum ≥ 0.9x raw pika on a quorum queue from 1MB", "amqp-quorum", "pika", "throughput",
              from_size("1MB"), lambda v: v >= 0.9),
        judge("kafka ≥ 0.9x raw kafka-python from 1MB", "kafka", "kafka-python", "throughput", from_size("1MB"),
              lambda v: v >= 0.9),
        judge("kafka-confluent ≥ 0.8x raw confluent-kafka at 4KB", "kafka-confluent", "confluent-kafka", "throughput",
              ["4KB"], lambda v: v >= 0.8),
        judge("kafka-confluent ≥ 1.0x raw confluent-kafka from 64KB", "kafka-confluent", "confluent-kafka",
              "throughput", [s for s in from_size("64KB") if parse_size(s) <= parse_size("16MB")], lambda v: v >= 1.0),
        judge("kafka-confluent ≥ 4x raw kafka-python at 4KB", "kafka-confluent", "kafka-python", "throughput", ["4KB"],
              lambda v: v >= 4.0),
        judge("shm ≥ 3x unix at 16MB and 256MB", "shm", "unix", "throughput", ["16MB", "256MB"], lambda v: v >= 3),
        judge("shm ≥ 1.5x unix at 1MB", "shm", "unix", "throughput", ["1MB"], lambda v: v >= 1.5),
        judge("shm with producer.empty ≥ 5x unix at 256MB", "shm-empty", "unix", "throughput", ["256MB"],
              lambda v: v >= 5),
        judge("shm 4KB round trip (p50) ≤ unix's", "shm", "unix", "latency", ["4KB"], lambda v: v <= 1.0),
    ]  # fmt: skip
    return [t for t in found_targets if t is not None]


# -- the table ----------------------------------------------------------------------------------


def _note(method: Method, cells: list[Cell]) -> str:
    if method.status != "ok":
        return f"{method.status}: {method.reason}"
    notes = []
    if method.in_process:
        notes.append("in-process (memory:// cannot cross processes)")
    for cell in cells:
        where = f"{format_size(cell.nbytes)}{' RTT' if cell.metric == 'latency' else ''}"
        if cell.error:
            notes.append(f"{where}: {cell.error}")
        if cell.failures:
            notes.append(f"{where}: {cell.failures} of {cell.verified} tensors failed verification ({cell.problem})")
    return "; ".join(notes)


def _throughput_text(cell: Cell | None, plain: bool) -> str:
    if cell is None:
        return "-"
    if not cell.rounds:
        return "error" if cell.error else "-"
    mark = "*" if cell.stopped_by else ""
    bad = f" ✗{cell.failures}" if cell.failures else ""
    sep = " " if plain else "\n"
    return f"{fmt_gbps(cell.gbps or 0)}{mark}{bad}{sep}({fmt_rate(cell.tensors_per_s or 0)})"


def table_rows(results: Results) -> tuple[list[str], list[tuple[Method, list[str]]]]:
    """Column headers and, per method, the cell texts (plain layout)."""
    cfg = results.config
    headers = ["method", *[format_size(n) for n in cfg.sizes]]
    for n in cfg.latency_sizes:
        headers += [f"RTT {format_size(n)} p50", "p99"]
    headers.append("note")
    rows = []
    for method in results.methods:
        cells = [c for c in results.cells if c.method == method.name]
        texts = [_throughput_text(results.cell(method.name, "throughput", n), True) for n in cfg.sizes]
        for n in cfg.latency_sizes:
            cell = results.cell(method.name, "latency", n)
            p50 = cell.percentile_us(50) if cell is not None else None
            p99 = cell.percentile_us(99) if cell is not None else None
            texts += [fmt_us(p50) if p50 is not None else "-", fmt_us(p99) if p99 is not None else "-"]
        texts.append(_note(method, cells))
        rows.append((method, texts))
    return headers, rows


def _title(results: Results) -> str:
    cfg, env = results.config, results.environment
    metrics = " · metrics on (their cost included)" if env.get("metrics") else ""
    return (
        f"tensorbus bench · {cfg.dtype} · {env.get('machine', '')} · loopback · "
        f"GB/s (tensors/s), median of up to {cfg.repeats} rounds · {results.duration_s:.0f} s{metrics}"
        f"{loop_note(results)}"
    )


def loop_note(results: Results) -> str:
    """ " · asyncio rows on ...", naming the event loop, when a row that ran runs on one; else ""."""
    if not any(m.impl in ON_A_LOOP and m.status == "ok" for m in results.methods):
        return ""
    return " · asyncio rows on " + ("uvloop" if results.config.event_loop == "uvloop" else "asyncio's own loop")


def _versions(results: Results) -> str:
    env = results.environment
    v = env.get("versions", {})
    parts = [f"{name} {v[key]}" for name, key in (("python", "python"), ("numpy", "numpy"), ("pyzmq", "zmq"),
             ("libzmq", "libzmq"), ("pika", "pika"), ("kafka-python", "kafka"),
             ("confluent-kafka", "confluent_kafka"), ("uvloop", "uvloop")) if key in v]  # fmt: skip
    brokers = "; ".join(env.get("brokers", {}).values()) or "none reached"
    return f"brokers: {brokers} · {', '.join(parts)}"


def render_plain(results: Results) -> str:
    """The whole report as plain text."""
    headers, rows = table_rows(results)
    body = [[display(m.name), *texts] for m, texts in rows]
    widths = [max(len(str(r[i])) for r in [headers, *body]) for i in range(len(headers) - 1)]
    lines = [_title(results), ""]
    lines.append("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=False)) + "  note")
    for row in body:
        lines.append("  ".join(t.ljust(w) for t, w in zip(row, widths, strict=False)) + "  " + row[-1])
    lines += ["", "* fewer timed rounds than asked: the cell's time budget or the broker cap stopped it"]
    lines += [_versions(results), ""]
    found = targets(results)
    lines += _ratio_lines(results) + [""] + ([GOALS_TITLE] if found else [])
    lines += [f"{t.verdict.upper():7} {t.name}: {t.detail}" for t in found]
    return "\n".join(lines)


def _ratio_lines(results: Results) -> list[str]:
    found = ratios(results)
    lines = [
        "tensorbus ÷ baseline (median of per-round ratios; throughput: higher is better; RTT p50: lower is better)"
    ]
    for transport, baseline in dict.fromkeys((r.transport, r.baseline) for r in found):
        parts = [f"{r.size}{' RTT' if r.metric == 'latency' else ''} {r.ratio:.2f}x" for r in found
                 if (r.transport, r.baseline) == (transport, baseline)]  # fmt: skip
        lines.append(f"  {transport} ÷ {display(baseline)}: " + ", ".join(parts))
    return lines


def print_report(results: Results) -> None:
    """Print the tables with rich, or as plain text when rich is not installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(render_plain(results))
        return
    from rich.markup import escape

    wide = sys.stdout.isatty() or "COLUMNS" in os.environ
    console = Console(width=None if wide else 200)  # a file or a pipe gets the whole table, unwrapped
    cfg = results.config
    table = Table(title=_title(results), title_justify="left", show_lines=True)
    table.add_column("method", no_wrap=True)
    for n in cfg.sizes:
        table.add_column(format_size(n), justify="right")
    for n in cfg.latency_sizes:
        table.add_column(f"RTT {format_size(n)}\np50", justify="right")
        table.add_column("p99", justify="right")
    table.add_column("note", overflow="fold", max_width=48)
    for method in results.methods:
        cells = [c for c in results.cells if c.method == method.name]
        texts = [_throughput_text(results.cell(method.name, "throughput", n), False) for n in cfg.sizes]
        for n in cfg.latency_sizes:
            cell = results.cell(method.name, "latency", n)
            for q in (50, 99):
                value = cell.percentile_us(q) if cell is not None else None
                texts.append(fmt_us(value) if value is not None else "-")
        label = escape(display(method.name))
        name = f"[bold]{label}[/bold]" if method.kind == "tensorbus" else f"[dim]{label}[/dim]"
        note = escape(_note(method, cells))
        style = "yellow" if method.status != "ok" else ("red" if any(c.failures or c.error for c in cells) else "")
        table.add_row(name, *texts, f"[{style}]{note}[/{style}]" if style and note else note)
    console.print(table)
    console.print("[dim]* fewer timed rounds than asked: the cell's time budget or the broker cap stopped it[/dim]")
    console.print(f"[dim]{escape(_versions(results))}[/dim]")
    _print_ratios(console, results)
    found = targets(results)
    if found:
        console.print(f"[dim]{GOALS_TITLE}[/dim]")
    for target in found:
        color = {"met": "green", "missed": "red"}.get(target.verdict, "yellow")
        console.print(f"[{color}]{target.verdict.upper():7}[/{color}] {escape(target.name)}: {escape(target.detail)}")


def _print_ratios(console: Any, results: Results) -> None:
    from rich.markup import escape
    from rich.table import Table

    found = ratios(results)
    if not found:
        return
    cfg = results.config
    table = Table(title="tensorbus ÷ baseline", title_justify="left")
    table.add_column("transport ÷ baseline", no_wrap=True)
    for n in cfg.sizes:
        table.add_column(format_size(n), justify="right")
    for n in cfg.latency_sizes:
        table.add_column(f"RTT {format_size(n)}", justify="right")
    for transport, baseline in dict.fromkeys((r.transport, r.baseline) for r in found):
        texts = []
        for metric, sizes in (("throughput", cfg.sizes), ("latency", cfg.latency_sizes)):
            for n in sizes:
                value = _ratio(found, transport, baseline, metric, format_size(n))
                if value is None:
                    texts.append("-")
                    continue
                good = value >= 1 if metric == "throughput" else value <= 1
                fair = value >= 0.9 if metric == "throughput" else value <= 1.5
                color = "green" if good else ("yellow" if fair else "red")
                texts.append(f"[{color}]{value:.2f}x[/{color}]")
        table.add_row(escape(f"{transport} ÷ {display(baseline)}"), *texts)
    console.print(table)
    console.print("[dim]median of per-round ratios; throughput: higher is better, RTT p50: lower is better[/dim]")


# -- files --------------------------------------------------------------------------------------


def _requested(results: Results) -> list[tuple[Method, str, int]]:
    cfg = results.config
    return [
        (m, metric, n)
        for m in results.methods
        for metric, sizes in (("throughput", cfg.sizes), ("latency", cfg.latency_sizes))
        for n in sizes
    ]


def _status(method: Method, cell: Cell | None) -> str:
    if method.status != "ok":
        return method.status
    if cell is None or cell.error:
        return "error"
    return "failed-verification" if cell.failures else "ok"


def to_dict(results: Results) -> dict[str, Any]:
    """Everything the run measured, JSON-ready."""
    started = datetime.datetime.fromtimestamp(results.started, datetime.timezone.utc).isoformat(timespec="seconds")
    cells = []
    for method, metric, n in _requested(results):
        cell = results.cell(method.name, metric, n)
        entry = cell.as_dict() if cell is not None else {"method": method.name, "metric": metric,
                                                         "size": format_size(n), "size_bytes": n}  # fmt: skip
        entry["status"] = _status(method, cell)
        entry["kind"] = method.kind
        cells.append(entry)
    return {
        "started": started,
        "duration_s": round(results.duration_s, 1),
        "environment": results.environment,
        "config": results.config.as_dict(),
        "methods": [asdict(m) for m in results.methods],
        "throughput": [c for c in cells if c["metric"] == "throughput"],
        "latency": [c for c in cells if c["metric"] == "latency"],
        "ratios": [asdict(r) for r in ratios(results)],
        "targets": [asdict(t) for t in targets(results)],
    }


def write_json(results: Results, path: str | Path) -> None:
    """Write `to_dict(results)` to `path`."""
    Path(path).write_text(json.dumps(to_dict(results), indent=2, ensure_ascii=False) + "\n")


CSV_FIELDS = [
    "method", "kind", "metric", "size", "size_bytes", "status", "gbps_median", "gbps_min", "gbps_max",
    "tensors_per_s", "p50_us", "p99_us", "rounds", "tensors_per_round", "verified", "failures", "note",
]  # fmt: skip


def write_csv(results: Results, path: str | Path) -> None:
    """One row per requested (method, metric, size), skipped ones included."""
    data = to_dict(results)
    notes = {m["name"]: m["reason"] for m in data["methods"]}
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in data["throughput"] + data["latency"]:
            note = row.get("error") or row.get("problem") or notes.get(row["method"], "")
            writer.writerow({**row, "note": note or ""})
