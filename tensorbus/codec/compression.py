"""Optional per-frame payload compression (lz4, zstd), bounded on the way back in."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, LimitExceeded, MalformedHeader, brief

CODECS = ("lz4", "zstd")


def compress(name: str, data: bytes | memoryview) -> bytes:
    """Compress a payload with the named codec (the libraries are imported only when used)."""
    try:
        return _compress(name, data)
    except ModuleNotFoundError as exc:
        hint = "pip install 'tensorbus[compression]'"
        raise ConfigError(f"{name} compression needs the {exc.name} package: {hint}") from None


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


def _zstd(zstandard: Any, data: memoryview, raw_len: int) -> bytes:
    """One zstd frame that declares `raw_len` as its size (libzstd then never writes more) and is
    the whole payload: unused bytes after it (junk, a second or skippable frame) are refused, as
    they are in uncompressed payloads."""
    declared = zstandard.get_frame_parameters(data).content_size
    if declared != raw_len:
        raise MalformedHeader(f"zstd frame declares {declared} bytes, header says {raw_len}")
    stream = zstandard.ZstdDecompressor().decompressobj()
    out: bytes = stream.decompress(data)
    if not stream.eof or stream.unused_data:
        what = f"{len(stream.unused_data)} bytes after it" if stream.eof else "it is cut short"
        raise MalformedHeader(f"zstd payload is not exactly one frame: {what}")
    return out


def decompress(name: object, data: memoryview, raw_len: int, max_bytes: int) -> bytes:
    """Decompress into exactly `raw_len` bytes, refusing to allocate beyond `max_bytes`."""
    if raw_len > max_bytes:
        raise LimitExceeded(f"compressed payload claims {raw_len} bytes; the limit is {max_bytes}")
    try:
        if name == "lz4":
            import lz4.block

            out = lz4.block.decompress(data, uncompressed_size=raw_len)
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
