"""The folding CRC32C (tensorbus/codec/_crc.c) gives the crc32c package's answers, for every length."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


def test_a_process_checksumming_with_the_folding_crc_does_not_import_the_package() -> None:
    """Importing the crc32c package costs a process ~50 ms (it reads its metadata): every CLI run, and every
    process an application spawns. Where the folding CRC serves, importing tensorbus leaves it out; where it
    cannot, the package serves (`test_frames_are_checksummed_by_the_folding_crc_only_where_this_cpu_has_it`)."""
    code = "import json, sys, tensorbus, tensorbus.cli_commands; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    imported = set(json.loads(done.stdout))
    if FOLDING.ACCELERATED:
        assert "crc32c" not in imported, "the crc32c package was imported"
        assert "importlib.metadata" not in imported, "importlib.metadata was imported (by something else?)"
    else:
        assert "crc32c" in imported, "no folding CRC here, yet the package that serves instead was not imported"


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


COPY_SIZES = [0, 1, 31, 32, 33, 255, 256, 4096, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 4099]


@needs_folding
@pytest.mark.parametrize("n", COPY_SIZES)
def test_the_copying_crc_copies_what_it_reads_and_gives_the_package_s_crc(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n + 64, np.uint8)
    for src_at, dst_at in ((0, 0), (1, 0), (0, 13), (7, 33)):  # streamed stores start where dst is aligned
        src = memoryview(data)[src_at : src_at + n]
        out = np.full(n + 64, 0xAA, np.uint8)
        assert FOLDING.crc32c_copy(memoryview(out)[dst_at : dst_at + n], src, 0x1234) == crc32c.crc32c(src, 0x1234)
        assert bytes(out[dst_at : dst_at + n]) == bytes(src), (n, src_at, dst_at)
        assert not (out[:dst_at] != 0xAA).any() and not (out[dst_at + n :] != 0xAA).any()  # nothing beyond it


@pytest.mark.parametrize("copy", [native.copy_then_crc, *([FOLDING.crc32c_copy] if FOLDING.ACCELERATED else [])])
def test_both_copying_crcs_refuse_a_target_of_another_length_or_read_only(copy: object) -> None:
    assert callable(copy)
    for dst in (bytearray(9), bytearray(11), b"0123456789"):
        with pytest.raises((ValueError, TypeError)):
            copy(dst, b"0123456789", 0)
    dst = bytearray(10)
    assert copy(dst, b"0123456789", 0) == crc32c.crc32c(b"0123456789") and dst == b"0123456789"


@pytest.mark.parametrize("copy", [native.plain_copy, *([FOLDING.copy_streamed] if FOLDING.ACCELERATED else [])])
@pytest.mark.parametrize("n", COPY_SIZES)
def test_both_large_copies_copy_every_byte_and_nothing_beyond(copy: Any, n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n + 64, np.uint8)
    for src_at, dst_at in ((0, 0), (1, 0), (0, 13), (7, 33)):  # streamed stores start where dst is aligned
        src = memoryview(data)[src_at : src_at + n]
        out = np.full(n + 64, 0xAA, np.uint8)
        copy(memoryview(out)[dst_at : dst_at + n], src)
        assert bytes(out[dst_at : dst_at + n]) == bytes(src), (n, src_at, dst_at)
        assert not (out[:dst_at] != 0xAA).any() and not (out[dst_at + n :] != 0xAA).any()
    for dst in (bytearray(9), bytearray(11), b"0123456789"):
        with pytest.raises((ValueError, TypeError)):
            copy(dst, b"0123456789")
