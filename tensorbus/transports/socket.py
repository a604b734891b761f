"""`tcp://HOST:PORT`, `tcps://` (TLS) and `unix:///path`: frames straight over a stream socket, no broker.

The consumer listens (127.0.0.1 unless told otherwise) and producers connect, many per consumer.
A frame goes out as one scatter-gather `sendmsg` of header and array memory, and comes in with
`recv_into` a buffer sized from the frame's prefix, so the tensor bytes are never copied twice.
The consumer acknowledges a frame as received (the producer's credit, and `flush`) and as taken
(ledger.py: the application has its tensor); a producer keeps the frames not taken (by reference:
do not modify a sent array before `flush`) and sends them again after reconnecting to a restarted
consumer or its successor. Duplicates are dropped above, by message id.

One endpoint object is either side: the producer's (socket_producer.py, its acks in
socket_acks.py) or the consumer's (socket_consumer.py). See `stream.py` for the handshake and the
records, `listener.py` for how the consumer accepts producers, `reactor.py` for how it reads them.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable

from ..buffers import BufferPool
from ..codec.frame import NATIVE
from ..errors import ConfigError
from .socket_acks import READ_ACKS_EVERY
from .socket_consumer import SocketConsumer
from .socket_producer import PROBE_AFTER_S, SocketProducer
from .stream import INCARNATION_BYTES, NATIVE_STREAM, SocketOptions, c_sends_below

__all__ = ["PROBE_AFTER_S", "READ_ACKS_EVERY", "SocketTransport"]


class SocketTransport(SocketProducer, SocketConsumer):
    """One stream socket per producer; the consumer's `Listener` accepts them and its `Reactor` reads them."""

    reads_while_waiting = True
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
        self._sock: socket.socket | None = None
        self._crc_after = False  # the consumer takes CRCs after frames (its hello says so)
        #: the consumer's run: a consumer's own; a producer's from the consumer's hello (b"": it did not say)
        self.incarnation = os.urandom(INCARNATION_BYTES)
        self._signed_for: bytes | None = None  # the run the producer signs new frames for
        self._unacked_for: bytes | None = None  # the run the unacknowledged frames are signed for
        self._used_at = 0.0  # when this producer last sent or read acks
        self._c_sends_below = c_sends_below(False)
        #: `_send_ndarray`'s steps in C (`_native.ndarray_head`, `_stream.send_frame`), where it applies
        #: (built, not TLS, one frame per tensor)
        self._c_head: Callable[..., bytearray | None] | None = None
        self._c_send: Callable[..., int | None] | None = None
        if NATIVE is not None and NATIVE_STREAM is not None and url.scheme != "tcps" and self.max_frame_bytes is None:
            self._c_head, self._c_send = NATIVE.ndarray_head, NATIVE_STREAM.send_frame
        self._lock = threading.Lock()  # the producer's send lock: its connection, copies and counts
        self._init_acks()
        #: for metrics (`counts`): connections made after the first, frames sent again on them; under `_lock`
        self._connects = self._resent = 0
        self._closed = False  # close began: no more sends or reconnects
        self._pool = BufferPool(options.pooled_buffers)

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
        if server_side:
            if not o.ssl_certfile:
                raise ConfigError("a tcps:// consumer needs ssl_certfile (and ssl_keyfile) or ssl_context")
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=o.ssl_cafile)
        else:
            context = ssl.create_default_context(cafile=o.ssl_cafile)
        if o.ssl_certfile:
            context.load_cert_chain(o.ssl_certfile, o.ssl_keyfile)
        return context

    def counts(self) -> dict[str, int]:
        """A consumer's producer connections; a producer's connection, unacknowledged bytes, reconnects and
        frames resent (written under `_lock`, read without it: each a snapshot of one int, at most one send behind)."""
        if self._listener is not None:
            return {"connections": 0 if self.reactor is None else self.reactor.connections}
        reconnects = max(0, self._connects - 1)
        connected = int(self._sock is not None)
        return {"unacked_bytes": self._unacked_bytes, "reconnects": reconnects, "resent_frames": self._resent,
                "connections": connected}  # fmt: skip

    def signing_identity(self, consumer: bool) -> tuple[str, bytes]:
        """ "socket" and the consumer's incarnation: a producer connects first, to learn it from the hello."""
        if not consumer:
            with self._lock:
                self._raise_if_closed()
                if self._sock is None:
                    self._sock = self._connect()
                self._signed_for = self.incarnation
        return "socket", self.incarnation

    def close(self) -> None:
        """Flush (up to close_timeout_s) and close the producer connection, or stop listening and drop every peer."""
        self._close_producer()
        self._close_consumer()
