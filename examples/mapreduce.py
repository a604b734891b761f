"""Map workers send partial results under rendezvous keys; a reducer receives them by key.

Each mapper process computes a histogram of its shard of the data and sends it under
`make_key("mapper<i>", incarnation, "reducer", "histogram", (0, i))`. The reducer asks for the
keys in its own order, whatever order they arrive in, and sums them; the result is checked
against a histogram computed in one piece.

    python examples/mapreduce.py                 # tcp://127.0.0.1 (a free port), 4 mappers
    python examples/mapreduce.py --url unix:///tmp/mr.sock --mappers 6
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import time

import numpy as np

import tensorbus as tb

BINS = np.linspace(-4, 4, 33)


def shard(index: int, size: int) -> np.ndarray:
    """The data a mapper owns (deterministic, so the reducer can check the answer)."""
    return np.random.default_rng(index).standard_normal(size)


def mapper(url: str, index: int, size: int) -> None:
    """Compute one shard's histogram and send it under this mapper's rendezvous key."""
    time.sleep(random.random() * 0.3)  # arrive in no particular order
    counts, _ = np.histogram(shard(index, size), BINS)
    with tb.Producer(url) as producer:
        key = tb.make_key(f"mapper{index}", os.getpid(), "reducer", "histogram", (0, index))
        producer.send(key, counts, metadata={"mapper": index, "incarnation": os.getpid()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="tcp://127.0.0.1:0", help="where the reducer listens (default: %(default)s)")
    parser.add_argument("--mappers", type=int, default=4)
    parser.add_argument("--shard-size", type=int, default=200_000)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    with tb.Consumer(args.url) as reducer:
        workers = [
            context.Process(target=mapper, args=(reducer.address, i, args.shard_size)) for i in range(args.mappers)
        ]
        for worker in workers:
            worker.start()
        total = np.zeros(len(BINS) - 1, np.int64)
        arrivals = []
        for index, worker in enumerate(workers):
            key = tb.make_key(f"mapper{index}", worker.pid, "reducer", "histogram", (0, index))
            message = reducer.recv_message(key, timeout=60)
            total += message.tensor
            arrivals.append(message.metadata["mapper"])
        for worker in workers:
            worker.join(30)
    expected, _ = np.histogram(np.concatenate([shard(i, args.shard_size) for i in range(args.mappers)]), BINS)
    ok = np.array_equal(total, expected)
    print(f"reduced {args.mappers} partial histograms ({total.sum():,} samples); equal to the one-piece result: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
