"""The tensorbus frame: fixed prefix, msgpack header, 64-byte aligned payload (see docs/FORMAT.md)."""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, cast

import msgpack
import numpy as np

from ..buffers import copy_into
from ..errors import (
    BadMagic,
    ChecksumMismatch,
    CodecError,
    ConfigError,
    InvalidTensor,
    LimitExceeded,
    MalformedHeader,
    SignatureError,
    TruncatedFrame,
    UnsupportedVersion,
    brief,
)
from ..keys import MAX_KEY_CHARS, check_key
from .compression import compress_if_it_pays, decompress
from .crc import combine, uncombine
from .native import NATIVE, agrees, crc32c, crc32c_copy
from .signing import TIMESTAMP, check_age
from .tensors import ALIGN, MAX_TREE_DEPTH, MAX_TREE_ENTRIES, align, flatten, rebuild
from .torch_bridge import to_like

MAGIC = b"TBUS"
VERSION = 1
#: magic, version, flags, reserved, header length, payload length, CRC32C
PREFIX = struct.Struct("<4sBBHIQI")
CRC_AT = PREFIX.size - 4
FLAG_CHECKSUM = 0x01
FLAG_SIGNED = 0x02
KNOWN_FLAGS = FLAG_CHECKSUM | FLAG_SIGNED
SIGNATURE_BYTES = 32

Buffer = bytes | bytearray | memoryview
MessageId = tuple[str, int]


@dataclass(frozen=True)
class Limits:
    """Bounds applied to untrusted frames before anything is allocated or built."""

    max_header_bytes: int = 1 << 20
    max_ndim: int = 32
    max_tensors: int = 65536
    max_payload_bytes: int = 1 << 36
    #: what a compressed payload may expand to: a few KB of zstd can claim gigabytes, so far less than the above
    max_decompressed_bytes: int = 1 << 30
    #: how far a signed message's timestamp may be from this clock, either way (None: not checked)
    max_frame_age_s: float | None = None
    #: how deeply a nested structure may nest, and how many containers and leaves it may hold
    max_tree_depth: int = MAX_TREE_DEPTH
    max_tree_entries: int = MAX_TREE_ENTRIES

    @functools.cached_property
    def native(self) -> bool:
        """Whether the C fast paths can apply these limits as given (else the Python paths apply them).

        Asked for every received frame: worked out once (the limits cannot change)."""
        header, payload, ndim, tensors = self.max_header_bytes, self.max_payload_bytes, self.max_ndim, self.max_tensors
        return (
            all(type(value) is int for value in (header, payload, ndim, tensors))
            and 0 <= header < 1 << 32
            and 0 <= payload <= 1 << 62
            and 0 <= ndim < 1 << 31
            and tensors >= 1
        )


DEFAULT_LIMITS = Limits()
#: the longest producer id a frame may carry (tensorbus producers use 16 hex digits)
MAX_PRODUCER_ID = 128
#: how deeply metadata may nest (maps and lists in maps and lists)
MAX_METADATA_DEPTH = 32
#: what each decoded metadata object (map, list, key, value) counts against a consumer's buffer
#: limit: about what Python spends on one, where msgpack may spend a single byte (an empty map)
OBJECT_BYTES = 64


class Acknowledger(Protocol):
    """What settles a message handed out under `ack="manual"` (the consumer's intake)."""

    def acknowledge(self, message: Message) -> None: ...

    def reject(self, message: Message) -> None: ...


@dataclass(slots=True)  # (one is made for every tensor received: slots halve that cost)
class Message:
    """A decoded frame: the tensor plus what travelled with it."""

    key: str | None
    tensor: Any
    metadata: dict[str, Any] = field(default_factory=dict)
    message_id: MessageId | None = None
    kind: str = "ndarray"
    #: bytes of the frame outside the payload (mostly the header: key, metadata), plus OBJECT_BYTES
    #: per metadata object, which the consumer's buffer limit counts along with the tensor's own
    header_bytes: int = 0
    #: set by a consumer with `ack="manual"` as it hands the message out (not a constructor argument:
    #: the C codec makes Messages without `__init__`, so it may be unset): what `ack` and `reject` call
    acknowledger: Acknowledger | None = field(default=None, init=False, repr=False, compare=False)

    def ack(self) -> None:
        """With `ack="manual"`: the application is done with this message (`consumer.ack(message)`)."""
        self._manual("ack").acknowledge(self)

    def reject(self) -> None:
        """With `ack="manual"`: give this message back unacknowledged, to be delivered again, first in
        line (`consumer.reject(message)`)."""
        self._manual("reject").reject(self)

    def _manual(self, what: str) -> Acknowledger:
        acknowledger = getattr(self, "acknowledger", None)  # (unset on a Message the C codec made)
        if acknowledger is None:
            raise ConfigError(
                f"message.{what}() needs a message handed out by a Consumer with ack='manual' "
                f"(this one was not: {brief(self.key)})"
            )
        return acknowledger


@dataclass(slots=True)
class TracedMessage(Message):
    """A decoded frame whose header carried a W3C trace context (`trace`: traceparent, tracestate)."""

    trace: dict[str, str] = field(default_factory=dict)


#: the optional header field of a producer's W3C trace context (docs/FORMAT.md), and the longest values read
TRACE = "trace"
_TRACE_FIELDS = {"traceparent": 128, "tracestate": 512}


class TraceCarrier(dict[str, Any]):
    """A message's metadata plus the trace context to put in its frame's header (`TRACE`): what a traced
    `Producer.send` passes where metadata goes. The C header maker leaves such a frame to `layout`."""

    def __init__(self, metadata: dict[str, Any] | None, trace: dict[str, str]) -> None:
        super().__init__(metadata or {})
        self.trace = trace


def read_trace(value: object) -> dict[str, str] | None:
    """The trace context of a header's `trace` field: its traceparent and tracestate when they are strings
    of a sane length; None for anything else, which is ignored (as W3C Trace Context says), not refused."""
    if not isinstance(value, dict):
        return None
    trace = {
        name: text
        for name, longest in _TRACE_FIELDS.items()
        if isinstance(text := value.get(name), str) and len(text) <= longest
    }
    return trace if "traceparent" in trace else None


@dataclass
class Frame:
    """A parsed and verified frame whose payload has not been turned into arrays yet."""

    header: dict[str, Any]
    payload: memoryview
    flags: int
    nbytes: int


def _message_id(value: object) -> MessageId | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str) and type(value[1]) is int:
        if len(value[0]) > MAX_PRODUCER_ID:  # consumers remember many ids: each must stay small
            raise MalformedHeader(f"producer id of {len(value[0])} characters; the limit is {MAX_PRODUCER_ID}")
        return value[0], value[1]
    raise MalformedHeader(f"message id must be [producer id, sequence], got {brief(value)}")


def frame_head(
    header: dict[str, Any], payload_len: int, flags: int, max_header_bytes: int = DEFAULT_LIMITS.max_header_bytes
) -> bytearray:
    """Prefix (CRC still zero) plus the packed header, padded to the 64-byte payload alignment.

    A header over `max_header_bytes` (what the consumers take) is refused here, before anything is sent.
    """
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise MalformedHeader(f"metadata must hold only msgpack-able values: {exc}") from None
    if header.get("meta"):  # refused here what every receiver would refuse (map keys, depth): see below
        metadata_objects(header["meta"], containers=(dict, list, tuple))
    if len(packed) > max_header_bytes:
        raise LimitExceeded(
            f"the frame's header (key, metadata, table of tensors) would be {len(packed)} bytes, over "
            f"max_header_bytes={max_header_bytes}: consumers refuse headers over their max_header_bytes "
            f"({DEFAULT_LIMITS.max_header_bytes} by default; a producer's option says what its consumers take)"
        )
    head = bytearray(align(PREFIX.size + len(packed)))
    PREFIX.pack_into(head, 0, MAGIC, VERSION, flags, 0, len(packed), payload_len, 0)
    head[PREFIX.size : PREFIX.size + len(packed)] = packed
    return head


def metadata_objects(value: Any, containers: tuple[type, ...] = (dict, list)) -> int:
    """Count the objects of decoded metadata (iteratively: it may come from anyone), checking its
    map keys and its depth; what a buffered message's metadata costs is charged by this count.

    Receivers unpack headers with strict map keys (a hostile header cannot make them hash arbitrary
    objects) and refuse nesting past MAX_METADATA_DEPTH; a sender checks the same (with tuples,
    which msgpack writes as lists), or such a frame would be sent fine and dropped by every consumer.
    """
    if type(value) is dict:  # the common case, quickly: a flat map of named values
        for name, inner in value.items():
            if type(name) is not str or isinstance(inner, containers):
                break
        else:
            return 1 + 2 * len(value)
    count, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if isinstance(item, containers):
            if depth > MAX_METADATA_DEPTH:
                raise MalformedHeader(f"metadata nests deeper than {MAX_METADATA_DEPTH} levels")
            if isinstance(item, dict):
                for name, inner in item.items():
                    if not isinstance(name, (str, bytes)):
                        raise MalformedHeader(f"metadata map keys must be str or bytes, got {brief(name)}")
                    stack.append((inner, depth + 1))
                count += len(item)
            else:
                stack.extend((inner, depth + 1) for inner in cast(list, item))
    return count


def seal_with_crc(head: bytearray, body_crc: int, body_len: int) -> None:
    """Write the frame CRC into `head` from the separately computed CRC32C of its payload."""
    struct.pack_into("<I", head, CRC_AT, combine(checksum_of(head), body_crc, body_len))


def write_crc(head: bytearray, body: Sequence[Buffer]) -> None:
    """Write the CRC32C over prefix, header and payload into the CRC field of `head`."""
    crc = checksum_of(head)
    for part in body:
        crc = crc32c(part, crc)
    struct.pack_into("<I", head, CRC_AT, crc)


def seal(
    head: bytearray, body: Sequence[Buffer], checksum: bool, signing_key: bytes | None, *, deferred: bool = False
) -> list[Buffer]:
    """Fill in the CRC over prefix, header and payload, and append the HMAC if signing.

    `deferred` (unsigned frames only) leaves the CRC field zero and the head a bytearray, for a
    transport that checksums while it sends (`transports.stream.send_frame`).
    """
    if checksum and deferred and signing_key is None:
        return [head, *body]
    if checksum:
        write_crc(head, body)
    if signing_key is None:
        return [bytes(head), *body]
    mac = hmac.new(signing_key, head, hashlib.sha256)
    for part in body:
        mac.update(part)
    return [bytes(head), *body, mac.digest()]


def encode_raw(
    header: dict[str, Any],
    body: Sequence[Buffer],
    payload_len: int,
    *,
    checksum: bool = True,
    signing_key: bytes | None = None,
    deferred_checksum: bool = False,
    max_header_bytes: int = DEFAULT_LIMITS.max_header_bytes,
) -> list[Buffer]:
    """Frame an already-laid-out payload under `header`; used for tensors and for chunks."""
    flags = (FLAG_CHECKSUM if checksum else 0) | (FLAG_SIGNED if signing_key is not None else 0)
    head = frame_head(header, payload_len, flags, max_header_bytes)
    return seal(head, body, checksum, signing_key, deferred=deferred_checksum)


def layout(
    obj: Any,
    *,
    key: str | None = None,
    metadata: dict[str, Any] | None = None,
    compression: str | None = None,
    message_id: MessageId | None = None,
) -> tuple[dict[str, Any], list[Buffer], int]:
    """The header, the payload buffers (the arrays' own memory) and the payload length of a tensor."""
    check_key(key)
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidTensor(f"metadata must be a dict of msgpack-able values, got a {type(metadata).__name__}")
    kind, extra, entries, arrays = flatten(obj)
    body: list[Buffer] = []
    end = 0
    for entry, array in zip(entries, arrays, strict=False):
        if entry["offset"] > end:
            body.append(bytes(entry["offset"] - end))
        if array.nbytes:
            body.append(flat_bytes(array))
        end = entry["offset"] + array.nbytes
    header: dict[str, Any] = {
        "kind": kind,
        "key": key,
        "meta": metadata or {},
        "id": list(message_id) if message_id else None,
        "tensors": entries,
        "comp": None,
        **extra,
    }
    if isinstance(metadata, TraceCarrier):
        header[TRACE] = metadata.trace
    if compression is not None:
        packed = compress_if_it_pays(compression, body)
        if packed is not None:
            header["comp"], header["raw"] = compression, end
            body, end = [packed], len(packed)
    return header, body, end


def stamp(header: dict[str, Any]) -> None:
    """Put the producer's clock in a signed message's header (see `signing.check_age`)."""
    header[TIMESTAMP] = time.time()


def restamp(frame: list[Buffer]) -> bool:
    """Put the producer's clock of now in a signed whole message's frame (its head, `frame[0]`, is
    replaced and its CRC fixed; the caller signs the frame again): what a producer resending a frame
    to another consumer run does, vouching for it anew (docs/SECURITY.md, "A redelivery is not a
    replay"). False, with the frame as it was, for anything else (a chunk: its message's clock is
    inside the payload, under a signature over the whole message)."""
    view = memoryview(frame[0]).cast("B")
    if len(view) < PREFIX.size:
        return False
    _, _, flags, _, header_len, _, stored = PREFIX.unpack_from(view)
    if not flags & FLAG_SIGNED or len(view) < PREFIX.size + header_len:
        return False
    header = _unpack_header(view[PREFIX.size : PREFIX.size + header_len])
    if header.get("kind") == "chunk" or TIMESTAMP not in header:
        return False
    stamp(header)
    packed = msgpack.packb(header, use_bin_type=True)
    if len(packed) != header_len:  # (never: the clock is a float64, 9 bytes, and the rest packs as it did)
        return False
    head = bytearray(view)
    head[PREFIX.size : PREFIX.size + header_len] = packed
    if flags & FLAG_CHECKSUM:  # the CRC over head and payload, from the payload's (taken out of the old one)
        body_len = sum(memoryview(part).nbytes for part in frame[1:-1])  # (the last part is the signature)
        body_crc = uncombine(stored, checksum_of(view), body_len)
        struct.pack_into("<I", head, CRC_AT, combine(checksum_of(head), body_crc, body_len))
    frame[0] = bytes(head)
    return True


def flat_bytes(array: np.ndarray) -> memoryview:
    """An array's memory as flat bytes (in its own C or Fortran order), without a copy."""
    try:
        return array.data.cast("B")  # (quick: this runs for every tensor sent)
    except (TypeError, ValueError):  # Fortran order, or a dtype the buffer protocol cannot name (bfloat16)
        return array.reshape(-1, order="A").view("u1").data


def encode(
    obj: Any,
    *,
    key: str | None = None,
    metadata: dict[str, Any] | None = None,
    compression: str | None = None,
    checksum: bool = True,
    message_id: MessageId | None = None,
    signing_key: bytes | None = None,
    deferred_checksum: bool = False,
    max_header_bytes: int = DEFAULT_LIMITS.max_header_bytes,
) -> list[Buffer]:
    """Encode a tensor as scatter-gather buffers; the payload buffers are the arrays' own memory.

    `deferred_checksum`: leave the CRC to a transport that computes it while sending (see `seal`).
    `max_header_bytes`: the largest header the consumers take (`LimitExceeded` for a larger one).
    """
    if (
        NATIVE is not None
        and compression is None
        and signing_key is None
        and type(obj) is np.ndarray
        and max_header_bytes >= DEFAULT_LIMITS.max_header_bytes  # (the C head leaves larger headers to Python)
    ):  # in C
        flags = (FLAG_CHECKSUM if checksum else 0) | (FLAG_SIGNED if signing_key is not None else 0)
        head = NATIVE.ndarray_head(obj, key, metadata, message_id, flags)
        if head is not None:
            body: list[Buffer] = [flat_bytes(obj)] if obj.nbytes else []
            return seal(head, body, checksum, signing_key, deferred=deferred_checksum)
    header, body, end = layout(obj, key=key, metadata=metadata, compression=compression, message_id=message_id)
    if signing_key is not None:
        stamp(header)
    return encode_raw(
        header,
        body,
        end,
        checksum=checksum,
        signing_key=signing_key,
        deferred_checksum=deferred_checksum,
        max_header_bytes=max_header_bytes,
    )


def dumps(obj: Any, *, out: bytearray | memoryview | None = None, **options: Any) -> bytes | memoryview:
    """Encode a tensor into one contiguous frame (see `encode` for the options).

    With `out`, the frame is written into that caller-owned buffer and a memoryview of the used
    part is returned: reusing one buffer avoids the fresh-page cost of a new large `bytes` per call.
    """
    buffers = encode(obj, **options)
    if out is None:
        return b"".join(buffers)
    return join_into(buffers, out)


def join_into(buffers: Sequence[Buffer], out: bytearray | memoryview) -> memoryview:
    """Copy scatter-gather buffers back to back into `out`; return the used part of it (a `LimitExceeded`
    when it is too small: what fitted of the frame was copied, the rest not)."""
    target = memoryview(out).cast("B")
    views = [memoryview(b).cast("B") for b in buffers]
    at = 0
    for view in views:
        end = at + view.nbytes
        if end > target.nbytes:
            raise LimitExceeded(f"out has {target.nbytes} bytes; the frame needs {sum(v.nbytes for v in views)}")
        copy_into(target[at:end], view)
        at = end
    return target[:at]


#: the msgpack types of the header fields this build knows (docs/FORMAT.md; `tree` is a node of any type, checked
#: as it is read): one of another type is `MalformedHeader`; a field not listed is ignored (a newer writer's)
HEADER_TYPES: dict[str, tuple[type, ...]] = {
    "kind": (str,), "key": (str, type(None)), "meta": (dict,), "id": (list, type(None)), "comp": (str, type(None)),
    "raw": (int,), "tensors": (list,), "dense_shape": (list,), "chunk": (list,), TIMESTAMP: (float,),
}  # fmt: skip
#: the same for each entry of `tensors`
ENTRY_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "dtype": (str,), "order": (str,), "shape": (list,), "fortran": (bool,), "offset": (int,),
    "nbytes": (int,),
}  # fmt: skip
_MSGPACK_NAMES = {str: "str", type(None): "nil", dict: "map", list: "array", int: "int", float: "float", bool: "bool"}


def _check_types(fields: dict[str, Any], known: dict[str, tuple[type, ...]], where: str) -> None:
    """Refuse a known field whose value is of another msgpack type (exact types: a bool is not an int)."""
    for name, types in known.items():
        if name in fields and type(fields[name]) not in types:
            wanted = " or ".join(_MSGPACK_NAMES[t] for t in types)
            raise MalformedHeader(f"{where} field {name!r} must be {wanted}, got {brief(fields[name])}")


def _unpack_header(raw: memoryview) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise MalformedHeader(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise MalformedHeader(f"header must be a msgpack map, got {type(header).__name__}")
    _check_types(header, HEADER_TYPES, "header")
    for entry in header.get("tensors", ()):
        if isinstance(entry, dict):  # (anything else is refused as the table is read)
            _check_types(entry, ENTRY_TYPES, "tensor entry")
    return header


def peek_message(frame: Buffer, limits: Limits = DEFAULT_LIMITS) -> tuple[str | None, MessageId | None] | None:
    """The key and id of a whole message's frame, read from its header without checking or decoding the
    rest (to decide where it goes before paying for it); None for a chunk or a frame that does not parse."""
    try:
        view = memoryview(frame).cast("B")
        frame_length(view, limits)
        header_len = PREFIX.unpack_from(view)[4]
        header = _unpack_header(view[PREFIX.size : PREFIX.size + header_len])
        key = header.get("key")
        if header.get("kind") == "chunk" or not (key is None or isinstance(key, str)):
            return None
        return key, _message_id(header.get("id"))
    except (CodecError, TypeError, ValueError):
        return None


def decoded_size(frame: Buffer, limits: Limits = DEFAULT_LIMITS) -> int | None:
    """The bytes a whole message's frame decodes to (its payload, or the `raw` size it declares when compressed),
    read from its prefix and header without decoding it; None for a frame that does not parse."""
    try:
        view = memoryview(frame).cast("B")
        frame_length(view, limits)
        header_len, payload_len = PREFIX.unpack_from(view)[4:6]
        header = _unpack_header(view[PREFIX.size : PREFIX.size + header_len])
    except (CodecError, TypeError, ValueError):
        return None
    raw = header.get("raw") if header.get("comp") is not None else payload_len
    return raw if type(raw) is int else None


def decode_work(frame: Buffer, limits: Limits = DEFAULT_LIMITS) -> int:
    """The bytes decoding a frame still has to go over once a stream reader checked its CRC: the payload
    again for a signature, and the `raw` bytes a compressed payload expands to. 0 for any other frame (its
    arrays are views of the payload) and for one whose header does not parse (refused at once)."""
    try:
        view = memoryview(frame).cast("B")
        _, _, flags, _, header_len, payload_len, _ = PREFIX.unpack_from(view)
        if header_len > limits.max_header_bytes:
            return 0
        header = _unpack_header(view[PREFIX.size : PREFIX.size + header_len])
    except (CodecError, TypeError, ValueError, struct.error):
        return 0
    raw = header.get("raw") if header.get("comp") is not None else 0
    return (payload_len if flags & FLAG_SIGNED else 0) + (raw if type(raw) is int and raw > 0 else 0)


def checksum_of(data: Buffer) -> int:
    """CRC32C of what a frame's checksum covers, over the frame (or its head) in `data`: all but bytes 20-23."""
    view = memoryview(data)
    return crc32c(view[PREFIX.size :], crc32c(view[:CRC_AT]))


def payload_crcs(payload: memoryview, whole: int | None = None) -> tuple[int, int | None]:
    """CRC32C of a chunk's payload, and of it without bytes 20-23 (None if shorter than a prefix).

    The first chunk's slice begins with the reassembled frame's prefix, whose checksum skips its
    own CRC field (bytes 20-23); with both, the reassembled frame's CRC is combined from its
    chunks' and the tensor is not read a second time. Given `whole` (the first value, known
    already), only the 24 bytes of that prefix are read.
    """
    if len(payload) < PREFIX.size:
        return (crc32c(payload) if whole is None else whole), None
    before, field = crc32c(payload[:CRC_AT]), crc32c(payload[CRC_AT : PREFIX.size])
    head, rest = combine(before, field, 4), len(payload) - PREFIX.size
    if whole is None:
        after = crc32c(payload[PREFIX.size :])
        whole = combine(head, after, rest)
    else:
        after = uncombine(whole, head, rest)
    return whole, combine(before, after, rest)


#: how a chunk frame's header begins (`split` writes "kind" first): a hint, checked like everything else
_CHUNK_HEADER_START = b"\xa4kind\xa5chunk"
#: where in a frame, and with which bytes, a chunk's header begins (`is_chunk`; the intake's C delivery reads it too)
_CHUNK_AT = PREFIX.size + 1
CHUNK_MARK = (_CHUNK_AT, _CHUNK_HEADER_START)


def is_chunk(view: memoryview) -> bool:
    """Whether a frame's header begins as a chunk's does (a hint: `parse` checks the frame all the same)."""
    return view[_CHUNK_AT : _CHUNK_AT + len(_CHUNK_HEADER_START)] == _CHUNK_HEADER_START


def peek_chunk(view: memoryview) -> tuple[tuple[Any, ...], int] | None:
    """A chunk frame's message id and index, read from its header before any check (a hint: to decide where
    its payload goes before paying for it); None for anything that does not read as a chunk's header."""
    if not is_chunk(view):
        return None
    try:
        header = msgpack.unpackb(view[PREFIX.size : PREFIX.size + PREFIX.unpack_from(view)[4]])
        message_id, index = tuple(header["id"]), header["chunk"][0]
        hash(message_id)
    except Exception:  # msgpack raises several unrelated types on garbage; any other shape is no chunk's
        return None
    return (message_id, index) if type(index) is int else None


def split_checksum(view: memoryview, crc: int | None = None, into: memoryview | None = None) -> tuple[int, int] | None:
    """For a checksummed, unsigned chunk frame: its CRC to verify and its payload's, in one pass; else None.

    With `crc`, the frame's CRC32C as a stream reader computed it while receiving, the payload's is
    derived from it and the payload is not read again. Else, given `into` (as long as the payload),
    the payload is copied there in the same pass (when the answer is not None). Other frames need no payload CRC, and
    combining CRCs is not free: they get None and `parse` as usual. (Only the first chunk also needs
    its payload's CRC without the reassembled frame's CRC field: `payload_crcs` from the second value.)
    """
    if not is_chunk(view):
        return None
    _, _, flags, _, header_len, payload_len, _ = PREFIX.unpack_from(view)
    start = align(PREFIX.size + header_len)
    if flags & (FLAG_CHECKSUM | FLAG_SIGNED) != FLAG_CHECKSUM or len(view) != start + payload_len:
        return None
    head = checksum_of(view[:start])
    if crc is not None:
        return crc, uncombine(crc, head, payload_len)
    whole = crc32c(view[start:]) if into is None else crc32c_copy(into, view[start:])
    return combine(head, whole, payload_len), whole


def frame_length(prefix: Buffer, limits: Limits = DEFAULT_LIMITS) -> int:
    """Validate a frame's fixed prefix and return the frame's total length (for stream readers)."""
    view = memoryview(prefix).cast("B")
    if len(view) < PREFIX.size:
        raise TruncatedFrame(f"frame needs at least {PREFIX.size} bytes for its prefix, got {len(view)}")
    magic, version, flags, reserved, header_len, payload_len, _ = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise BadMagic(f"expected magic {MAGIC!r}, found {bytes(magic)!r}")
    if version != VERSION:
        raise UnsupportedVersion(f"expected format version {VERSION}, found {version}")
    if flags & ~KNOWN_FLAGS:
        raise UnsupportedVersion(f"frame sets unknown flags {flags:#x}")
    if reserved:
        raise UnsupportedVersion(f"frame sets reserved bytes 6-7 to {reserved:#06x}; they must be 0")
    if header_len > limits.max_header_bytes:
        raise LimitExceeded(f"header of {header_len} bytes exceeds max_header_bytes={limits.max_header_bytes}")
    if payload_len > limits.max_payload_bytes:
        raise LimitExceeded(f"payload of {payload_len} bytes exceeds max_payload_bytes={limits.max_payload_bytes}")
    return align(PREFIX.size + header_len) + payload_len + (SIGNATURE_BYTES if flags & FLAG_SIGNED else 0)


def parse(
    data: Buffer,
    *,
    limits: Limits = DEFAULT_LIMITS,
    signing_key: bytes | None = None,
    crc: int | None = None,
    aged_at: float | None = None,
) -> Frame:
    """Check a frame's prefix, lengths, checksum and signature; return its header and payload view.

    A signed message's age is its clock's distance from now, or from `aged_at` (a broker's append time).

    `crc` is the CRC32C of the checksummed bytes when the caller already computed it (a stream
    reader does, slice by slice while the bytes are still in cache); it is compared, not trusted.
    """
    view = memoryview(data).cast("B")
    total = frame_length(view, limits)
    _, _, flags, _, header_len, _, stored = PREFIX.unpack_from(view)
    start = align(PREFIX.size + header_len)
    end = total - (SIGNATURE_BYTES if flags & FLAG_SIGNED else 0)
    if len(view) < total:
        raise TruncatedFrame(f"frame needs {total} bytes, got {len(view)}")
    if len(view) > total:
        raise MalformedHeader(f"frame is {total} bytes but {len(view) - total} more follow it")
    if signing_key is not None:
        if not flags & FLAG_SIGNED:
            raise SignatureError("frame is unsigned but this endpoint requires a signature")
        expected = hmac.new(signing_key, view[:end], hashlib.sha256).digest()
        if not hmac.compare_digest(expected, view[end:total]):
            raise SignatureError("frame signature does not match: tampered, or signed with another key")
    if flags & FLAG_CHECKSUM:
        actual = crc if crc is not None else checksum_of(view[:end])
        if actual != stored:
            raise ChecksumMismatch(f"CRC32C stored {stored:#010x}, computed {actual:#010x}")
    header = _unpack_header(view[PREFIX.size : PREFIX.size + header_len])
    if signing_key is not None and header.get("kind") != "chunk":
        check_age(header, limits.max_frame_age_s, time.time if aged_at is None else lambda: aged_at)
    tensors = header.get("tensors", [])
    if isinstance(tensors, list) and len(tensors) > limits.max_tensors:
        raise LimitExceeded(f"frame holds {len(tensors)} tensors; the limit is max_tensors={limits.max_tensors}")
    return Frame(header, view[start:end], flags, total)


def decode(
    data: Buffer,
    *,
    copy: bool = False,
    limits: Limits = DEFAULT_LIMITS,
    signing_key: bytes | None = None,
    like: str = "numpy",
) -> Message:
    """Decode one frame into a `Message`; with copy=False the arrays are views of `data`."""
    if not copy and signing_key is None:
        message = decode_native(memoryview(data).cast("B"), None, limits, like)
        if message is not None:
            return message
    return message_from_frame(parse(data, limits=limits, signing_key=signing_key), copy=copy, limits=limits, like=like)


def decode_native(view: memoryview, crc: int | None, limits: Limits, like: str) -> Message | None:
    """A frame of one plain ndarray decoded by the C fast path (None: not built, or another kind of frame).

    Only for receivers that take unsigned frames: the fast path does not check signatures.
    """
    if NATIVE is None or not limits.native:
        return None
    fast = NATIVE.decode(view, crc, limits.max_header_bytes, limits.max_payload_bytes, limits.max_ndim)
    if fast is None:
        return None
    key, metadata, message_id, array, header_bytes = fast
    return Message(key, to_like(array, like), metadata, message_id, "ndarray", header_bytes)


def message_from_frame(
    frame: Frame, *, copy: bool = False, limits: Limits = DEFAULT_LIMITS, like: str = "numpy"
) -> Message:
    """Build the arrays a parsed frame describes."""
    header, payload = frame.header, frame.payload
    if header.get("kind") == "chunk":
        raise MalformedHeader("frame is one chunk of a larger message; feed it to a Reassembler")
    key, metadata = header.get("key"), header.get("meta", {})
    if key is not None and not isinstance(key, str):
        raise MalformedHeader(f"key must be a string, got {type(key).__name__}")
    if key is not None and len(key) > MAX_KEY_CHARS:
        raise MalformedHeader(f"key of {len(key)} characters; the limit is {MAX_KEY_CHARS}")
    if not isinstance(metadata, dict):
        raise MalformedHeader(f"metadata must be a map, got {type(metadata).__name__}")
    if header.get("comp") is not None:
        raw = header.get("raw")
        if type(raw) is not int or raw < 0:
            raise MalformedHeader(f"compressed frame needs a non-negative 'raw' length, got {brief(raw)}")
        most = min(limits.max_payload_bytes, limits.max_decompressed_bytes)
        payload = decompress(header["comp"], payload, raw, most)  # (64-byte aligned, as a received payload is)
    tensor, entries = rebuild(
        header,
        payload,
        copy=copy,
        max_ndim=limits.max_ndim,
        max_tree_depth=limits.max_tree_depth,
        max_tree_entries=limits.max_tree_entries,
    )
    overhead = frame.nbytes - len(frame.payload) + OBJECT_BYTES * (metadata_objects(metadata) + entries)
    fields = (key, to_like(tensor, like), metadata, _message_id(header.get("id")), header["kind"], overhead)
    trace = read_trace(header.get(TRACE)) if TRACE in header else None
    return Message(*fields) if trace is None else TracedMessage(*fields, trace)


def loads(data: Buffer, *, copy: bool = False, like: str = "numpy", **options: Any) -> Any:
    """Decode one frame and return just the tensor (ndarray, SparseTensor or dict)."""
    return decode(data, copy=copy, like=like, **options).tensor


#: the constants `_native.c` repeats, by the names it exports them under
NATIVE_CONSTANTS = {
    "PREFIX_SIZE": PREFIX.size,
    "CRC_AT": CRC_AT,
    "FORMAT_VERSION": VERSION,
    "FLAG_CHECKSUM": FLAG_CHECKSUM,
    "ALIGN": ALIGN,
    "OBJECT_BYTES": OBJECT_BYTES,
    "MAX_PRODUCER_ID": MAX_PRODUCER_ID,
    "MAX_KEY_CHARS": MAX_KEY_CHARS,
    "MAX_HEADER_BYTES": DEFAULT_LIMITS.max_header_bytes,
}
NATIVE = agrees(NATIVE, NATIVE_CONSTANTS)
if NATIVE is not None:  # (`decode_message` builds Messages in C: it checks their fields are the ones it sets)
    NATIVE.configure_message(Message, tuple(f.name for f in fields(Message) if f.init))
