"""The PNG: throughput against tensor size (log-log, baselines dashed) and round-trip latency."""

from __future__ import annotations

from pathlib import Path

from .config import format_size
from .report import display, loop_note
from .results import Results

#: one colour per method, the same in both panels; tensorbus transports get the strong colours
COLORS = {
    "memory": "#7f7f7f",
    "tcp": "#1f77b4",
    "unix": "#2ca02c",
    "shm": "#000000",
    "shm-empty": "#393b79",
    "amqp": "#ff7f0e",
    "amqp-quorum": "#ff7f0e",
    "amqp-classic": "#bcbd22",
    "kafka": "#d62728",
    "socket": "#17becf",
    "zmq": "#9467bd",
    "zmq-recipe": "#c5b0d5",
    "zmq-frame": "#7b4173",
    "pickle": "#8c564b",
    "pika": "#e3a857",
    "pika-classic": "#c49a6c",
    "kafka-python": "#e377c2",
}


def write_plot(results: Results, path: str | Path) -> None:
    """Draw both panels into `path` (PNG) with matplotlib's Agg canvas, without touching pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    cfg = results.config
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, width_ratios=[1.35, 1])
    measured = [m for m in results.methods if m.status == "ok"]

    for method in measured:
        points = [
            (cell.nbytes, cell.gbps)
            for n in cfg.sizes
            if (cell := results.cell(method.name, "throughput", n)) is not None and cell.gbps is not None
        ]
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        baseline = method.kind == "baseline"
        left.plot(
            xs,
            ys,
            linestyle="--" if baseline else "-",
            marker="o" if not baseline else "s",
            markersize=4 if baseline else 5,
            linewidth=1.3 if baseline else 2.2,
            color=COLORS.get(method.name),
            alpha=0.85 if baseline else 1.0,
            label=display(method.name) + (" (baseline)" if baseline else ""),
        )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(cfg.sizes, [format_size(n) for n in cfg.sizes])
    left.xaxis.set_minor_locator(NullLocator())
    left.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    left.yaxis.set_minor_locator(NullLocator())
    left.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    left.set_xlabel(f"tensor size ({cfg.dtype})")
    left.set_ylabel("throughput, GB/s (median of rounds)")
    left.set_title("Throughput: producer → consumer, separate processes")
    left.grid(True, which="major", alpha=0.3)
    left.legend(fontsize=8, loc="lower right", ncol=2)

    bars = []
    for method in measured:
        for n in cfg.latency_sizes:
            cell = results.cell(method.name, "latency", n)
            p50 = cell.percentile_us(50) if cell is not None else None
            p99 = cell.percentile_us(99) if cell is not None else None
            if p50 is not None and p99 is not None:
                suffix = f" {format_size(n)}" if len(cfg.latency_sizes) > 1 else ""
                bars.append((display(method.name) + suffix, method, p50, p99))
    if bars:
        positions = range(len(bars))
        for i, (_, method, p50, p99) in zip(positions, bars, strict=False):
            color = COLORS.get(method.name)
            hatch = "//" if method.kind == "baseline" else None
            right.bar(i - 0.2, p50, width=0.4, color=color, hatch=hatch, edgecolor="black", linewidth=0.5)
            right.bar(i + 0.2, p99, width=0.4, color=color, alpha=0.45, hatch=hatch, edgecolor="black", linewidth=0.5)
            right.annotate(f"{p50:.0f}", (i - 0.2, p50), ha="center", va="bottom", fontsize=7)
        right.set_xticks(list(positions), [label for label, *_ in bars], rotation=35, ha="right", fontsize=8)
        right.set_yscale("log")
        right.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        right.yaxis.set_minor_locator(NullLocator())
        right.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        right.set_ylabel("round trip, µs (log)")
        sizes = ", ".join(format_size(n) for n in cfg.latency_sizes)
        right.set_title(f"Round trip of a {sizes} tensor: p50 (solid), p99 (light)")
        right.grid(True, axis="y", which="major", alpha=0.3)
    else:
        right.text(0.5, 0.5, "no latency measured", ha="center", va="center", transform=right.transAxes)
        right.set_axis_off()
    env = results.environment
    fig.suptitle(
        f"tensorbus bench · {cfg.dtype} · {env.get('machine', '')} · loopback · medians of up to {cfg.repeats} "
        f"rounds · dashed/hatched = baselines{loop_note(results)}",
        fontsize=11,
    )
    fig.savefig(path, dpi=110)
