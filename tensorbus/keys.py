"""TensorFlow-style rendezvous keys: "src;incarnation;dst;name;frame:iter"."""

from __future__ import annotations

from typing import NamedTuple

from .errors import ConfigError, brief


class ParsedKey(NamedTuple):
    """The five parts of a rendezvous key."""

    src: str
    src_incarnation: int
    dst: str
    name: str
    frame_iter: tuple[int, int]


def make_key(src: str, src_incarnation: int, dst: str, name: str, frame_iter: tuple[int, int] = (0, 0)) -> str:
    """Build a key that names who sends, which incarnation of it, to whom, what, and in which loop frame."""
    for label, part in (("src", src), ("dst", dst), ("name", name)):
        if not part or ";" in part:
            raise ConfigError(f"{label} must be a non-empty string without ';', got {part!r}")
    if type(src_incarnation) is not int or not 0 <= src_incarnation < 1 << 64:
        raise ConfigError(f"src_incarnation must be an int in [0, 2**64), got {src_incarnation!r}")
    if not isinstance(frame_iter, (tuple, list)) or len(frame_iter) != 2 or not all(type(n) is int for n in frame_iter):
        raise ConfigError(f"frame_iter must be a pair of ints, got {frame_iter!r}")
    return f"{src};{src_incarnation:x};{dst};{name};{frame_iter[0]}:{frame_iter[1]}"


def parse_key(key: str) -> ParsedKey:
    """Split a key made by `make_key`; anything that is not exactly five well-formed parts is refused."""
    parts = key.split(";")
    if len(parts) != 5:
        raise ConfigError(f"rendezvous key must have 5 ';'-separated parts, got {len(parts)}: {brief(key)}")
    src, incarnation, dst, name, frame_iter = parts
    frame, sep, iteration = frame_iter.partition(":")
    try:
        parsed = ParsedKey(src, int(incarnation, 16), dst, name, (int(frame), int(iteration)))
    except ValueError:
        raise ConfigError(f"rendezvous key has a bad incarnation or frame:iter part: {brief(key)}") from None
    if not (src and dst and name and sep) or not 0 <= parsed.src_incarnation < 1 << 64:
        raise ConfigError(f"rendezvous key has an empty or malformed part: {brief(key)}")
    return parsed
