"""A method's worker processes and the pipes to them: post commands, wait for replies with deadlines."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import urllib.parse
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from . import brokers, workers
from .results import Method

if TYPE_CHECKING:
    from .exposition import BenchExposition


class StepFailed(Exception):
    """A worker reported an error, died, or missed its deadline."""


class Pair:
    """A method's two worker processes (one process with two threads for memory://) and their pipes."""

    def __init__(self, method: Method, spec: dict[str, Any], exposition: BenchExposition | None = None) -> None:
        self.method, self.spec, self.exposition = method, spec, exposition
        ctx = multiprocessing.get_context("spawn")
        a_here, a_there = ctx.Pipe()
        b_here, b_there = ctx.Pipe()
        self.conns: dict[str, Connection] = {"A": a_here, "B": b_here}
        targets: list[tuple[Any, ...]]
        if method.in_process:
            targets = [(a_there, "A", spec, b_there)]
        else:
            targets = [(a_there, "A", spec), (b_there, "B", spec)]
        self.procs = [
            ctx.Process(target=workers.main, args=args, daemon=True, name=f"bench-{method.name}-{args[1]}")
            for args in targets
        ]
        self._children = [a_there, b_there]
        self.next_index = 0
        self.broken: str | None = None
        self.opened = False

    def start(self) -> None:
        """Start the worker processes."""
        for proc in self.procs:
            proc.start()
        for conn in self._children:
            conn.close()

    def send(self, role: str, command: str, **args: Any) -> None:
        """Post a command to one side."""
        try:
            self.conns[role].send((command, args))
        except (OSError, ValueError) as exc:
            raise StepFailed(f"worker {role} is gone ({exc})") from None

    def wait(self, role: str, command: str, timeout: float) -> Any:
        """The reply to the last command posted to `role`, within `timeout` seconds."""
        conn = self.conns[role]
        try:
            if not conn.poll(timeout):
                raise StepFailed(f"{command} on side {role} did not finish within {timeout:.0f}s")
            status, value, metrics = conn.recv()
        except (EOFError, OSError):
            codes = [p.exitcode for p in self.procs]
            raise StepFailed(f"worker {role} died during {command} (exit codes {codes})") from None
        self._keep(metrics)
        if status == "error":
            raise StepFailed(value)
        return value

    def _keep(self, metrics: tuple[int, str] | None) -> None:
        """A worker's metrics, sent with its reply (`--metrics-port`): to the bench's exposition."""
        if metrics is not None and self.exposition is not None:
            self.exposition.update(self.method.name, self.spec["tag"], *metrics)

    def call(self, role: str, command: str, timeout: float, **args: Any) -> Any:
        """Post a command and wait for its reply."""
        self.send(role, command, **args)
        return self.wait(role, command, timeout)

    def kill(self) -> None:
        """Stop both workers now; delete the broker queues/topics they could not delete themselves."""
        if self.exposition is not None:
            self.exposition.ended(self.spec["tag"])
        killed = False
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                killed = True
        for proc in self.procs:
            proc.join(5)
        for conn in self.conns.values():
            conn.close()
        if not (killed and self.opened):
            return
        from .links import inbound_url

        for role in ("A", "B"):
            url = inbound_url(self.spec, role)
            if self.method.through_broker:
                brokers.delete_endpoint(url)
            elif self.method.family == "unix" and self.method.kind == "tensorbus":
                with contextlib.suppress(OSError):
                    os.unlink(urllib.parse.urlsplit(url).path)
            elif self.method.family == "shm":  # (a killed consumer leaves its control socket's file)
                from ..transports.shm_control import control_path

                with contextlib.suppress(Exception):
                    os.unlink(control_path(urllib.parse.urlsplit(url).netloc, None))

    def request_close(self) -> None:
        """Ask both workers to close their links (deleting broker queues and topics) and exit."""
        if self.broken:
            return
        for role in ("A", "B"):
            try:
                self.send(role, "close")
            except StepFailed:
                pass

    def finish_close(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the workers to exit (unless broken), then kill what is left."""
        deadline = time.monotonic() + timeout
        if self.exposition is not None and not self.broken:  # the workers' last metrics, endpoints closed
            for conn in self.conns.values():
                with contextlib.suppress(EOFError, OSError, ValueError):
                    if conn.poll(max(deadline - time.monotonic(), 0.1)):
                        self._keep(conn.recv()[2])
        for proc in self.procs:
            if not self.broken:
                proc.join(max(deadline - time.monotonic(), 0.1))
        self.kill()
