"""Where a kafka:// fan-out round's CPU goes: each subscriber thread's CPU and minor faults, and the broker's CPU.

What it measures
    The layout of `tensorbus bench --fanout` (its `_Side`: a publisher here, N subscriber processes per method,
    kafka:// against raw kafka-python, rounds alternating which goes first) on the single-node Kafka. Per timed
    round and per subscriber process: CPU time and minor page faults of its main thread, of its busiest other
    thread (kafka-python's I/O thread, in both), and of the rest (kafka://: its reading thread, which reassembles;
    raw: nothing much, its main thread polls). Also the broker's CPU in the round, when the broker is a process
    on this machine (`--broker-pid`, default: the pid file scripts/brokers.sh writes): the compacted topic's log
    cleaner works there for kafka:// only. Load disturbs CPU time and faults less than wall time.

Run
    python -m benchmarks.fanout_threads [--size-mb 256] [--subscribers 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np

from tensorbus.bench import fanout

from .common import process_cpu_s, thread_stats

BROKER_PID_FILE = Path(__file__).resolve().parent.parent / ".brokers" / "kafka" / "kafka.pid"


def threads(pid: int) -> dict[int, tuple[float, int]]:
    """Each thread of a process: (CPU seconds from the scheduler's nanosecond count, minor faults)."""
    return {tid: (cpu, faults) for tid, (_, cpu, faults) in thread_stats(pid).items()}


def process_cpu(pid: int | None) -> float | None:
    """A process's CPU seconds so far, None if it cannot be read."""
    if pid is None:
        return None
    try:
        return process_cpu_s(pid)
    except OSError:
        return None


def by_role(
    pid: int, before: dict[int, tuple[float, int]], after: dict[int, tuple[float, int]]
) -> dict[str, tuple[float, int]]:
    """One process's CPU seconds and faults in a round: its main thread, its busiest other thread, the rest."""
    spent = {tid: (c - before.get(tid, (0.0, 0))[0], f - before.get(tid, (0.0, 0))[1]) for tid, (c, f) in after.items()}
    others = sorted((tid for tid in spent if tid != pid), key=lambda tid: after[tid][0], reverse=True)
    rest = [spent[tid] for tid in others[1:]]
    return {
        "main": spent.get(pid, (0.0, 0)),
        "busiest other (I/O)": spent[others[0]] if others else (0.0, 0),
        "rest": (sum(c for c, _ in rest), sum(f for _, f in rest)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=256)
    parser.add_argument("--subscribers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kafka", default="kafka://127.0.0.1:9092")
    parser.add_argument("--broker-pid", type=int, default=None)
    args = parser.parse_args()
    broker = args.broker_pid
    if broker is None and BROKER_PID_FILE.exists():
        broker = int(BROKER_PID_FILE.read_text().split()[0])
    array = np.random.default_rng(0).integers(0, 255, int(args.size_mb * (1 << 20)), np.uint8)
    sides = [
        fanout._Side(m, args.subscribers, fanout.FIRST + 1 + args.rounds, args.kafka) for m in ("kafka", "kafka-python")
    ]
    seconds: dict[str, list[float]] = defaultdict(list)
    roles: dict[str, dict[str, list[tuple[float, int]]]] = defaultdict(lambda: defaultdict(list))
    broker_s: dict[str, list[float]] = defaultdict(list)
    try:
        for side in sides:
            side.warm_up(array, 120)
        for r in range(args.rounds):
            array[:8] = r
            for side in sides if r % 2 == 0 else sides[::-1]:
                pids = [p.pid for p in side.processes if p.pid]
                before, broker_before = {pid: threads(pid) for pid in pids}, process_cpu(broker)
                seconds[side.method].append(side.round(fanout.FIRST + 2 + r, array, 300))
                broker_after = process_cpu(broker)
                if broker_before is not None and broker_after is not None:
                    broker_s[side.method].append(broker_after - broker_before)
                for pid in pids:
                    for role, spent in by_role(pid, before[pid], threads(pid)).items():
                        roles[side.method][role].append(spent)
    finally:
        for side in sides:
            side.close()
    for method in seconds:
        broker_text = ", ".join(f"{s * 1000:.0f}" for s in broker_s[method]) or "-"
        print(
            f"{method}: rounds {', '.join(f'{s * 1000:.0f}' for s in seconds[method])} ms; "
            f"broker CPU per round {broker_text} ms"
        )
        for role, rounds in roles[method].items():
            cpu_ms, faults = statistics.median(c for c, _ in rounds) * 1000, statistics.median(f for _, f in rounds)
            print(f"   {role:20s} per subscriber and round (median): {cpu_ms:7.0f} ms CPU, {faults:8.0f} minor faults")


if __name__ == "__main__":
    main()
