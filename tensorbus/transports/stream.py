"""The stream-socket protocol around frames: handshake (with optional shared-secret auth) and acks.

consumer -> producer  HELLO  "TBSK", version u8, flags u8 (bit 0: auth required), 32-byte nonce
producer -> consumer  PROOF  HMAC-SHA256(secret, "tensorbus-socket-auth-v1" + nonce), or 32 zero bytes
consumer -> producer  VERDICT u8: 1 accepted; 0 refused, and the connection closes
producer -> consumer  frames, back to back, and ACK REQUESTs ("TBAK" + 20 zero bytes, a frame-sized marker)
consumer -> producer  ACK u64: frames of this connection safely delivered so far (cumulative), sent
                      on every ACK REQUEST and every `ack_every_frames` frames / `ack_every_bytes` bytes
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import socket
import ssl
import struct

from ..codec.frame import Buffer
from ..errors import TransportError

HELLO = struct.Struct("<4sBB32s")
HELLO_MAGIC = b"TBSK"
PROTOCOL_VERSION = 1
FLAG_AUTH = 0x01
PROOF_BYTES = 32
ACK = struct.Struct("<Q")
ACK_REQUEST = b"TBAK" + bytes(20)
_AUTH_CONTEXT = b"tensorbus-socket-auth-v1"
IOV_MAX = 512


class AuthRefused(TransportError):
    """The consumer refused this producer's proof of the shared secret."""

    retriable = False


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


def recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from the socket; return the bytes received (fewer only at end of stream)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def greet(sock: socket.socket, secret: bytes | None) -> bool:
    """Consumer side of the handshake: send a nonce, check the proof, send the verdict."""
    nonce = os.urandom(32)
    sock.sendall(HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, FLAG_AUTH if secret else 0, nonce))
    answer = bytearray(PROOF_BYTES)
    got = recv_exact(sock, memoryview(answer))
    if got == 0:
        raise ConnectionResetError("it closed the connection without answering")
    if got < PROOF_BYTES:
        return False
    accepted = secret is None or hmac.compare_digest(bytes(answer), proof(secret, nonce))
    sock.sendall(b"\x01" if accepted else b"\x00")
    return accepted


def introduce(sock: socket.socket, secret: bytes | None, address: str) -> None:
    """Producer side of the handshake; raises `AuthRefused` or `TransportError` with the reason."""
    hello = bytearray(HELLO.size)
    try:
        got = recv_exact(sock, memoryview(hello))
    except TimeoutError:
        raise TransportError(f"{address} sent no tensorbus hello in time (a TLS endpoint? use tcps://)") from None
    if got < HELLO.size or hello[:4] != HELLO_MAGIC:
        raise TransportError(f"{address} is not a tensorbus socket consumer (or speaks TLS: use tcps://)")
    _, version, flags, nonce = HELLO.unpack(hello)
    if version != PROTOCOL_VERSION:
        raise TransportError(f"{address} speaks socket protocol {version}, this build speaks {PROTOCOL_VERSION}")
    if flags & FLAG_AUTH and secret is None:
        raise AuthRefused(f"{address} requires a shared secret: set the auth_secret option")
    sock.sendall(proof(secret, nonce))
    verdict = sock.recv(1)
    if verdict != b"\x01":
        raise AuthRefused(f"{address} refused this producer's auth_secret")
