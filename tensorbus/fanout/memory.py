"""`memory://NAME`: publisher and subscribers in one process.

A subscriber receives on the publisher's thread, each its own copy of the frame, checked as over a
socket: a publish costs a copy and a check per subscriber, and never waits for a receive. Subscribers may start
before the publisher; a publisher that closes leaves them waiting for the next one of the name.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from collections.abc import Callable

from ..buffers import aligned_empty
from ..codec.frame import Buffer, join_into
from ..errors import CodecError, ConfigError
from ..transports.base import TransportOptions
from .retained import Published, Retained

log = logging.getLogger(__name__)

Receive = Callable[[Buffer], bool]


def endpoint(url: urllib.parse.SplitResult) -> str:
    """What frames are signed for: the name."""
    return f"fanout-memory:{_name(url)}"


def _name(url: urllib.parse.SplitResult) -> str:
    name = url.netloc + url.path
    if not name:
        raise ConfigError("memory:// needs a name, e.g. memory://policy")
    return name


class _Topic:
    """One name's publisher (at most one at a time) and subscribers; guarded by `_TOPICS_LOCK`."""

    def __init__(self) -> None:
        self.retained: Retained | None = None
        self.subscribers: list[Receive] = []


_TOPICS: dict[str, _Topic] = {}
_TOPICS_LOCK = threading.Lock()


def _forget_if_unused(name: str, topic: _Topic) -> None:
    """Drop a name with no publisher and no subscribers (called under `_TOPICS_LOCK`): names are not kept forever."""
    if topic.retained is None and not topic.subscribers and _TOPICS.get(name) is topic:
        del _TOPICS[name]


def _hand(receive: Receive, published: Published) -> None:
    """Give one subscriber its own copy of a frame (one that fails the subscriber's checks is logged there)."""
    copy = aligned_empty(published.nbytes).data
    join_into(published.frame, copy)
    try:
        receive(copy)
    except CodecError as exc:
        log.error("memory subscriber refused version %d of %r: %s", published.version, published.key, exc)


class PublishingSide:
    """Hands each version to the name's subscribers."""

    def __init__(
        self,
        url: urllib.parse.SplitResult,
        options: TransportOptions,
        retained: Retained,
        signing_key: bytes | None = None,
    ) -> None:
        # (`signing_key` unused: whole frames, signed by the publisher, are sent as they are)
        self.address, self._name = f"memory://{_name(url)}", _name(url)
        with _TOPICS_LOCK:
            self._topic = _TOPICS.setdefault(self._name, _Topic())
            if self._topic.retained is not None:
                raise ConfigError(f"{self.address} already has a publisher")
            self._topic.retained = retained

    def publish(self, published: Published) -> None:
        with _TOPICS_LOCK:
            subscribers = list(self._topic.subscribers)
        for receive in subscribers:
            _hand(receive, published)

    def close(self) -> None:
        with _TOPICS_LOCK:
            self._topic.retained = None
            _forget_if_unused(self._name, self._topic)


class SubscribingSide:
    """Joins the name: gets what its publisher retains, then every publish."""

    def __init__(self, url: urllib.parse.SplitResult, options: TransportOptions, receive: Receive) -> None:
        self._name, self._receive = _name(url), receive
        while True:
            with _TOPICS_LOCK:  # (the name's topic, found and joined under one lock: none dropped meanwhile)
                self._topic = _TOPICS.setdefault(self._name, _Topic())
                retained = self._topic.retained
                if retained is None:  # no publisher yet: its first publish comes as an update
                    self._topic.subscribers.append(receive)
                    return
            with retained.lock:  # no publish between the retained frames and the first update
                with _TOPICS_LOCK:
                    if self._topic.retained is not retained:  # that publisher closed meanwhile
                        continue
                    self._topic.subscribers.append(receive)
                for published in retained.frames():
                    _hand(receive, published)
                return

    def close(self) -> None:
        with _TOPICS_LOCK:
            if self._receive in self._topic.subscribers:
                self._topic.subscribers.remove(self._receive)
            _forget_if_unused(self._name, self._topic)
