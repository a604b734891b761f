"""What the in-host transports `memory://NAME` and `shm://NAME` share: an endpoint named by its URL,
and a producer bounded as on the socket transports (unacknowledged bytes, a send's wait, a flush to nobody)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from ..errors import ConfigError
from .base import Transport, TransportOptions


@dataclass(frozen=True, kw_only=True)
class NamedOptions(TransportOptions):
    """The producer's bounds of memory:// and shm:// endpoints."""

    #: the bytes a producer sent and its consumer did not take yet, at most, before a new message waits
    #: for room (up to `send_timeout_s`), as on the socket transports
    max_unacked_bytes: int = 256 * 1024 * 1024
    send_timeout_s: float = 30.0
    #: how long a `flush` waits while no consumer listens (as on tcp://, what ends a flush to nobody)
    reconnect_timeout_s: float = 10.0


class NamedTransport(Transport):
    """A transport whose endpoint is the name after `SCHEME://` (the host part and the path, as written)."""

    def __init__(self, url: urllib.parse.SplitResult, options: TransportOptions) -> None:
        super().__init__(url, options)
        self.name = url.netloc + url.path
        if not self.name:
            raise ConfigError(f"{url.scheme} URL needs a name after {url.scheme}://, e.g. {url.scheme}://weights")

    def signing_identity(self, consumer: bool) -> tuple[str, bytes]:
        """SCHEME://NAME."""
        return f"{self.url.scheme}://{self.name}", b""
