"""A socket producer's sends on the event loop: tcp:// and unix:// frames written by the loop itself.

The blocking producer underneath (`tensorbus.Producer`) numbers, encodes and signs as ever, and its
socket transport keeps the copies and reads the acks (socket_acks.py); what waits moves here: the
connect and handshake, writing a frame (its buffers by scatter-gather `sendmsg` on a non-blocking
socket: never joined, never copied into a loop transport's buffer; a large frame's CRC computed slice
by slice as it goes, `stream.wire_batches`), waiting for room (`max_unacked_bytes`) and for acks.
Everything runs on the loop's thread, one message at a time (an `asyncio.Lock`); no thread starts.

tcps:// keeps the worker thread (producer.py): TLS writes on a non-blocking socket would need the
record layer driven here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from .. import api
from ..codec.frame import Buffer, MessageId
from ..codec.native import crc32c
from ..errors import Closed, Rejected, TransportError
from ..options import finite_timeout
from ..transports.base import backoff_s
from ..transports.socket import SocketProducer
from ..transports.socket_acks import READ_ACKS_EVERY, AckIO, AckStep, next_step
from ..transports.stream import (
    ACK_REQUEST_MARKER,
    HELLO,
    IOV_MAX,
    NATIVE_STREAM,
    REASON,
    REFUSALS_WANTED,
    VERDICT_REASON,
    AuthRefused,
    Refused,
    c_sends_below,
    check_verdict,
    hello_terms,
    proof,
    read_hello,
    tune_connection,
    wire_batches,
)
from .turns import Turns

log = logging.getLogger("tensorbus.transports.socket")  # (the socket transport's one logger)
#: the schemes whose producers send on the loop
SCHEMES = ("tcp", "unix")
#: `_stream.send_frame_from` where the C extension is built (None: the Python path), and the payload size
#: from which it leaves an unsealed frame to that path (checksummed slice by slice as it goes)
SEND_FROM: Callable[..., tuple[int, int] | None] | None = getattr(NATIVE_STREAM, "send_frame_from", None)
C_SENDS_BELOW = c_sends_below(True)


def sends_on_loop(producer: api.Producer) -> bool:
    """Whether the loop can send this producer's frames itself (tcp://, unix://; no metrics or tracing,
    whose hooks wrap the blocking send; no compression or signing, which would run over a whole tensor on
    the loop: those producers send on their worker thread)."""
    transport = producer.transport
    return (
        isinstance(transport, SocketProducer)
        and transport.url.scheme in SCHEMES
        and producer._monitor is None
        and producer._encoding.plain_flags is not None
    )


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class Turn:
    """One message (or flush) at a time on a connection: an `asyncio.Lock`, and the tasks that hold it or wait for
    it (the loop's thread alone counts them). `free` when there are none: a lock just released is not locked while
    the task it woke has not run yet, and a send that wrote then would come between that task and its turn."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._tasks = 0

    def free(self) -> bool:
        """No task holds the turn or waits for it: taking it now would not suspend."""
        return not self._tasks

    def locked(self) -> bool:
        return self._lock.locked()

    async def __aenter__(self) -> None:
        if not self._tasks:  # (a fresh lock: an asyncio.Lock serves the first loop it waited on only, and a
            self._lock = asyncio.Lock()  # producer may be used in one `asyncio.run` after another)
        self._tasks += 1
        try:
            await self._lock.acquire()
        except BaseException:
            self._tasks -= 1
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()
        self._tasks -= 1


class LoopSender:
    """Sends a blocking socket producer's messages on the running loop (see the module docstring)."""

    def __init__(self, producer: api.Producer) -> None:
        self.producer = producer
        self.transport: SocketProducer = producer.transport  # type: ignore[assignment]
        self._turn = Turn()
        self._turns = Turns()

    # -- waiting on the loop ------------------------------------------------------------------

    async def _ready(self, sock: socket.socket, write: bool, timeout: float | None) -> bool:
        """Wait until `sock` is writable (`write`) or readable; False if `timeout` seconds passed first."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        fd = sock.fileno()
        if write:
            loop.add_writer(fd, _settle, future, True)
        else:
            loop.add_reader(fd, _settle, future, True)
        timer = None if timeout is None else loop.call_later(timeout, _settle, future, False)
        try:
            return await future
        finally:
            self._turns.waited()
            (loop.remove_writer if write else loop.remove_reader)(fd)
            if timer is not None:
                timer.cancel()

    async def _write(self, sock: socket.socket, buffers: list[Buffer]) -> None:
        """Write every byte of `buffers`, awaiting room; a TransportError after `send_timeout_s` without progress."""
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        first = 0
        while first < len(views):
            try:
                sent = sock.sendmsg(views[first : first + IOV_MAX])
            except (BlockingIOError, InterruptedError):
                await self._room_to_write(sock)
                continue
            while sent and sent >= len(views[first]):
                sent -= len(views[first])
                first += 1
            if sent:
                views[first] = views[first][sent:]

    async def _room_to_write(self, sock: socket.socket) -> None:
        """Await room in the socket; a TransportError after `send_timeout_s` without it."""
        timeout = finite_timeout(self.transport.options.send_timeout_s)
        if not await self._ready(sock, True, timeout):
            raise TransportError(f"sending to {self.transport.address} made no progress for {timeout}s") from None

    async def _send_frame(self, sock: socket.socket, frame: list[Buffer], written: int = 0) -> int:
        """Write one frame as `stream.send_frame` would (sealed, or its CRC after it); the bytes of the frame.
        `written`: bytes of it `send_frame_from` wrote on `sock` already.

        In C where it is built (`_stream.send_frame_from`: as far as the socket takes, each call), but for
        a large frame to checksum as it goes; else, and for that one, batch by batch (`stream.wire_batches`).
        """
        if SEND_FROM is not None:
            progress = SEND_FROM(sock.fileno(), frame, written, C_SENDS_BELOW, crc32c)
            if progress is not None:
                sent, total = progress
                while sent < total:
                    await self._room_to_write(sock)
                    sent = SEND_FROM(sock.fileno(), frame, sent, C_SENDS_BELOW, crc32c)[0]  # type: ignore[index]  # (None only from byte 0)
                return int(total)
        for at, batch in enumerate(wire_batches(frame, True)):  # (~1 MiB each: the loop's tasks run between)
            if at and self._turns.due():  # (not after the last: a frame written whole is booked before any yield)
                await asyncio.sleep(0)
            await self._write(sock, batch)
        return sum(memoryview(b).nbytes for b in frame)

    # -- connecting ---------------------------------------------------------------------------

    async def _handshake(self, sock: socket.socket) -> bytes:
        """The producer's side of the handshake (`stream.handshake_as_producer`), awaited."""
        loop, t = asyncio.get_running_loop(), self.transport
        _, nonce = read_hello(await _recv_exactly(sock, HELLO.size), t.secret, t.address)
        await loop.sock_sendall(sock, proof(t.secret, nonce))
        verdict = await loop.sock_recv(sock, 1)
        if verdict == VERDICT_REASON:
            size = await _recv_exactly(sock, REASON.size)
            text = await _recv_exactly(sock, REASON.unpack(size)[0]) if len(size) == REASON.size else b""
            raise Refused(f"{t.address} refused the connection: {text.decode('utf-8', 'replace') or 'no reason given'}")
        check_verdict(verdict, t.address)
        await loop.sock_sendall(sock, REFUSALS_WANTED)
        return hello_terms(nonce)

    async def _connect(self, deadline: float | None = None) -> socket.socket:
        """Connect, handshake and send again what the last connection left unacknowledged, retrying as
        `SocketProducer._connect` does (`reconnect_timeout_s`, `connect_timeout_s` per attempt)."""
        loop, t = asyncio.get_running_loop(), self.transport
        t._raise_if_closed()
        started = time.monotonic()
        retry_until = started + t.options.reconnect_timeout_s
        bound = f"reconnect_timeout_s={t.options.reconnect_timeout_s:g}"
        if deadline is not None and deadline < retry_until:
            retry_until, bound = deadline, "the flush's timeout"
        for delay in backoff_s():
            sock = socket.socket(t.family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                attempt_s = t.options.connect_timeout_s
                if deadline is not None:
                    left = max(0.05, deadline - time.monotonic())
                    attempt_s = left if attempt_s is None else min(attempt_s, left)
                try:
                    await asyncio.wait_for(self._greet(loop, sock), attempt_s)
                except asyncio.TimeoutError:
                    raise TransportError(f"no handshake with {t.address} within {attempt_s:g}s") from None
                for frame, _ in list(t._unacked):
                    await self._send_frame(sock, frame)
                    t._sent += 1
                    if self._turns.due():
                        await asyncio.sleep(0)
                t._connects += 1
                t._resent += len(t._unacked)
                t._sock = sock
                return sock
            except AuthRefused:
                sock.close()
                raise
            except (OSError, TransportError) as exc:
                sock.close()
                left = retry_until - time.monotonic()
                if t._closed or left <= 0:
                    raise TransportError(
                        f"cannot connect to {t.address}: {exc} (gave up after {time.monotonic() - started:.1f}s "
                        f"of retries, as {bound} bounds them; connect_timeout_s bounds each attempt)"
                    ) from None
                log.info("connect to %s failed (%s); retrying in %.2fs", t.address, exc, min(delay, left))
                await asyncio.sleep(min(delay, left))
            except BaseException:  # e.g. cancelled while resending: half a frame must not stay on a live socket
                sock.close()
                raise
        raise AssertionError("unreachable")

    async def _greet(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        t = self.transport
        await loop.sock_connect(sock, t.target)
        t._start_connection(await self._handshake(sock))
        tune_connection(sock)

    def _drop(self) -> None:
        """Close the connection (a frame cut off part way: the consumer drops what came of it)."""
        self.transport._drop_connection()

    # -- sending ------------------------------------------------------------------------------

    async def send(self, key: str | None, tensor: Any, metadata: dict[str, Any] | None) -> MessageId:
        """Send one tensor; returns once its frames are written (kept until taken, as the blocking producer does).

        A send cancelled while its frame is being written drops the connection (the consumer drops the
        part it got; the frames not acknowledged go again on the next one): a frame goes whole or not at all.
        """
        if self._turns.due():
            await asyncio.sleep(0)
        if self._turn.free():  # (no send or flush under way, or waiting: nothing to wait behind)
            begun = self._write_at_once(key, tensor, metadata)
            if begun is not None:
                message_id, frame, written, whole = begun
                if whole:
                    return message_id
                async with self._turn:  # (taken at once: nothing ran since the check)
                    if frame is None:  # (no plain frame for it: encoded as any tensor is)
                        await self._send_message(tensor, key, metadata, message_id, plain=False)
                    elif written:  # (the rest, as the socket takes it)
                        await self._send_retrying(frame, written)
                    else:  # (a large frame, checksummed as it goes; or, the connection broken, on a new one)
                        await self._send_retrying(frame, attempts=1 if self.transport._sock is None else 2)
                return message_id
        async with self._turn:
            p = self.producer
            if p._closed:
                raise Closed("send on a closed Producer")
            message_id = (p.producer_id, next(p._sequence))
            await self._send_message(tensor, key, metadata, message_id)
        return message_id

    def _write_at_once(
        self, key: str | None, tensor: Any, metadata: dict[str, Any] | None
    ) -> tuple[MessageId, list[Buffer] | None, int, bool] | None:
        """A plain ndarray's send without suspending, where nothing needs awaiting (connected, room, no refusal
        to raise): coroutines and a lock fewer per tensor, most of a small tensor's cost on the loop beside its
        system call. None, with nothing done, where it does not apply. Else its message id, its frame (None: no
        plain frame, encode it), the bytes of it the current connection took (0 where it broke: dropped), and
        whether that is all of it (the send is done, booked as `_send_retrying` books it)."""
        p, t = self.producer, self.transport
        sock, flags, limit = t._sock, p._encoding.plain_flags, t.options.max_unacked_bytes
        if (
            SEND_FROM is None
            or sock is None
            or flags is None
            or type(tensor) is not np.ndarray
            or p._closed
            or t._closed
            or t._rejections.pending
            or t._unacked_bytes >= limit
        ):
            return None
        t._probe_if_quiet()
        if t._sock is not sock:  # (the consumer had closed it: connecting awaits)
            return None
        message_id = (p.producer_id, next(p._sequence))
        frame = t.plain_frame(tensor, key, metadata, message_id, flags)
        if frame is None:
            return message_id, None, 0, False
        try:
            t._signed_for_now(frame)
            progress = SEND_FROM(sock.fileno(), frame, 0, C_SENDS_BELOW, crc32c)
        except OSError as exc:
            log.warning("connection to %s broke (%s); reconnecting", t.address, exc)
            self._drop()
            return message_id, frame, 0, False
        except BaseException:
            self._drop()
            raise
        if progress is None:  # (a large frame: checksummed slice by slice as it goes, awaited)
            return message_id, frame, 0, False
        sent, total = progress
        if sent < total:
            return message_id, frame, sent, False
        self._book(frame, total)
        return message_id, frame, total, True

    async def _send_message(
        self, tensor: Any, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, plain: bool = True
    ) -> None:
        """Send one message's frames, holding the turn (`plain` False: the C head declined it already)."""
        t = self.transport
        if t._rejections.pending or t._unacked_bytes >= t.options.max_unacked_bytes:  # (`_room`'s test)
            await self._room()
        t._raise_if_closed()
        t._probe_if_quiet()  # (a connection the consumer closed while quiet is replaced now)
        if t._sock is None:
            await self._connect()
        frames = self._frames(tensor, key, metadata, message_id, plain)
        sent: list[list[Buffer]] = []
        try:
            for frame in frames:
                if sent and self._turns.due():  # (between chunks, each booked: a cancellation here forgets them)
                    await asyncio.sleep(0)
                await self._send_retrying(frame)
                sent.append(frame)
        except BaseException:
            if sent:  # the chunks that went out can never make a whole tensor: don't resend them
                t.forget(sent)
            raise

    def _frames(
        self, tensor: Any, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, plain: bool = True
    ) -> Any:
        """The frames of one message: a plain ndarray's made as the blocking send makes it where it can be
        (`SocketProducer.plain_frame`; not tried again with `plain` False), else the producer's encoding (in chunks
        past `max_frame_bytes`)."""
        t, encoding = self.transport, self.producer._encoding
        if plain and encoding.plain_flags is not None and type(tensor) is np.ndarray:
            frame = t.plain_frame(tensor, key, metadata, message_id, encoding.plain_flags)
            if frame is not None:
                return [frame]
        bound_key = t._frame_key(encoding.signing_key)
        if t.max_frame_bytes is None:
            return [encoding.encode(tensor, key, metadata, message_id, bound_key)]
        return encoding.encode_chunks(tensor, key, metadata, message_id, t.max_frame_bytes, bound_key)

    async def _send_retrying(self, frame: list[Buffer], written: int = 0, attempts: int = 2) -> None:
        """Write `frame` (from byte `written`: on the current connection, which took those already) in up to
        `attempts` tries, reconnecting after a broken connection; keep it until it is taken."""
        t = self.transport
        for attempt in range(1, attempts + 1):
            try:
                sock = t._sock if t._sock is not None else await self._connect()
                if not written:
                    t._signed_for_now(frame)
                nbytes = await self._send_frame(sock, frame, written)
                break
            except OSError as exc:
                self._drop()
                written = 0
                if attempt == attempts:
                    raise TransportError(f"sending to {t.address} failed: {exc}") from None
                log.warning("connection to %s broke (%s); reconnecting", t.address, exc)
            except BaseException:  # cancelled (or timed out) part way
                self._drop()
                raise
        self._book(frame, nbytes)

    def _book(self, frame: list[Buffer], nbytes: int) -> None:
        """Keep a frame written whole until it is taken; read the acks every READ_ACKS_EVERY frames."""
        t = self.transport
        # `ProducerAcks._keep_until_acked`, less its ack request (a full socket would refuse it here:
        # `_room` asks, awaiting room to write)
        t._unacked.append((frame, nbytes))
        t._unacked_bytes += nbytes
        if t.tally.timed is None:
            t.tally.timing(t._sent)
        t._sent += 1
        if t._sent % READ_ACKS_EVERY == 0 and t._sock is not None:
            try:
                t._read_acks(0)
            except OSError as exc:
                log.warning("connection to %s broke (%s); frames will be resent on reconnect", t.address, exc)
                self._drop()

    async def _room(self) -> None:
        """Before a new message: await while `max_unacked_bytes` are unacknowledged (up to `send_timeout_s`)."""
        t = self.transport
        limit, timeout = t.options.max_unacked_bytes, t.options.send_timeout_s
        if t._rejections.pending:
            t._raise_rejection()
        if t._unacked_bytes < limit:
            return
        await self._await_acks(
            lambda: t._unacked_bytes < limit,
            finite_timeout(timeout),
            lambda: (
                f"{t.address} left {t._unacked_bytes} bytes unacknowledged for {timeout}s "
                f"(max_unacked_bytes={limit}): is the consumer aborted, or not receiving?"
            ),
        )

    async def _await_acks(self, done: Callable[[], bool], timeout: float | None, failure: Callable[[], str]) -> None:
        """Read acks (asking for them, reconnecting and resending as needed) until `done()`, for at most
        `timeout` seconds: `SocketProducer._ack_steps`, each step awaited (the socket, not polled)."""
        await self._perform(self.transport._ack_steps(done, timeout, failure))

    async def _perform(self, steps: Generator[AckStep, None, None]) -> None:
        """Perform a wait's steps (`_ack_steps`, `_flush_steps`), each awaited."""
        t, error = self.transport, None
        while (step := next_step(steps, error)) is not None:
            error = None
            kind, value = step
            try:
                if kind is AckIO.CONNECT:
                    await self._connect(value)
                elif kind is AckIO.ASK:
                    assert t._sock is not None
                    await self._write(t._sock, [ACK_REQUEST_MARKER])
                elif kind is AckIO.READ:
                    assert t._sock is not None
                    if await self._ready(t._sock, False, value):
                        t._read_acks(0)
                else:
                    await asyncio.sleep(value or 0.0)
            except BaseException as exc:  # (thrown back: the steps handle a broken connection; the rest ends the wait)
                error = exc

    async def flush(self, timeout: float | None) -> None:
        """Await the consumer's acks of every frame sent so far; `Rejected` if it refused one. Then, as the
        blocking flush, the copies kept of untaken frames are the producer's own: the application may
        change the arrays it sent."""
        t, timeout = self.transport, finite_timeout(timeout)
        async with self._turn:
            if t._unacked:  # a consumer that went with untaken tensors: resend them to its successor
                t._probe_if_quiet(0.0)
            await self._perform(t._flush_steps(timeout))  # (the untaken ones are then the producer's own)
            t._raise_rejection()

    async def close(self) -> None:
        """Flush (up to `close_timeout_s`) what the consumer has not received, and close the connection."""
        p, t = self.producer, self.transport
        t._rejections.clear()  # (each was logged as it came)
        if t._acked < t._sent and not t._closed:
            timeout = finite_timeout(t.options.close_timeout_s)
            try:
                await asyncio.wait_for(self.flush(timeout), timeout)  # (the wait for a stuck send's turn counts too)
            except Rejected:
                pass
            except TransportError as exc:
                log.warning("closing with frames not acknowledged: %s", exc)
            except asyncio.TimeoutError:
                log.warning("closing with frames not acknowledged within close_timeout_s=%s", timeout)
        t._closed = p._closed = True
        if self._turn.locked() and t._sock is not None:  # a send awaits a consumer that stopped reading: wake it
            with contextlib.suppress(OSError):
                t._sock.shutdown(socket.SHUT_RDWR)
        async with self._turn:
            self._drop()


async def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    """`size` bytes from `sock` (fewer only at the end of the stream), awaited."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    while len(got) < size:
        data = await loop.sock_recv(sock, size - len(got))
        if not data:
            break
        got += data
    return bytes(got)
