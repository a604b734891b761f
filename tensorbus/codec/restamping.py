"""A signed chunked message resent to another consumer run: its chunks stamped now and signed again."""

from __future__ import annotations

from typing import Any

from .chunking import slices
from .frame import (
    FLAG_CHECKSUM,
    FLAG_SIGNED,
    PREFIX,
    SIGNATURE_BYTES,
    Buffer,
    _unpack_header,
    encode_raw,
    restamp,
)
from .signing import resign
from .tensors import align


def _cut(parts: list[memoryview], n: int) -> tuple[bytes, list[memoryview]]:
    """The first `n` bytes of `parts` (copied), and views of the rest."""
    first, rest = bytearray(), list(parts)
    while len(first) < n and rest:
        take = rest[0][: n - len(first)]
        first += take
        rest[0] = rest[0][len(take) :]
        if not len(rest[0]):
            rest.pop(0)
    return bytes(first), rest


def _cut_end(parts: list[memoryview], n: int) -> tuple[list[memoryview], bytes]:
    """Views of all but the last `n` bytes of `parts`, and those bytes (copied)."""
    keep = sum(len(part) for part in parts) - n
    body, last = [], bytearray()
    for part in parts:
        head, tail = part[: max(keep, 0)], part[max(keep, 0) :]
        if len(head):
            body.append(head)
        last += tail
        keep -= len(head)
    return body, bytes(last)


def restamp_chunks(chunks: list[list[Buffer]], whole_key: bytes, chunk_key: bytes) -> list[list[Buffer]] | None:
    """The signed chunk frames of one message (any order), with the message's clock set to now and
    signed again with `whole_key`, each chunk signed with `chunk_key`: what `frame.restamp` and
    `signing.resign` do for a whole frame that a producer resends to another consumer run. None when
    they are not every chunk of one signed, stamped message (then nothing changed)."""
    placed: dict[int, tuple[dict[str, Any], int, list[Buffer]]] = {}
    order = []  # the chunks' indexes, as given
    for chunk in chunks:
        view = memoryview(chunk[0]).cast("B")
        _, _, flags, _, header_len, _, _ = PREFIX.unpack_from(view)
        header = _unpack_header(view[PREFIX.size : PREFIX.size + header_len])
        if header.get("kind") != "chunk" or not flags & FLAG_SIGNED:
            return None
        placed[header["chunk"][0]] = (header, flags, chunk)
        order.append(header["chunk"][0])
    if not placed:
        return None
    _, count, total, stride = placed[min(placed)][0]["chunk"]
    if sorted(placed) != list(range(count)):
        return None
    parts = [memoryview(part).cast("B") for index in range(count) for part in placed[index][2][1:-1]]
    if sum(len(part) for part in parts) != total:
        return None
    prefix, _ = _cut(parts, PREFIX.size)
    head, rest = _cut(parts, align(PREFIX.size + PREFIX.unpack_from(prefix)[4]))
    if total - len(head) < SIGNATURE_BYTES:
        return None
    body, mac = _cut_end(rest, SIGNATURE_BYTES)  # the message's payload, then its own MAC
    message: list[Buffer] = [head, *body, mac]
    if not restamp(message):
        return None
    resign(message, whole_key)
    runs = slices(message, stride)
    if len(runs) != count:
        return None
    resealed = {
        index: encode_raw(
            placed[index][0],
            run,
            sum(len(part) for part in run),
            checksum=bool(placed[index][1] & FLAG_CHECKSUM),
            signing_key=chunk_key,
        )
        for index, run in enumerate(runs)
    }
    return [resealed[index] for index in order]
