"""A socket producer: connect (and reconnect, resending what was not taken), send frames, flush.

A frame goes out as one scatter-gather `sendmsg` of header and array memory (built and sent in C
for a plain ndarray where the extension is built). The producer keeps each frame until the
consumer took it (by reference: do not modify a sent array before `flush`), and sends those again
after reconnecting, to a restarted consumer or its successor; the acks are read in socket_acks.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

from ..codec.frame import NATIVE, Buffer, MessageId, flat_bytes, is_chunk, restamp
from ..codec.native import crc32c
from ..codec.restamping import restamp_chunks
from ..codec.signing import frame_key, resign
from ..errors import Closed, Rejected, TransportError
from ..options import finite_timeout
from .base import Encoding, backoff_s
from .socket_acks import AckIO, AckStep, ProducerAcks, next_step
from .socket_endpoint import SocketEndpoint
from .stream import (
    ACK_REQUEST_MARKER,
    NATIVE_STREAM,
    AuthRefused,
    SocketOptions,
    UnreleasedDraft,
    c_sends_below,
    handshake_as_producer,
    names_in,
    send_frame,
    set_send_timeout,
    tune_connection,
)

log = logging.getLogger("tensorbus.transports.socket")  # (the socket transport's one logger)
#: a producer whose connection was quiet this long looks for a close (e.g. `idle_timeout_s`) before it sends
PROBE_AFTER_S = 1.0


class SocketProducer(SocketEndpoint, ProducerAcks):
    """The producer side of a socket endpoint: `send`, `send_message`, `flush`, `wait_for_room`, closing."""

    def __init__(self, url: urllib.parse.SplitResult, options: SocketOptions) -> None:
        super().__init__(url, options)
        self._sock: socket.socket | None = None
        #: the consumer's run, from its hello (b"": not connected yet, or it did not say)
        self.incarnation = b""
        self._signed_for: bytes | None = None  # the run the producer signs new frames for
        self._unacked_for: bytes | None = None  # the run the unacknowledged frames are signed for
        self._used_at = 0.0  # when this producer last sent or read acks
        #: the payload size from which `_stream.send_frame` leaves a frame to `send_frame` (every consumer
        #: takes CRCs after frames: large ones are checksummed as they go out)
        self._c_sends_below = c_sends_below(True)
        #: `_send_ndarray`'s steps in C (`_native.ndarray_head`, `_stream.send_frame`), where it applies
        #: (built, not TLS, one frame per tensor)
        self._c_head: Callable[..., bytearray | None] | None = None
        self._c_send: Callable[..., int | None] | None = None
        self._c_flat: Callable[[np.ndarray], Buffer | None] = flat_bytes  # (`_native.flat_bytes` with the C head)
        if NATIVE is not None and NATIVE_STREAM is not None and url.scheme != "tcps" and self.max_frame_bytes is None:
            self._c_head, self._c_send = NATIVE.ndarray_head, NATIVE_STREAM.send_frame
            self._c_flat = NATIVE.flat_bytes
        self._lock = threading.Lock()  # the producer's send lock: its connection, copies and counts
        self._init_acks()
        #: for metrics (`counts`): connections made after the first, frames sent again on them; under `_lock`
        self._connects = self._resent = 0
        self._closed = False  # close began: no more sends or reconnects

    def counts(self) -> dict[str, int]:
        """The connection, unacknowledged bytes, reconnects and frames resent (written under `_lock`, read
        without it: each a snapshot of one int, at most one send behind)."""
        reconnects = max(0, self._connects - 1)
        connected = int(self._sock is not None)
        return {"unacked_bytes": self._unacked_bytes, "reconnects": reconnects, "resent_frames": self._resent,
                "connections": connected}  # fmt: skip

    def signing_identity(self, consumer: bool) -> tuple[str, bytes]:
        """ "socket" and the consumer's incarnation: the producer connects first, to learn it from the hello."""
        with self._lock:
            self._raise_if_closed()
            if self._sock is None:
                self._sock = self._connect()
            self._signed_for = self.incarnation
        return "socket", self.incarnation

    def close(self) -> None:
        """Flush (up to close_timeout_s) what the consumer has not received, and close the connection."""
        self._rejections.clear()  # (each was logged as it came: close waits for the acks of what is left)
        if self._acked < self._sent and not self._closed:  # (not for copies of untaken ones: the producer goes)
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
                self._start_connection(handshake_as_producer(sock, self.secret, self.address))
                set_send_timeout(sock, self.options.send_timeout_s)
                tune_connection(sock)
                for frame, _ in self._unacked:
                    send_frame(sock, frame, True)
                    self._sent += 1
                self._connects += 1
                self._resent += len(self._unacked)
                return sock
            except (AuthRefused, UnreleasedDraft, ssl.SSLCertVerificationError) as exc:
                sock.close()
                raise TransportError(f"{self.address}: {exc}") if isinstance(exc, ssl.SSLError) else exc from None
            except (OSError, TransportError) as exc:
                sock.close()
                left = retry_until - time.monotonic()
                if self._closed or left <= 0:  # (the last attempt comes at the bound, not a backoff step before it)
                    raise TransportError(
                        f"cannot connect to {self.address}: {exc} (gave up after {time.monotonic() - started:.1f}s "
                        f"of retries, as {bound} bounds them; connect_timeout_s bounds each attempt)"
                    ) from None
                log.info("connect to %s failed (%s); retrying in %.2fs", self.address, exc, min(delay, left))
                time.sleep(min(delay, left))
            except BaseException:  # e.g. Ctrl-C while resending: half a frame must not stay on a live socket
                sock.close()
                raise
        raise AssertionError("unreachable")

    def _start_connection(self, incarnation: bytes) -> None:
        """A new connection passed its handshake: take the consumer's incarnation, and count every frame
        kept as not sent on it yet (the caller sends them again first). Also the asyncio producer's."""
        self.incarnation = incarnation
        self._sign_unacked_for(incarnation)
        self.tally.renumber(self._taken, len(self._unacked))  # (a frame resent is timed from its first send)
        self._sent = self._acked = self._taken = 0
        self._unacked_bytes, self._untaken_bytes = sum(n for _, n in self._unacked), 0
        self._ack_buf.clear()
        self._ack_requested = False

    def _sign_unacked_for(self, incarnation: bytes) -> None:
        """Sign the frames to be resent for the consumer run just connected to, if another than before.

        The producer vouches for them again, now: they never reached that run, which refuses frames
        signed for another, and their clock is set to the resend's, so a tensor that waited untaken in
        a consumer that then died is not refused by its successor as too old (`max_frame_age_s`). A
        chunked tensor's clock and signature are inside the message its chunks carry: set anew the same way.
        """
        if self.signing_key is not None and self._unacked_for not in (None, incarnation):
            key = frame_key(self.signing_key, "socket", incarnation)
            chunked: dict[MessageId | None, list[int]] = {}  # a chunked message's chunks, by where they are kept
            for index, (frame, _) in enumerate(self._unacked):
                if restamp(frame) or not is_chunk(memoryview(frame[0]).cast("B")):
                    resign(frame, key)
                else:  # (its clock is inside the message the chunks carry: restamped whole, below)
                    chunked.setdefault(names_in(frame[0])[1], []).append(index)
            for places in chunked.values():
                chunks = [self._unacked[index][0] for index in places]
                again = restamp_chunks(chunks, self.signing_key, key)
                for index, chunk in zip(places, again or chunks, strict=True):
                    if again is None:  # (not every chunk of it is kept: only signed for this run)
                        resign(chunk, key)
                    self._unacked[index] = (chunk, self._unacked[index][1])
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
        c_send = self._c_send
        if c_send is None:
            return False
        frame = self.plain_frame(array, key, metadata, message_id, flags)
        if frame is None:
            return False
        with self._lock:
            limit = self.options.max_unacked_bytes
            if self._rejections.pending or self._closed or self._unacked_bytes >= limit:  # (one test, mostly)
                if self._rejections.pending:
                    self._raise_rejection()
                if self._unacked_bytes >= limit:
                    return False  # (the general path waits for room)
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

    def plain_frame(
        self, array: np.ndarray, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, flags: int
    ) -> list[Buffer] | None:
        """One plain ndarray's frame, its head built in C and its bytes not copied; None where the C head
        does not apply (no C extension, TLS, chunked frames, a tensor it leaves to `encode`)."""
        if self._c_head is None:
            return None
        head = self._c_head(array, key, metadata, message_id, flags)
        if head is None:
            return None
        return [head, self._c_flat(array) or flat_bytes(array)] if array.nbytes else [head]

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
                    return send_frame(self._sock, frame, True)
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

    def _probe_if_quiet(self, quiet_s: float = PROBE_AFTER_S) -> None:
        """After a quiet spell, read what the consumer sent meanwhile: acks, or the end of a connection it
        closed (e.g. after `idle_timeout_s`), which is then replaced before the frame goes out rather than after."""
        now = time.monotonic()
        if self._sock is not None and now - self._used_at >= quiet_s:
            try:
                for _ in range(4):  # (acks, then perhaps the end of the connection: a read each)
                    if not self._read_acks(0):
                        break
            except OSError as exc:
                log.info("connection to %s was closed while quiet (%s); reconnecting", self.address, exc)
                self._drop_connection()
        self._used_at = now

    def _raise_if_closed(self) -> None:
        """Refuse to send or (re)connect once `close` began: the connection would outlive the producer."""
        if self._closed:
            raise Closed(f"the producer for {self.address} is closed")

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the consumer has acknowledged every frame sent so far (resending after reconnects);
        `Rejected` if it refused one (for each refused message, a send or flush raises once).

        Then the copies kept of untaken frames are made the producer's own (`_own_untaken`): from here
        on the application may change the arrays it sent."""
        with self._locked(timeout, "flush"):  # (refused frames are acknowledged too: the wait ends)
            if self._unacked:  # a consumer that went with untaken tensors: resend them to its successor
                self._probe_if_quiet(0.0)
            self._perform(self._flush_steps(timeout))
            self._raise_rejection()

    def wait_for_room(self) -> None:
        """Before a new message: wait while `max_unacked_bytes` are unacknowledged (up to `send_timeout_s`).

        Called between messages, never between the chunks of one, so a message larger than the
        limit still goes out whole.
        """
        limit, timeout = self.options.max_unacked_bytes, self.options.send_timeout_s
        with self._locked(timeout, "wait for room"):
            if self._rejections.pending:
                self._raise_rejection()
            if self._unacked_bytes < limit:
                return
            started = time.monotonic()
            try:
                self._await_acks(
                    lambda: self._unacked_bytes < limit,
                    finite_timeout(timeout),
                    lambda: (
                        f"{self.address} left {self._unacked_bytes} bytes unacknowledged for {timeout}s "
                        f"(max_unacked_bytes={limit}): is the consumer aborted, or not receiving?"
                    ),
                )
            finally:
                self.tally.blocked(started)

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
        """Read acks (asking for them, reconnecting and resending as needed) until `done()`, for at most
        `timeout` seconds (`_ack_steps`, performed blocking); caller holds the lock."""
        self._perform(self._ack_steps(done, timeout, failure))

    def _perform(self, steps: Generator[AckStep, None, None]) -> None:
        """Perform a wait's steps (`_ack_steps`, `_flush_steps`), blocking; caller holds the lock."""
        error: BaseException | None = None
        while (step := next_step(steps, error)) is not None:
            error = None
            kind, value = step
            try:
                if kind is AckIO.CONNECT:
                    self._sock = self._connect(value)
                elif kind is AckIO.ASK:
                    assert self._sock is not None
                    self._sock.sendall(ACK_REQUEST_MARKER)
                elif kind is AckIO.READ:
                    self._read_acks(value or 0.0)
                else:
                    time.sleep(value or 0.0)
            except BaseException as exc:  # (thrown back: the steps handle a broken connection; the rest ends the wait)
                error = exc
