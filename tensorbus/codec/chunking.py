"""Cut an encoded frame into chunk frames no bigger than a transport allows, and put them back together."""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..buffers import BufferPool
from ..errors import ConfigError, LimitExceeded, MalformedHeader
from .frame import (
    DEFAULT_LIMITS,
    PREFIX,
    SIGNATURE_BYTES,
    Buffer,
    Limits,
    Message,
    MessageId,
    _message_id,
    encode_raw,
    message_from_frame,
    parse,
)
from .tensors import align

log = logging.getLogger(__name__)


def frame_size(buffers: list[Buffer]) -> int:
    """Total bytes of a scatter-gather frame."""
    return sum(memoryview(b).nbytes for b in buffers)


def chunk_overhead(key: str | None, message_id: MessageId, total: int, signed: bool) -> int:
    """Bytes a chunk frame adds around its slice, at most (header sized with the largest numbers)."""
    header = {"kind": "chunk", "key": key, "id": list(message_id), "chunk": [total, total, total, total]}
    return align(PREFIX.size + len(msgpack.packb(header))) + (SIGNATURE_BYTES if signed else 0)


def _slices(buffers: list[Buffer], stride: int) -> list[list[memoryview]]:
    """Group zero-copy slices of `buffers` into runs of `stride` bytes (the last run may be shorter)."""
    runs: list[list[memoryview]] = [[]]
    room = stride
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while len(view):
            if room == 0:
                runs.append([])
                room = stride
            take = view[:room]
            runs[-1].append(take)
            room -= len(take)
            view = view[len(take) :]
    return runs


def split(
    frame: list[Buffer],
    *,
    max_chunk_bytes: int,
    message_id: MessageId,
    key: str | None = None,
    checksum: bool = True,
    signing_key: bytes | None = None,
) -> list[list[Buffer]]:
    """Return the frame as-is if it fits, else chunk frames of at most `max_chunk_bytes` each."""
    total = frame_size(frame)
    if total <= max_chunk_bytes:
        return [frame]
    stride = max_chunk_bytes - chunk_overhead(key, message_id, total, signing_key is not None)
    if stride < 1024:
        raise ConfigError(f"max_chunk_bytes={max_chunk_bytes} leaves no room for a chunk's payload")
    runs = _slices(frame, stride)
    count = len(runs)
    return [
        encode_raw(
            {"kind": "chunk", "key": key, "id": list(message_id), "chunk": [index, count, total, stride]},
            run,
            sum(len(part) for part in run),
            checksum=checksum,
            signing_key=signing_key,
        )
        for index, run in enumerate(runs)
    ]


@dataclass
class _Partial:
    buffer: memoryview
    count: int
    stride: int
    key: str | None
    started: float
    received: set[int] = field(default_factory=set)


class Reassembler:
    """Collects chunks (any order, duplicates allowed) into one preallocated buffer per message.

    Memory is bounded: a message whose size would push the bytes held past `max_bytes` is refused
    with `LimitExceeded`, and messages still incomplete after `timeout_s` are dropped and counted.
    """

    def __init__(
        self,
        *,
        max_bytes: int = 1 << 31,
        timeout_s: float = 60.0,
        limits: Limits = DEFAULT_LIMITS,
        signing_key: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes, self.timeout_s, self.limits = max_bytes, timeout_s, limits
        self.signing_key, self.clock = signing_key, clock
        self._partials: dict[MessageId, _Partial] = {}
        self._done: collections.OrderedDict[MessageId, None] = collections.OrderedDict()
        self.held_bytes = 0
        #: the message id of the last chunk fed (None for whole frames), for transports that ack per message
        self.last_message_id: MessageId | None = None
        self.stats = collections.Counter[str]()
        self._pool = BufferPool(max_buffers=4)  # a consumer holds ~3 in flight: assembling, queued, in use

    def feed(self, data: Buffer, *, copy: bool = False, crc: int | None = None) -> Message | None:
        """Take one received frame; return the decoded message once it is complete, else None.

        `crc` is the frame's CRC32C if the receiver already computed it (see `parse`).
        """
        if self._partials:
            self.expire()
        self.last_message_id = None
        frame = parse(data, limits=self.limits, signing_key=self.signing_key, crc=crc)
        if frame.header.get("kind") != "chunk":
            return message_from_frame(frame, copy=copy, limits=self.limits)
        message_id = _message_id(frame.header.get("id"))
        if message_id is None:
            raise MalformedHeader("chunk has no message id")
        self.last_message_id = message_id
        index, count, total, stride = self._chunk_fields(frame.header)
        if message_id in self._done:
            self.stats["duplicates"] += 1
            return None
        partial = self._partials.get(message_id) or self._start(message_id, count, total, stride, frame.header)
        if (partial.count, partial.stride, len(partial.buffer), partial.key) != (
            count,
            stride,
            total,
            frame.header.get("key"),
        ):
            raise MalformedHeader(f"chunk {index} of message {message_id} disagrees with the earlier chunks")
        expected = min(stride, total - index * stride)
        if len(frame.payload) != expected:
            raise MalformedHeader(f"chunk {index} should carry {expected} bytes, carries {len(frame.payload)}")
        if index in partial.received:
            self.stats["duplicates"] += 1
            return None
        partial.buffer[index * stride : index * stride + expected] = frame.payload
        partial.received.add(index)
        if len(partial.received) < count:
            return None
        self._finish(message_id)
        return message_from_frame(
            parse(partial.buffer, limits=self.limits, signing_key=self.signing_key), limits=self.limits
        )

    def _chunk_fields(self, header: dict[str, Any]) -> tuple[int, int, int, int]:
        fields = header.get("chunk")
        if not (isinstance(fields, list) and len(fields) == 4 and all(type(v) is int for v in fields)):
            raise MalformedHeader(f"chunk info must be [index, count, total, stride], got {fields!r}")
        index, count, total, stride = fields
        if stride <= 0 or total <= 0 or count != math.ceil(total / stride) or not 0 <= index < count:
            raise MalformedHeader(f"inconsistent chunk info index={index} count={count} total={total} stride={stride}")
        limit = self.limits.max_payload_bytes + self.limits.max_header_bytes
        if total > limit:
            raise LimitExceeded(f"chunked message claims {total} bytes; the frame limit is {limit}")
        return index, count, total, stride

    def _start(self, message_id: MessageId, count: int, total: int, stride: int, header: dict[str, Any]) -> _Partial:
        if self.held_bytes + total > self.max_bytes:
            self.stats["refused"] += 1
            raise LimitExceeded(
                f"reassembling {total} more bytes would hold {self.held_bytes + total}; the limit is {self.max_bytes}"
            )
        buffer = self._pool.take(total)  # a reused one when no tensor still views it: fresh pages are slow
        partial = _Partial(buffer, count, stride, header.get("key"), self.clock())
        self._partials[message_id] = partial
        self.held_bytes += total
        return partial

    def _finish(self, message_id: MessageId) -> None:
        partial = self._partials.pop(message_id)
        self.held_bytes -= len(partial.buffer)
        self._done[message_id] = None
        if len(self._done) > 4096:
            self._done.popitem(last=False)

    def expire(self) -> int:
        """Drop messages incomplete for longer than `timeout_s`; return how many were dropped."""
        now = self.clock()
        stale = [mid for mid, p in self._partials.items() if now - p.started > self.timeout_s]
        for mid in stale:
            partial = self._partials.pop(mid)
            self.held_bytes -= len(partial.buffer)
            log.error(
                "dropped incomplete message %s (key %r): %d of %d chunks after %.1fs",
                mid,
                partial.key,
                len(partial.received),
                partial.count,
                self.timeout_s,
            )
        self.stats["expired"] += len(stale)
        return len(stale)

    def is_pending(self, message_id: MessageId | None) -> bool:
        """True while some but not all chunks of `message_id` have arrived."""
        return message_id in self._partials

    @property
    def pending(self) -> int:
        """Messages with some but not all chunks received."""
        return len(self._partials)
