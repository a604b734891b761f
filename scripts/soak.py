"""Soak: minutes of mixed-size tensors from many producers per transport; RSS, fds and throughput stay flat.

For each transport, a consumer process receives while N producer processes send tensors of mixed
sizes (4 KB .. 4 MB) as fast as the consumer takes them (at most `--max-in-flight` tensors sent
and not yet received: through a broker, producers would otherwise outrun the consumer until the
broker's retention deletes what was never read), for `--minutes`. Every 10 s the consumer samples its RSS,
open file descriptors and throughput. The report compares the last minute with the first:
RSS (after a two-minute warm-up) and fds flat, throughput within 20 %. Each transport
is soaked in a fresh process, so one transport's memory does not count against the next.

    python scripts/soak.py --minutes 10 --transports tcp,unix,amqp,kafka --producers 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
import uuid
from typing import Any

import numpy as np

import tensorbus as tb

SIZES = [1024, 16 * 1024, 256 * 1024, 1024 * 1024]  # float32 elements: 4 KB .. 4 MB


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def produce(url: str, seconds: float, index: int, in_flight: Any, max_in_flight: int) -> None:
    """Send mixed sizes as fast as the consumer takes them: at most `max_in_flight` tensors unreceived."""
    rng = np.random.default_rng(index)
    tensors = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    deadline = time.monotonic() + seconds
    with tb.Producer(url) as producer:
        i = 0
        while time.monotonic() < deadline:
            while in_flight.value >= max_in_flight and time.monotonic() < deadline:
                time.sleep(0.001)
            producer.send(f"p{index}", tensors[i % len(SIZES)], metadata={"i": i})
            with in_flight.get_lock():
                in_flight.value += 1
            i += 1
            if i % 64 == 0:
                producer.flush(60)


def soak(url: str, seconds: float, producers: int, max_in_flight: int) -> dict[str, Any]:
    samples: list[dict[str, float]] = []
    context = multiprocessing.get_context("spawn")
    in_flight = context.Value("q", 0)
    with tb.Consumer(url) as consumer:
        workers = [
            context.Process(target=produce, args=(consumer.address, seconds, i, in_flight, max_in_flight))
            for i in range(producers)
        ]
        for w in workers:
            w.start()
        received = nbytes = 0
        started = last = time.monotonic()
        window = 0
        while time.monotonic() - started < seconds + 5:
            try:
                message = consumer.next_message(timeout=1)
                with in_flight.get_lock():
                    in_flight.value -= 1
                received += 1
                window += message.tensor.nbytes
                nbytes += message.tensor.nbytes
            except tb.Timeout:
                if not any(w.is_alive() for w in workers):
                    break
            now = time.monotonic()
            if now - last >= 10:
                samples.append(
                    {
                        "t": round(now - started),
                        "rss_mb": rss_mb(),
                        "fds": len(os.listdir("/proc/self/fd")),
                        "mb_s": window / (now - last) / 1e6,
                    }
                )
                window, last = 0, now
        for w in workers:
            w.join(30)
        lost = consumer.intake.reassembler.stats["expired"] + consumer.stats["rejected"]
    # the first two minutes fill the dedup window (100,000 ids) and malloc's arenas: RSS is judged after them
    first, final = samples[12:18] or samples[:6], samples[-6:]
    return {
        "url": url.split("?")[0],
        "received": received,
        "lost": lost,  # chunked tensors that never completed, frames rejected
        "gb": nbytes / 1e9,
        "samples": samples,
        "rss_first_mb": max(s["rss_mb"] for s in first),
        "rss_last_mb": max(s["rss_mb"] for s in final),
        "fds_first": max(s["fds"] for s in first),
        "fds_last": max(s["fds"] for s in final),
        "mb_s_first": statistics.median(s["mb_s"] for s in first),
        "mb_s_last": statistics.median(s["mb_s"] for s in final),
    }


def _soak_in_child(result: Any, url: str, seconds: float, producers: int, max_in_flight: int) -> None:
    result.send(soak(url, seconds, producers, max_in_flight))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--transports", default="tcp,unix,amqp,kafka")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=256,
        help="tensors sent but not yet received, across producers (a broker would otherwise queue without bound)",
    )
    args = parser.parse_args()
    name = f"soak-{uuid.uuid4().hex[:8]}"
    urls = {
        "tcp": "tcp://127.0.0.1:0",
        "unix": f"unix:///tmp/{name}.sock",
        "amqp": os.environ.get("TENSORBUS_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F") + f"?queue={name}",
        "kafka": os.environ.get("TENSORBUS_KAFKA_URL", "kafka://127.0.0.1:9092").rstrip("/") + f"/{name}",
    }
    results = []
    ok = True
    context = multiprocessing.get_context("spawn")
    for transport in args.transports.split(","):
        receiving, sending = context.Pipe(duplex=False)
        worker = context.Process(
            target=_soak_in_child,
            args=(sending, urls[transport], args.minutes * 60, args.producers, args.max_in_flight),
        )
        worker.start()  # a fresh process per transport
        result = receiving.recv()
        worker.join()
        flat = (
            result["rss_last_mb"] <= result["rss_first_mb"] * 1.1 + 20
            and result["fds_last"] <= result["fds_first"]
            and result["mb_s_last"] >= 0.8 * result["mb_s_first"]
            and result["lost"] == 0
        )
        ok &= flat
        results.append(result)
        print(
            f"{transport}: {result['received']:,} tensors ({result['lost']} lost), {result['gb']:.1f} GB; "
            f"RSS {result['rss_first_mb']:.0f}"
            f" -> {result['rss_last_mb']:.0f} MB; fds {result['fds_first']} -> {result['fds_last']}; "
            f"throughput {result['mb_s_first']:.0f} -> {result['mb_s_last']:.0f} MB/s; "
            f"{'flat' if flat else 'NOT FLAT'}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
