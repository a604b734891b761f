"""Compression benchmark: what `dumps(x, compression=...)` costs for 4 MB of random and of compressible data.

Random (incompressible) data is judged from a sample and sent raw; the baseline is what compressing
the whole payload costs (what a sender without the sample does before it finds that it does not pay).
Medians of `--rounds` runs, in milliseconds. Run: `python -m benchmarks.compression_bench`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

import tensorbus as tb
from tensorbus.codec.compression import compress


def median_ms(run: Callable[[], object], rounds: int) -> float:
    """Median wall time of `run` over `rounds` calls (after one warm-up), in milliseconds."""
    run()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--mbytes", type=int, default=4)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    random = rng.integers(0, 256, args.mbytes << 20, dtype=np.uint8)
    sparse = np.zeros((args.mbytes << 20) // 4, np.float32)
    sparse[::7] = 1.0
    print(f"{'codec':<6} {'data':<13} {'dumps ms':>9} {'whole-payload compress ms':>26} {'sent as':>8}")
    for codec in ("lz4", "zstd"):
        for name, array in (("random", random), ("compressible", sparse)):
            dumps = median_ms(lambda a=array, c=codec: tb.dumps(a, compression=c), args.rounds)
            whole = median_ms(lambda a=array, c=codec: compress(c, a.data), args.rounds)
            comp = tb.codec.parse(tb.dumps(array, compression=codec)).header["comp"] or "raw"
            print(f"{codec:<6} {name:<13} {dumps:>9.2f} {whole:>26.2f} {comp:>8}")
    raw = median_ms(lambda: tb.dumps(random), args.rounds)
    print(f"no compression, random: dumps {raw:.2f} ms")


if __name__ == "__main__":
    main()
