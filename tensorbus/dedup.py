"""The ids of messages already received, so that a resent message is dropped.

In memory the window is the last `window` ids that reached the consumer. With a `path`, the id of
every message handed to the application is also appended to that file (one small write, no fsync:
it survives a killed process, not a power cut), and a consumer restarted on the same file drops
what its predecessor had already handed out — which is what a producer resends after reconnecting
to it — but takes what it had only received. The file is a msgpack stream; a record cut short by a
kill is ignored, and the file is compacted to the window once it holds twice as many records.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from pathlib import Path

import msgpack

from .codec.frame import MessageId

log = logging.getLogger(__name__)


class SeenIds:
    """A bounded set of message ids, optionally kept in a file across restarts."""

    def __init__(
        self,
        window: int,
        path: str | Path | None = None,
        *,
        ids: collections.OrderedDict[MessageId, None] | None = None,
    ) -> None:
        """`ids`: the dict to keep the window's ids in, oldest first, where others read it too (the
        intake's state, whose C delivery adds to it as `add` does); a new one by default."""
        self.window = window
        self._ids = collections.OrderedDict() if ids is None else ids
        #: the last `window` ids persisted (what a compacted file keeps: not ids that only arrived)
        self._persisted: collections.OrderedDict[MessageId, None] = collections.OrderedDict()
        self._path = Path(path) if path is not None else None
        self._fd: int | None = None
        self._records = 0
        if self._path is not None:
            for message_id in self._load(self._path):
                self._remember(message_id)
                self._remember(message_id, self._persisted)
            self._compact()

    def __contains__(self, message_id: MessageId) -> bool:
        return message_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, message_id: MessageId) -> None:
        """Remember an id, in memory: a second copy arriving meanwhile is a duplicate."""
        self._remember(message_id)

    def discard(self, message_id: MessageId) -> None:
        """Forget an id added in memory (its message never got through after all)."""
        self._ids.pop(message_id, None)

    def persist(self, message_id: MessageId) -> None:
        """Append an id the application now has to the file (if any); compact it at twice the window."""
        if self._fd is not None:
            try:
                os.write(self._fd, msgpack.packb(list(message_id)))
                self._remember(message_id, self._persisted)
                self._records += 1
                if self._records >= 2 * self.window:
                    self._compact()
            except OSError as exc:  # e.g. a full disk: delivery goes on, dedup across restarts is lost
                log.error("cannot keep delivered ids in %s any more (%s); dedup is in memory only now", self._path, exc)
                self.close()

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):  # already failed (e.g. EBADF): nothing more to release
                os.close(fd)

    def _remember(self, message_id: MessageId, ids: collections.OrderedDict[MessageId, None] | None = None) -> None:
        ids = self._ids if ids is None else ids
        ids[message_id] = None
        ids.move_to_end(message_id)
        if len(ids) > self.window:
            ids.popitem(last=False)

    @staticmethod
    def _load(path: Path) -> list[MessageId]:
        """The ids in the file, in order; a torn last record and anything not an id are skipped."""
        if not path.exists():
            return []
        ids: list[MessageId] = []
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64 << 20)
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                unpacker.feed(chunk)
                try:
                    for item in unpacker:
                        ok = isinstance(item, list) and len(item) == 2
                        if ok and isinstance(item[0], str) and isinstance(item[1], int):
                            ids.append((item[0], item[1]))
                except (ValueError, msgpack.UnpackException) as exc:
                    log.warning("%s is damaged after %d ids (%s); keeping those", path, len(ids), exc)
                    return ids
        return ids

    def _compact(self) -> None:
        """Rewrite the file with just the window's ids (temp file + rename), and append from there."""
        assert self._path is not None
        self.close()
        tmp = self._path.with_name(self._path.name + ".tmp")
        tmp.write_bytes(b"".join(msgpack.packb(list(message_id)) for message_id in self._persisted))
        os.replace(tmp, self._path)
        self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND)
        self._records = len(self._persisted)
