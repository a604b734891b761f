"""Producer handshakes on one event loop: a connection that never answers costs a socket, not a thread.

Each accepted connection is a small state machine (TLS handshake, HELLO out, PROOF in, VERDICT
out) driven by one selector on the accept thread. A peer that stays silent holds nothing but its
descriptor until its `connect_timeout_s` runs out, so any number of them cannot keep an honest
producer waiting: its handshake takes the few round trips it needs. Past `handshake_cap()` at once,
the oldest is dropped (an honest handshake takes milliseconds; the oldest are the silent ones).
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import resource
import selectors
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from ..logs import LogLimiter
from .stream import (
    HELLO,
    HELLO_AUTH,
    HELLO_INCARNATION,
    HELLO_MAGIC,
    HELLO_REFUSALS,
    HELLO_TRAILING_CRC,
    PROOF_BYTES,
    PROTOCOL_VERSION,
    VERDICT_ACCEPTED,
    VERDICT_REFUSED,
    proof,
    turned_down,
)

log = logging.getLogger(__name__)
#: handshakes in progress at once, at most (see `handshake_cap`); past it the oldest is dropped
MAX_HANDSHAKES = 4096


def handshake_cap() -> int:
    """How many handshakes may be in progress at once: MAX_HANDSHAKES, or a quarter of the process's
    descriptor limit if that is less (silent peers must not use up the descriptors accepting needs)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_HANDSHAKES if soft == resource.RLIM_INFINITY else max(16, min(MAX_HANDSHAKES, soft // 4))


class Handshake:
    """One connection between accept and verdict: what it still has to send, what it has received."""

    def __init__(self, conn: socket.socket, peer: Any, deadline: float | None) -> None:
        self.conn, self.peer, self.deadline = conn, peer, deadline
        self.fd = conn.fileno()
        self.writing = False  # also waiting for room to write (TLS)
        self.tls_pending = isinstance(conn, ssl.SSLSocket)
        self.nonce = b""
        self.out = b""
        self.answer = bytearray()
        self.done = False  # the verdict is out: hand it on (accepted) or close it (refused)
        self.accepted = False


class Greeter:
    """Runs the handshakes of accepted connections; `admit(conn, peer)` gets the ones that passed."""

    def __init__(
        self,
        secret: bytes | None,
        incarnation: bytes,
        timeout_s: float | None,
        room: Callable[[], str | None],
        admit: Callable[[socket.socket, Any], None],
    ) -> None:
        self.secret, self.incarnation, self.timeout_s = secret, incarnation, timeout_s
        self.room, self.admit = room, admit  # room(): None, or why no connection can be taken now
        self.selector = selectors.DefaultSelector()
        self.pending: collections.OrderedDict[int, Handshake] = collections.OrderedDict()
        self.max_handshakes = handshake_cap()
        self._refusals = LogLimiter(log, "producers refused")  # (per address: anyone can provoke these)

    def start(self, conn: socket.socket, peer: Any, context: ssl.SSLContext | None) -> None:
        """Begin the handshake of a connection just accepted."""
        conn.setblocking(False)
        if context is not None:
            try:
                conn = context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError) as exc:
                log.info("handshake with %s failed: %s", peer, exc)
                conn.close()
                return
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        shake = Handshake(conn, peer, deadline)
        if len(self.pending) >= self.max_handshakes:
            _, oldest = self.pending.popitem(last=False)
            self._close(oldest, f"dropped (over {self.max_handshakes} handshakes at once, this the oldest)")
        self.pending[shake.fd] = shake
        self.selector.register(conn, selectors.EVENT_READ, shake)
        self._advance(shake)

    def watch(self, sock: socket.socket, on_ready: Callable[[], None] | None) -> None:
        """Call `on_ready()` whenever `sock` (the listening socket) is readable; None: stop."""
        if on_ready is None:
            self.selector.unregister(sock)
        else:
            self.selector.register(sock, selectors.EVENT_READ, on_ready)

    def run_once(self, wait_s: float) -> None:
        """Advance what can move within `wait_s` (watched sockets, handshakes); end handshakes past their deadline."""
        for key, _ in self.selector.select(wait_s):
            if isinstance(key.data, Handshake):
                self._advance(key.data)
            else:
                key.data()
        now = time.monotonic()
        while self.pending:
            shake = next(iter(self.pending.values()))
            if shake.deadline is None or shake.deadline > now:
                break  # (in order of arrival: the deadlines are too)
            self._close(shake, "timed out (connect_timeout_s)", logging.INFO)

    def _advance(self, shake: Handshake) -> None:
        """Take the handshake as far as the bytes at hand allow."""
        try:
            if shake.tls_pending:
                shake.conn.do_handshake()  # type: ignore[attr-defined]
                shake.tls_pending = False
            if not shake.nonce:
                shake.nonce = self.incarnation + os.urandom(32 - len(self.incarnation))
                flags = HELLO_TRAILING_CRC | HELLO_REFUSALS | HELLO_INCARNATION | (HELLO_AUTH if self.secret else 0)
                shake.out = HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, flags, shake.nonce)
            self._flush(shake)
            if not shake.done:
                self._read_proof(shake)
                self._flush(shake)
            if shake.done and not shake.out:
                self._finish(shake)
        except ssl.SSLWantWriteError:
            self._want_write(shake, True)
        except ssl.SSLWantReadError:
            self._want_write(shake, False)
        except BlockingIOError:
            self._want_write(shake, bool(shake.out))  # (bytes left to send: the socket was full)
        except (OSError, ssl.SSLError, ValueError) as exc:
            left = isinstance(exc, (BrokenPipeError, ConnectionResetError, EOFError, ssl.SSLEOFError))
            self._close(shake, f"failed: {exc}", logging.INFO if left else logging.WARNING)

    def _want_write(self, shake: Handshake, writing: bool) -> None:
        """Watch the connection for room to write as well as for bytes, or stop watching for room."""
        if shake.writing != writing and shake.fd in self.pending:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0)
            self.selector.modify(shake.conn, events, shake)
            shake.writing = writing

    def _flush(self, shake: Handshake) -> None:
        """Send what the handshake has to say (raises a would-block error while the socket is full)."""
        while shake.out:
            sent = shake.conn.send(shake.out)
            shake.out = shake.out[sent:]

    def _read_proof(self, shake: Handshake) -> None:
        """Read the producer's PROOF; once whole, decide and queue the VERDICT."""
        while len(shake.answer) < PROOF_BYTES:
            data = shake.conn.recv(PROOF_BYTES - len(shake.answer))
            if not data:
                raise ConnectionResetError("it closed the connection without answering")
            shake.answer += data
        shake.done = True
        source = str(shake.peer[0]) if isinstance(shake.peer, tuple) else ""
        if self.secret is not None and not hmac.compare_digest(bytes(shake.answer), proof(self.secret, shake.nonce)):
            self._refusals.log(
                logging.WARNING, source, "refused producer %s: no valid proof of the shared secret", shake.peer
            )
            shake.out = VERDICT_REFUSED
            return
        reason = self.room()
        if reason is not None:
            self._refusals.log(logging.WARNING, source, "refused producer %s: %s", shake.peer, reason)
            shake.out = turned_down(reason)
            return
        shake.accepted = True
        shake.out = VERDICT_ACCEPTED

    def _finish(self, shake: Handshake) -> None:
        """The verdict is out: hand an accepted connection on, close a refused one."""
        self._forget(shake)
        if shake.accepted:
            shake.conn.setblocking(True)
            self.admit(shake.conn, shake.peer)
        else:
            _close_quietly(shake.conn)

    def _forget(self, shake: Handshake) -> None:
        self.pending.pop(shake.fd, None)
        try:
            self.selector.unregister(shake.conn)
        except (KeyError, ValueError, OSError):
            pass

    def _close(self, shake: Handshake, why: str, level: int = logging.INFO) -> None:
        log.log(level, "handshake with %s %s", shake.peer or "a producer", why)
        self._forget(shake)
        _close_quietly(shake.conn)

    def close(self) -> None:
        """Drop every handshake still in progress."""
        for shake in list(self.pending.values()):
            self._forget(shake)
            _close_quietly(shake.conn)
        self.selector.close()


def _close_quietly(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        pass
