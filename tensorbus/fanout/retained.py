"""The publisher's side: the last version of each key, and the retained frame late joiners get first."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..codec.frame import Buffer
from ..errors import ConfigError, LimitExceeded


@dataclass(frozen=True)
class Published:
    """One published version, as every subscriber gets it."""

    key: str
    version: int
    frame: list[Buffer]
    nbytes: int
    message_id: tuple[str, int]  # (chunks name their message by it)


class Retained:
    """The latest frame of each key, within `max_bytes` (a publish that would pass it is refused).

    `lock` is held across a publish (check, keep, hand to the transports) and by a transport taking
    a new subscriber's first frames, so a subscriber gets each version once: from here or as an update.
    """

    def __init__(self, max_bytes: int, keep_frames: bool = True) -> None:
        self.max_bytes = max_bytes
        self.keep_frames = keep_frames  # False where a broker keeps them (only the versions are tracked)
        self.lock = threading.RLock()
        self._latest: dict[str, Published] = {}  # in publish order: a key moves to the end when published
        self._versions: dict[str, int] = {}  # the last version of each key, retained or only learned
        self.nbytes = 0

    def check(self, key: str, version: int) -> None:
        """Refuse a version not greater than the key's last one (checked before encoding)."""
        last = self._versions.get(key)
        if last is not None and version <= last:
            raise ConfigError(f"version {version} of {key!r} is not greater than its last one, {last}")

    def check_room(self, published: Published) -> int:
        """The bytes retained once `published` is kept (`LimitExceeded` past `max_bytes`)."""
        old = self._latest.get(published.key)
        total = self.nbytes - (old.nbytes if old else 0) + published.nbytes
        if self.keep_frames and total > self.max_bytes:
            raise LimitExceeded(
                f"publishing {published.key!r} ({published.nbytes} bytes) would retain {total} bytes; "
                f"max_retained_bytes={self.max_bytes}"
            )
        return total

    def keep(self, published: Published) -> None:
        """Retain `published` in place of its key's older frame (`LimitExceeded` past `max_bytes`: nothing changes)."""
        self.check(published.key, published.version)
        if not self.keep_frames:
            self._versions[published.key] = published.version
            return
        total = self.check_room(published)
        self._latest.pop(published.key, None)
        self._latest[published.key] = published
        self._versions[published.key] = published.version
        self.nbytes = total

    def learn(self, key: str, version: int) -> None:
        """A version published before this publisher started (read back from a broker): later ones must exceed it."""
        self._versions[key] = max(version, self._versions.get(key, version))

    def frames(self) -> list[Published]:
        """What a new subscriber gets first: the latest of each key, oldest published first."""
        return list(self._latest.values())

    def versions(self) -> dict[str, int]:
        """The last version of each key."""
        return dict(self._versions)
