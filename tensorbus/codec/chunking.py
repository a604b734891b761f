"""Cut an encoded frame into chunk frames no bigger than a transport allows, and put them back together."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..buffers import BufferPool, aligned, copy_into
from ..errors import CodecError, ConfigError, LimitExceeded, MalformedHeader, brief
from ..running_clock import CLOCK
from .crc import combine
from .frame import (
    CRC_AT,
    DEFAULT_LIMITS,
    FLAG_CHECKSUM,
    FLAG_SIGNED,
    PREFIX,
    SIGNATURE_BYTES,
    Buffer,
    Limits,
    Message,
    MessageId,
    _message_id,
    checksum_of,
    decode_native,
    encode_raw,
    frame_head,
    is_chunk,
    layout,
    message_from_frame,
    parse,
    payload_crcs,
    peek_chunk,
    seal,
    seal_with_crc,
    split_checksum,
    stamp,
)
from .native import crc32c
from .tensors import align

log = logging.getLogger(__name__)

#: received frames at least this large get their payload's CRC on the side of the frame check (one
#: pass for both); smaller chunks are read a second time, which costs less than the extra bookkeeping
SPLIT_CRC_FROM = 64 * 1024
#: the smallest chunk payload `split` makes (and a receiver accepts)
MIN_STRIDE = 1024
#: what a pending message costs the reassembly budget beyond its bytes (its bookkeeping): bounds
#: how many a flood of tiny chunks with distinct ids can open
PARTIAL_OVERHEAD = 16 << 10
#: a chunk kept by reference may pin this much more than twice its payload (the rest of the buffer
#: it arrived in: its header, a larger pooled buffer); beyond that its payload is copied, as the
#: budget counts payloads and a hostile header can be a megabyte of padding around 1 KB
PINNED_SLACK = 16 << 10


def frame_size(buffers: list[Buffer]) -> int:
    """Total bytes of a scatter-gather frame."""
    return sum(memoryview(b).nbytes for b in buffers)


def chunk_header(
    key: str | None, message_id: MessageId, index: int, count: int, total: int, stride: int
) -> dict[str, Any]:
    """The header of chunk `index` of `count` ("kind" first: `frame.split_checksum` recognises chunks by it)."""
    return {"kind": "chunk", "key": key, "id": list(message_id), "chunk": [index, count, total, stride]}


def chunk_overhead(key: str | None, message_id: MessageId, total: int, signed: bool) -> int:
    """Bytes a chunk frame adds around its slice, at most (header sized with the largest numbers)."""
    header = chunk_header(key, message_id, total, total, total, total)
    return align(PREFIX.size + len(msgpack.packb(header))) + (SIGNATURE_BYTES if signed else 0)


def slices(buffers: list[Buffer], stride: int) -> list[list[memoryview]]:
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
    if stride < MIN_STRIDE:
        raise ConfigError(f"max_chunk_bytes={max_chunk_bytes} leaves no room for a chunk's payload")
    runs = slices(frame, stride)
    count = len(runs)
    return [
        encode_raw(
            chunk_header(key, message_id, index, count, total, stride),
            run,
            sum(len(part) for part in run),
            checksum=checksum,
            signing_key=signing_key,
        )
        for index, run in enumerate(runs)
    ]


def encode_chunks(
    obj: Any,
    *,
    max_chunk_bytes: int,
    message_id: MessageId,
    key: str | None = None,
    metadata: dict[str, Any] | None = None,
    compression: str | None = None,
    checksum: bool = True,
    signing_key: bytes | None = None,
    chunk_signing_key: bytes | None = None,
    max_header_bytes: int = DEFAULT_LIMITS.max_header_bytes,
) -> list[list[Buffer]]:
    """`split(encode(obj, ...))`, but a chunked tensor's bytes are checksummed once, not twice.

    `chunk_signing_key` signs the chunks, if they are to be signed with another key than the
    message they carry (a `Producer`'s are bound to the endpoint: see `signing`).

    Each chunk's CRC32C is computed over its slice, and the whole frame's CRC is combined from
    those (see `crc.combine`); with a signing key the HMAC needs its own pass anyway, so that
    case (like an unchunked frame) takes the plain path.
    """
    header, body, end = layout(obj, key=key, metadata=metadata, compression=compression, message_id=message_id)
    if signing_key is not None:
        stamp(header)
    flags = FLAG_CHECKSUM if checksum else 0
    head = frame_head(header, end, flags | (FLAG_SIGNED if signing_key is not None else 0), max_header_bytes)
    total = len(head) + end
    stride = max_chunk_bytes - chunk_overhead(key, message_id, total, signing_key is not None)
    one_pass_anyway = total <= max_chunk_bytes or not checksum or signing_key is not None
    if one_pass_anyway or stride < MIN_STRIDE or len(head) > stride:  # split() refuses such a stride
        whole = total + (SIGNATURE_BYTES if signing_key is not None else 0) <= max_chunk_bytes
        frame = seal(head, body, checksum, chunk_signing_key if whole and chunk_signing_key else signing_key)
        return split(
            frame,
            max_chunk_bytes=max_chunk_bytes,
            message_id=message_id,
            key=key,
            checksum=checksum,
            signing_key=chunk_signing_key or signing_key,
        )
    runs = slices([head, *body], stride)  # runs[0] starts with the whole head, whose CRC field is still 0
    tails = []  # (CRC32C, length) of each run's bytes past the head: the one pass over the tensor
    for index, run in enumerate(runs):
        crc, tail = 0, run[1:] if index == 0 else run
        for part in tail:
            crc = crc32c(part, crc)
        tails.append((crc, sum(len(part) for part in tail)))
    frame_crc = checksum_of(head)
    for crc, length in tails:
        frame_crc = combine(frame_crc, crc, length)
    struct.pack_into("<I", head, CRC_AT, frame_crc)
    chunks: list[list[Buffer]] = []
    for index, (run, (crc, length)) in enumerate(zip(runs, tails, strict=True)):
        if index == 0:  # its slice is the head (CRC now filled in), then the first bytes of the payload
            crc, length = combine(crc32c(head), crc, length), length + len(head)
        chunk_head = frame_head(chunk_header(key, message_id, index, len(runs), total, stride), length, flags)
        seal_with_crc(chunk_head, crc, length)
        chunks.append([bytes(chunk_head), *run])
    return chunks


#: message ids remembered as done or given up (later chunks of them are dropped)
REMEMBERED_IDS = 4096


def _remember(ids: collections.OrderedDict[MessageId, None], message_id: MessageId) -> None:
    """Add an id to a bounded record, forgetting the oldest past REMEMBERED_IDS."""
    ids[message_id] = None
    if len(ids) > REMEMBERED_IDS:
        ids.popitem(last=False)


@dataclass
class _Partial:
    total: int
    count: int
    stride: int
    key: str | None
    started: float
    #: the whole message, allocated once half of its bytes are here: until then a claimed size costs
    #: nothing, and the chunks are kept as they came (`pieces`), so a sender pays for what it claims.
    #: Or, from the first chunk, a free buffer the pool holds already (no new memory): each chunk is
    #: copied into place as it arrives, and the budget still counts only the bytes received
    buffer: memoryview | None = None
    allocated: bool = False  # the whole message counts against the budget (after half of it came)
    pieces: dict[int, memoryview] = field(default_factory=dict)
    got: int = 0  # payload bytes received
    charged: int = 0  # what this message counts against the budget now
    received: set[int] = field(default_factory=set)
    #: per chunk: CRC32C of its slice (the first: without the frame's CRC field), to combine at the end
    crcs: dict[int, int | None] = field(default_factory=dict)


def _buffer_bytes(view: memoryview) -> float:
    """Bytes of the buffer `view` is a slice of (infinite when that cannot be told: then it is copied)."""
    try:
        return memoryview(view.obj).nbytes  # (.obj is None for views made in C: TypeError)
    except (TypeError, BufferError):
        return float("inf")


class Reassembler:
    """Collects chunks (any order, duplicates allowed) into one buffer per message.

    Memory is bounded by what actually arrived: a message counts the bytes of its chunks against
    `max_bytes` until half of it is here, and only then gets (and counts) its whole buffer, so a
    tiny chunk claiming gigabytes reserves nothing. A chunk that would push the bytes held past
    `max_bytes` is refused with `LimitExceeded` and its message given up on (freed at once, its
    later chunks dropped); messages still incomplete after `timeout_s` are dropped and counted. That time is
    the process's running time (running_clock.py): a consumer stopped mid-message (SIGSTOP, a breakpoint) finds
    its remaining chunks when it runs again instead of dropping what it had.
    """

    def __init__(
        self,
        *,
        max_bytes: int = 1 << 31,
        timeout_s: float = 60.0,
        limits: Limits = DEFAULT_LIMITS,
        signing_key: bytes | None = None,
        clock: Callable[[], float] = CLOCK.now,
        like: str = "numpy",
        whole_signing_key: bytes | None = None,
    ) -> None:
        self.max_bytes, self.timeout_s, self.limits = max_bytes, timeout_s, limits
        self.signing_key, self.clock = signing_key, clock
        #: the key a reassembled message is signed with, if not `signing_key` (see `encode_chunks`)
        self.whole_signing_key = whole_signing_key or signing_key
        self.like = like  # what arrays come back as: "numpy", or "torch" (see `decode`)
        self._partials: dict[MessageId, _Partial] = {}
        self._done: collections.OrderedDict[MessageId, None] = collections.OrderedDict()
        self._given_up: collections.OrderedDict[MessageId, None] = collections.OrderedDict()
        self._paused_since: float | None = None
        self._expire_at = math.inf  # no incomplete message can be late before this (see `expire`)
        #: incomplete messages given up so far (expired, over `max_bytes`, or bad once whole)
        self.given_up = 0
        #: called with the id of each message given up on (the consumer's ledger releases its frames)
        self.on_given_up: Callable[[MessageId], None] | None = None
        self.held_bytes = 0
        #: the message id of the last chunk fed (None for whole frames), for transports that ack per message
        self.last_message_id: MessageId | None = None
        self.stats = collections.Counter[str]()
        self._pool = BufferPool(max_buffers=4)  # a consumer holds ~3 in flight: assembling, queued, in use

    def decode_whole(self, data: Buffer, *, crc: int | None = None) -> Message:
        """A whole message's frame (not a chunk) decoded as `feed` decodes it, with no state of the reassembler's
        read or changed: a caller may run it without the lock that guards `feed` (the costly part of a large
        signed or compressed frame). `data` is handed over, as with `feed(..., owned=True)`."""
        view = memoryview(data).cast("B")
        if type(data) is bytes:  # (see `feed`)
            view = aligned(view, self._pool)
        if self.signing_key is None:
            message = decode_native(view, crc, self.limits, self.like)
            if message is not None:
                return message
        frame = parse(view, limits=self.limits, signing_key=self.signing_key, crc=crc)
        if frame.header.get("kind") == "chunk":
            raise MalformedHeader("a chunk's frame whose header does not begin as a chunk's does")
        return message_from_frame(frame, limits=self.limits, like=self.like)

    def feed(
        self,
        data: Buffer,
        *,
        copy: bool = False,
        crc: int | None = None,
        owned: bool = False,
        redelivered: bool = False,
        appended_at: float | None = None,
    ) -> Message | None:
        """Take one received frame; return the decoded message once it is complete, else None.

        `crc` is the frame's CRC32C if the receiver already computed it (see `parse`). `owned`:
        the caller never writes to `data` again, so a chunk may be kept without a copy (as may `bytes`).
        `redelivered`: the transport vouches that the frame is a redelivery (see `Deliver`): the message
        it makes (a whole frame, or the one whose last chunk it is) is not refused for its age alone.
        `appended_at`: the broker's clock when it stored the frame (see `Deliver`): that message's age
        is measured to it.
        """
        if self._partials and self.clock() > self._expire_at:
            self.expire()
        self.last_message_id = None
        view = memoryview(data).cast("B")
        if not copy and type(data) is bytes and not is_chunk(view):  # (a chunk's bytes are copied anyway)
            # the broker clients' frames: a bytes object's data starts 32 bytes in, so its tensors (views at
            # multiples of 64 from the frame's start) would not be aligned; every other transport receives
            # into aligned buffers, which need no look
            view = aligned(view, self._pool)
        if not copy and self.signing_key is None:
            message = decode_native(view, crc, self.limits, self.like)
            if message is not None:  # one plain ndarray, decoded in C
                return message
        into = self._slot(view) if crc is None and len(view) >= SPLIT_CRC_FROM else None
        crcs = split_checksum(view, crc, into) if len(view) >= SPLIT_CRC_FROM else None
        limits = self.limits if not redelivered else dataclasses.replace(self.limits, max_frame_age_s=None)
        frame = parse(
            view, limits=limits, signing_key=self.signing_key, crc=crc if crcs is None else crcs[0], aged_at=appended_at
        )
        if frame.header.get("kind") != "chunk":
            return message_from_frame(frame, copy=copy, limits=self.limits, like=self.like)
        message_id = _message_id(frame.header.get("id"))
        if message_id is None:
            raise MalformedHeader("chunk has no message id")
        self.last_message_id = message_id
        index, count, total, stride = self._chunk_fields(frame.header)
        if message_id in self._done:
            self.stats["duplicates"] += 1
            return None
        if message_id in self._given_up:
            self.stats["given_up_chunks"] += 1
            return None
        expected = min(stride, total - index * stride)
        if len(frame.payload) != expected:  # checked before any memory is set aside for the message
            raise MalformedHeader(f"chunk {index} should carry {expected} bytes, carries {len(frame.payload)}")
        partial = self._partials.get(message_id) or self._start(message_id, count, total, stride, frame.header)
        if (partial.count, partial.stride, partial.total, partial.key) != (
            count,
            stride,
            total,
            frame.header.get("key"),
        ):
            raise MalformedHeader(f"chunk {index} of message {message_id} disagrees with the earlier chunks")
        if index in partial.received:
            self.stats["duplicates"] += 1
            if len(partial.received) < count:
                return None
            # whole already: the decode of it was interrupted (Ctrl-C) and its last chunk is fed again
        else:
            placed = into is not None and crcs is not None  # (copied by the check: see `_slot`)
            self._place(message_id, partial, index, frame.payload, owned or isinstance(data, bytes), placed)
            partial.received.add(index)
            if frame.flags & (FLAG_CHECKSUM | FLAG_SIGNED) == FLAG_CHECKSUM:
                whole = crcs[1] if crcs is not None else crc32c(frame.payload)
                # (the first chunk's slice starts with the whole frame's prefix: its CRC field is skipped)
                partial.crcs[index] = payload_crcs(frame.payload, whole)[1] if index == 0 else whole
            if len(partial.received) < count:
                return None
        if not partial.allocated:
            self._allocate(partial)
        assert partial.buffer is not None
        try:
            message = message_from_frame(
                parse(
                    partial.buffer,
                    limits=limits,
                    signing_key=self.whole_signing_key,
                    crc=self._combined_crc(partial),
                    aged_at=appended_at,
                ),
                copy=copy,
                limits=self.limits,
                like=self.like,
            )
        except CodecError:
            self._finish(message_id)  # a bad frame: done with it (anything else leaves it to be fed again)
            self._gave_up(message_id)
            raise
        self._finish(message_id)
        return message

    def _slot(self, view: memoryview) -> memoryview | None:
        """Where a chunk's payload goes in its message's buffer, if its header says it is one not yet received
        of a message that has its buffer: its CRC check then copies it there in the same pass. Read before the
        check, so a bad chunk may fill its slot, but only one not received: a good one overwrites it."""
        peeked = peek_chunk(view) if self._partials and self.signing_key is None else None
        partial = self._partials.get(peeked[0]) if peeked is not None else None
        if partial is None or partial.buffer is None or peeked is None or peeked[1] in partial.received:
            return None
        start, payload = peeked[1] * partial.stride, len(view) - align(PREFIX.size + PREFIX.unpack_from(view)[4])
        fits = 0 <= peeked[1] < partial.count and payload == min(partial.stride, partial.total - start)
        return partial.buffer[start : start + payload] if fits else None

    def _place(
        self, message_id: MessageId, partial: _Partial, index: int, payload: memoryview, owned: bool, placed: bool
    ) -> None:
        """Put a chunk's bytes in place (unless `placed` there already), or keep them until the message gets
        its buffer (see the class)."""
        if not partial.allocated:
            if self.held_bytes + len(payload) > self.max_bytes:
                raise self._give_up(
                    message_id,
                    f"chunk {index} of message {message_id} would hold {self.held_bytes + len(payload)} bytes "
                    f"for reassembly; the limit is {self.max_bytes}: message given up",
                )
            if partial.buffer is None and not partial.pieces:  # its first chunk: a free pooled buffer, if one fits
                partial.buffer = self._pool.take_free(partial.total)
            self._charge(partial, len(payload))
        if partial.buffer is not None:  # (while its bytes are in cache: the CRC check just read them)
            if not placed:
                copy_into(partial.buffer[index * partial.stride : index * partial.stride + len(payload)], payload)
        else:
            keep = owned and _buffer_bytes(payload) <= 2 * len(payload) + PINNED_SLACK
            partial.pieces[index] = payload if keep else memoryview(bytes(payload))
        partial.got += len(payload)
        grown = partial.total - partial.charged + PARTIAL_OVERHEAD
        if not partial.allocated and 2 * partial.got >= partial.total and self.held_bytes + grown <= self.max_bytes:
            self._allocate(partial)

    def _allocate(self, partial: _Partial) -> None:
        """Count a message's whole buffer against the budget: give it one (a reused one when no tensor still
        views it: fresh pages are slow) and move the chunks kept so far into it, unless it has one already."""
        buffer = partial.buffer if partial.buffer is not None else self._pool.take(partial.total)
        for index, piece in partial.pieces.items():
            copy_into(buffer[index * partial.stride : index * partial.stride + len(piece)], piece)
        partial.buffer, partial.pieces, partial.allocated = buffer, {}, True
        self._charge(partial, partial.total + PARTIAL_OVERHEAD - partial.charged)

    def _charge(self, partial: _Partial, nbytes: int) -> None:
        partial.charged += nbytes
        self.held_bytes += nbytes

    def _give_up(self, message_id: MessageId, why: str) -> LimitExceeded:
        """Drop a message that cannot be completed within the budget (its later chunks are dropped
        too, and what it held is freed); returns the error to raise."""
        self.stats["refused"] += 1
        _remember(self._given_up, message_id)
        partial = self._partials.pop(message_id, None)
        if partial is None:  # refused at its first chunk
            return LimitExceeded(why)
        self._gave_up(message_id)
        self.held_bytes -= partial.charged
        log.error(
            "gave up on message %s (key %r): %d of %d bytes received, %d bytes held for reassembly (limit %d)",
            message_id,
            partial.key,
            partial.got,
            partial.total,
            self.held_bytes,
            self.max_bytes,
        )
        return LimitExceeded(why)

    @staticmethod
    def _combined_crc(partial: _Partial) -> int | None:
        """The reassembled frame's CRC32C from its chunks' (None: a frame `parse` must read through)."""
        buffer = partial.buffer
        assert buffer is not None
        if len(partial.crcs) != partial.count or len(buffer) < PREFIX.size or buffer[5] & FLAG_SIGNED:
            return None  # a signed frame's checksum stops before its signature: not the chunks' sum
        crc = partial.crcs[0]
        for index in range(1, partial.count):
            slice_crc = partial.crcs[index]
            if crc is None or slice_crc is None:
                return None
            crc = combine(crc, slice_crc, min(partial.stride, len(buffer) - index * partial.stride))
        return crc

    def _chunk_fields(self, header: dict[str, Any]) -> tuple[int, int, int, int]:
        fields = header.get("chunk")
        if not (isinstance(fields, list) and len(fields) == 4 and all(type(v) is int for v in fields)):
            raise MalformedHeader(f"chunk info must be [index, count, total, stride], got {brief(fields)}")
        index, count, total, stride = fields
        if stride <= 0 or total <= 0 or count != -(-total // stride) or not 0 <= index < count:
            raise MalformedHeader(f"inconsistent chunk info index={index} count={count} total={total} stride={stride}")
        if stride < MIN_STRIDE and count > 1:
            raise MalformedHeader(f"chunks of {stride} bytes are below the {MIN_STRIDE}-byte minimum")
        limit = self.limits.max_payload_bytes + self.limits.max_header_bytes
        if total > limit:
            raise LimitExceeded(f"chunked message claims {total} bytes; the frame limit is {limit}")
        return index, count, total, stride

    def _start(self, message_id: MessageId, count: int, total: int, stride: int, header: dict[str, Any]) -> _Partial:
        if total + PARTIAL_OVERHEAD > self.max_bytes:  # could never be held whole
            raise self._give_up(
                message_id, f"a chunked message of {total} bytes; the reassembly limit is {self.max_bytes}"
            )
        if self.held_bytes + PARTIAL_OVERHEAD > self.max_bytes:  # (it cannot be whole any more)
            raise self._give_up(
                message_id,
                f"{len(self._partials)} messages hold {self.held_bytes} bytes for reassembly; "
                f"the limit is {self.max_bytes}: message given up",
            )
        partial = _Partial(total, count, stride, header.get("key"), self.clock())
        self._partials[message_id] = partial
        self._expire_at = min(self._expire_at, partial.started + self.timeout_s)
        self._charge(partial, PARTIAL_OVERHEAD)
        return partial

    def _finish(self, message_id: MessageId) -> None:
        partial = self._partials.pop(message_id)
        self.held_bytes -= partial.charged
        _remember(self._done, message_id)

    def expire(self) -> int:
        """Drop messages incomplete for longer than `timeout_s`; return how many were dropped (none while paused).

        `feed` calls it once the oldest incomplete message may be late (`_expire_at`), not for every frame.
        """
        if self._paused_since is not None or not self._partials:  # (no clock read for nothing to expire)
            return 0
        now, stale = self.clock(), []
        self._expire_at = math.inf
        for mid, p in self._partials.items():  # oldest first (started in insertion order): stop at a fresh one
            if now - p.started <= self.timeout_s:
                self._expire_at = p.started + self.timeout_s
                break
            stale.append(mid)
        for mid in stale:
            partial = self._partials.pop(mid)
            self.held_bytes -= partial.charged
            log.error(
                "dropped incomplete message %s (key %r): %d of %d chunks after %.1fs",
                mid,
                partial.key,
                len(partial.received),
                partial.count,
                self.timeout_s,
            )
        self.stats["expired"] += len(stale)
        for mid in stale:
            self._gave_up(mid)
        return len(stale)

    def _gave_up(self, message_id: MessageId) -> None:
        """Count a message given up on, and report it (its frames may be acknowledged now)."""
        self.given_up += 1
        if self.on_given_up is not None:
            self.on_given_up(message_id)

    def pause(self) -> None:
        """Stop the clocks of incomplete messages: their chunks are not late, their reader is held up."""
        if self._paused_since is None:
            self._paused_since = self.clock()

    def resume(self) -> None:
        """Start the clocks again, giving every incomplete message the time they stood still."""
        if self._paused_since is not None:
            stood = self.clock() - self._paused_since
            self._paused_since = None
            for partial in self._partials.values():
                partial.started += stood
            self._expire_at += stood

    def close(self) -> None:
        """Forget every incomplete message (its consumer closed): the chunks kept for them, and the
        buffers they came in (an shm:// segment among them), are let go. Not given up on: their frames
        were never acknowledged, so the endpoint hands them to the next consumer."""
        self._partials.clear()
        self.held_bytes = 0
        self._expire_at = math.inf

    def is_pending(self, message_id: MessageId | None) -> bool:
        """True while some but not all chunks of `message_id` have arrived."""
        return message_id in self._partials

    @property
    def pending(self) -> int:
        """Messages with some but not all chunks received."""
        return len(self._partials)
