"""What metrics add to one send and one recv, in-process: the meter's wrapper around a call that does nothing.

The stream benchmark (`benchmarks.metrics_cost`) is what a user sees, but on a loaded machine its
noise can exceed the effect; this isolates the added work: the best of `repeat` timings of `number`
calls each (the least disturbed), metered minus bare, in microseconds per call.

Run
    python -m benchmarks.metrics_overhead [--number 100000] [--repeat 15]
"""

from __future__ import annotations

import argparse
import timeit
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

import tensorbus as tb
from tensorbus.codec import Message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=100000)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    array = np.ones(1024, np.float32)
    message = Message("k", array)
    url = "memory://metrics-overhead"
    registry = CollectorRegistry()
    with tb.Consumer(url, metrics=True, metrics_registry=registry) as consumer:
        with tb.Producer(url, metrics=True, metrics_registry=registry) as producer:
            sender, receiver = producer._monitor, consumer._monitor
            assert sender is not None and receiver is not None

            def send(*_: Any) -> None:
                return None

            def receive(*_: Any) -> Message:
                return message

            def best(call: Any) -> float:
                return min(timeit.repeat(call, number=args.number, repeat=args.repeat)) / args.number * 1e6

            bare_send = best(lambda: send(array, "k", None, ("p", 1), None))
            metered_send = best(lambda: sender.send(send, array, "k", None, ("p", 1), None))
            bare_recv = best(lambda: receive("k", None))
            metered_recv = best(lambda: receiver.recv(receive, "k", None))
    print(f"send: +{metered_send - bare_send:.3f} µs per call (bare {bare_send:.3f}, metered {metered_send:.3f})")
    print(f"recv: +{metered_recv - bare_recv:.3f} µs per call (bare {bare_recv:.3f}, metered {metered_recv:.3f})")


if __name__ == "__main__":
    main()
