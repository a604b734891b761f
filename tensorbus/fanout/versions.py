"""A versioned frame: an ordinary tensorbus frame whose metadata carries the key's version.

The publisher encodes each version once (signed once, for the endpoint) and every subscriber gets
those same bytes; `decode_version` turns them back into a `VersionedMessage`.
"""

from __future__ import annotations

import itertools
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from ..buffers import BufferPool
from ..codec.frame import PREFIX, Buffer, Limits, Message, _unpack_header, decode, encode, join_into, parse
from ..codec.tensors import align
from ..errors import CodecError, ConfigError, MalformedHeader, brief
from ..keys import check_key

#: the metadata field a version travels in (taken out again before the subscriber sees the metadata)
VERSION_FIELD = "tb.version"


@dataclass(slots=True)
class VersionedMessage(Message):
    """A `Message` with the version its publisher gave it (an int, increasing per key)."""

    version: int = 0


#: the largest version a frame's header carries (a msgpack unsigned 64-bit int)
MAX_VERSION = (1 << 64) - 1


def check_version(version: object) -> int:
    """A version must be an int from 0 to MAX_VERSION (bool is not one)."""
    if type(version) is not int or not 0 <= version <= MAX_VERSION:
        raise ConfigError(f"version must be an int from 0 to 2**64-1, got {brief(version)}")
    return version


def check_published_key(key: object) -> str:
    """A published key: a str (subscribers ask for keys by name: a version of no key could not be asked for),
    no longer than any key may be."""
    if not isinstance(key, str):
        raise ConfigError(f"a published key must be a str, got {type(key).__name__}: {brief(key)}")
    check_key(key)
    return key


class Encoder:
    """Encodes versions for one publisher: fresh message ids (reassembly tells chunks apart by them), one signature."""

    def __init__(self, compression: str | None, checksum: bool, signing_key: bytes | None) -> None:
        self.compression, self.checksum, self.signing_key = compression, checksum, signing_key
        self.publisher_id = uuid.uuid4().hex[:16]
        self._sequence = itertools.count(1)
        #: snapshots go into reused buffers (one retained, one spare): fresh pages cost more than the copy
        self._pool = BufferPool(max_buffers=2)

    def encode(
        self, key: str, tensor: Any, version: int, metadata: dict[str, Any] | None, snapshot: bool
    ) -> tuple[list[Buffer], tuple[str, int]]:
        """The frame of one version. `snapshot`: copied into one buffer of its own, so the caller may
        update its arrays in place right after; else the frame's payload is the caller's memory."""
        if metadata is not None and VERSION_FIELD in metadata:
            raise ConfigError(f"metadata field {VERSION_FIELD!r} is the version's own")
        message_id = (self.publisher_id, next(self._sequence))
        buffers = encode(
            tensor,
            key=key,
            metadata={**(metadata or {}), VERSION_FIELD: version},
            compression=self.compression,
            checksum=self.checksum,
            message_id=message_id,
            signing_key=self.signing_key,
        )
        if not snapshot:
            return buffers, message_id
        whole = self._pool.take(sum(memoryview(b).nbytes for b in buffers))
        join_into(buffers, whole)
        return [whole], message_id


def versioned(message: Message) -> VersionedMessage:
    """A decoded frame as a `VersionedMessage` (`MalformedHeader` if it carries no version)."""
    metadata = dict(message.metadata)
    version = metadata.pop(VERSION_FIELD, None)
    if type(version) is not int or message.key is None:
        raise MalformedHeader(f"not a published version (key {message.key!r}, version {version!r})")
    return VersionedMessage(
        message.key, message.tensor, metadata, message.message_id, message.kind, message.header_bytes, version
    )


def decode_version(frame: Buffer, limits: Limits, signing_key: bytes | None, like: str = "numpy") -> VersionedMessage:
    """Decode one whole received frame (its arrays are views of `frame`)."""
    return versioned(decode(frame, limits=limits, signing_key=signing_key, like=like))


def _header(view: memoryview) -> dict[str, Any]:
    header_len = PREFIX.unpack_from(view)[4]
    return _unpack_header(view[PREFIX.size : PREFIX.size + header_len])


def peek_version(frame: Buffer, signing_key: bytes | None = None) -> tuple[str, int] | None:
    """The key and version a stored frame carries, read from its header alone (of the message, for the first
    chunk of one); None for a later chunk or what does not parse. For a publisher learning where versions stand.

    With a `signing_key`, only a frame (or chunk) whose signature verifies counts: anyone who can write
    to the topic could otherwise raise a key's version and stop the publisher's next ones.
    """
    try:
        view = memoryview(frame).cast("B")
        if signing_key is not None:
            parse(view, signing_key=signing_key)  # (a version may be old: no age limit)
        header = _header(view)
        if header.get("kind") == "chunk":
            if header.get("chunk", [None])[0] != 0:
                return None
            header = _header(view[align(PREFIX.size + PREFIX.unpack_from(view)[4]) :])  # the message's own frame
        key, version = header.get("key"), header.get("meta", {}).get(VERSION_FIELD)
        return (key, version) if isinstance(key, str) and type(version) is int else None
    except (CodecError, TypeError, ValueError, AttributeError, IndexError, KeyError, struct.error):
        return None
