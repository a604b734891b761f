"""CRC32C of concatenations from the CRCs of the parts, so a chunked tensor is checksummed in one pass.

`combine(crc(a), crc(b), len(b)) == crc(a + b)`: the GF(2) arithmetic of zlib's crc32_combine
(multmodp / x2nmodp), with the Castagnoli polynomial. The `crc32c` package computes the CRCs of
the bytes; this module only joins them, in microseconds and without touching the data again (in C, from
`_crc.c`, where it is built).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from .native import load

POLY = 0x82F63B78  # CRC-32C (Castagnoli), bit-reflected
_ONE = 1 << 31  # the polynomial 1 in the reflected representation


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial (reflected)."""
    m, p = _ONE, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(67):  # k = 3 (bytes to bits) + 64 bits of length
        table.append(p)
        p = _multmodp(p, p)
    return table


#: x^(2^k) modulo the polynomial. Not indexed modulo 32 as zlib does for CRC-32: that relies on
#: x^(2^32) = x for zlib's polynomial, which does not hold for Castagnoli's (lengths >= 512 MiB broke)
_X2N = _x2n_table()


@functools.lru_cache(maxsize=256)
def _shift_operator(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial; cached, as a stream repeats its chunk sizes."""
    p, k = _ONE, 3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k], p)
        nbytes >>= 1
        k += 1
    return p


def python_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of `a + b` given CRC32C(a), CRC32C(b) and len(b): the readable path of `combine`."""
    if len_b < 0:
        raise ValueError(f"combine: len_b={len_b}; a length is not negative")
    return _multmodp(_shift_operator(len_b), crc_a) ^ crc_b


def _combine() -> Callable[[int, int, int], int]:
    """`_crc.c`'s combine where it is built (a 256 MB version over Kafka combines ~540 CRCs), else Python's."""
    fast = load(f"{__package__}._crc")
    return fast.combine if fast is not None else python_combine


#: CRC32C of `a + b` given CRC32C(a), CRC32C(b) and len(b)
combine = _combine()


def uncombine(crc_ab: int, crc_a: int, len_b: int) -> int:
    """CRC32C of `b` given CRC32C(a + b), CRC32C(a) and len(b): what `combine` took, recovered."""
    return combine(crc_a, 0, len_b) ^ crc_ab
