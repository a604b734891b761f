"""TensorFlow-style rendezvous keys: "src;incarnation;dst;name;frame:iter"."""

from __future__ import annotations

import re
from typing import NamedTuple, TypeGuard

from .errors import ConfigError, brief

#: the longest key a frame may carry (docs/FORMAT.md): senders refuse longer ones, receivers drop them
MAX_KEY_CHARS = 1024


class ParsedKey(NamedTuple):
    """The five parts of a rendezvous key."""

    src: str
    src_incarnation: int
    dst: str
    name: str
    frame_iter: tuple[int, int]


#: the ';' in a key made by `make_key`: only a key with exactly this many may name an incarnation (and is fenced)
INCARNATION_SEPARATORS = 4


def may_name_incarnation(key: str | None) -> TypeGuard[str]:
    """Whether `key` has the shape of a `make_key` key: the table fences it (and the C delivery leaves it to Python)."""
    return key is not None and key.count(";") == INCARNATION_SEPARATORS


def check_key(key: object) -> None:
    """Refuse a key that is neither a str nor None ("no key"), or longer than MAX_KEY_CHARS: any other
    would be sent, then dropped by every consumer as a malformed frame."""
    if key is not None and not isinstance(key, str):
        raise ConfigError(f"key must be a str (or None), got {type(key).__name__}: {brief(key)}")
    if key is not None and len(key) > MAX_KEY_CHARS:
        raise ConfigError(f"key of {len(key)} characters; the limit is {MAX_KEY_CHARS}: {brief(key)}")


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


#: what `make_key` writes for the incarnation (lowercase hex, 64 bits) and for frame:iter (decimal ints)
_INCARNATION = re.compile(r"[0-9a-f]{1,16}", re.ASCII)
_FRAME_ITER = re.compile(r"(-?[0-9]+):(-?[0-9]+)", re.ASCII)


def parse_key(key: str) -> ParsedKey:
    """Split a key made by `make_key`; anything that is not exactly five well-formed parts is refused.

    Only the forms `make_key` writes are accepted ("0x1f", " 1f" or "1_f" are not "1f"): the
    incarnation fences a source, so two spellings of one number must not pass for different keys.
    """
    parts = key.split(";")
    if len(parts) != 5:
        raise ConfigError(f"rendezvous key must have 5 ';'-separated parts, got {len(parts)}: {brief(key)}")
    src, incarnation, dst, name, frame_iter = parts
    numbers = _FRAME_ITER.fullmatch(frame_iter)
    if not (src and dst and name and numbers and _INCARNATION.fullmatch(incarnation)):
        raise ConfigError(f"rendezvous key has an empty or malformed part: {brief(key)}")
    return ParsedKey(src, int(incarnation, 16), dst, name, (int(numbers[1]), int(numbers[2])))
