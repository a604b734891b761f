"""Optional per-frame payload compression (lz4, zstd), bounded on the way back in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..buffers import aligned, aligned_empty
from ..errors import ConfigError, LimitExceeded, MalformedHeader, brief

CODECS = ("lz4", "zstd")
#: payloads at least this large are judged from a sample before the whole is compressed
SAMPLE_FROM = 256 << 10
#: the sample: this many slices of SLICE_BYTES, spread evenly over the payload
SLICES, SLICE_BYTES = 8, 8 << 10
#: the whole is compressed only if the sample shrinks below this fraction of its size
PAYS_BELOW = 0.9


def compress(name: str, data: bytes | memoryview) -> bytes:
    """Compress a payload with the named codec (the libraries are imported only when used)."""
    try:
        return _compress(name, data)
    except ModuleNotFoundError as exc:
        hint = "pip install 'tensorbus[compression]'"
        raise ConfigError(f"{name} compression needs the {exc.name} package: {hint}") from None


def compress_if_it_pays(name: str, buffers: Sequence[bytes | bytearray | memoryview]) -> bytes | None:
    """The payload in `buffers` compressed, or None where that does not make it smaller.

    A large payload is first judged from a sample spread over it: random or already compressed
    data is then left alone without compressing (and joining) the whole of it.
    """
    views = [memoryview(b).cast("B") for b in buffers]
    total = sum(len(v) for v in views)
    if total >= SAMPLE_FROM:
        sample = _sample(views, total)
        if len(compress(name, sample)) >= PAYS_BELOW * len(sample):
            return None
    packed = compress(name, views[0] if len(views) == 1 else b"".join(views))  # (one array: no joined copy)
    return packed if len(packed) < total else None


def _sample(views: list[memoryview], total: int) -> bytes:
    """SLICES slices of SLICE_BYTES at evenly spaced offsets of the concatenated `views`."""
    step = total // SLICES
    wanted = [(i * step, i * step + SLICE_BYTES) for i in range(SLICES)]
    parts, at = [], 0
    for view in views:
        for start, end in wanted:
            lo, hi = max(start, at), min(end, at + len(view))
            if lo < hi:
                parts.append(view[lo - at : hi - at])
        at += len(view)
    return b"".join(parts)


def check_codec(name: str) -> None:
    """Refuse an unknown codec, or one whose package is missing, when an endpoint is made (not at its first send)."""
    compress(name, b"")  # what `compress` refuses, it refuses here


def _compress(name: str, data: bytes | memoryview) -> bytes:
    if name == "lz4":
        import lz4.block

        return lz4.block.compress(data, store_size=False)
    if name == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=3).compress(data)
    raise ConfigError(f"unknown compression {name!r}; known: {', '.join(CODECS)}")


#: zstd block types (RFC 8878, 3.1.1.2): how many bytes of content follow a block header of each
_RAW, _RLE, _COMPRESSED = 0, 1, 2


def _zstd_frame_size(data: memoryview) -> int:
    """The length of the zstd frame at the start of `data`, read from its headers (RFC 8878, 3.1.1; what
    libzstd's ZSTD_findFrameCompressedSize does, which python-zstandard does not offer); a frame cut
    short reports more than `len(data)`. Nothing is decompressed."""
    if len(data) < 6 or bytes(data[:4]) != b"\x28\xb5\x2f\xfd":
        raise MalformedHeader("zstd payload does not start with a zstd frame")
    descriptor = data[4]
    fcs_flag, single_segment, checksum = descriptor >> 6, (descriptor >> 5) & 1, (descriptor >> 2) & 1
    at = 5 + (not single_segment) + (0, 1, 2, 4)[descriptor & 3] + (single_segment, 2, 4, 8)[fcs_flag]
    while at + 3 <= len(data):
        block = int.from_bytes(data[at : at + 3], "little")
        kind, size = (block >> 1) & 3, block >> 3
        if kind not in (_RAW, _RLE, _COMPRESSED):
            raise MalformedHeader("zstd payload does not decompress: a block of the reserved type")
        at += 3 + (1 if kind == _RLE else size)
        if block & 1:  # the last block
            return at + 4 * checksum
    return len(data) + 1  # (no last block: cut short)


def _zstd(zstandard: Any, data: memoryview, raw_len: int) -> memoryview:
    """One zstd frame that declares `raw_len` as its size and is the whole payload (unused bytes after it, junk or a
    second or skippable frame, are refused, as they are in uncompressed payloads), decompressed straight into
    a 64-byte aligned buffer of `raw_len` bytes: a payload costs its size once, not once more as a copy."""
    declared = zstandard.get_frame_parameters(data).content_size
    if declared != raw_len:
        raise MalformedHeader(f"zstd frame declares {declared} bytes, header says {raw_len}")
    size = _zstd_frame_size(data)
    if size != len(data):
        what = f"{len(data) - size} bytes after it" if size < len(data) else "it is cut short"
        raise MalformedHeader(f"zstd payload is not exactly one frame: {what}")
    out = aligned_empty(raw_len).data
    done = 0
    with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False) as reader:
        while done < raw_len and (got := reader.readinto(out[done:])):
            done += got
    if done != raw_len:
        raise MalformedHeader(f"zstd payload decompressed to {done} bytes, header says {raw_len}")
    return out


def decompress(name: object, data: memoryview, raw_len: int, max_bytes: int) -> memoryview:
    """Decompress into exactly `raw_len` bytes at a 64-byte aligned address, refusing to allocate beyond
    `max_bytes`; zstd is written there directly, lz4 (which has no such call) copied there once."""
    if raw_len > max_bytes:
        raise LimitExceeded(f"compressed payload claims {raw_len} bytes; the limit is {max_bytes}")
    try:
        out: memoryview
        if name == "lz4":
            import lz4.block

            out = aligned(lz4.block.decompress(data, uncompressed_size=raw_len))
        elif name == "zstd":
            import zstandard

            out = _zstd(zstandard, data, raw_len)
        else:
            raise MalformedHeader(f"unknown compression {brief(name)}; known: {', '.join(CODECS)}")
    except MalformedHeader:
        raise
    except Exception as exc:  # the libraries raise their own error types on corrupt input
        raise MalformedHeader(f"{name} payload does not decompress: {exc}") from None
    if len(out) != raw_len:
        raise MalformedHeader(f"{name} payload decompressed to {len(out)} bytes, header says {raw_len}")
    return out
