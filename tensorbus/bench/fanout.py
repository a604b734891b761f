"""`tensorbus bench --fanout`: one publisher, N subscriber processes, the time until every one holds version v.

Each pair runs side by side, its rounds alternating (so a ratio compares rounds run one after the
other): tcp:// `tb.Publisher` against pyzmq PUB/SUB (`copy=False`), kafka:// `tb.Publisher` (a
compacted topic; `kafka-confluent`: the same on `client=confluent`) against raw kafka-python (chunked
records, one consumer group per subscriber).
Every subscriber checks the CRC32C of what it got; a round is timed from the publish call until
the last subscriber reported. Untimed first: small versions until every subscriber answers (PUB/SUB
drops what is sent before a subscriber joined), then two full-size versions.
Each round also counts, per subscriber process, the CPU time its threads used and the minor page
faults it took (from /proc, on Linux): what load disturbs less than wall time, and where a round was
decided by fresh memory (the allocator handing pages back and touching them again) rather than by code.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import brokers
from .broker_baselines import _Assembler
from .config import format_size

KEY = "bench"
#: versions: small warm-ups count from 1, two full-size untimed ones are FIRST and FIRST + 1 (the steady
#: state: buffers reused), timed ones follow them
FIRST = 1_000_000
CHUNK_BYTES = 1_000_000  # raw kafka-python's records, as the kafka:// transport's
PAIRS = {"tcp": "zmq", "kafka": "kafka-python", "kafka-confluent": "kafka-python"}
#: the tensorbus rows, and the query their kafka:// URL takes
OURS = {"tcp": "", "kafka": "", "kafka-confluent": "?client=confluent"}


def _crc(buffer: Any) -> int:
    from ..codec.native import crc32c

    return int(crc32c(memoryview(buffer).cast("B")))


# -- subscribers (each in a process of its own) -------------------------------------------------------


def _tensorbus_sub(address: str, last: int, report: Callable[[int, Any], None]) -> None:
    import tensorbus as tb

    with tb.Subscriber(address) as sub:
        version = -1
        while version < last:
            message = sub.latest(KEY, newer_than=version, timeout=300)
            version = message.version
            report(version, message.tensor)


def _zmq_sub(address: str, last: int, report: Callable[[int, Any], None]) -> None:
    import zmq

    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 300_000)
    sub.connect(address)
    version = -1
    while version < last:
        header, payload = sub.recv_multipart(copy=False)
        version = int.from_bytes(header.buffer, "little")
        report(version, payload.buffer)
    sub.close(linger=0)
    context.term()


def _kafka_python_sub(address: str, last: int, report: Callable[[int, Any], None]) -> None:
    from kafka import KafkaConsumer

    bootstrap, topic = address.rsplit("/", 1)
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"tbfan-{uuid.uuid4().hex[:8]}",  # one group per subscriber: each reads every record
        auto_offset_reset="earliest",
        allow_auto_create_topics=False,  # (one left behind never brings a deleted topic back)
        max_partition_fetch_bytes=16 << 20,
    )
    assembler = _Assembler()
    version = -1
    while version < last:
        for records in consumer.poll(timeout_ms=1000).values():
            for record in records:
                h = {k: int.from_bytes(v, "little") for k, v in record.headers}
                whole = assembler.add(h["c"], h["n"], record.value, CHUNK_BYTES)
                if whole is not None:
                    version = h["v"]
                    report(version, whole)
    consumer.close(autocommit=False)


_SUBSCRIBERS = {**dict.fromkeys(OURS, _tensorbus_sub), "zmq": _zmq_sub, "kafka-python": _kafka_python_sub}


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _subscriber(method: str, address: str, last: int, index: int, out: Any) -> None:
    """A subscriber process: reports (its index, version, CRC32C, when) for every version it gets, until `last`.

    It ends itself if the benchmark process goes away (killed: no one would stop it otherwise)."""
    parent = os.getppid()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    try:
        _SUBSCRIBERS[method](address, last, lambda v, buf: out.put((index, v, _crc(buf), time.monotonic())))
    except BaseException as exc:
        out.put((index, -1, repr(exc), time.monotonic()))


class Usage(NamedTuple):
    """What a process has spent so far: CPU seconds of the threads in `threads`, and minor page faults (all)."""

    cpu_s: float
    minflt: int
    threads: frozenset[str]


def usage(pid: int) -> Usage | None:
    """A process's CPU seconds so far (each thread's from the scheduler's nanosecond counts) and its minor page
    faults; None where /proc does not tell (not Linux, or the process is gone)."""
    cpu_ns, counted = 0, []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    for tid in threads:
        with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                cpu_ns += int(f.read().split()[0])
                counted.append(tid)
    return Usage(cpu_ns / 1e9, int(stat[stat.rindex(")") + 2 :].split()[7]), frozenset(counted))  # (minflt: 10th)


def spent(before: Usage | None, after: Usage | None) -> tuple[float, int] | None:
    """CPU seconds and minor faults between two readings; None if either is missing or a thread counted in the
    first is not in the second (it ended, taking its CPU time with it: a subscriber ending after its last round)."""
    if before is None or after is None or not before.threads <= after.threads:
        return None
    return after.cpu_s - before.cpu_s, after.minflt - before.minflt


# -- publishers (in this process) ---------------------------------------------------------------------


class _Publisher:
    """One method's publishing end: `publish(version, array)`, `address` for its subscribers, `close`."""

    def __init__(self, method: str, kafka_url: str) -> None:
        self.method, self.cleanup = method, ""
        if method in OURS:
            import tensorbus as tb

            url = "tcp://127.0.0.1:0"
            if method != "tcp":
                url = self.cleanup = f"{kafka_url.rstrip('/')}/tbfan-{uuid.uuid4().hex[:8]}"
            self.pub: Any = tb.Publisher(url + OURS[method])
            self.address = self.pub.address + OURS[method]  # (the address names no client)
        elif method == "zmq":
            import zmq

            self.context = zmq.Context()
            self.pub = self.context.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.address = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            from kafka import KafkaProducer

            topic = f"tbfan-{uuid.uuid4().hex[:8]}"
            self.cleanup = f"{kafka_url.rstrip('/')}/{topic}"
            brokers.create_topic(kafka_url, topic, 30)
            bootstrap = brokers.kafka_bootstrap(kafka_url)
            self.pub = KafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=CHUNK_BYTES + 4096)
            self.address, self.topic = f"{bootstrap}/{topic}", topic

    def publish(self, version: int, array: np.ndarray) -> None:
        if self.method in OURS:
            self.pub.publish(KEY, array, version=version)
        elif self.method == "zmq":
            self.pub.send_multipart([version.to_bytes(8, "little"), array], copy=False)
        else:
            view = array.data.cast("B")
            count = max(1, -(-len(view) // CHUNK_BYTES))
            for chunk in range(count):
                headers = [(k, n.to_bytes(8, "little")) for k, n in (("v", version), ("c", chunk), ("n", count))]
                body = bytes(view[chunk * CHUNK_BYTES : (chunk + 1) * CHUNK_BYTES])
                self.pub.send(self.topic, value=body, key=KEY.encode(), headers=headers)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pub.close()
        if self.method == "zmq":
            self.context.term()
        if self.cleanup:
            brokers.delete_endpoint(self.cleanup)


class _Side:
    """One method in a cell: its publisher and subscriber processes, and the reports they send."""

    def __init__(self, method: str, subscribers: int, last: int, kafka_url: str) -> None:
        self.method, self.subscribers = method, subscribers
        self.publisher = _Publisher(method, kafka_url)
        context = multiprocessing.get_context("spawn")
        self.out = context.Queue()
        self.processes = [
            context.Process(target=_subscriber, args=(method, self.publisher.address, last, i, self.out), daemon=True)
            for i in range(subscribers)
        ]
        for process in self.processes:
            process.start()
        #: per timed round: the subscribers' mean CPU seconds and minor page faults in it (None: not told)
        self.cpu_s: list[float | None] = []
        self.minflt: list[float | None] = []

    def _usage(self) -> list[Usage | None]:
        return [usage(process.pid) if process.pid else None for process in self.processes]

    def _reports(self, version: int, crc: int | None, timeout_s: float) -> float:
        """Read reports until every subscriber reported `version` (CRC-checked if `crc`); when the last one did."""
        got: set[int] = set()
        latest = 0.0
        deadline = time.monotonic() + timeout_s
        while len(got) < self.subscribers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.method}: {len(got)} of {self.subscribers} subscribers within {timeout_s}s")
            try:
                index, v, check, when = self.out.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if v == -1:
                raise RuntimeError(f"{self.method} subscriber failed: {check}")
            if v == version:
                if crc is not None and check != crc:
                    raise RuntimeError(f"{self.method}: CRC32C {check:#x} of version {v}, published {crc:#x}")
                got.add(index)
                latest = max(latest, when)
        return latest

    def warm_up(self, array: np.ndarray, timeout_s: float) -> None:
        """Small versions until every subscriber has one (late PUB/SUB joiners miss the first), then a full one."""
        everyone = set(range(self.subscribers))
        heard: set[int] = set()
        deadline = time.monotonic() + timeout_s
        for version in range(1, FIRST):
            self.publisher.publish(version, np.full(2, version, np.int64))
            quiet_at = time.monotonic() + 0.3
            while time.monotonic() < quiet_at:
                with contextlib.suppress(queue.Empty):
                    index, v, check, _ = self.out.get(timeout=0.05)
                    if v == -1:
                        raise RuntimeError(f"{self.method} subscriber failed: {check}")
                    heard.add(index)
            if heard >= everyone:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.method}: only {len(heard)} of {self.subscribers} subscribers answered")
        for version in (FIRST, FIRST + 1):
            self.publisher.publish(version, array)
            self._reports(version, None, timeout_s)

    def round(self, version: int, array: np.ndarray, timeout_s: float) -> float:
        crc = _crc(array)
        before = self._usage()
        started = time.monotonic()
        self.publisher.publish(version, array)
        took = self._reports(version, crc, timeout_s) - started
        each = [spent(a, b) for a, b in zip(before, self._usage(), strict=True)]
        told = [s for s in each if s is not None] if None not in each else []
        self.cpu_s.append(statistics.mean(cpu for cpu, _ in told) if told else None)
        self.minflt.append(statistics.mean(faults for _, faults in told) if told else None)
        return took

    def close(self) -> None:
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        self.publisher.close()


def run_cell(pair: tuple[str, str], nbytes: int, subscribers: int, rounds: int, kafka_url: str) -> dict[str, Any]:
    """Rounds of one (pair, size, subscribers) cell: each method's seconds per round, alternating which goes first."""
    array = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8)
    last = FIRST + 1 + rounds
    sides = [_Side(method, subscribers, last, kafka_url) for method in pair]
    try:
        for side in sides:
            side.warm_up(array, 120)
        times: dict[str, list[float]] = {method: [] for method in pair}
        for r in range(rounds):
            array[:8] = r  # another tensor each round (its CRC is checked)
            for side in sides if r % 2 == 0 else sides[::-1]:
                times[side.method].append(side.round(FIRST + 2 + r, array, 300))
        return {
            "pair": list(pair),
            "nbytes": nbytes,
            "subscribers": subscribers,
            "seconds": times,
            "subscriber_cpu_s": {side.method: side.cpu_s for side in sides},
            "subscriber_minflt": {side.method: side.minflt for side in sides},
        }
    finally:
        for side in sides:
            side.close()


def _per_round(cell: dict[str, Any], method: str) -> str:
    """A method's subscriber CPU ms and minor faults per round (medians over the rounds), or "-"."""
    cpu = [c for c in cell.get("subscriber_cpu_s", {}).get(method, []) if c is not None]
    faults = [f for f in cell.get("subscriber_minflt", {}).get(method, []) if f is not None]
    if not cpu or not faults:
        return "-"
    return f"{statistics.median(cpu) * 1000:.0f} ms, {statistics.median(faults):.0f} faults"


def summary(cell: dict[str, Any]) -> str:
    """One table line: the medians, the same-round ratio (baseline time / tensorbus time: >1 is faster), and
    what one subscriber process spent per round."""
    ours, theirs = cell["pair"]
    a, b = cell["seconds"][ours], cell["seconds"][theirs]
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    return (
        f"| {format_size(cell['nbytes'])} | {cell['subscribers']} | {ours} {statistics.median(a) * 1000:.0f} ms | "
        f"{theirs} {statistics.median(b) * 1000:.0f} ms | {statistics.median(ratios):.2f}x "
        f"[{min(ratios):.2f}-{max(ratios):.2f}] | {_per_round(cell, ours)} / {_per_round(cell, theirs)} |"
    )


def run(
    methods: list[str], sizes: list[int], subscribers: list[int], rounds: int, kafka_url: str
) -> list[dict[str, Any]]:
    """Every cell, printing its line as it finishes."""
    print(
        "| size | subscribers | tensorbus (median) | baseline (median) | same-round ratio, median [range] "
        "| a subscriber's CPU and minor faults per round, tensorbus / baseline (medians) |"
    )
    print("|---|---|---|---|---|---|")
    cells = []
    for method in methods:
        if method != "tcp" and brokers.unreachable(kafka_url):
            print(f"| skipped {method}: {brokers.unreachable(kafka_url)} |")
            continue
        for nbytes in sizes:
            for count in subscribers:
                cell = run_cell((method, PAIRS[method]), nbytes, count, rounds, kafka_url)
                print(summary(cell), flush=True)
                cells.append(cell)
    return cells
