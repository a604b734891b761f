"""CPU per tensor, thread wake-ups and round trips of memory:// with both ends in one process, as the bench runs it.

What it measures
    The bench's own link (tensorbus/bench: `TensorbusLink` on memory://): the main thread sends `--tensors`
    float32 tensors of `--size` bytes (metadata `{"i": n}`), a second thread receives them with
    `recv_message` and checks each one's CRC32C, as the bench's receiving worker does. Printed per round:
    tensors/s, and per tensor each thread's CPU time (`time.thread_time`), voluntary context switches (each
    a sleep, whose wake-up costs ~100 µs on an idle vCPU of this VM) and minor page faults. Both threads share
    one interpreter lock, so on a quiet machine their CPU per tensor summed sets the rate. With `--ping` it
    times round trips instead (send, the peer sends it back): p50 and p99.

Run
    python -m benchmarks.memory_cpu [--size 4096] [--tensors 20000] [--rounds 3] [--ping]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import threading
import time
import uuid
from typing import Any

import crc32c
import numpy as np

from tensorbus.bench.links import make_link
from tensorbus.bench.workers import make_slots

WARMUP = 2000


def switches() -> tuple[int, int]:
    """Voluntary context switches (sleeps) and minor page faults so far of the calling thread."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_nvcsw, usage.ru_minflt


class Pair:
    """The bench's two memory:// links of one process: A (this thread) sends "fwd", B (a thread) receives it."""

    def __init__(self, size: int) -> None:
        spec = {"tag": uuid.uuid4().hex[:8], "timeout_s": 60, "url": "memory://bench", "impl": "tensorbus"}
        self.a, self.b = make_link(spec, "A"), make_link(spec, "B")
        self.a.connect(self.b.open())
        self.b.connect(self.a.open())
        self.slots = make_slots(size, np.dtype(np.float32))
        self.crcs = [crc32c.crc32c(slot.data) for slot in self.slots]

    def check(self, obj: Any, index: int, expected: int) -> None:
        if index != expected or crc32c.crc32c(obj) != self.crcs[index % len(self.crcs)]:
            raise AssertionError(f"tensor #{index}: expected #{expected} with its CRC")

    def receive(self, first: int, count: int, out: dict[str, float]) -> None:
        cpu, (slept, faulted) = time.thread_time(), switches()
        for k in range(first, first + count):
            index, obj = self.b.recv(60)
            self.check(obj, index, k)
            del obj
        out["cpu"] = time.thread_time() - cpu
        slept_now, faulted_now = switches()
        out["switches"], out["faults"] = slept_now - slept, faulted_now - faulted

    def stream(self, first: int, count: int) -> dict[str, float]:
        """Send `count` tensors while the peer thread receives them: rate, CPU and sleeps per tensor by side."""
        got: dict[str, float] = {}
        peer = threading.Thread(target=self.receive, args=(first, count, got), name="receiver")
        peer.start()
        started, cpu, woke = time.perf_counter(), time.thread_time(), switches()
        for k in range(first, first + count):
            self.a.send(self.slots[k % len(self.slots)], k)
        sent_cpu, (slept, faulted) = time.thread_time() - cpu, switches()
        peer.join()
        wall = time.perf_counter() - started
        return {
            "rate": count / wall,
            "send_us": sent_cpu / count * 1e6,
            "recv_us": got["cpu"] / count * 1e6,
            "send_sleeps": (slept - woke[0]) / count,
            "recv_sleeps": got["switches"] / count,
            "send_faults": (faulted - woke[1]) / count,
            "recv_faults": got["faults"] / count,
        }

    def echo(self, first: int, count: int) -> None:
        for _ in range(count):
            index, obj = self.b.recv(60)
            self.b.send(obj, index)
            del obj

    def ping(self, first: int, count: int) -> list[float]:
        """Round trips of `count` tensors (the peer thread sends each back), in seconds."""
        peer = threading.Thread(target=self.echo, args=(first, count), name="echo")
        peer.start()
        rtts = []
        for k in range(first, first + count):
            t0 = time.perf_counter()
            self.a.send(self.slots[k % len(self.slots)], k)
            index, obj = self.a.recv(60)
            rtts.append(time.perf_counter() - t0)
            self.check(obj, index, k)
            del obj
        peer.join()
        return rtts

    def close(self) -> None:
        self.a.close()
        self.b.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--tensors", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ping", action="store_true", help="round trips instead of a stream")
    args = parser.parse_args()
    pair = Pair(args.size)
    first = 0
    try:
        for _ in range(args.rounds):
            print(f"load {os.getloadavg()[0]:.2f}", end="  ")
            if args.ping:
                pair.ping(first, WARMUP // 4)
                rtts = pair.ping(first + WARMUP // 4, args.tensors)
                first += WARMUP // 4 + args.tensors
                rtts.sort()
                p50, p99 = statistics.median(rtts), rtts[int(len(rtts) * 0.99)]
                print(f"round trip {args.size} B: p50 {p50 * 1e6:.1f} µs, p99 {p99 * 1e6:.1f} µs")
                continue
            pair.stream(first, WARMUP)
            got = pair.stream(first + WARMUP, args.tensors)
            first += WARMUP + args.tensors
            print(
                f"{args.size} B: {got['rate']:,.0f} tensors/s; CPU per tensor: send {got['send_us']:.2f} µs, "
                f"recv {got['recv_us']:.2f} µs; sleeps per tensor: send {got['send_sleeps']:.3f}, "
                f"recv {got['recv_sleeps']:.3f}; page faults per tensor: send {got['send_faults']:.2f}, "
                f"recv {got['recv_faults']:.2f}"
            )
    finally:
        pair.close()


if __name__ == "__main__":
    main()
