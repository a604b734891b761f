"""Worker processes: each serves one side (A sends, B receives) of a method, driven over a pipe.

The runner sends `(command, arguments)` and gets `("ok", result, metrics)` or `("error", "Type: text",
metrics)` back (`metrics`: None, or with `--metrics-port` the process's exposition: exposition.py).
Tensors come from a few immutable "slots" per size (random bytes whose CRC32C both sides know);
tensor `i` is slot `i % len(slots)` and carries `i` in its metadata, so the receiver checks order,
size, dtype and checksum of every tensor without the sender touching memory in flight.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import resource
import signal
import threading
import time
import warnings
from multiprocessing.connection import Connection
from typing import Any

import crc32c
import numpy as np

from .aio_links import LoopRounds
from .links import Link, make_link, worker_registry

SLOT_BYTES = 64 << 20  # small tensors get up to 16 distinct slots, large ones 2


def main(conn: Connection, role: str, spec: dict[str, Any], peer_conn: Connection | None = None) -> None:
    """Process entry point; with `peer_conn` (memory://) role B runs on a thread of this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner stops us; Ctrl-C must not print tracebacks
    logging.basicConfig(level=logging.INFO if spec.get("verbose") else logging.CRITICAL)
    warnings.simplefilter("ignore")
    peer = None
    if peer_conn is not None:
        peer = threading.Thread(target=Worker(peer_conn, "B", spec).serve, daemon=True, name="bench-peer")
        peer.start()
    Worker(conn, role, spec).serve()
    if peer is not None:
        peer.join(timeout=10)


def make_slots(nbytes: int, dtype: np.dtype) -> list[np.ndarray]:
    """Distinct random tensors of `nbytes` (at least 2, so a stale buffer cannot pass for the next one)."""
    count = max(2, min(16, SLOT_BYTES // nbytes))
    slots = []
    for k in range(count):
        raw = np.random.default_rng([nbytes, k]).integers(0, 256, nbytes, dtype=np.uint8)
        slots.append(raw.view(dtype))
    return slots


class Worker:
    """Executes the runner's commands against one `Link`."""

    def __init__(self, conn: Connection, role: str, spec: dict[str, Any]) -> None:
        self.conn, self.role, self.spec = conn, role, spec
        self.link: Link | None = None
        self.dtype = np.dtype(spec["dtype"])
        self.verify = spec["verify"]
        self.nbytes = 0
        self.slots: list[np.ndarray] = []
        self.crcs: list[int] = []

    def serve(self) -> None:
        """Answer commands until `close` or until the runner goes away."""
        try:
            while True:
                try:
                    if not self.conn.poll(1.0):
                        if self.link is not None:
                            with contextlib.suppress(Exception):
                                self.link.idle()
                        continue
                    command, args = self.conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply: tuple[str, Any] = ("ok", getattr(self, f"do_{command}")(**args))
                except BaseException as exc:
                    reply = ("error", f"{type(exc).__name__}: {exc}".strip())
                try:
                    self.conn.send((*reply, self.exposition()))
                except (OSError, ValueError):
                    return
                if command == "close":
                    return
        finally:
            self.do_close()

    def exposition(self) -> tuple[int, str] | None:
        """With `--metrics-port`: this process's metrics now, and its pid (two workers of one process
        share them); sent back with every reply, after the command (never inside a timed step)."""
        if not self.spec.get("metrics"):
            return None
        from prometheus_client import generate_latest

        return os.getpid(), generate_latest(worker_registry()).decode()

    # -- setup ----------------------------------------------------------------------------------

    def do_open(self) -> str:
        self.link = make_link(self.spec, self.role)
        return self.link.open()

    def do_connect(self, address: str) -> None:
        assert self.link is not None
        self.link.connect(address)

    def do_prepare(self, nbytes: int, crcs: list[int] | None = None) -> list[int]:
        """Build the slots (the sender, A) or take their checksums (B); get receive buffers ready."""
        assert self.link is not None
        self.do_release()
        self.nbytes = nbytes
        if crcs is None:
            self.slots = self.link.adopt(make_slots(nbytes, self.dtype))
            self.crcs = [crc32c.crc32c(slot.data) for slot in self.slots]
        else:
            self.crcs = crcs
        self.link.prepare(nbytes)
        return self.crcs

    def do_release(self) -> None:
        self.slots, self.crcs = [], []
        if self.link is not None:
            self.link.release()
        gc.collect()

    def do_close(self) -> None:
        if self.link is not None:
            link, self.link = self.link, None
            link.close()

    # -- measuring ------------------------------------------------------------------------------

    def check(self, obj: Any, index: int, expected: int) -> str | None:
        """Why a received tensor is wrong, or None."""
        if index != expected:
            return f"expected tensor #{expected}, got #{index}"
        if isinstance(obj, np.ndarray):
            if obj.dtype != self.dtype or obj.nbytes != self.nbytes:
                return f"tensor #{index}: got {obj.dtype} of {obj.nbytes} bytes, sent {self.dtype} of {self.nbytes}"
        elif memoryview(obj).nbytes != self.nbytes:
            return f"tensor #{index}: got {memoryview(obj).nbytes} bytes, sent {self.nbytes}"
        if self.verify == "crc32c" and crc32c.crc32c(obj) != self.crcs[index % len(self.crcs)]:
            return f"tensor #{index}: CRC32C mismatch"
        return None

    def do_send(self, n: int, first: int, timeout: float) -> dict[str, float]:
        """Send tensors first..first+n-1 back to back; then, untimed, wait for confirmations."""
        assert self.link is not None
        self.link.set_timeout(timeout)
        slots, count, send = self.slots, len(self.slots), self.link.send
        if isinstance(self.link, LoopRounds):  # awaited on one running loop
            t_start, t_end = self.link.send_round(slots, first, n)
        else:
            t_start = time.perf_counter()
            for index in range(first, first + n):
                send(slots[index % count], index)
            t_end = time.perf_counter()
        self.link.finish(timeout)
        return {"t_start": t_start, "t_end": t_end, "finish_s": time.perf_counter() - t_end}

    def do_recv(self, n: int, first: int, timeout: float) -> dict[str, Any]:
        """Receive and verify n tensors; report when the first and the last arrived."""
        assert self.link is not None
        self.link.set_timeout(timeout)
        if isinstance(self.link, LoopRounds):
            return {**self.link.recv_round(n, first, timeout, self.check), **_rss()}
        self.link.expect(first)
        deadline = time.perf_counter() + timeout
        failures, problem = 0, None
        recv, check = self.link.recv, self.check
        t_first = 0.0
        for k in range(n):
            index, obj = recv(max(deadline - time.perf_counter(), 0.001))
            if k == 0:
                t_first = time.perf_counter()
            error = check(obj, index, first + k)
            del obj
            if error is not None:
                failures += 1
                problem = problem or error
        t_last = time.perf_counter()
        return {"t_first": t_first, "t_last": t_last, "failures": failures, "problem": problem, **_rss()}

    def do_ping(self, n: int, first: int, timeout: float) -> dict[str, Any]:
        """Round trips: send a tensor, wait for the peer to send it back; times in seconds."""
        assert self.link is not None
        self.link.set_timeout(timeout)
        if isinstance(self.link, LoopRounds):
            return self.link.ping_round(self.slots, first, n, timeout, self.check)
        link, slots, count = self.link, self.slots, len(self.slots)
        link.expect(first)
        rtts: list[float] = []
        failures, problem = 0, None
        for index in range(first, first + n):
            t0 = time.perf_counter()
            link.send(slots[index % count], index)
            got, obj = link.recv(timeout)
            rtts.append(time.perf_counter() - t0)
            error = self.check(obj, got, index)
            del obj
            if error is not None:
                failures += 1
                problem = problem or error
        return {"rtts": rtts, "failures": failures, "problem": problem}

    def do_echo(self, n: int, first: int, timeout: float) -> dict[str, Any]:
        """The other end of `ping`: send every tensor straight back, then verify it."""
        assert self.link is not None
        self.link.set_timeout(timeout)
        link = self.link
        if isinstance(link, LoopRounds):
            outcome = link.echo_round(n, first, timeout, self.check, self.dtype)
            link.finish(timeout)
            return {**outcome, **_rss()}
        failures, problem = 0, None
        link.expect(first)
        for expected in range(first, first + n):
            index, obj = link.recv(timeout)
            link.send(obj if isinstance(obj, np.ndarray) else np.frombuffer(obj, self.dtype), index)
            error = self.check(obj, index, expected)
            del obj
            if error is not None:
                failures += 1
                problem = problem or error
        link.finish(timeout)
        return {"failures": failures, "problem": problem, **_rss()}


def _rss() -> dict[str, float]:
    """This process's peak resident set so far, in MiB."""
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
