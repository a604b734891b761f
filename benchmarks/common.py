"""Helpers shared by the benchmarks: sizes, interleaved timing with medians, tables and JSON output.

The machine these run on is shared and noisy (single rounds vary by about ±30 %), so every benchmark
follows the same recipe:

1. warm up each case (first calls allocate, import and fault pages in);
2. calibrate, per case, how many operations one sample needs to last at least `min_sample_s`;
3. run `rounds` rounds; within a round every case takes one sample, in an order rotated each round,
   so slow phases of the machine hit all cases alike;
4. report medians over rounds, and ratios as the median of per-round (paired) ratios.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}


def parse_size(text: str) -> int:
    """Parse a byte count such as `4K`, `64KB`, `16M`, `1G` or `4096` (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if match is None:
        raise ValueError(f"not a size: {text!r} (expected e.g. 4K, 64KB, 16M, 1G)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def parse_sizes(text: str) -> list[int]:
    """Parse a comma-separated list of sizes (see `parse_size`)."""
    return [parse_size(part) for part in text.split(",") if part.strip()]


def format_size(n: int) -> str:
    """Format a byte count the way the sizes are written on the command line: `4 KB`, `16 MB`."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


@dataclass
class Stats:
    """Summary of one case's samples (seconds per operation)."""

    samples: list[float]
    median: float = field(init=False)
    q1: float = field(init=False)
    q3: float = field(init=False)

    def __post_init__(self) -> None:
        ordered = sorted(self.samples)
        self.median = statistics.median(ordered)
        if len(ordered) >= 2:
            self.q1, _, self.q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        else:
            self.q1 = self.q3 = ordered[0]

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median (0.1 means the middle half lies within 10 %)."""
        return (self.q3 - self.q1) / self.median if self.median > 0 else 0.0


def time_calls(fn: Callable[[], object], n: int) -> float:
    """Run `fn` `n` times with the garbage collector off; return seconds per call."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - start
    finally:
        if gc_was_enabled:
            gc.enable()
    return elapsed / n


def calibrate(fn: Callable[[], object], min_sample_s: float, max_calls: int = 1_000_000) -> int:
    """How many calls of `fn` one sample needs to last at least `min_sample_s` (at least 1)."""
    n = 1
    while True:
        per_call = time_calls(fn, n)
        if per_call * n >= min_sample_s or n >= max_calls:
            return n
        # aim 20 % past the target, growing at most 100x per step in case the first calls were slow
        n = min(max_calls, max(n + 1, min(n * 100, math.ceil(1.2 * min_sample_s / max(per_call, 1e-9)))))


def run_interleaved(
    cases: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    warmup: int = 2,
    min_sample_s: float = 0.03,
    between: Callable[[], None] | None = None,
) -> dict[str, Stats]:
    """Time every case in every round, rotating the order each round; return seconds per call.

    `between` runs (untimed) after each sample, e.g. to drop references to large buffers.
    """
    names = list(cases)
    for name in names:
        for _ in range(warmup):
            cases[name]()
    counts = {name: calibrate(cases[name], min_sample_s) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        gc.collect()
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(time_calls(cases[name], counts[name]))
            if between is not None:
                between()
    return {name: Stats(values) for name, values in samples.items()}


def paired_ratio(a: Stats, b: Stats) -> float:
    """Median over rounds of b_time / a_time, i.e. how many times faster `a` is than `b` (same round)."""
    return statistics.median(tb / ta for ta, tb in zip(a.samples, b.samples, strict=True))


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, core count, Python and library versions."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["load_avg"] = os.getloadavg()
    except OSError:
        pass
    return info


def package_versions(names: Sequence[str]) -> dict[str, str]:
    """Installed versions of the given distributions ("missing" when not installed)."""
    from importlib import metadata

    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    markdown: bool = False,
    caption: str | None = None,
) -> None:
    """Print a table with rich when it is installed (numbers right-aligned), as plain text otherwise."""
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        _print_plain_table(title, columns, rows, caption)
        return
    table = Table(box=box.MARKDOWN if markdown else box.SIMPLE_HEAVY, caption=caption, caption_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console = Console()
    if console.width < 140 and not console.is_terminal:  # piped into a file: don't wrap at 80
        console = Console(width=140)
    console.print(f"\n{title}", style="bold", markup=False, highlight=False)
    console.print(table)


def _print_plain_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], caption: str | None) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(columns, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        return "  ".join([first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))])

    print(title)
    print(line(columns))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))
    if caption:
        print(caption)
    print()


def thread_stats(pid: int | str = "self") -> dict[int, tuple[str, float, int]]:
    """Each live thread of a process, by id (/proc): its name, its CPU seconds (the scheduler's nanosecond
    count, not clock ticks) and its minor page faults."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                cpu = int(f.read().split()[0]) / 1e9
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # (ended meanwhile)
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]  # (a thread's name may hold spaces and parentheses)
        found[int(tid)] = (name, cpu, int(stat[stat.rindex(")") + 2 :].split()[7]))
    return found


def process_cpu_s(pid: int | str = "self") -> float:
    """CPU seconds (user and system) a process has used, its ended threads' included (/proc/PID/stat, in
    clock ticks)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()  # (the command name may hold spaces)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_json(path: str | Path, data: Any) -> None:
    """Write results as indented JSON (dataclasses become dicts)."""

    def default(obj: Any) -> Any:
        if hasattr(obj, "__dataclass_fields__"):
            return asdict(obj)
        raise TypeError(f"cannot serialise {type(obj).__name__}")

    Path(path).write_text(json.dumps(data, indent=2, default=default) + "\n", encoding="utf-8")
