"""`tcp://`, `tcps://`, `unix://`: the publisher listens, subscribers connect.

The publisher accepts subscribers with the socket consumer's `Listener` (TLS, `auth_secret`,
`max_connections`), then gives each one a sending thread and a mailbox of at most one version
per key: a publish replaces the key's version there (conflation) and never waits for a socket; the
frame being written stays in flight. A subscriber reads frames on a thread of its own and, when the
connection breaks, reconnects with backoff until closed; the publisher then sends the latest of
every key again (versions it already holds are dropped). A frame the subscriber refuses (over its
limits, failing its checks) is skipped, as on every other transport: the stream stays in step.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any

from ..buffers import BufferPool
from ..codec.frame import PREFIX, Limits, frame_length
from ..errors import CodecError, LimitExceeded, TransportError
from ..transports.base import backoff_s
from ..transports.listener import Listener
from ..transports.socket_acks import readable
from ..transports.socket_endpoint import SocketEndpoint
from ..transports.stream import (
    REFUSALS_WANTED,
    AuthRefused,
    SocketOptions,
    handshake_as_producer,
    recv_exact,
    sendmsg_all,
    set_send_timeout,
    tune_connection,
)
from .api import Receiver
from .retained import Published, Retained

log = logging.getLogger(__name__)
#: a subscriber's first words after the handshake, and the publisher's answer (frame-sized markers, as
#: the socket protocol's own): a producer or consumer at the other end is told apart at once
SUBSCRIBE = b"TBSB" + bytes(20)
PUBLISHING = b"TBPB" + bytes(20)
#: a subscriber's mailbox with nothing to send looks this often whether its subscriber went away (it sends
#: nothing after subscribing: a readable connection is one closed, or one that misbehaves), so a subscriber
#: gone frees its thread and its place under `max_connections` without waiting for the next publish
GONE_CHECK_S = 0.5
#: a subscriber's TCP connection is probed after this long without bytes, then every KEEPALIVE_INTERVAL_S, and
#: given up after KEEPALIVE_PROBES unanswered: a publisher whose host went away is noticed (and dialled again)
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
#: a subscriber logs its first skipped frames, then every this many
LOGGED_SKIPS = 10
#: the length of a frame whatever a subscriber's limits (to read past one over them)
_UNLIMITED = Limits(max_header_bytes=1 << 62, max_payload_bytes=1 << 62)


class _NotAPublisher(TransportError):
    """What answered is a tensorbus endpoint, but not a publisher: a wrong URL, not worth retrying."""

    retriable = False


class _Unanswered(TransportError):
    """The other end closed the connection instead of answering the subscription (a Consumer does)."""


def endpoint(url: urllib.parse.SplitResult) -> str:
    """What frames are signed for (one name: a publisher and its subscribers may call the host differently)."""
    return "fanout-socket"


class _Mailbox:
    """One subscriber's connection: the versions not yet written to it, at most one per key (guarded by `_cond`)."""

    def __init__(self, conn: socket.socket, name: str) -> None:
        self.conn, self.name = conn, name
        self._cond = threading.Condition()
        self._pending: collections.OrderedDict[str, Published] = collections.OrderedDict()
        self._closed = False

    def put(self, published: Published) -> None:
        """Replace the key's unsent version (if any) with this one, at the end of the line."""
        with self._cond:
            self._pending.pop(published.key, None)
            self._pending[published.key] = published
            self._cond.notify()

    def pending_bytes(self) -> int:
        with self._cond:
            return sum(p.nbytes for p in self._pending.values())

    def run(self) -> None:
        """Write versions, oldest update first, until closed, the connection fails or the subscriber goes."""
        try:
            while True:
                with self._cond:
                    if not self._pending and not self._closed:
                        self._cond.wait(GONE_CHECK_S)
                    if self._closed:
                        return
                    published = self._pending.popitem(last=False)[1] if self._pending else None
                if published is not None:
                    sendmsg_all(self.conn, published.frame)
                elif readable(self.conn):
                    log.info("subscriber %s went away", self.name)
                    return
        except OSError as exc:
            log.info("subscriber %s dropped: %s", self.name, exc)
        finally:
            self.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify()
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)


class PublishingSide:
    """Listens; every subscriber that passes the handshake gets the retained versions, then each update."""

    def __init__(
        self,
        url: urllib.parse.SplitResult,
        options: SocketOptions,
        retained: Retained,
        signing_key: bytes | None = None,
    ) -> None:
        # (`signing_key` unused: whole frames, signed by the publisher, are sent as they are)
        self._where = SocketEndpoint(url, options)  # (the address, TLS and secret, as a socket consumer's)
        self.options, self.retained = options, retained
        self._lock = threading.Lock()
        self._boxes: list[_Mailbox] = []
        self._greeting = 0  # connections past the handshake, not yet subscribed (they count for max_connections)
        self._closed = False
        self._listener = Listener(
            self._where.family, self._where.target, options, self._where.secret, lambda: self.address, b""
        )
        context = self._where._ssl_context(server_side=True)  # (before binding: a missing certificate binds nothing)
        bound = self._listener.bind()
        if self._where.family != socket.AF_UNIX:
            host, port = bound[:2]
            self._where.url = self._where.url._replace(netloc=f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        self._listener.start(self, context)

    @property
    def address(self) -> str:
        return self._where.address

    @property
    def connections(self) -> int:
        """Subscribers, and connections still being greeted (what `max_connections` bounds)."""
        with self._lock:
            return len(self._boxes) + self._greeting

    def add(self, conn: socket.socket, name: Any) -> None:
        """A connection passed the handshake (on the listener's thread): greet it on a thread of its own."""
        with self._lock:
            self._greeting += 1
        threading.Thread(target=self._serve, args=(conn, str(name)), daemon=True, name="tensorbus-fanout-send").start()

    def _greet(self, conn: socket.socket) -> None:
        """Read the subscription (after any REFUSALS_WANTED markers) and answer it, all within `connect_timeout_s`."""
        deadline = time.monotonic() + self.options.connect_timeout_s
        marker = memoryview(bytearray(len(SUBSCRIBE)))
        while True:
            got = 0
            while got < len(marker):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"no subscription within connect_timeout_s={self.options.connect_timeout_s}")
                conn.settimeout(left)
                n = conn.recv_into(marker[got:])
                if n == 0:
                    raise TransportError("closed before it subscribed")
                got += n
            if bytes(marker) != REFUSALS_WANTED:
                break
        if bytes(marker) != SUBSCRIBE:
            raise TransportError("not a tensorbus subscriber (a Producer? it sends to a Consumer)")
        conn.settimeout(self.options.connect_timeout_s)
        conn.sendall(PUBLISHING)
        set_send_timeout(conn, self.options.send_timeout_s)
        tune_connection(conn)

    def _serve(self, conn: socket.socket, name: str) -> None:
        try:
            self._greet(conn)
        except (OSError, TransportError) as exc:
            log.info("%s: connection from %s closed: %s", self.address, name, exc)
            conn.close()
            with self._lock:
                self._greeting -= 1
            return
        box = _Mailbox(conn, name)
        with self.retained.lock:  # the retained versions, then the updates: none missed, none twice
            with self._lock:
                self._greeting -= 1
                if self._closed:
                    conn.close()
                    return
                self._boxes.append(box)
            for published in self.retained.frames():
                box.put(published)
        try:
            box.run()
        finally:
            with self._lock:
                self._boxes.remove(box)
            conn.close()

    def publish(self, published: Published) -> None:
        with self._lock:
            boxes = list(self._boxes)
        for box in boxes:
            box.put(published)

    def mailbox_bytes(self) -> list[int]:
        """What each subscriber's mailbox holds (at most one version per key; the frames are the retained ones)."""
        with self._lock:
            return [box.pending_bytes() for box in self._boxes]

    def close(self, timeout: float | None = None) -> None:
        """Stop listening and drop every subscriber (called by the listener too, on its close)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            boxes = list(self._boxes)
        for box in boxes:
            box.close()
        self._listener.close()


class SubscribingSide:
    """Connects (and reconnects) to the publisher on a thread of its own; every frame goes to the `Receiver`."""

    def __init__(self, url: urllib.parse.SplitResult, options: SocketOptions, receive: Receiver) -> None:
        self._where = SocketEndpoint(url, options)
        self._context = self._where._ssl_context(server_side=False)  # (here: a missing CA file fails the constructor)
        self.options, self._receive = options, receive
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None  # the live connection (closed by `close` to stop a blocked read)
        self.connects = 0  # connections made so far
        #: frames are read into reused buffers (the one a held version views, one being read, a spare)
        self._pool = BufferPool(max_buffers=3)
        self.frames = 0  # frames read whole so far (taken or skipped)
        self.skipped = 0  # of them, those refused (over the limits, failing their checks, no memory for them)
        self._thread = threading.Thread(target=self._run, daemon=True, name="tensorbus-fanout-recv")
        self._thread.start()

    def _run(self) -> None:
        delays = backoff_s()
        while not self._closed.is_set():
            frames_before = self.frames
            try:
                self._read(self._connect())
            except (AuthRefused, _NotAPublisher, ssl.SSLCertVerificationError) as exc:
                self._receive.latest.fail(TransportError(f"{self._where.address}: {exc}"))
                return
            except (OSError, TransportError, CodecError) as exc:
                if self._closed.is_set():
                    return
                self._receive.latest.trouble(f"{exc}" if str(exc) else repr(exc))
                if self.frames > frames_before:  # (a connection that carried frames: dial again soon; one that
                    delays = backoff_s()  # fails before its first frame backs off further each time)
                delay = next(delays)
                # (a bad frame: a wrong key? no answer: a wrong URL? else the publisher is away, as it may be)
                level = logging.ERROR if isinstance(exc, CodecError | _Unanswered) else logging.INFO
                log.log(level, "subscriber of %s: %s; reconnecting in %.2fs", self._where.address, exc, delay)
                self._closed.wait(delay)
            except Exception as exc:  # a fault of this side's own: the receives are told, rather than left to wait
                log.exception("subscriber of %s: receiving failed", self._where.address)
                self._receive.latest.fail(TransportError(f"{self._where.address}: receiving failed: {exc!r}"))
                return
            finally:
                with self._lock:
                    if self._sock is not None:
                        self._sock.close()
                    self._sock = None

    def _connect(self) -> socket.socket:
        where = self._where
        sock = socket.socket(where.family, socket.SOCK_STREAM)
        with self._lock:
            if self._closed.is_set():
                sock.close()
                raise TransportError("closed")
            self._sock = sock
        sock.settimeout(self.options.connect_timeout_s)
        sock.connect(where.target)  # (a `close` meanwhile cannot stop it: it is checked below)
        if self._context is not None:
            sock = self._context.wrap_socket(sock, server_hostname=where.target[0])
        with self._lock:
            self._sock = sock
            if self._closed.is_set():  # (`_run` closes the socket)
                raise TransportError("closed")
        handshake_as_producer(sock, where.secret, where.address)
        sock.sendall(SUBSCRIBE)
        answer = bytearray(len(PUBLISHING))
        got = recv_exact(sock, memoryview(answer))
        if got < len(answer):
            raise _Unanswered(
                f"{where.address} closed the connection before it answered (a Consumer, not a Publisher?)"
            )
        if bytes(answer) != PUBLISHING:
            raise _NotAPublisher(f"{where.address} is not a tensorbus Publisher (a Consumer?)")
        sock.settimeout(None)
        if sock.family != socket.AF_UNIX:
            keep_alive(sock)
        self.connects += 1
        self._receive.latest.trouble(None)
        return sock

    def _read(self, sock: socket.socket) -> None:
        """Read frames until the connection ends. A frame read whole that is refused (over this subscriber's limits,
        failing its checks, or too large for the memory left) is skipped, and the next one read: its prefix said
        where it ends. A prefix that is no frame's ends the connection (the stream is suspect)."""
        limits = self._receive.limits
        prefix = memoryview(bytearray(PREFIX.size))
        while True:
            if recv_exact(sock, prefix) < PREFIX.size:
                raise TransportError("the publisher closed the connection")
            try:
                length = frame_length(prefix, limits)
                frame = self._pool.take(length)
            except (LimitExceeded, MemoryError) as exc:
                self._skip(sock, frame_length(prefix, _UNLIMITED) - PREFIX.size, exc)
                continue
            frame[: PREFIX.size] = prefix
            if recv_exact(sock, frame[PREFIX.size :]) < len(frame) - PREFIX.size:
                raise TransportError("the publisher closed the connection mid-frame")
            self.frames += 1
            try:
                self._receive(frame)
            except (CodecError, MemoryError) as exc:
                self._refused(exc)

    def _skip(self, sock: socket.socket, nbytes: int, why: BaseException) -> None:
        """Read past the rest of a refused frame, into a small buffer (a frame over the limits is never held)."""
        scratch = memoryview(bytearray(min(nbytes, 1 << 16)))
        while nbytes > 0:
            got = recv_exact(sock, scratch[: min(nbytes, len(scratch))])
            if got == 0:
                raise TransportError("the publisher closed the connection mid-frame")
            nbytes -= got
        self.frames += 1
        self._refused(why)

    def _refused(self, why: BaseException) -> None:
        self.skipped += 1
        if self.skipped <= LOGGED_SKIPS or self.skipped % LOGGED_SKIPS == 0:  # (a wrong key refuses every frame)
            log.error("subscriber of %s: a frame skipped (%d so far): %r", self._where.address, self.skipped, why)

    def close(self) -> None:
        """Stop receiving: the receiving thread ends (a connect under way is given up) and its socket is closed."""
        self._closed.set()
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
        if threading.current_thread() is not self._thread:
            self._thread.join(self.options.connect_timeout_s)


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive probes on a subscriber's connection (see KEEPALIVE_IDLE_S), where the system has them."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
