"""A node-loss run for any transport: one producer process, one consumer process, faults at set points.

The producer sends `count` tensors of mixed sizes (log-uniform from 4 KB to 4 MB, plus a few
`large_bytes` ones that travel chunked), each with its index and CRC32C in the metadata, then a
last tensor that marks the end. The consumer checks every tensor's CRC and reports each one to
this process over a queue, with the time it arrived; faults (kill or start a broker node) run here
when the consumer has received a given number (in the stream's way, or beside it on a thread:
`Fault.background`). A semaphore keeps the producer at most `window` tensors ahead of the consumer,
so a fault lands in the middle of the stream at both ends.

`run` returns a `NodeLossResult` (sent, received, lost, duplicated to the application, corrupted,
the longest stall) and `table` prints results side by side. Every wait is on an event or on the
queue, bounded by `timeout_s`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import queue
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tests.faults import CONTEXT, checksum

#: the launcher whose `restart`, `cluster kill|start|leader` act on the brokers under test
#: (scripts/compose-brokers.sh for Docker Compose's)
BROKERS_SH = os.environ.get("TENSORBUS_BROKERS_SH", str(Path(__file__).resolve().parents[1] / "scripts" / "brokers.sh"))
END_KEY = "node-loss-end"
KEY = "node-loss"
SMALL_BYTES, BIG_BYTES = 4 << 10, 4 << 20


@dataclasses.dataclass
class Fault:
    """`action` runs (in the test process) once the consumer has received `after_received` tensors.

    `background`: it runs on a thread of its own while the stream goes on (a node's start, which returns only once
    the node is back in its cluster: ~10 s), and `run` waits for it before it returns, raising what it raised.
    """

    after_received: int
    action: Callable[[], None]
    name: str = ""
    background: bool = False


@dataclasses.dataclass
class NodeLossResult:
    """What one run saw; `ok` when every tensor arrived once, intact, and the producer raised nothing."""

    name: str
    sent: int
    received: int
    lost: int
    duplicated: int
    corrupted: int
    longest_stall_s: float
    elapsed_s: float
    producer_error: str | None = None
    consumer_error: str | None = None
    faults: list[str] = dataclasses.field(default_factory=list)
    #: per fault run, whether it ran mid-stream: the producer not done yet and the consumer short of `count`
    mid_stream: list[bool] = dataclasses.field(default_factory=list)
    #: the indices of the tensors never received, and of those received more than once (for the failure's report)
    missing: list[int] = dataclasses.field(default_factory=list)
    repeated: list[int] = dataclasses.field(default_factory=list)
    #: the consumer's counts as it closed (its intake's and table's `stats`: duplicates dropped, rejections, ...)
    consumer_stats: dict[str, int] = dataclasses.field(default_factory=dict)
    #: each side's last tensorbus log lines from INFO up (`LOG_LINES` at most), for the failure's report
    logs: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.duplicated == 0
            and self.corrupted == 0
            and self.producer_error is None
            and self.consumer_error is None
        )


def cluster(*args: str) -> str:
    """Run `brokers.sh cluster ARGS...` (kill NODE, start NODE, leader QUEUE), failing the test if it fails;
    its output. `start` returns once the node is back in its cluster."""
    done = subprocess.run(["bash", BROKERS_SH, "cluster", *args], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"brokers.sh cluster {' '.join(args)} failed:\n{done.stderr}"
    return done.stdout.strip()


def sizes(count: int, large_count: int, large_bytes: int, seed: int = 0) -> list[int]:
    """Tensor sizes in bytes: log-uniform 4 KB..4 MB, with `large_count` of `large_bytes` spread evenly."""
    rng = np.random.default_rng(seed)
    result = [int(n) & ~7 for n in np.exp(rng.uniform(np.log(SMALL_BYTES), np.log(BIG_BYTES), count))]
    for j in range(large_count):
        result[(j + 1) * count // (large_count + 1)] = large_bytes
    return result


#: tensorbus log lines each side keeps for a failed case's report (the last ones): its own, and apart from them
#: the Kafka client's (librdkafka logs each refused reconnect to a dead broker, which would crowd out the rest)
LOG_LINES, CLIENT_LOG_LINES = 60, 15


class _LogTail(logging.Handler):
    """The last tensorbus log lines of a producer or consumer process, from INFO up: `LOG_LINES` of its own and
    `CLIENT_LOG_LINES` relayed from librdkafka."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self.client_lines: collections.deque[str] = collections.deque(maxlen=CLIENT_LOG_LINES)
        self.setFormatter(logging.Formatter("%(relativeCreated)8.0f ms %(threadName)s %(name)s: %(message)s"))
        logger = logging.getLogger("tensorbus")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        relayed = record.name == "tensorbus.librdkafka" or record.getMessage().startswith("librdkafka: ")
        (self.client_lines if relayed else self.lines).append(self.format(record))  # (under the handler's lock)

    def snapshot(self) -> list[str]:
        """The lines so far (another thread may be logging meanwhile): its own, then librdkafka's."""
        with self.lock:  # type: ignore[union-attr]
            relayed = ["  (librdkafka's last lines:)", *self.client_lines] if self.client_lines else []
            return [*self.lines, *relayed]


def _tensor(pool: bytes, index: int, nbytes: int) -> np.ndarray:
    """A tensor of `nbytes` unique to `index`: a slice of a random pool with the index written in front."""
    offset = (index * 7919) % (len(pool) - nbytes + 1)
    array = np.frombuffer(pool, np.uint8, count=nbytes, offset=offset).copy()
    array[:8] = np.frombuffer(index.to_bytes(8, "little"), np.uint8)
    return array


def _produce(url: str, options: dict[str, Any], plan: list[int], window: Any, events: Any, timeout_s: float) -> None:
    import tensorbus as tb

    deadline = time.monotonic() + timeout_s
    pool = np.random.default_rng(1).bytes(max(plan) + (1 << 20))
    sent = 0
    tail = _LogTail()
    try:
        with tb.Producer(url, **options) as producer:
            events.put(("producer-ready", time.monotonic()))
            for index, nbytes in enumerate(plan):
                if not window.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"the consumer fell {sent} tensors behind and stayed there")
                array = _tensor(pool, index, nbytes)
                producer.send(KEY, array, metadata={"i": index, "crc": checksum(array)})
                sent += 1
                if sent % 50 == 0:
                    events.put(("sent", sent))
            producer.flush(timeout=max(1.0, deadline - time.monotonic()))
            producer.send(END_KEY, np.zeros(1, np.uint8), metadata={"end": True})
            producer.flush(timeout=max(1.0, deadline - time.monotonic()))
        events.put(("log", "producer", tail.snapshot()))
        events.put(("producer-done", sent, None))
    except BaseException as exc:
        events.put(("log", "producer", tail.snapshot()))
        events.put(("producer-done", sent, f"{type(exc).__name__}: {exc}"))


def _consume(
    url: str, options: dict[str, Any], window: Any, events: Any, stop: Any, drain_s: float, timeout_s: float
) -> None:
    import tensorbus as tb

    deadline = time.monotonic() + timeout_s
    ended_at: float | None = None
    tail = _LogTail()
    try:
        with tb.Consumer(url, **options) as consumer:
            events.put(("consumer-ready", time.monotonic()))
            while True:
                now = time.monotonic()
                stop_at = deadline if ended_at is None else min(deadline, ended_at + drain_s)
                if now >= stop_at or stop.is_set():
                    break
                try:
                    message = consumer.next_message(timeout=min(0.5, stop_at - now))
                except tb.Timeout:
                    continue
                if message.metadata.get("end"):
                    ended_at = time.monotonic()  # then read a little longer, for late duplicates
                    events.put(("end", ended_at))
                    continue
                array = message.tensor
                intact = checksum(array) == message.metadata["crc"] and array.dtype == np.uint8
                events.put(("recv", message.metadata["i"], intact, time.monotonic()))
                window.release()
            counts = {**consumer.stats, **{f"table {name}": n for name, n in consumer.table.stats.items()}}
            events.put(("consumer-stats", counts))
        events.put(("log", "consumer", tail.snapshot()))
        events.put(("consumer-done", None))
    except BaseException as exc:
        events.put(("log", "consumer", tail.snapshot()))
        events.put(("consumer-done", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run(
    url: str,
    *,
    name: str = "",
    consumer_url: str | None = None,
    count: int = 1000,
    large_count: int = 3,
    large_bytes: int = 24 << 20,
    faults: Sequence[Fault] = (),
    window: int = 100,
    timeout_s: float = 110.0,
    drain_s: float = 1.0,
    producer_options: dict[str, Any] | None = None,
    consumer_options: dict[str, Any] | None = None,
) -> NodeLossResult:
    """Stream `count` tensors from a producer process to a consumer process, running `faults` on the way."""
    events: Any = CONTEXT.Queue()
    credit = CONTEXT.Semaphore(window)
    stop = CONTEXT.Event()
    plan = sizes(count, large_count, large_bytes)
    started = time.monotonic()
    deadline = started + timeout_s
    consumer = CONTEXT.Process(
        target=_consume,
        args=(consumer_url or url, consumer_options or {}, credit, events, stop, drain_s, timeout_s),
        name="node-loss-consumer",
    )
    producer = CONTEXT.Process(
        target=_produce, args=(url, producer_options or {}, plan, credit, events, timeout_s), name="node-loss-producer"
    )
    consumer.start()
    seen: dict[int, int] = {}
    corrupted = 0
    times: list[float] = []
    pending = sorted(faults, key=lambda fault: fault.after_received)
    ran: list[str] = []
    mid_stream: list[bool] = []
    sent, received, producer_error, consumer_error = 0, 0, None, None
    consumer_stats: dict[str, int] = {}
    logs: dict[str, list[str]] = {}
    producer_done = consumer_done = False
    apart = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="node-loss-fault")  # (threads made on use)
    running: list[concurrent.futures.Future[None]] = []
    try:
        while not consumer_done and time.monotonic() < deadline:
            try:
                event = events.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if not consumer.is_alive() and events.empty():
                    consumer_error = consumer_error or f"consumer process exited with {consumer.exitcode}"
                    break
                continue
            kind = event[0]
            if kind == "consumer-ready":
                times.append(event[1])
                producer.start()
            elif kind == "recv":
                _, index, intact, at = event
                seen[index] = seen.get(index, 0) + 1
                received += 1
                corrupted += not intact
                times.append(at)
            elif kind == "sent":
                sent = event[1]
            elif kind == "producer-done":
                producer_done, sent, producer_error = True, event[1], event[2]
                if producer_error is not None:
                    break  # nothing more will come: the consumer is stopped below
            elif kind == "consumer-stats":
                consumer_stats = event[1]
            elif kind == "log":
                logs[event[1]] = event[2]
            elif kind == "consumer-done":
                consumer_done, consumer_error = True, event[1]
            while pending and received >= pending[0].after_received:
                fault = pending.pop(0)
                mid_stream.append(not producer_done and received < count)
                if fault.background:
                    running.append(apart.submit(fault.action))
                else:
                    fault.action()
                ran.append(f"{fault.name or fault.action.__name__} after {fault.after_received}")
    finally:
        apart.shutdown(wait=True)  # (a node's start is bounded by `cluster`'s own timeout)
        stop.set()
        for process in (producer, consumer):
            if process.is_alive() or process.pid is not None:
                process.join(timeout=max(0.1, min(15.0, deadline + 15 - time.monotonic())))
                if process.is_alive():
                    process.kill()
                    process.join(5)
    for fault_run in running:
        fault_run.result()  # (a background fault that failed fails the case)
    if not producer_done and producer_error is None:
        producer_error = "the producer did not finish in time"
    return NodeLossResult(
        name=name or url,
        sent=sent,
        received=received,
        lost=count - len(seen),
        duplicated=received - len(seen),
        corrupted=corrupted,
        longest_stall_s=max((b - a for a, b in itertools.pairwise(times)), default=0.0),
        elapsed_s=time.monotonic() - started,
        producer_error=producer_error,
        consumer_error=consumer_error,
        faults=ran,
        mid_stream=mid_stream,
        missing=[index for index in range(count) if index not in seen],
        repeated=[index for index, times in seen.items() if times > 1],
        consumer_stats=consumer_stats,
        logs=logs,
    )


def table(results: Sequence[NodeLossResult]) -> str:
    """The results as a Markdown table (printed by the tests, pasted into the README)."""
    lines = [
        "| case | sent | received | lost | duplicated | corrupted | longest stall (s) | total (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.sent} | {r.received} | {r.lost} | {r.duplicated} | {r.corrupted} "
            f"| {r.longest_stall_s:.1f} | {r.elapsed_s:.1f} |"
        )
    for r in results:
        if r.producer_error or r.consumer_error:
            lines.append(f"{r.name}: producer error {r.producer_error!r}, consumer error {r.consumer_error!r}")
        if r.missing or r.repeated:
            lines.append(f"{r.name}: never received {_ranges(r.missing)}; received twice or more {_ranges(r.repeated)}")
            lines.append(f"{r.name}: the consumer counted {dict(sorted(r.consumer_stats.items()))}")
        if not r.ok:
            for side, logged in sorted(r.logs.items()):
                lines += [f"{r.name}: the {side}'s last tensorbus log lines (INFO and up):", *logged]
    return "\n".join(lines)


def _ranges(indices: Sequence[int]) -> str:
    """Indices as runs, `3-6, 9` (or `none`)."""
    runs: list[list[int]] = []
    for index in sorted(indices):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"
