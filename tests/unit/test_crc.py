"""CRC32C combining, and what it buys: a chunked tensor is checksummed once on each side, still fully checked."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import crc32c
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tensorbus as tb
from tensorbus.codec import chunking, frame, native
from tensorbus.codec.crc import _ONE, _multmodp, _shift_operator, combine, python_combine
from tensorbus.codec.frame import CRC_AT


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_equals_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_combine_over_large_and_odd_lengths() -> None:
    for la, lb in [(0, 1 << 20), (1 << 20, 12345), (7, (1 << 20) - 1)]:
        a, b = os.urandom(la), os.urandom(lb)
        assert combine(crc32c.crc32c(a), crc32c.crc32c(b), lb) == crc32c.crc32c(a + b)


@given(st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFFFFFFFF), st.integers(0, (1 << 63) - 1))
def test_combine_in_c_gives_the_python_path_s_answers(crc_a: int, crc_b: int, len_b: int) -> None:
    """`combine` is _crc.c's where it is built (the Python path under TENSORBUS_NATIVE=0): the two agree."""
    assert combine(crc_a, crc_b, len_b) == python_combine(crc_a, crc_b, len_b)
    assert combine(crc_a, crc_b, len_b % 5000) == python_combine(crc_a, crc_b, len_b % 5000)


def test_both_combines_refuse_a_negative_length() -> None:
    for join in (combine, python_combine):
        with pytest.raises(ValueError, match="not negative"):
            join(1, 2, -1)


def _power(operator: int, exponent: int) -> int:
    result = _ONE
    while exponent:
        if exponent & 1:
            result = _multmodp(result, operator)
        operator, exponent = _multmodp(operator, operator), exponent >> 1
    return result


def test_shifts_past_512_mib_agree_with_composed_1_mib_shifts() -> None:
    # too large to checksum real bytes in a test: compose the 1 MiB shift checked against real bytes above
    mib = _shift_operator(1 << 20)
    for n in (1 << 29, (1 << 29) + 12345, (1 << 30) + 7, (1 << 36) + 1):
        whole_mibs, rest = divmod(n, 1 << 20)
        assert _shift_operator(n) == _multmodp(_power(mib, whole_mibs), _shift_operator(rest)), n


BUNDLE = {"w": np.arange(70_001, dtype=np.float32), "b": np.ones((3, 5), np.int8), "e": np.zeros(0)}


@pytest.mark.parametrize("tensor", [np.arange(300_000, dtype=np.float64), BUNDLE], ids=["array", "bundle"])
@pytest.mark.parametrize("max_chunk_bytes", [4096, 65536, 1 << 20])
def test_encode_chunks_is_byte_for_byte_split_of_encode(tensor: object, max_chunk_bytes: int) -> None:
    options = {"key": "k", "message_id": ("p", 3), "metadata": {"step": 1}}
    expected = tb.split(tb.encode(tensor, **options), max_chunk_bytes=max_chunk_bytes, message_id=("p", 3), key="k")
    got = tb.codec.encode_chunks(tensor, max_chunk_bytes=max_chunk_bytes, **options)
    assert [b"".join(c) for c in got] == [b"".join(c) for c in expected]


def test_encode_chunks_with_compression_or_signing_or_no_checksum_matches_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tb.codec.frame.time, "time", lambda: 1.0e9)  # (a signed message carries the clock)
    tensor = np.tile(np.arange(1000, dtype=np.int32), 300)
    for options in ({"compression": "zstd"}, {"signing_key": b"s"}, {"checksum": False}):
        full = {"key": "k", "message_id": ("p", 1), **options}
        frame_ = tb.encode(tensor, **full)
        split_options = {k: v for k, v in options.items() if k in ("signing_key", "checksum")}
        expected = tb.split(frame_, max_chunk_bytes=8192, message_id=("p", 1), key="k", **split_options)
        got = tb.codec.encode_chunks(tensor, max_chunk_bytes=8192, **full)
        assert [b"".join(c) for c in got] == [b"".join(c) for c in expected], options


class CountingCrc:
    """Wraps tensorbus's crc32c to count the bytes it reads."""

    def __init__(self) -> None:
        self.bytes = 0
        self._crc = native.crc32c

    def __call__(self, data: object, value: int = 0) -> int:
        self.bytes += memoryview(data).nbytes
        return self._crc(data, value)


def test_a_chunked_tensor_is_checksummed_once_when_sent_and_once_when_received(monkeypatch) -> None:
    tensor = np.random.default_rng(0).random(1 << 20)  # 8 MiB in 1 MiB chunks
    counter = CountingCrc()
    for module in (frame, chunking):
        monkeypatch.setattr(module, "crc32c", counter)
    chunks = tb.codec.encode_chunks(tensor, max_chunk_bytes=1 << 20, key="k", message_id=("p", 1))
    assert len(chunks) == 9 and counter.bytes < tensor.nbytes * 1.01
    counter.bytes = 0
    reassembler = tb.Reassembler()
    results = [reassembler.feed(b"".join(c)) for c in chunks]
    assert counter.bytes < tensor.nbytes * 1.01
    np.testing.assert_array_equal(results[-1].tensor, tensor)


@pytest.mark.parametrize("nbytes", [1 << 20, (1 << 20) + 7, 3 << 17])
def test_payload_crcs_derived_from_a_received_frame_crc_equal_those_read_from_the_bytes(nbytes: int) -> None:
    tensor = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    chunks = tb.codec.encode_chunks(tensor, max_chunk_bytes=1 << 17, message_id=("p", 1))
    for chunk in chunks:  # the first carries the frame's prefix, the last may be a few bytes only
        view = memoryview(b"".join(chunk))
        read = frame.split_checksum(view)
        assert read is not None and frame.split_checksum(view, frame.checksum_of(view)) == read
        assert frame.split_checksum(view, read[0] ^ 1)[1] != read[1]  # derived from the CRC, not copied


def test_a_chunk_whose_crc_was_computed_while_receiving_is_not_read_again(monkeypatch) -> None:
    tensor = np.random.default_rng(1).random(1 << 20)  # 8 MiB in 1 MiB chunks, as tcp:// reads them
    chunks = [b"".join(c) for c in tb.codec.encode_chunks(tensor, max_chunk_bytes=1 << 20, message_id=("p", 1))]
    received = [frame.checksum_of(c) for c in chunks]  # what the socket reader computed, slice by slice
    counter = CountingCrc()
    for module in (frame, chunking):
        monkeypatch.setattr(module, "crc32c", counter)
    reassembler = tb.Reassembler()
    results = [reassembler.feed(c, crc=crc) for c, crc in zip(chunks, received, strict=True)]
    assert counter.bytes < tensor.nbytes * 0.01
    np.testing.assert_array_equal(results[-1].tensor, tensor)


def _reseal_chunk(data: bytearray) -> None:
    """Give a chunk frame a correct CRC again after its payload was changed (a chunk that checks out)."""
    struct.pack_into("<I", data, CRC_AT, frame.checksum_of(data))


@pytest.mark.parametrize("received_crc", [False, True], ids=["crc-checked-here", "crc-computed-while-receiving"])
@pytest.mark.parametrize("where", ["payload", "crc field", "first header byte"])
def test_a_change_the_chunk_checks_miss_is_caught_by_the_combined_frame_crc(where: str, received_crc: bool) -> None:
    tensor = np.arange(1 << 18, dtype=np.float32)  # 1 MiB in 128 KiB chunks: all on the combining path
    chunks = [
        bytearray(b"".join(c)) for c in tb.codec.encode_chunks(tensor, max_chunk_bytes=1 << 17, message_id=("p", 1))
    ]
    target, offset = {"payload": (3, 5000), "crc field": (0, 20), "first header byte": (0, 24)}[where]
    start = frame.parse(chunks[target]).nbytes - len(frame.parse(chunks[target]).payload)
    chunks[target][start + offset] ^= 0x40
    _reseal_chunk(chunks[target])
    reassembler = tb.Reassembler()

    def crc(chunk: bytearray) -> int | None:
        return frame.checksum_of(chunk) if received_crc else None

    for chunk in chunks[:-1]:
        assert reassembler.feed(chunk, crc=crc(chunk)) is None
    with pytest.raises(tb.ChecksumMismatch):
        reassembler.feed(chunks[-1], crc=crc(chunks[-1]))


def test_small_chunks_and_signed_chunks_still_reassemble() -> None:
    tensor = np.arange(50_000, dtype=np.int16)
    for options in ({}, {"signing_key": b"secret"}):
        chunks = tb.codec.encode_chunks(tensor, max_chunk_bytes=4096, message_id=("p", 1), **options)
        reassembler = tb.Reassembler(signing_key=options.get("signing_key"))
        results = [reassembler.feed(b"".join(c)) for c in reversed(chunks)]
        np.testing.assert_array_equal(results[-1].tensor, tensor)


def test_tensorbus_checksums_with_the_folding_crc_where_the_cpu_has_it() -> None:
    folding = native.load("tensorbus.codec._crc")
    folds = folding is not None and bool(folding.ACCELERATED)
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " vpclmulqdq" in cpu and " avx2" in cpu and native.enabled():
        assert folds, "this CPU can fold but the extension is not built or not used"
    assert native.crc32c is (folding.crc32c if folds else crc32c.crc32c)
    assert frame.crc32c is native.crc32c and chunking.crc32c is native.crc32c
