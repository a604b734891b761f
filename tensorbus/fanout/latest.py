"""The subscriber's side: the newest version it has of each key, and the keys updated since last read."""

from __future__ import annotations

import collections
import logging
import threading
import time

from ..errors import Closed, TensorBusError, Timeout
from .versions import VersionedMessage

log = logging.getLogger(__name__)


class Latest:
    """Keeps one message per key; a version not newer than the one held is dropped (an older one logged once per key).

    Filled by a transport's receiving thread (`offer`), read by the application (`latest`, `next`).
    Every field is guarded by `_cond`.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._latest: dict[str, VersionedMessage] = {}
        self._unread: collections.OrderedDict[str, None] = collections.OrderedDict()  # in update order
        self._warned: set[str] = set()
        self._error: TensorBusError | None = None
        self._closed = False
        self._held = False  # a transport still catching up (reading a log from its start): no answers yet
        self._trouble: str | None = None  # why the transport is not connected now, if it says (`trouble`)
        self.ignored = 0  # versions dropped as older than one already held

    def offer(self, message: VersionedMessage) -> bool:
        """Take a received version if it is newer than the key's; whether it was taken."""
        with self._cond:
            held = self._latest.get(message.key or "")
            if held is not None and message.version <= held.version:
                if message.version < held.version:
                    self.ignored += 1
                    if message.key not in self._warned:
                        self._warned.add(message.key or "")
                        log.warning(
                            "%s: ignored version %d of %r, older than version %d already received (a restarted "
                            "publisher starting its versions lower?); told once per key",
                            self.name, message.version, message.key, held.version,
                        )  # fmt: skip
                return False
            self._latest[message.key or ""] = message
            self._unread.pop(message.key or "", None)
            self._unread[message.key or ""] = None
            self._cond.notify_all()
            return True

    def version(self, key: str) -> int | None:
        """The newest version held of `key` (None: none yet)."""
        with self._cond:
            if self._closed:
                raise Closed(f"{self.name}: subscriber closed")
            held = self._latest.get(key)
            return None if held is None else held.version

    def latest(self, key: str, newer_than: int | None, timeout: float | None) -> VersionedMessage:
        """The newest version of `key`, waiting for one (newer than `newer_than`, if given)."""

        def ready() -> VersionedMessage | None:
            held = self._latest.get(key)
            return held if held is not None and (newer_than is None or held.version > newer_than) else None

        with self._cond:
            self._wait(ready, timeout, f"no version of {key!r}" + ("" if newer_than is None else f" > {newer_than}"))
            found = ready()
            assert found is not None
            self._unread.pop(key, None)
            return found

    def next(self, timeout: float | None = None) -> VersionedMessage:
        """The newest version of the key updated longest ago and not read since."""
        with self._cond:
            self._wait(lambda: self._unread, timeout, "no update")
            key, _ = self._unread.popitem(last=False)
            return self._latest[key]

    def _wait(self, ready: object, timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._closed or self._held or not ready():  # type: ignore[operator]  # (closed: none handed out)
            if self._closed:
                raise Closed(f"{self.name}: subscriber closed")
            if self._error is not None:
                raise self._error
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                trouble = "" if self._trouble is None else f" (not connected: {self._trouble})"
                raise Timeout(f"{self.name}: {what} within {timeout}s{trouble}")
            self._cond.wait(left)

    def trouble(self, why: str | None) -> None:
        """The transport's last connection failed (`why`), or it connected (None): a receive that times out
        says why nothing came (a wrong port, say), not only that nothing did."""
        with self._cond:
            self._trouble = why

    def hold(self) -> None:
        """Answer nothing until `release`: the transport is reading what was published before it joined."""
        with self._cond:
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def fail(self, error: TensorBusError) -> None:
        """The transport gave up for good (e.g. its auth_secret was refused): every wait raises `error`."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
