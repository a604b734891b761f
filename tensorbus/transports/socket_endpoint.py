"""What both sides of a socket endpoint know: its address (family and target), TLS and secret (see socket.py)."""

from __future__ import annotations

import socket
import ssl
import urllib.parse

from ..errors import ConfigError
from .base import Endpoint
from .stream import SocketOptions
from .tls import context_from_files


class SocketEndpoint(Endpoint):
    """What both sides of a socket endpoint know: its address (family and target), TLS and secret."""

    Options = SocketOptions
    options: SocketOptions

    def __init__(self, url: urllib.parse.SplitResult, options: SocketOptions) -> None:
        super().__init__(url, options)
        self.target: str | tuple[str, int]
        if url.scheme == "unix":
            if not url.path:
                raise ConfigError(f"unix URL needs a path, e.g. unix:///tmp/tensorbus.sock; got {url.geturl()!r}")
            self.family, self.target = socket.AF_UNIX, url.path
        else:
            if url.port is None:
                raise ConfigError(f"{url.scheme} URL needs a port, e.g. tcp://127.0.0.1:5555; got {url.geturl()!r}")
            if url.path not in ("", "/"):
                raise ConfigError(f"{url.scheme} URL takes no path (a port is the whole address); got {url.geturl()!r}")
            host = url.hostname or "127.0.0.1"
            self.family, self.target = socket.AF_INET6 if ":" in host else socket.AF_INET, (host, url.port)
        secret = options.auth_secret
        self.secret: bytes | None = secret.encode() if isinstance(secret, str) else secret

    @property
    def address(self) -> str:
        """The endpoint URL, with the port the listener actually bound."""
        return f"unix://{self.target}" if self.family == socket.AF_UNIX else super().address

    def _ssl_context(self, server_side: bool) -> ssl.SSLContext | None:
        if self.url.scheme != "tcps":
            return None
        if self.options.ssl_context is not None:
            return self.options.ssl_context
        o = self.options
        if server_side and not o.ssl_certfile:
            raise ConfigError("a tcps:// consumer needs ssl_certfile (and ssl_keyfile) or ssl_context")
        return context_from_files(o.ssl_cafile, o.ssl_certfile, o.ssl_keyfile, server_side=server_side)
