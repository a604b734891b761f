"""Waiting in tests for something to happen, rather than sleeping and hoping it has.

On a loaded machine (a busy CI runner, brokers in the background) a thread can be kept off the CPU
for a second or more: a fixed sleep or a short timeout then fails a test for no fault of the code.
These wait for the condition itself, with a deadline far past what it takes on a quiet machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> None:
    """Return once `condition()` is true; fail naming `what` if it is not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def child_exit_code(pid: int, timeout: float = 30) -> int:
    """The exit code of forked child `pid`, waited for through a pidfd (Linux); a child still running after
    `timeout` seconds is killed and the wait fails, rather than hanging the test run."""
    pidfd = os.pidfd_open(pid)
    try:
        ended, _, _ = select.select([pidfd], [], [], timeout)
        if not ended:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
    assert ended, f"the forked child did not end in {timeout} s"
    return os.waitstatus_to_exitcode(status)


async def until(condition: Callable[[], Any], what: str, timeout: float = 30) -> None:
    """Yield to the running event loop until `condition()` holds (the loop's twin of `wait_for`)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.001)


def catching(failures: list[BaseException], call: Callable[..., Any], *args: Any) -> Callable[[], None]:
    """`call(*args)` as a thread's target, whatever it raises kept in `failures` (for the test to assert on)."""

    def run() -> None:
        try:
            call(*args)
        except BaseException as exc:
            failures.append(exc)

    return run


def once(condition: Callable[[], Any], action: Callable[[], Any], what: str, timeout: float = 30) -> threading.Thread:
    """Run `action()` on a new thread as soon as `condition()` holds (waited for as `wait_for` does): the
    thread, started, for the caller to join."""

    def run() -> None:
        wait_for(condition, timeout, what)
        action()

    thread = threading.Thread(target=run, daemon=True, name=f"once {what}")
    thread.start()
    return thread


def once_leading(consumer: Any, action: Callable[[], Any]) -> threading.Thread:
    """Run `action` on another thread once this thread leads the consumer's reading (in a recv): what it sends is
    then read and delivered by this thread. (Sent after a fixed delay instead, it found a recv that a loaded
    machine had not yet let start, and the background reader took it.) Sockets, memory:// and shm://."""
    transport = consumer.transport
    scheme = transport.url.scheme  # (who leads: a `Leadership`'s field, or the socket reactor's own)
    if scheme == "memory":
        state = transport._reader.leadership
    elif scheme == "shm":
        state = transport._listener.leadership
    else:
        state = transport.reactor
    me = threading.get_ident()
    return once(lambda: state._leading == me, action, "this thread to lead the reading")


@contextlib.contextmanager
def held_elsewhere(lock: Any) -> Iterator[None]:
    """`lock` held by another thread for as long as the body runs (let go, and the thread joined, after)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10), "the other thread never got the lock"
    try:
        yield
    finally:
        release.set()
        holder.join(10)
