"""What a socket consumer's reading thread waits on: its connections' readiness, and the application's idleness.

`Poller` is the selector the Reactor's leader polls (an event loop's subclass in tensorbus/aio);
`IdleClock` tells the background reader when the application stopped leading long enough for it to
take over (the Python stand-in for `_stream.IdleTimer`).
"""

from __future__ import annotations

import select
import selectors
import threading
import time
from typing import Any


class IdleClock:
    """When the application last led: the background reader waits until it has been idle for a while.

    The Python stand-in for `_stream.IdleTimer`, which waits without the GIL (this one wakes with
    it every `linger_s` while the application keeps receiving).
    """

    def __init__(self) -> None:
        self._idle_at = 0.0
        self._woken = False
        self._cond = threading.Condition()

    def touch(self, linger_s: float) -> None:
        """The application stopped leading: idle once `linger_s` pass without another touch."""
        self._idle_at = time.monotonic() + linger_s

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the application is idle (True), or until `timeout_s` pass or `wake` is called (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                if now >= self._idle_at:
                    return True
                if self._woken or now >= deadline:
                    return False
                self._cond.wait(min(self._idle_at, deadline) - now)

    def wake(self) -> None:
        """Make every wait, now and later, return at once (False unless the application is idle): closing."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()


class Poller:
    """The readiness of the connections, for the reading thread: epoll itself where there is one.

    A `selectors` select costs about a microsecond of Python around its system call, and a reading
    thread makes several while it waits for a reply; this one returns what was registered with
    each ready descriptor. Elsewhere (not Linux) it is a `selectors.DefaultSelector` underneath.
    """

    def __init__(self) -> None:
        self._data: dict[int, Any] = {}
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._selector = selectors.DefaultSelector() if self._epoll is None else None

    def register(self, fd: int, data: Any) -> None:
        """Report `data` whenever `fd` is readable; raises (OSError, KeyError) if it is registered already."""
        if fd in self._data:
            raise KeyError(f"{fd} is registered already")
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN)
        else:
            assert self._selector is not None
            self._selector.register(fd, selectors.EVENT_READ)
        self._data[fd] = data

    def watches(self, fd: int, data: Any) -> bool:
        """Whether `fd` is watched for `data`."""
        return self._data.get(fd) is data

    def unregister(self, fd: int, data: Any) -> None:
        """Stop watching `fd` for `data` (KeyError if it is not watched for it: a reused number)."""
        if fd not in self._data or self._data[fd] is not data:
            raise KeyError(f"{fd} is not watched for {data!r}")
        del self._data[fd]
        if self._epoll is not None:
            self._epoll.unregister(fd)
        else:
            assert self._selector is not None
            self._selector.unregister(fd)

    def poll(self, timeout_s: float) -> list[Any]:
        """What was registered with each descriptor readable within `timeout_s` (0: now)."""
        data = self._data
        if self._epoll is not None:
            return [data[fd] for fd, _ in self._epoll.poll(timeout_s) if fd in data]
        assert self._selector is not None
        return [data[key.fd] for key, _ in self._selector.select(timeout_s)]

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
        if self._selector is not None:
            self._selector.close()
