"""`tcp://HOST:PORT`, `tcps://` (TLS) and `unix:///path`: frames straight over a stream socket, no broker.

The consumer listens (127.0.0.1 unless told otherwise) and producers connect, many per consumer.
A frame goes out as one scatter-gather `sendmsg` of header and array memory, and comes in with
`recv_into` a buffer sized from the frame's prefix, so the tensor bytes are never copied twice.
The consumer acknowledges frames once they reached the rendezvous table; a producer keeps
unacknowledged frames (by reference: do not modify a sent array before `flush`) and sends them
again after reconnecting to a restarted consumer. Duplicates are dropped above, by message id.
See `stream.py` for the handshake and acks, `listener.py` for how the consumer accepts producers,
`reactor.py` for how it reads them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import os
import select
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..buffers import BufferPool
from ..codec.frame import NATIVE, Buffer, Limits, MessageId, flat_bytes
from ..codec.native import crc32c
from ..codec.signing import frame_key, resign
from ..errors import Closed, ConfigError, Rejected, TransportError
from ..options import finite_timeout
from .base import Deliver, Encoding, Transport, backoff_s
from .listener import Listener
from .reactor import Reactor
from .stream import (
    ACK,
    ACK_REQUEST_MARKER,
    INCARNATION_BYTES,
    NATIVE_STREAM,
    REFUSAL,
    REFUSED,
    AuthRefused,
    SocketOptions,
    c_sends_below,
    handshake_as_producer,
    names_in,
    send_frame,
    set_send_timeout,
)

log = logging.getLogger(__name__)
#: a producer reads the acks that arrived every this many sends (four times `ack_every_frames` unacked asks for one)
READ_ACKS_EVERY = 64
#: a producer waiting for acks asks again this often when the consumer answers without progress
ACK_POLL_S = 0.02
#: a producer whose connection was quiet this long looks for a close (e.g. `idle_timeout_s`) before it sends
PROBE_AFTER_S = 1.0


def _readable(sock: socket.socket, wait_s: float) -> bool:
    """Whether `sock` has bytes (or an error) to read within `wait_s`; poll, as select() fails on fds >= 1024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(wait_s * 1000))))


def _recv_now(sock: socket.socket) -> bytes | None:
    """What the socket has now; None when that is only part of a TLS record (a blocking read would wait)."""
    if not isinstance(sock, ssl.SSLSocket):
        return sock.recv(4096)
    timeout = sock.gettimeout()
    sock.settimeout(0.0)
    try:
        return sock.recv(4096)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
        return None
    finally:
        sock.settimeout(timeout)


class SocketTransport(Transport):
    """One stream socket per producer; the consumer's `Listener` accepts them and its `Reactor` reads them."""

    schemes = ("tcp", "tcps", "unix")
    acknowledges = True
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
        self._lock = threading.Lock()
        self._unacked: collections.deque[tuple[list[Buffer], int]] = collections.deque()
        self._unacked_bytes = 0
        self._sent = self._acked = 0
        #: for metrics (`counts`): connections made after the first, frames sent again on them; under `_lock`
        self._connects = self._resent = 0
        self._ack_buf = bytearray()
        self._ack_requested = False
        #: the consumer's refusals of this producer's messages, raised one by one by the next sends or flushes
        self._rejections: collections.deque[Rejected] = collections.deque()
        self._last_refused: MessageId | None = None  # (a message's other chunks are refused too: told once)
        self._listener: Listener | None = None
        self.reactor: Reactor | None = None
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

    # -- producer side ------------------------------------------------------------------------------

    def _connect(self, deadline: float | None = None) -> socket.socket:
        """Connect, handshake, and send again every frame the last connection left unacknowledged.

        Retries with backoff for `reconnect_timeout_s`, or until `deadline` (a flush's) if sooner;
        each attempt (connect, TLS, handshake) may take up to `connect_timeout_s`. A consumer that is
        not there refuses at once, so it is `reconnect_timeout_s` that bounds a send to nobody.
        """
        self._raise_if_closed()
        started = time.monotonic()
        retry_until = started + self.options.reconnect_timeout_s
        bound = f"reconnect_timeout_s={self.options.reconnect_timeout_s:g}"
        if deadline is not None and deadline < retry_until:
            retry_until, bound = deadline, "the flush's timeout"
        context = self._ssl_context(server_side=False)
        for delay in backoff_s():
            sock = socket.socket(self.family, socket.SOCK_STREAM)
            try:
                attempt_s = self.options.connect_timeout_s
                if deadline is not None:  # a flush's: no attempt outlasts it
                    left = max(0.05, deadline - time.monotonic())
                    attempt_s = left if attempt_s is None else min(attempt_s, left)
                sock.settimeout(attempt_s)
                sock.connect(self.target)
                if context is not None:
                    sock = context.wrap_socket(sock, server_hostname=self.target[0])
                self._crc_after, self.incarnation = handshake_as_producer(sock, self.secret, self.address)
                self._sign_unacked_for(self.incarnation)
                self._c_sends_below = c_sends_below(self._crc_after)
                set_send_timeout(sock, self.options.send_timeout_s)
                if self.family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sent = self._acked = 0
                self._ack_buf.clear()
                self._ack_requested = False
                for frame, _ in self._unacked:
                    send_frame(sock, frame, self._crc_after)
                    self._sent += 1
                self._connects += 1
                self._resent += len(self._unacked)
                return sock
            except (AuthRefused, ssl.SSLCertVerificationError) as exc:
                sock.close()
                raise TransportError(f"{self.address}: {exc}") if isinstance(exc, ssl.SSLError) else exc from None
            except (OSError, TransportError) as exc:
                sock.close()
                if self._closed or time.monotonic() + delay > retry_until:
                    raise TransportError(
                        f"cannot connect to {self.address}: {exc} (gave up after {time.monotonic() - started:.1f}s "
                        f"of retries, as {bound} bounds them; connect_timeout_s bounds each attempt)"
                    ) from None
                log.info("connect to %s failed (%s); retrying in %.2fs", self.address, exc, delay)
                time.sleep(delay)
            except BaseException:  # e.g. Ctrl-C while resending: half a frame must not stay on a live socket
                sock.close()
                raise
        raise AssertionError("unreachable")

    def counts(self) -> dict[str, int]:
        """A producer's unacknowledged bytes, reconnects and frames resent (written under `_lock`, read
        without it: each a snapshot of one int, at most one send behind)."""
        if self._listener is not None:
            return {}
        reconnects = max(0, self._connects - 1)
        return {"unacked_bytes": self._unacked_bytes, "reconnects": reconnects, "resent_frames": self._resent}

    def signing_identity(self, consumer: bool) -> tuple[str, bytes]:
        """ "socket" and the consumer's incarnation: a producer connects first, to learn it from the hello."""
        if not consumer:
            with self._lock:
                self._raise_if_closed()
                if self._sock is None:
                    self._sock = self._connect()
                self._signed_for = self.incarnation
        return "socket", self.incarnation

    def _sign_unacked_for(self, incarnation: bytes) -> None:
        """Sign the frames to be resent for the consumer run just connected to, if another than before.

        The producer vouches for them again: they never reached that run, which refuses frames signed for another.
        """
        if self.signing_key is not None and self._unacked_for not in (None, incarnation):
            key = frame_key(self.signing_key, "socket", incarnation)
            for frame, _ in self._unacked:
                resign(frame, key)
        self._unacked_for = incarnation

    def _signed_for_now(self, frame: list[Buffer]) -> None:
        """Sign a new frame again if the connection changed consumer runs since the producer signed it."""
        if self.signing_key is not None and self._signed_for not in (None, self.incarnation):
            resign(frame, frame_key(self.signing_key, "socket", self.incarnation))

    def send(self, frame: list[Buffer], *, key: str | None) -> None:
        """Send one frame; after a broken connection, reconnect (resending what is unacked) and retry once."""
        with self._lock:
            self._raise_if_closed()  # even while close waits for this lock with the connection still open
            self._probe_if_quiet()
            self._keep_until_acked(frame, self._send_retrying(frame))

    def send_message(
        self, tensor: Any, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, encoding: Encoding
    ) -> None:
        """Send one tensor; a plain ndarray (most sends) is built and sent in C where it can be."""
        flags = encoding.plain_flags
        if (
            flags is None
            or type(tensor) is not np.ndarray
            or not self._send_ndarray(tensor, key, metadata, message_id, flags)
        ):
            super().send_message(tensor, key, metadata, message_id, encoding)

    def encoding(self, wanted: Encoding) -> Encoding:
        """`wanted`, with a whole frame's CRC left to `send_frame`, which computes it while sending."""
        return dataclasses.replace(wanted, deferred_checksum=True)

    def _send_ndarray(
        self, array: np.ndarray, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, flags: int
    ) -> bool:
        """`encode` and `send` of one plain ndarray in the fewest steps: the frame built and sent in C.

        A small tensor's time is mostly such steps. False, with nothing sent, where it does not apply
        (no C extension, TLS, chunked frames, no room, a tensor the C head leaves to `encode`).
        """
        if self._rejections:
            self._raise_rejection()
        c_head, c_send = self._c_head, self._c_send
        if c_head is None or c_send is None or self._unacked_bytes >= self.options.max_unacked_bytes:
            return False
        head = c_head(array, key, metadata, message_id, flags)
        if head is None:
            return False
        frame: list[Buffer] = [head, flat_bytes(array)] if array.nbytes else [head]
        with self._lock:
            self._raise_if_closed()
            self._probe_if_quiet()
            sock = self._sock
            sent: int | None = None
            if sock is not None:
                try:
                    sent = c_send(sock.fileno(), frame, self._c_sends_below, crc32c)
                except BaseException as exc:
                    sent = self._send_retrying(frame, exc)
            self._keep_until_acked(frame, self._send_retrying(frame) if sent is None else sent)
        return True

    def _send_retrying(self, frame: list[Buffer], failed: BaseException | None = None) -> int:
        """Send `frame` (`failed`: how a first attempt ended), reconnecting once after a broken connection.

        Caller holds the lock. Returns the bytes sent.
        """
        for attempt in (1, 2):
            if failed is None:
                try:
                    if self._sock is None:
                        self._sock = self._connect()
                    self._signed_for_now(frame)
                    return send_frame(self._sock, frame, self._crc_after)
                except BaseException as exc:
                    failed = exc
            self._drop_connection()  # a frame cut off part way: the consumer drops what came of it
            if not isinstance(failed, OSError):  # e.g. Ctrl-C, which would leave the rest unsent
                raise failed
            if isinstance(failed, (TimeoutError, BlockingIOError)):  # the consumer stopped reading
                raise TransportError(
                    f"sending to {self.address} made no progress for {self.options.send_timeout_s}s"
                ) from None
            if attempt == 2:
                raise TransportError(f"sending to {self.address} failed: {failed}") from None
            log.warning("connection to %s broke (%s); reconnecting", self.address, failed)
            failed = None
        raise AssertionError("unreachable")

    def _probe_if_quiet(self) -> None:
        """After a quiet spell, read what the consumer sent meanwhile: acks, or the end of a connection it
        closed (e.g. after `idle_timeout_s`), which is then replaced before the frame goes out rather than after."""
        now = time.monotonic()
        if self._sock is not None and now - self._used_at >= PROBE_AFTER_S:
            try:
                self._read_acks(0)
            except OSError as exc:
                log.info("connection to %s was closed while quiet (%s); reconnecting", self.address, exc)
                self._drop_connection()
        self._used_at = now

    def _keep_until_acked(self, frame: list[Buffer], nbytes: int) -> None:
        """Keep a sent frame until it is acked; read the acks that came every `READ_ACKS_EVERY` sends."""
        self._unacked.append((frame, nbytes))
        self._unacked_bytes += nbytes
        self._sent += 1
        if self._sent % READ_ACKS_EVERY == 0 or self._unacked_bytes >= self.options.max_unacked_bytes:
            self._trim_acked()

    def _raise_if_closed(self) -> None:
        """Refuse to send or (re)connect once `close` began: the connection would outlive the producer."""
        if self._closed:
            raise Closed(f"the producer for {self.address} is closed")

    def forget_last(self, count: int) -> None:
        """Drop the last `count` frames sent (the chunks of a message that failed part way) from those
        resent on reconnect: a message that can never complete would hold up the consumer's acks.

        A failed send has dropped the connection already; after an interrupt between two chunks it
        is dropped here, as its acks would wait for the rest of the message too.
        """
        with self._lock:
            self._drop_connection()
            for _ in range(min(count, len(self._unacked))):
                _, n = self._unacked.pop()
                self._unacked_bytes -= n

    def abandon(self) -> None:
        """Close this process's descriptor of the connection: the parent's stays open (no shutdown, no FIN)."""
        self._drop_connection()  # (close, not shutdown)
        self._unacked.clear()  # the parent's to resend
        self._unacked_bytes = 0

    def _drop_connection(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._ack_requested = False

    def _trim_acked(self) -> None:
        """Release the frames acks already received cover; never blocks.

        The consumer acks every `ack_every_frames` frames by itself (each ack costs it a system call
        that also wakes this side): an ack is asked for only when that plainly is not happening.
        """
        assert self._sock is not None
        overdue = (
            len(self._unacked) >= 4 * self.options.ack_every_frames
            or self._unacked_bytes >= self.options.max_unacked_bytes
        )
        try:
            if overdue and not self._ack_requested:
                self._sock.sendall(ACK_REQUEST_MARKER)
                self._ack_requested = True
            self._read_acks(0)
        except OSError as exc:
            log.warning("connection to %s broke (%s); frames will be resent on reconnect", self.address, exc)
            self._drop_connection()

    def _read_acks(self, wait_s: float) -> None:
        """Apply the acks that arrive within `wait_s` seconds (0: only those already here)."""
        sock = self._sock
        assert sock is not None
        pending = isinstance(sock, ssl.SSLSocket) and sock.pending()
        if not pending and not _readable(sock, wait_s):
            return
        data = _recv_now(sock)
        if data is None:
            return  # part of a TLS record: the rest comes with a later read
        if not data:
            raise ConnectionResetError("consumer closed the connection")
        self._ack_buf += data
        while len(self._ack_buf) >= ACK.size:
            (count,) = ACK.unpack_from(self._ack_buf)
            if count & REFUSED:
                if not self._take_refusal():
                    return  # (the rest of it comes with a later read)
                continue
            del self._ack_buf[: ACK.size]
            if not self._acked <= count <= self._acked + len(self._unacked):
                raise ConnectionResetError(f"the consumer acked {count} frames; {self._sent} were sent")
            self._ack_requested = False
            for _ in range(count - self._acked):
                _, n = self._unacked.popleft()
                self._unacked_bytes -= n
            self._acked = count

    def _take_refusal(self) -> bool:
        """Take a REFUSAL off the front of the ack buffer (False: not all of it is here yet); a message's
        first refused frame becomes a `Rejected` for the next send or flush to raise."""
        if len(self._ack_buf) < REFUSAL.size:
            return False
        field, length = REFUSAL.unpack_from(self._ack_buf)
        if len(self._ack_buf) < REFUSAL.size + length:
            return False
        reason = bytes(self._ack_buf[REFUSAL.size : REFUSAL.size + length]).decode("utf-8", "replace")
        del self._ack_buf[: REFUSAL.size + length]
        index = field & ~REFUSED
        if not self._acked <= index < self._acked + len(self._unacked):
            raise ConnectionResetError(f"the consumer refused frame {index}; {self._sent} were sent")
        key, message_id = names_in(self._unacked[index - self._acked][0][0])
        if message_id is not None and message_id == self._last_refused:
            return True  # another chunk of a message already refused (and perhaps raised already)
        self._last_refused = message_id
        log.warning("%s refused message %s (key %r): %s", self.address, message_id, key, reason)
        self._rejections.append(
            Rejected(
                f"{self.address} refused message {message_id} (key {key!r}): {reason}; it is not sent again",
                key=key,
                message_id=message_id,
                reason=reason,
            )
        )
        return True

    def _raise_rejection(self) -> None:
        """Raise the consumer's oldest refusal not raised yet, if there is one."""
        try:
            rejection = self._rejections.popleft()
        except IndexError:  # (none; or another thread's send raised the last one just now)
            return
        raise rejection

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the consumer has acknowledged every frame sent so far (resending after reconnects);
        `Rejected` if it refused one (for each refused message, a send or flush raises once)."""
        with self._locked(timeout, "flush"):  # (refused frames are acknowledged too: the wait ends)
            self._await_acks(
                lambda: not self._unacked,
                timeout,
                lambda: f"{len(self._unacked)} frames unacknowledged by {self.address} after {timeout}s",
            )
            self._raise_rejection()

    def wait_for_room(self) -> None:
        """Before a new message: wait while `max_unacked_bytes` are unacknowledged (up to `send_timeout_s`).

        Called between messages, never between the chunks of one, so a message larger than the
        limit still goes out whole.
        """
        if self._rejections:
            self._raise_rejection()
        limit = self.options.max_unacked_bytes
        if self._unacked_bytes < limit:
            return
        timeout = self.options.send_timeout_s
        with self._locked(timeout, "wait for room"):
            self._await_acks(
                lambda: self._unacked_bytes < limit,
                finite_timeout(timeout),
                lambda: (
                    f"{self.address} left {self._unacked_bytes} bytes unacknowledged for {timeout}s "
                    f"(max_unacked_bytes={limit}): is the consumer aborted, or not receiving?"
                ),
            )

    @contextlib.contextmanager
    def _locked(self, timeout: float | None, what: str) -> Iterator[None]:
        """Hold the send lock, waiting at most `timeout` for a send that holds it (None: as long as it takes)."""
        if not self._acquire(timeout):
            raise TransportError(f"{what} on {self.address}: a send has held the connection for over {timeout}s")
        try:
            yield
        finally:
            self._lock.release()

    def _acquire(self, timeout: float | None) -> bool:
        """Take the send lock within `timeout` seconds (None, or too long for the platform: as long as it takes)."""
        timeout = finite_timeout(timeout)
        return self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0))

    def _await_acks(self, done: Callable[[], bool], timeout: float | None, failure: Callable[[], str]) -> None:
        """Read acks (asking for them, reconnecting and resending as needed) until `done()`; caller holds the lock."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TransportError(failure())
            acked = self._acked
            try:
                if self._sock is None:
                    try:
                        self._sock = self._connect(deadline)
                    except TransportError as exc:  # the wait's time ran out while reconnecting: say what waited
                        if deadline is None or time.monotonic() < deadline:
                            raise
                        raise TransportError(f"{failure()}; the last reconnect: {exc}") from None
                if not self._ack_requested:
                    self._sock.sendall(ACK_REQUEST_MARKER)
                    self._ack_requested = True
                self._read_acks(min(remaining, 1.0) if remaining is not None else 1.0)
                if self._acked == acked and not self._ack_requested:  # answered, but nothing new: don't spin
                    time.sleep(min(ACK_POLL_S, remaining) if remaining is not None else ACK_POLL_S)
            except OSError as exc:
                if self._sock is not None:
                    with contextlib.suppress(OSError):
                        self._read_acks(0)  # a consumer that closed may have acked everything first
                self._drop_connection()
                if not done():
                    log.warning("connection to %s broke while awaiting acks (%s); reconnecting", self.address, exc)

    # -- consumer side ------------------------------------------------------------------------------

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        """Bind, then accept producers on a background thread; their frames are read by a `Reactor`."""
        context = self._ssl_context(server_side=True)
        self._listener = Listener(
            self.family, self.target, self.options, self.secret, lambda: self.address, self.incarnation
        )
        bound = self._listener.bind()
        if self.family != socket.AF_UNIX:
            host, port = bound[:2]
            self.url = self.url._replace(netloc=f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        self.reactor = Reactor(deliver, limits, self.options, self._pool)
        self._listener.start(self.reactor, context)

    def sender(self) -> str | None:
        """The address of the producer connection being read (on the reading thread)."""
        name = None if self.reactor is None else self.reactor.reading
        if isinstance(name, tuple) and len(name) >= 2:
            host, port = name[:2]
            return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
        return None if name is None else (str(name) or "a unix-socket producer")

    def read_while_waiting(self, done: threading.Lock, deadline: float | None) -> bool:
        """Wait for `done`, reading frames on the calling thread meanwhile (see `Reactor.read_while_waiting`)."""
        assert self.reactor is not None
        return self.reactor.read_while_waiting(done, deadline)

    def room_opened(self) -> None:
        """The consumer's table has room again (or a receiver waits): offer it what is held back."""
        if self.reactor is not None:
            self.reactor.room_opened()

    def close(self) -> None:
        """Flush (up to close_timeout_s) and close the producer connection, or stop listening and drop every peer."""
        self._rejections.clear()  # (each was logged as it came: close waits for the acks of what is left)
        if self._unacked and not self._closed:
            try:
                self.flush(self.options.close_timeout_s)
            except Rejected:
                pass  # (logged as it came)
            except TransportError as exc:
                log.warning("closing with frames not acknowledged: %s", exc)
        self._closed = True
        if self._acquire(self.options.close_timeout_s):
            try:
                self._drop_connection()
            finally:
                self._lock.release()
        elif (sock := self._sock) is not None:  # a send stuck on a consumer that stopped reading holds the lock:
            with contextlib.suppress(OSError):  # wake it (it fails, drops the connection, and does not reconnect)
                sock.shutdown(socket.SHUT_RDWR)
        if self._listener is not None:
            self._listener.close()
