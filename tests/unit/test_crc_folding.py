"""The folding CRC32C (tensorbus/codec/_crc.c) gives the crc32c package's answers, for every length."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import crc32c
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorbus.codec import native

from ..conftest import require_native

FOLDING = native.load("tensorbus.codec._crc")
require_native(FOLDING is not None, "the folding CRC32C (tensorbus/codec/_crc.c)")
needs_folding = pytest.mark.skipif(
    FOLDING is None or not FOLDING.ACCELERATED, reason="this CPU lacks AVX2 + VPCLMULQDQ: the crc32c package is used"
)
BLOCK = 1 << 16  # _crc.c's BLOCK: half folded, half in four crc32 streams


def test_frames_are_checksummed_by_the_folding_crc_only_where_this_cpu_has_it() -> None:
    """Not skipped on any CPU: without AVX2 + VPCLMULQDQ the C function refuses and the package serves
    (every codec test then runs on it; scripts/test.sh says which in the CI log)."""
    if FOLDING.ACCELERATED:
        assert native.crc32c is FOLDING.crc32c
    else:
        assert native.crc32c is crc32c.crc32c
        with pytest.raises(RuntimeError):
            FOLDING.crc32c(b"abc")


@needs_folding
@pytest.mark.parametrize(
    "n",
    [0, 1, 7, 8, 127, 128, 255, 256, 257, 383, 384, 4095, 4096]
    + [k * BLOCK + d for k in (1, 2, 5) for d in (-129, -128, -1, 0, 1, 128, 255, 256, 4099)],
)
def test_the_folding_crc_equals_the_package_at_every_boundary(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n + 64, np.uint8)
    for offset in (0, 1, 13, 63):  # unaligned starts too
        view = memoryview(data)[offset : offset + n]
        for value in (0, 1, 0xFFFFFFFF, 0x12345678):
            assert FOLDING.crc32c(view, value) == crc32c.crc32c(view, value), (n, offset, value)


@needs_folding
@given(st.binary(max_size=70000), st.integers(0, 0xFFFFFFFF))
def test_the_folding_crc_equals_the_package(data: bytes, value: int) -> None:
    assert FOLDING.crc32c(data, value) == crc32c.crc32c(data, value)
    assert FOLDING.crc32c(data) == crc32c.crc32c(data)


@needs_folding
def test_the_folding_crc_continues_as_the_package_does_and_takes_its_keywords() -> None:
    data = os.urandom(3 * BLOCK + 1234)
    whole = crc32c.crc32c(data)
    assert FOLDING.crc32c(data[5000:], value=FOLDING.crc32c(data[:5000])) == whole
    assert FOLDING.crc32c(data=data) == whole
    assert FOLDING.crc32c(np.frombuffer(data, np.uint8)) == whole  # any contiguous buffer


@needs_folding
def test_the_folding_crc_takes_what_the_package_takes_and_refuses_what_it_refuses() -> None:
    """The same call must work on every CPU: the package is what runs where this one cannot."""
    data = os.urandom(BLOCK + 99)
    for value in (-1, 1 << 32, (1 << 64) + 5, np.uint32(0xDEADBEEF), True):  # masked to 32 bits, as there
        assert FOLDING.crc32c(data, value) == crc32c.crc32c(data, value), value
    for mode in (-1, 0, 1):
        assert FOLDING.crc32c(data, 7, gil_release_mode=mode) == crc32c.crc32c(data, 7, gil_release_mode=mode)
    strided = np.arange(100, dtype=np.uint8)[::2]
    for bad in (("text",), (strided,), (b"abc", 1.5), (b"abc", "7")):
        for crc in (FOLDING.crc32c, crc32c.crc32c):
            with pytest.raises((BufferError, TypeError, ValueError)):
                crc(*bad)


@needs_folding
def test_the_folding_crc_gives_right_answers_from_many_threads_at_once() -> None:
    """Large buffers are checksummed without the GIL: threads at once must not disturb each other."""
    buffers = [os.urandom(BLOCK * 3 + i) for i in range(4)]
    expected = [crc32c.crc32c(b) for b in buffers]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: [FOLDING.crc32c(buffers[i % 4]) for _ in range(50)], range(8)))
    assert all(answers == [expected[i % 4]] * 50 for i, answers in enumerate(got))
