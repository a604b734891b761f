"""The stream-socket protocol around frames: handshake (with optional shared-secret auth) and acks.

consumer -> producer  HELLO  "TBSK", version u8, flags u8 (bit 0: auth required; bit 1: CRCs may
                      follow their frames; bit 2: refusals are told; bit 3: the nonce's first 16 bytes
                      are the consumer's incarnation, which signed frames are bound to), 32-byte nonce
producer -> consumer  PROOF  HMAC-SHA256(secret, "tensorbus-socket-auth-v1" + nonce), or 32 zero bytes
consumer -> producer  VERDICT u8: 1 accepted; 0 refused (the secret), and the connection closes;
                      2 refused for another reason, which follows (u16 length, UTF-8), then it closes
producer -> consumer  REFUSALS WANTED ("TBRF" + 20 zero bytes, a frame-sized marker), first, if HELLO set bit 2;
                      then frames, back to back, and ACK REQUESTs ("TBAK" + 20 zero bytes, also frame-sized)
consumer -> producer  ACK u64: frames of this connection received so far (cumulative: in the consumer's
                      table, or settled), sent on every ACK REQUEST and every `ack_every_frames` frames /
                      `ack_every_bytes` bytes; the producer's credit, and what `flush` waits for
consumer -> producer  TAKEN u64 (bit 62 set; the rest: a cumulative count of frames whose tensor the
                      application took, or that were settled: duplicates, refused, dropped), after an ACK
                      whenever it moved, and every `TAKEN_EVERY_S` or so: the producer drops its copies
consumer -> producer  REFUSAL u64 (bit 63 set: no ACK count gets there; the rest: the index of the refused
                      frame on this connection, from 0), reason length u16, reason (UTF-8); only to a
                      producer that sent REFUSALS WANTED, and before the ACK that covers that frame

A refused frame (over the consumer's limits, failing its checksum or signature, a stale incarnation...)
is acknowledged like any other, so it is not sent again; the producer learns of it from its REFUSAL.

A large checksummed, unsigned, unchunked frame may go out before its CRC32C is known, so the
producer checksums each slice just before sending it (in cache, while the consumer already reads)
instead of reading the whole tensor once more first. Such a frame has bit 7 (`TRAILING_CRC`) set in
its flags byte and a zero CRC field, and its CRC follows it as 4 more bytes (u32). The consumer
clears the bit and writes the CRC into the field: the frame it decodes is the frame as `encode`
would have sealed it.

Every consumer of this protocol version sets HELLO bits 1, 2 and 3 (the protocol was never released
without them), and a producer refuses a hello that lacks one. Bit 2 stays an offer: a hand-driven
peer that sends no REFUSALS WANTED is told of no refusal.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import socket
import ssl
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import msgpack

from ..codec.frame import (
    CRC_AT,
    FLAG_CHECKSUM,
    KNOWN_FLAGS,
    PREFIX,
    SIGNATURE_BYTES,
    VERSION,
    Buffer,
    checksum_of,
    write_crc,
)
from ..codec.native import agrees, crc32c, crc32c_c, load
from ..codec.tensors import ALIGN
from ..errors import AuthRefused, TransportError
from .base import TransportOptions

#: the C reader and sender (`_stream.c`); None when not built, stale, or TENSORBUS_NATIVE=0
NATIVE_STREAM: ModuleType | None = load(f"{__package__}._stream")


@dataclass(frozen=True, kw_only=True)
class SocketOptions(TransportOptions):
    """The options of tcp://, tcps:// and unix:// endpoints."""

    connect_timeout_s: float = 5.0  # one attempt: connect, TLS, handshake (a refused connect ends it at once)
    send_timeout_s: float = 30.0
    reconnect_timeout_s: float = 10.0  # all attempts: how long a send retries a consumer that is not (yet) there
    max_unacked_bytes: int = 256 * 1024 * 1024
    #: copies of tensors a consumer received but did not take yet, kept to send to its successor, at most:
    #: past it the oldest are let go (counted in `untaken_let_go`, logged), so a send never waits for a `recv`
    max_untaken_bytes: int = 1024 * 1024 * 1024
    ack_every_frames: int = 256  # (each ack costs the consumer a system call: fewer acks, less time)
    ack_every_bytes: int = 8 * 1024 * 1024
    close_timeout_s: float = 10.0
    backlog: int = 128
    max_connections: int = 1024  # producer connections read at once (lowered to half `ulimit -n`)
    idle_timeout_s: float | None = 300.0  # a connection with nothing sent or owed this long is closed
    pooled_buffers: int = 4
    linger_s: float = 0.001
    spin_s: float = 0.0001
    auth_secret: str | bytes | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_context: ssl.SSLContext | None = None


HELLO = struct.Struct("<4sBB32s")
HELLO_MAGIC = b"TBSK"
PROTOCOL_VERSION = 1
HELLO_AUTH = 0x01
HELLO_TRAILING_CRC = 0x02  # in HELLO: this consumer takes frames whose CRC follows them
HELLO_INCARNATION = 0x08  # in HELLO: the nonce begins with the consumer's incarnation
#: random bytes naming one run of a consumer: signed frames are bound to it (see docs/FORMAT.md)
INCARNATION_BYTES = 16
VERDICT_ACCEPTED, VERDICT_REFUSED, VERDICT_REASON = b"\x01", b"\x00", b"\x02"
REASON = struct.Struct("<H")
TRAILING_CRC = 0x80  # in a frame's flags byte, on a stream only: its CRC follows it
CRC_TRAILER = struct.Struct("<I")
#: payloads at least this large are checksummed while they are sent; smaller ones up front, as the
#: socket buffers let the producer run ahead of the consumer anyway
SEAL_WHILE_SENDING = 4 << 20
#: ... slice by slice, each still in cache when the kernel copies it
SEAL_SLICE = 1 << 20
PROOF_BYTES = 32
ACK = struct.Struct("<Q")
#: sent by a producer in place of a frame to ask for an ack (a frame-sized marker: "TBAK", 20 zero bytes)
ACK_REQUEST_MARKER = b"TBAK" + bytes(20)
HELLO_REFUSALS = 0x04  # in HELLO: this consumer tells the producers that want it which frames it refused
#: the HELLO flags every consumer of this protocol sets (a producer refuses a hello without them)
HELLO_EVERY_CONSUMER = HELLO_TRAILING_CRC | HELLO_REFUSALS | HELLO_INCARNATION
#: sent by a producer first, where HELLO offers it, to be told which frames were refused (a frame-sized marker)
REFUSALS_WANTED = b"TBRF" + bytes(20)
REFUSAL = struct.Struct("<QH")
REFUSED = 1 << 63  # in the first field of a REFUSAL: what tells it from an ACK
TAKEN = 1 << 62  # in an ACK: the count is of frames the application took (or that were settled), not received
#: a refusal's reason is cut to this many bytes
MAX_REASON_BYTES = 1000
_AUTH_CONTEXT = b"tensorbus-socket-auth-v1"
IOV_MAX = 512


class Refused(TransportError):
    """The consumer refused this connection for a reason it gave (e.g. its `max_connections`)."""


class UnreleasedDraft(TransportError):
    """The consumer speaks a draft of the protocol that was never released: connecting again cannot help."""

    retriable = False


def turned_down(reason: str) -> bytes:
    """VERDICT 2 and its reason, as the consumer sends it."""
    text = reason.encode()[: (1 << 16) - 1]
    return VERDICT_REASON + REASON.pack(len(text)) + text


def proof(secret: bytes | None, nonce: bytes) -> bytes:
    """What a producer answers to a consumer's nonce."""
    if secret is None:
        return bytes(PROOF_BYTES)
    return hmac.new(secret, _AUTH_CONTEXT + nonce, hashlib.sha256).digest()


def sendmsg_all(sock: socket.socket, buffers: list[Buffer]) -> None:
    """Send every byte of `buffers`: scatter-gather `sendmsg` where the socket has it (not TLS)."""
    if isinstance(sock, ssl.SSLSocket):
        for buf in buffers:
            sock.sendall(buf)
        return
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first : first + IOV_MAX])
        while sent and sent >= len(views[first]):
            sent -= len(views[first])
            first += 1
        if sent:
            views[first] = views[first][sent:]


_NO_CRC = bytes(4)


def unsealed(head: Buffer) -> bool:
    """A frame head encoded with `deferred_checksum`: checksummed, unsigned, its CRC field still zero.

    (A sealed frame whose CRC happens to be zero passes too; sealing it again writes the same zero.)
    """
    return len(head) >= PREFIX.size and head[5] == FLAG_CHECKSUM and head[CRC_AT : PREFIX.size] == _NO_CRC


def c_sends_below(crc_after: bool) -> int:
    """The payload size from which the C `send_frame` leaves a frame to `send_frame` here (returns None):
    with `crc_after`, those are checksummed slice by slice as they go out."""
    return SEAL_WHILE_SENDING if crc_after else (1 << 64) - 1  # (no such frame: all sent in C)


def send_frame(sock: socket.socket, frame: list[Buffer], crc_after: bool) -> int:
    """Send one frame, sealing it first if its checksum was deferred (see the module docstring); the bytes sent.

    With `crc_after` and a large payload the CRC is computed slice by slice as the slices go out and
    sent after the frame. Either way the head is left sealed, so a resend goes out whole. Plain
    sockets send in C (`_stream.c`) but for that slice by slice case.
    """
    if NATIVE_STREAM is not None and not isinstance(sock, ssl.SSLSocket):
        sent: int | None = NATIVE_STREAM.send_frame(sock.fileno(), frame, c_sends_below(crc_after), crc32c)
        if sent is not None:
            return sent
    for batch in wire_batches(frame, crc_after):
        sendmsg_all(sock, batch)
    return sum(memoryview(b).nbytes for b in frame)


def wire_batches(frame: list[Buffer], crc_after: bool) -> Iterator[list[Buffer]]:
    """The buffers one frame goes out as, batch by batch, sealing it if its checksum was deferred: the
    sans-IO half of `send_frame` (the asyncio producer writes the same batches on its event loop).

    With `crc_after` and a large payload each batch (~1 MiB) is checksummed just before it is yielded,
    its CRC follows the frame, and the head is sealed once the last batch was taken.
    """
    head = frame[0]
    if not isinstance(head, bytearray) or not unsealed(head):
        yield frame
        return
    if not crc_after or PREFIX.unpack_from(head)[5] < SEAL_WHILE_SENDING:  # (field 5: the payload's length)
        write_crc(head, frame[1:])
        yield frame
        return
    crc = checksum_of(head)
    wire_head = bytearray(head)
    wire_head[5] |= TRAILING_CRC
    batch: list[Buffer] = [wire_head]
    batched = 0
    for buffer in frame[1:]:  # many small arrays (a bundle) go out together, ~1 MiB per call
        part = memoryview(buffer).cast("B")
        for at in range(0, len(part), SEAL_SLICE):
            piece = part[at : at + SEAL_SLICE]
            crc = crc32c(piece, crc)
            batch.append(piece)
            batched += len(piece)
            if batched >= SEAL_SLICE:
                yield batch
                batch, batched = [], 0
    yield [*batch, CRC_TRAILER.pack(crc)]
    struct.pack_into("<I", head, CRC_AT, crc)


def set_send_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Make sends give up after `seconds` without progress (then `BlockingIOError`), enforced by the kernel.

    Python's own socket timeout polls before every call: one more system call per frame.
    None (or infinity): sends wait as long as the consumer takes.
    """
    if seconds is not None and math.isinf(seconds):
        seconds = None
    if isinstance(sock, ssl.SSLSocket) or seconds is None:
        sock.settimeout(seconds)  # TLS retries its reads and writes itself: keep Python's timeout
        return
    sock.settimeout(None)
    whole, micros = divmod(max(round(seconds * 1e6), 1), 1_000_000)  # 0 would mean "never time out"
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", whole, micros))


#: A Unix stream socket's send buffer: how far a producer runs ahead of its consumer before a send waits.
#: Linux's default (net.core.wmem_default, 208 KiB) stops a producer of 64 KB frames every few frames, and
#: its consumer then waits for the producer's wake-up, where TCP on loopback grows its buffer to 4 MiB by
#: itself (docs/PERFORMANCE.md, "unix:// with TCP's send buffer"). The kernel caps it at net.core.wmem_max.
UNIX_SEND_BUFFER = 4 << 20


def tune_connection(sock: socket.socket) -> None:
    """Set what each family of a connected stream needs: TCP sends small frames and acks at once (no
    Nagle), a Unix socket gets the send buffer TCP's loopback would grow to."""
    if sock.family == socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER)
    else:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from the socket; return the bytes received (fewer only at end of stream)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def handshake_as_producer(sock: socket.socket, secret: bytes | None, address: str) -> bytes:
    """Producer side of the handshake (asking for refusals): the consumer's incarnation.

    Raises `AuthRefused`, `Refused`, `UnreleasedDraft` or `TransportError` with the reason.
    """
    hello = bytearray(HELLO.size)
    try:
        got = recv_exact(sock, memoryview(hello))
    except TimeoutError:
        raise TransportError(f"{address} sent no tensorbus hello in time (a TLS endpoint? use tcps://)") from None
    _, nonce = read_hello(hello[:got], secret, address)
    sock.sendall(proof(secret, nonce))
    verdict = sock.recv(1)
    if verdict == VERDICT_REASON:
        raise Refused(f"{address} refused the connection: {_reason(sock)}")
    check_verdict(verdict, address)
    sock.sendall(REFUSALS_WANTED)
    return hello_terms(nonce)


def read_hello(hello: Buffer, secret: bytes | None, address: str) -> tuple[int, bytes]:
    """The flags and nonce of a consumer's HELLO (all the bytes that came of it), checked; what the
    producer answers is `proof(secret, nonce)`."""
    if len(hello) < HELLO.size or hello[:4] != HELLO_MAGIC:
        raise TransportError(f"{address} is not a tensorbus socket consumer (or speaks TLS: use tcps://)")
    _, version, flags, nonce = HELLO.unpack(hello)
    if version != PROTOCOL_VERSION:
        raise TransportError(f"{address} speaks socket protocol {version}, this build speaks {PROTOCOL_VERSION}")
    if flags & HELLO_EVERY_CONSUMER != HELLO_EVERY_CONSUMER:
        raise UnreleasedDraft(
            f"{address} speaks a draft of socket protocol {version} that was never released (its hello lacks "
            f"flags {HELLO_EVERY_CONSUMER & ~flags:#x}): run the same tensorbus on both ends"
        )
    if flags & HELLO_AUTH and secret is None:
        raise AuthRefused(f"{address} requires a shared secret: set the auth_secret option")
    return flags, nonce


def check_verdict(verdict: bytes, address: str) -> None:
    """Raise `AuthRefused` unless the consumer's VERDICT accepted the producer (VERDICT 2 is the caller's:
    its reason follows)."""
    if verdict != VERDICT_ACCEPTED:
        raise AuthRefused(f"{address} refused this producer's auth_secret")


def hello_terms(nonce: bytes) -> bytes:
    """What an accepted producer keeps of the HELLO: the consumer's incarnation (`read_hello` made sure the
    consumer sets every flag, so CRCs may follow frames and refusals are told)."""
    return bytes(nonce[:INCARNATION_BYTES])


def _reason(sock: socket.socket) -> str:
    """The reason that follows a VERDICT of 2 (best effort: it is only for the error message)."""
    try:
        size = bytearray(REASON.size)
        if recv_exact(sock, memoryview(size)) == REASON.size:
            text = bytearray(REASON.unpack(size)[0])
            return bytes(text[: recv_exact(sock, memoryview(text))]).decode("utf-8", "replace")
    except OSError:
        pass
    return "no reason given"


def reason_told(reason: str) -> bytes:
    """A refusal's reason as a consumer tells it to its producer, cut to `MAX_REASON_BYTES` (a producer decodes it
    with "replace": a character cut in two shows as one replaced)."""
    return reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]


def refusal(index: int, reason: str) -> bytes:
    """The REFUSAL record of the frame `index` of a connection (counted from 0), its reason cut short if long."""
    text = reason_told(reason)
    return REFUSAL.pack(REFUSED | index, len(text)) + text


def names_in(head: Buffer) -> tuple[str | None, tuple[str, int] | None]:
    """The key and message id written in a frame's head, as this process encoded it (for a refusal's error)."""
    _, _, _, _, header_len, _, _ = PREFIX.unpack_from(head)
    header = msgpack.unpackb(memoryview(head)[PREFIX.size : PREFIX.size + header_len])
    message_id = header.get("id")
    return header.get("key"), None if message_id is None else (message_id[0], message_id[1])


#: the constants `_stream.c` repeats, by the names it exports them under
NATIVE_CONSTANTS = {
    "PREFIX_SIZE": PREFIX.size,
    "CRC_AT": CRC_AT,
    "FORMAT_VERSION": VERSION,
    "KNOWN_FLAGS": KNOWN_FLAGS,
    "TRAILING_CRC": TRAILING_CRC,
    "CRC_TRAILER": CRC_TRAILER.size,
    "SIGNATURE_BYTES": SIGNATURE_BYTES,
    "ALIGN": ALIGN,
}
NATIVE_STREAM = agrees(NATIVE_STREAM, NATIVE_CONSTANTS)
if NATIVE_STREAM is not None:  # (small buffers checksummed in C, without a call of crc32c)
    NATIVE_STREAM.configure(crc32c_c())
