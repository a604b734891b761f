"""Log lines a hostile peer can provoke at will, rate-limited per peer and summarised.

A flood of bad frames must not become a flood of log: each source gets `burst` lines per
`window_s`; the rest are counted and reported as one line ("N more ... from SOURCE in the last
10 s") once the window has passed (at the source's next event, or at `flush`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

#: lines logged per source and window before the rest are only counted
BURST = 5
WINDOW_S = 10.0
#: sources remembered at once (a flood from many addresses forgets the oldest, unsummarised beyond a line)
MAX_SOURCES = 1024


class _Window:
    __slots__ = ("logged", "started", "suppressed")

    def __init__(self, started: float) -> None:
        self.started, self.logged, self.suppressed = started, 0, 0


class LogLimiter:
    """Rate-limits log lines per source; `what` names what was suppressed in the summary line."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str = "similar errors",
        *,
        burst: int = BURST,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.what, self.burst, self.window_s, self.clock = logger, what, burst, window_s, clock
        self._windows: collections.OrderedDict[str, _Window] = collections.OrderedDict()
        self._lock = threading.Lock()

    def log(self, level: int, source: str, message: str, *args: Any) -> bool:
        """Log `message % args` unless `source` has had its `burst` this window; True if it was logged."""
        now = self.clock()
        with self._lock:
            window = self._windows.get(source)
            if window is not None and now - window.started >= self.window_s:
                self._summarise(source, window, level)
                window = None
            if window is None:
                window = self._windows[source] = _Window(now)
                if len(self._windows) > MAX_SOURCES:
                    self._summarise(*self._windows.popitem(last=False), level=level)
            if window.logged >= self.burst:
                window.suppressed += 1
                return False
            window.logged += 1
        self.logger.log(level, message, *args)
        return True

    def error(self, message: str, *args: Any, source: str = "") -> bool:
        """`log` at ERROR."""
        return self.log(logging.ERROR, source, message, *args)

    def flush(self, level: int = logging.ERROR, *, final: bool = False) -> None:
        """Report every window that has passed (`final`: every window) with lines suppressed, and forget it."""
        now = self.clock()
        with self._lock:
            for source, window in list(self._windows.items()):
                if final or now - window.started >= self.window_s:
                    del self._windows[source]
                    self._summarise(source, window, level)

    def _summarise(self, source: str, window: _Window, level: int) -> None:
        if window.suppressed:
            where = f" from {source}" if source else ""
            self.logger.log(level, "%d more %s%s in the last %g s", window.suppressed, self.what, where, self.window_s)
        self._windows.pop(source, None)
