"""The full transport comparison: every tensorbus transport against every baseline, default sizes.

This is `tensorbus bench` with nothing left out (see `tensorbus bench --help` for what it measures
and how); the README's table and plot come from

    python -m benchmarks.transport_bench --json docs/bench.json --plot docs/bench.png

Any `tensorbus bench` option may follow (e.g. `--sizes 1MB,16MB`). Takes a few minutes; brokers
that do not answer are skipped (start them with `bash scripts/brokers.sh up`).
"""

from __future__ import annotations

import sys

from tensorbus.cli import main

FULL = ["bench", "--transports", "memory,tcp,unix,amqp,kafka", "--baselines", "auto"]

if __name__ == "__main__":
    raise SystemExit(main([*FULL, *sys.argv[1:]]))
