"""The C fast path (`tensorbus/codec/_native.c`) against the Python codec it stands in for.

Everything it encodes must be the Python encoder's bytes exactly; everything it decodes must be
what the Python decoder makes of the frame; and any frame Python refuses, it must leave to Python
(None). Checked on chosen frames, on hand-made headers, and on many mutated ones.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import ml_dtypes
import msgpack
import numpy as np
import pytest

from tensorbus import CodecError
from tensorbus.buffers import address
from tensorbus.codec import frame, native
from tensorbus.codec.dtypes import whitelist
from tensorbus.codec.frame import CRC_AT, FLAG_CHECKSUM, PREFIX, Limits, checksum_of, decode, encode
from tensorbus.codec.tensors import align

from ..conftest import require_native, require_torch

NATIVE = native.NATIVE
require_native(NATIVE is not None, "the codec's C fast path (tensorbus/codec/_native.c)")

LIMITS = Limits()


@pytest.fixture
def python_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run `frame` without the fast path."""
    monkeypatch.setattr(frame, "NATIVE", None)
    yield


def python_encode(obj: Any, **options: Any) -> bytes:
    saved, frame.NATIVE = frame.NATIVE, None
    try:
        return b"".join(bytes(b) for b in encode(obj, **options))
    finally:
        frame.NATIVE = saved


def python_decode(data: Any, **options: Any) -> frame.Message:
    saved, frame.NATIVE = frame.NATIVE, None
    try:
        return decode(data, **options)
    finally:
        frame.NATIVE = saved


def fast_decode(data: Any) -> frame.Message | None:
    return frame.decode_native(memoryview(data).cast("B"), None, LIMITS, "numpy")


def assert_same(fast: frame.Message, slow: frame.Message) -> None:
    """The two decoders agree on everything a receiver can see."""
    assert (fast.key, fast.metadata, fast.message_id, fast.kind, fast.header_bytes) == (
        slow.key,
        slow.metadata,
        slow.message_id,
        slow.kind,
        slow.header_bytes,
    )
    assert [type(v) for v in fast.metadata.values()] == [type(v) for v in slow.metadata.values()]
    a, b = fast.tensor, slow.tensor
    assert type(a) is np.ndarray
    assert (a.dtype, a.shape, a.strides) == (b.dtype, b.shape, b.strides)
    assert a.flags.writeable == b.flags.writeable and a.flags.f_contiguous == b.flags.f_contiguous
    assert a.tobytes(order="A") == b.tobytes(order="A")
    assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]  # views of the same bytes


def arrays() -> Iterator[np.ndarray]:
    rng = np.random.default_rng(7)
    for name, dtype in whitelist().items():
        yield (rng.integers(0, 256, 24, dtype=np.uint8)[: 24 // dtype.itemsize * dtype.itemsize]).view(dtype)
        if name in ("float32", "int16", "complex128"):
            yield np.arange(6, dtype=dtype.newbyteorder(">"))
    base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    yield base
    yield np.asfortranarray(base)
    yield np.full((), 2.5)  # 0-d
    yield np.zeros((0, 3), np.int8)
    yield np.zeros((3, 0), np.int64, order="F")
    yield np.ones((1,) * 20, np.uint8)
    yield np.arange(10, dtype=np.float64)[::-1].copy()
    yield np.ones(3, ml_dtypes.bfloat16)


METADATA: list[Any] = [
    None,
    {},
    {"i": 1},
    {"none": None, "t": True, "f": False, "x": 1.5, "inf": float("inf"), "s": "", "b": b"", "é": "ünï"},
    {f"k{n}": n for n in range(20)},  # map16
    {"ints": 0, **{f"i{v}": v for v in (127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1)}},
    {f"n{-v}": -v for v in (1, 32, 33, 128, 129, 32768, 32769, 2**31, 2**31 + 1, 2**63)},
    {f"s{n}": "x" * n for n in (31, 32, 255, 256, 65535, 65536)},
    {f"b{n}": b"y" * n for n in (1, 255, 256, 65535, 65536)},
]


@pytest.mark.parametrize("meta", METADATA, ids=range(len(METADATA)))
def test_encodes_the_python_encoders_bytes_and_decodes_as_python_does(meta: Any) -> None:
    for array in arrays():
        for key, message_id in ((None, None), ("k", ("p" * 16, 7)), ("ключ;" * 9, ("é", -(2**63)))):
            for options in ({"checksum": True}, {"checksum": False}):
                expected = python_encode(array, key=key, metadata=meta, message_id=message_id, **options)
                flags = FLAG_CHECKSUM if options["checksum"] else 0
                head = NATIVE.ndarray_head(array, key, meta, message_id, flags)
                assert head is not None, (array.dtype, array.shape)
                whole, crc = NATIVE.ndarray_frame(array, key, meta, message_id, flags)  # (memory://'s, whole)
                assert bytes(whole) == expected and address(whole) % 64 == 0, (array.dtype, array.shape, meta)
                assert crc == (checksum_of(whole) if options["checksum"] else None)
                got = b"".join(
                    bytes(b) for b in encode(array, key=key, metadata=meta, message_id=message_id, **options)
                )
                assert got == expected, (array.dtype, array.shape, key, meta)
                buffer = bytearray(got)
                fast = fast_decode(buffer)
                assert fast is not None, (array.dtype, array.shape, meta)
                assert_same(fast, python_decode(buffer))


def test_decoded_arrays_follow_the_buffer_they_came_in() -> None:
    data = python_encode(np.arange(5, dtype=np.int32), key="k")
    readonly = fast_decode(data)
    assert readonly is not None and not readonly.tensor.flags.writeable
    buffer = bytearray(data)
    message = fast_decode(buffer)
    assert message is not None and message.tensor.flags.writeable
    message.tensor[0] = 99  # a view: the frame's own bytes
    assert np.frombuffer(buffer, np.int32, count=1, offset=align(PREFIX.size + PREFIX.unpack_from(buffer)[4]))[0] == 99
    assert fast_decode(buffer) is None  # (its CRC no longer matches)
    view = memoryview(bytearray(data))
    kept = fast_decode(view)
    assert kept is not None
    del view, message
    assert kept.tensor.tolist() == [0, 1, 2, 3, 4]  # it holds the memory alive
    torch = require_torch()
    as_torch = decode(bytearray(data), like="torch")
    assert isinstance(as_torch.tensor, torch.Tensor) and as_torch.tensor.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "obj, key, meta, message_id",
    [
        (np.arange(10)[::2], "k", None, None),  # strided: the Python path copies it
        (np.arange(3), "k", {"nested": {"a": 1}}, None),
        (np.arange(3), "k", {"list": [1, 2]}, None),
        (np.arange(3), "k", {1: "int key"}, None),
        (np.arange(3), "k", {"np": np.int64(3)}, None),
        (np.arange(3), "k", {"big": 2**64}, None),
        (np.arange(3), "k", {"bad": "\udc80"}, None),
        (np.arange(3), 5, None, None),
        (np.arange(3), "k", None, ["p", 1]),
        (np.arange(3), "k", None, ("p", True)),
        (np.arange(3, dtype=object), "k", None, None),
        (np.zeros(3, [("a", "i4")]), "k", None, None),
        (np.ma.masked_array([1, 2]), "k", None, None),
        ([1, 2, 3], "k", None, None),
    ],
)
def test_leaves_everything_else_to_python(obj: Any, key: Any, meta: Any, message_id: Any) -> None:
    assert NATIVE.ndarray_head(obj, key, meta, message_id, FLAG_CHECKSUM) is None
    assert NATIVE.ndarray_frame(obj, key, meta, message_id, FLAG_CHECKSUM) is None
    try:
        expected: bytes | type = python_encode(obj, key=key, metadata=meta, message_id=message_id)
    except (CodecError, Exception) as exc:
        expected = type(exc)
    try:
        got: bytes | type = b"".join(bytes(b) for b in encode(obj, key=key, metadata=meta, message_id=message_id))
    except (CodecError, Exception) as exc:
        got = type(exc)
    assert got == expected


def test_signed_compressed_and_other_kinds_are_decoded_by_python() -> None:
    array = np.arange(100, dtype=np.float32)
    for data in (
        python_encode(array, signing_key=b"secret"),
        python_encode(np.zeros(4096), compression="zstd"),
        python_encode({"a": array}),
        python_encode(np.arange(3), metadata={"nested": [1, {"x": 2}]}),
    ):
        assert fast_decode(data) is None
        python_decode(data)  # and Python takes it


def test_a_receiver_that_requires_signatures_never_takes_the_fast_path() -> None:
    data = python_encode(np.arange(3))  # unsigned: the fast path would take it
    with pytest.raises(CodecError, match="unsigned"):
        decode(data, signing_key=b"secret")


def frame_with_header(header: dict[str, Any], payload: bytes, checksum: bool = True) -> bytearray:
    """A frame around any header, with a valid CRC: what a hostile peer can send."""
    packed = msgpack.packb(header, use_bin_type=True)
    head = bytearray(align(PREFIX.size + len(packed)))
    PREFIX.pack_into(
        head, 0, frame.MAGIC, frame.VERSION, FLAG_CHECKSUM if checksum else 0, 0, len(packed), len(payload), 0
    )
    head[PREFIX.size : PREFIX.size + len(packed)] = packed
    data = head + payload
    if checksum:
        data[CRC_AT : PREFIX.size] = frame.checksum_of(data).to_bytes(4, "little")
    return data


def good_header(**changes: Any) -> dict[str, Any]:
    entry = {"name": "", "dtype": "float32", "order": "<", "shape": [2, 3], "fortran": False, "offset": 0, "nbytes": 24}
    entry.update(changes.pop("entry", {}))
    header = {"kind": "ndarray", "key": "k", "meta": {}, "id": ["p", 1], "tensors": [entry], "comp": None}
    header.update(changes)
    return {k: v for k, v in header.items() if v != "DROP"}


def agree(data: bytes | bytearray) -> str:
    """Assert the fast path decodes `data` exactly as Python does, or leaves it to Python; say which."""
    buffer = bytearray(data)
    fast = fast_decode(buffer)
    try:
        slow = python_decode(buffer)
    except CodecError:
        assert fast is None, "the fast path took a frame Python refuses"
        return "refused"
    if fast is None:
        return "python"
    assert_same(fast, slow)
    return "fast"


HOSTILE = [
    good_header(),
    good_header(kind="sparse"),
    good_header(kind="chunk"),
    good_header(key=5),
    good_header(key=b"bytes"),
    good_header(meta=[]),
    good_header(meta={"a": {"deep": 1}}),
    good_header(meta={b"bytes key": 1}),
    good_header(id=["p" * 129, 1]),
    good_header(id=["p" * 128, 1]),
    good_header(id=["p", 1, 2]),
    good_header(id=["p", "1"]),
    good_header(id=None),
    good_header(id=[b"p", 1]),
    good_header(comp="zstd"),
    good_header(comp="DROP"),
    good_header(key="DROP"),
    good_header(extra=1),
    good_header(tensors=[]),
    good_header(tensors="x"),
    good_header(entry={"offset": 64}),
    good_header(entry={"offset": -1}),
    good_header(entry={"nbytes": 25}),
    good_header(entry={"shape": [2, -3]}),
    good_header(entry={"shape": [6]}),
    good_header(entry={"shape": [0, 2**62], "nbytes": 0}),
    good_header(entry={"shape": [2**40, 2**40], "nbytes": 24}),
    good_header(entry={"shape": [1] * 33}),
    good_header(entry={"shape": [2.0, 3]}),
    good_header(entry={"fortran": 1}),
    good_header(entry={"fortran": True}),
    good_header(entry={"dtype": "object"}),
    good_header(entry={"dtype": "float32" * 10}),
    good_header(entry={"dtype": "float32\0"}),
    good_header(entry={"dtype": "float32\0\xff"}),
    good_header(entry={"dtype": "bfloat16", "order": ">", "nbytes": 12}),
    good_header(entry={"order": "="}),
    good_header(entry={"order": ""}),
    good_header(entry={"order": ">"}),
    good_header(entry={"name": "anything"}),
    good_header(entry={"name": 3}),
    good_header(entry={"extra": 0}),
]


@pytest.mark.parametrize("header", HOSTILE, ids=range(len(HOSTILE)))
def test_hand_made_headers_are_decoded_as_python_does_or_left_to_it(header: dict[str, Any]) -> None:
    outcomes = {
        agree(frame_with_header(header, payload, checksum))
        for payload in (bytes(24), bytes(12), bytes(0))
        for checksum in (True, False)
    }
    plain = (msgpack.packb(good_header()), msgpack.packb(good_header(entry={"name": "anything"})))
    if msgpack.packb(header) in plain:  # (bytes: 2.0 == 2 in Python, not in msgpack)
        assert "fast" in outcomes  # (the 24-byte payload fits its shape)


def test_truncated_padded_and_corrupted_frames_are_left_to_python() -> None:
    data = bytearray(python_encode(np.arange(16, dtype=np.float32), key="k", metadata={"i": 1}))
    assert agree(data) == "fast"
    for cut in range(len(data)):
        assert agree(data[:cut]) == "refused"
    assert agree(data + b"\0") == "refused"
    for at in range(len(data)):
        corrupted = bytearray(data)
        corrupted[at] ^= 0x01
        # (bit 0 of byte 5 says "no checksum": then none is checked, by either decoder)
        assert agree(corrupted) == ("fast" if at == 5 else "refused")


def test_mutated_headers_with_valid_checksums_never_make_the_decoders_disagree() -> None:
    """Random byte changes in the header, the CRC then fixed up (what a hostile peer can do)."""
    rng = random.Random(11)
    seeds = [
        python_encode(array, key="key", metadata=meta, message_id=("producer", 3))
        for array in (np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((), np.int8), np.zeros(0, np.uint16))
        for meta in (None, {"i": 1, "s": "x", "f": 0.5, "b": b"z"})
    ]
    outcomes = {"fast": 0, "python": 0, "refused": 0}
    for _ in range(4000):
        data = bytearray(rng.choice(seeds))
        header_end = PREFIX.size + PREFIX.unpack_from(data)[4]
        for _ in range(rng.choice((1, 1, 2, 3))):
            at = rng.randrange(PREFIX.size, header_end)
            data[at] = rng.choice((rng.randrange(256), data[at] ^ 1, 0xC0, 0xC3, 0x90, 0x80, 0xA0))
        data[CRC_AT : PREFIX.size] = frame.checksum_of(data).to_bytes(4, "little")
        outcomes[agree(data)] += 1
    assert all(outcomes.values()), outcomes  # each kind of outcome happened


def test_a_crc_computed_while_receiving_is_compared_not_trusted() -> None:
    data = bytearray(python_encode(np.arange(8, dtype=np.float64), key="k"))
    view = memoryview(data)
    right = crc32c.crc32c(view[PREFIX.size :], crc32c.crc32c(view[:CRC_AT]))
    assert frame.decode_native(view, right, LIMITS, "numpy") is not None
    assert frame.decode_native(view, right ^ 1, LIMITS, "numpy") is None


def test_limits_below_the_frame_leave_it_to_python_which_refuses() -> None:
    data = bytearray(python_encode(np.ones((2, 2, 2), np.float32), key="k"))
    for limits in (
        Limits(max_header_bytes=-1),
        Limits(max_ndim=2),
        Limits(max_payload_bytes=31),
        Limits(max_header_bytes=10),
        Limits(max_tensors=0),
    ):
        assert frame.decode_native(memoryview(data), None, limits, "numpy") is None
        with pytest.raises(CodecError):
            python_decode(data, limits=limits)
    for unusual in (float("inf"), 1e9, np.int64(1 << 30)):  # limits C cannot take as given: Python applies them
        limits = Limits(max_payload_bytes=unusual)  # type: ignore[arg-type]
        assert frame.decode_native(memoryview(data), None, limits, "numpy") is None
        assert decode(data, limits=limits).tensor.shape == (2, 2, 2)


def test_a_build_with_other_format_constants_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    assert native.agrees(NATIVE, frame.NATIVE_CONSTANTS) is NATIVE
    monkeypatch.setattr(NATIVE, "ALIGN", 32)
    with pytest.warns(RuntimeWarning, match="constants"):
        assert native.agrees(NATIVE, frame.NATIVE_CONSTANTS) is None


def test_a_stale_build_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NATIVE, "SOURCE_HASH", "built from another _native.c")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native._load() is None
    assert any("rebuild" in str(w.message) for w in caught)
    monkeypatch.setenv("TENSORBUS_NATIVE", "0")
    assert native._load() is None


def test_a_build_from_another_version_of_the_shared_header_is_stale(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert native.checked(NATIVE) is NATIVE  # built from the .c and the header beside it
    edited = tmp_path / "_frame.h"
    edited.write_bytes(native.SHARED_HEADER.read_bytes() + b"#define ANOTHER 1\n")
    monkeypatch.setattr(native, "SHARED_HEADER", edited)
    with pytest.warns(RuntimeWarning, match="rebuild"):
        assert native.checked(NATIVE) is None


def test_a_small_frame_is_checksummed_by_the_folding_crc_in_c_a_large_one_through_the_python_call() -> None:
    """With `_crc`'s CRC32C_C capsule (where the folding CRC32C is the one in use) a frame below 32 KiB is
    checksummed without a Python call (two calls and two memoryviews were a fifth of a 4 KB tensor's decode);
    a larger one still goes through `crc32c`, which lets go of the GIL while it reads. Both refuse a bad byte."""
    c_api = native.crc32c_c()
    if c_api is None:
        pytest.skip("the folding CRC32C is not in use here (a CPU without VPCLMULQDQ, or TENSORBUS_NATIVE=0)")
    calls = []

    def counting_crc32c(data: Any, value: int = 0) -> int:
        calls.append(len(data))
        return crc32c.crc32c(data, value)

    small = python_encode(np.arange(1024, dtype=np.float32), key="k")
    large = python_encode(np.arange(16384, dtype=np.float32), key="k")
    try:
        NATIVE.configure(native._resolved(), native.describe, counting_crc32c, c_api)
        for data, checked_by_call in ((small, False), (large, True)):
            calls.clear()
            message = fast_decode(bytearray(data))
            assert message is not None and message.tensor[-1] == len(message.tensor) - 1
            assert (sum(calls) == len(data) - 4) is checked_by_call and (calls == []) is not checked_by_call
            damaged = bytearray(data)
            damaged[-1] ^= 1
            assert fast_decode(damaged) is None  # (left to Python, which refuses it)
    finally:
        native.configure(NATIVE)


def test_the_python_path_alone_still_round_trips(python_only: None) -> None:
    message = decode(bytearray(b"".join(encode(np.arange(4.0), key="k", metadata={"i": 1}))))
    assert message.tensor.tolist() == [0.0, 1.0, 2.0, 3.0] and message.metadata == {"i": 1}


def test_frames_of_other_kinds_are_not_checksummed_twice() -> None:
    """The header is read before the CRC: a chunk or a bundle goes to Python, which checksums it, unread."""
    calls = []

    def counting_crc32c(data: Any, value: int = 0) -> int:
        calls.append(len(data))
        return crc32c.crc32c(data, value)

    chunk = b"".join(bytes(b) for b in frame.encode_raw({"kind": "chunk", "key": "k"}, [bytes(4096)], 4096))
    plain = python_encode(np.zeros(1024, np.float32), key="k")
    try:
        NATIVE.configure(native._resolved(), native.describe, counting_crc32c)
        assert fast_decode(chunk) is None and fast_decode(python_encode({"a": np.zeros(3)})) is None
        assert calls == []
        assert fast_decode(plain) is not None
        assert sum(calls) == len(plain) - 4  # every byte but the CRC field's, once
    finally:
        native.configure(NATIVE)


def test_an_arrays_flat_bytes_in_c_are_its_memory_as_the_python_path_gives_it_and_hold_the_array() -> None:
    """`_native.flat_bytes` (the socket producer's, with the C head): the same bytes as `frame.flat_bytes` for
    every contiguous array (C or Fortran order, other byte order, bfloat16, read-only), no copy, the array
    kept alive by them; None for a strided array or anything not an ndarray, left to `frame.flat_bytes`."""
    rng = np.random.default_rng(3)
    arrays = [
        rng.standard_normal((4, 5)).astype(np.float32),
        np.asfortranarray(rng.standard_normal((3, 7))),
        rng.integers(0, 1000, 9).astype(">i4"),
        np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16),
        np.array(7.5),
        np.zeros(0, np.uint8),
    ]
    read_only = np.arange(10, dtype=np.int16)
    read_only.flags.writeable = False
    for array in [*arrays, read_only]:
        flat = NATIVE.flat_bytes(array)
        view = memoryview(flat)
        assert view.format == "B" and view.ndim == 1 and bytes(view) == bytes(frame.flat_bytes(array))
        assert len(flat) == array.nbytes  # (as a flat view's length: senders skip empty buffers by it)
        assert view.readonly is not array.flags.writeable
        if array.nbytes:
            assert address(view) == array.__array_interface__["data"][0]  # (the array's own memory)
    kept = np.arange(1000, dtype=np.int64)
    flat = NATIVE.flat_bytes(kept)
    del kept
    assert np.frombuffer(flat, np.int64).tolist() == list(range(1000))
    assert NATIVE.flat_bytes(np.arange(10)[::2]) is None and NATIVE.flat_bytes(b"abc") is None
