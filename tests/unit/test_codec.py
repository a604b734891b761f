"""Frame codec: round trips across dtypes, shapes and layouts; the public encode/decode contract."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tensorbus as tb
from tensorbus.codec.dtypes import ML_DTYPE_NAMES, NUMPY_DTYPE_NAMES, whitelist
from tensorbus.codec.frame import CRC_AT, PREFIX, decode_work, encode
from tensorbus.codec.tensors import ALIGN
from tensorbus.transports.stream import unsealed

ML = [n for n in ML_DTYPE_NAMES if n in whitelist()]
#: numpy's own dtypes, but not long double (its width and padding differ by platform)
HYPOTHESIS_DTYPES = [np.dtype(n) for n in NUMPY_DTYPE_NAMES if np.dtype(n).char not in "gG"]
HYPOTHESIS_DTYPES += [d.newbyteorder(">") for d in HYPOTHESIS_DTYPES if d.itemsize > 1]


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact equality with dtype and shape, NaN-safe."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes(order="C") == b.tobytes(order="C")


@pytest.mark.parametrize("name", list(whitelist()))
def test_every_whitelisted_dtype_round_trips(name: str) -> None:
    rng = np.random.default_rng(0)
    array = rng.integers(0, 3, size=(3, 5)).astype(whitelist()[name])
    assert same(tb.loads(tb.dumps(array)), array)


@pytest.mark.parametrize("name", ["int16", "int32", "int64", "uint32", "float32", "float64", "complex128"])
def test_big_endian_arrays_keep_their_values(name: str) -> None:
    array = np.arange(24, dtype=np.dtype(name).newbyteorder(">")).reshape(4, 6)
    out = tb.loads(tb.dumps(array))
    assert out.dtype.byteorder == ">"
    np.testing.assert_array_equal(out, array)


def test_fortran_and_strided_arrays_keep_values_and_shape() -> None:
    f = np.asfortranarray(np.arange(60.0).reshape(3, 4, 5))
    out = tb.loads(tb.dumps(f))
    assert out.flags.f_contiguous and out.shape == f.shape
    np.testing.assert_array_equal(out, f)
    strided = np.arange(100).reshape(10, 10)[::3, 1::2]
    np.testing.assert_array_equal(tb.loads(tb.dumps(strided)), strided)
    transposed = np.arange(24).reshape(2, 3, 4).transpose(1, 2, 0)
    np.testing.assert_array_equal(tb.loads(tb.dumps(transposed)), transposed)


@pytest.mark.parametrize("array", [np.array(7.25), np.zeros((0,)), np.zeros((3, 0, 2), np.int8), np.array(True)])
def test_scalars_and_empty_arrays(array: np.ndarray) -> None:
    assert same(tb.loads(tb.dumps(array)), array)


@settings(max_examples=150, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from(HYPOTHESIS_DTYPES),
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6),
    ),
    st.sampled_from(["C", "F", "strided"]),
)
def test_property_round_trip(array: np.ndarray, layout: str) -> None:
    if layout == "F":
        array = np.asfortranarray(array)
    elif layout == "strided" and array.ndim:
        array = array[::2]
    out = tb.loads(tb.dumps(array, key="k", metadata={"step": 3}))
    assert out.shape == array.shape and out.dtype == array.dtype
    assert np.ascontiguousarray(out).tobytes() == np.ascontiguousarray(array).tobytes()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(ML), hnp.array_shapes(min_dims=0, max_dims=3, max_side=5))
def test_property_ml_dtypes(name: str, shape: tuple[int, ...]) -> None:
    array = (np.arange(int(np.prod(shape))) % 3).reshape(shape).astype(whitelist()[name])
    assert same(tb.loads(tb.dumps(array)), array)


@pytest.mark.parametrize("bad", [np.array([object()]), np.zeros(2, "i4,f8"), np.zeros(2, "V8"), np.array(["a"])])
def test_object_structured_void_and_strings_are_refused(bad: np.ndarray) -> None:
    with pytest.raises(tb.UnsupportedDtype, match="cannot be sent"):
        tb.dumps(bad)


def test_message_fields_and_view_semantics() -> None:
    array = np.arange(1000, dtype=np.float32)
    data = tb.dumps(array, key="layer1/w", metadata={"step": 7, "tags": ["a"]})
    message = tb.decode(data)
    assert (message.key, message.metadata, message.message_id) == ("layer1/w", {"step": 7, "tags": ["a"]}, None)
    view = tb.loads(data)
    assert not view.flags.writeable and not view.flags.owndata  # a view of the read-only bytes
    writable = tb.loads(bytearray(data))
    assert writable.flags.writeable and not writable.flags.owndata
    owned = tb.loads(data, copy=True)
    assert owned.flags.writeable and owned.flags.owndata
    np.testing.assert_array_equal(owned, array)


def test_encode_is_scatter_gather_without_copying_the_payload() -> None:
    array = np.arange(4096, dtype=np.float64)
    buffers = tb.encode(array, key="k")
    assert b"".join(buffers) == tb.dumps(array, key="k")
    payload = buffers[1]
    assert np.shares_memory(np.frombuffer(payload, np.uint8), array)


def test_payload_starts_at_a_64_byte_offset_and_bundle_entries_are_aligned() -> None:
    bundle = {"w": np.ones((3, 7), np.float32), "b": np.ones(5, np.float16), "step": np.array(9)}
    data = tb.dumps(bundle)
    frame = tb.codec.parse(data)
    start = len(data) - len(frame.payload)
    assert start % ALIGN == 0 and start >= PREFIX.size
    assert all(entry["offset"] % ALIGN == 0 for entry in frame.header["tensors"])
    out = tb.loads(data)
    assert list(out) == ["w", "b", "step"]
    for name, value in bundle.items():
        assert same(out[name], value)


def test_bundle_of_variable_sized_tensors_needs_no_side_channel() -> None:
    parts = {f"t{i}": np.random.default_rng(i).random(i * 13) for i in range(10)}
    out = tb.loads(tb.dumps(parts))
    assert all(np.array_equal(out[k], v) for k, v in parts.items())


def test_sparse_round_trip_and_to_dense() -> None:
    sparse = tb.SparseTensor(np.array([[0, 1], [2, 3], [2, 3]]), np.array([1.5, 2.0, 1.0]), (3, 4))
    out = tb.loads(tb.dumps(sparse))
    assert out == sparse
    dense = out.to_dense()
    assert dense.shape == (3, 4) and dense[0, 1] == 1.5 and dense[2, 3] == 3.0 and dense.sum() == 4.5


def test_a_sparse_scalar_sums_its_entries_into_its_one_element() -> None:
    scalar = tb.SparseTensor(np.zeros((2, 0), np.int64), np.array([1.5, 2.0]), ())
    dense = tb.loads(tb.dumps(scalar)).to_dense()
    assert dense.shape == () and dense == 3.5
    assert tb.SparseTensor(np.zeros((0, 0), np.int64), np.zeros(0), ()).to_dense() == 0
    big_endian = tb.SparseTensor(np.zeros((2, 0), np.int64), np.array([1.5, 2.0], ">f8"), ())
    assert tb.loads(tb.dumps(big_endian)).to_dense() == 3.5


def test_sparse_rejects_inconsistent_parts() -> None:
    with pytest.raises(ValueError, match="indices must have shape"):
        tb.SparseTensor(np.zeros((2, 3), np.int64), np.zeros(2), (4, 4))


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_compression_round_trips_and_shrinks(codec: str) -> None:
    array = np.zeros((256, 1024), np.float32)
    array[::7] = 1.0
    data = tb.dumps(array, compression=codec)
    assert len(data) < array.nbytes // 10
    assert tb.codec.parse(data).header["comp"] == codec
    np.testing.assert_array_equal(tb.loads(data), array)


def test_decode_work_counts_what_a_signature_or_a_decompression_goes_over() -> None:
    """What decoding a frame costs past the reader's CRC (a tensorbus.aio consumer decodes costly frames off
    its loop): the payload again for a signature, the raw bytes for a decompression, nothing otherwise."""
    array = np.zeros(1 << 18, np.float32)  # (1 MiB)
    plain, signed = tb.dumps(array), tb.dumps(array, signing_key=b"k")
    compressed = tb.dumps(array, compression="zstd")
    both = tb.dumps(array, compression="zstd", signing_key=b"k")
    assert decode_work(plain) == 0
    assert decode_work(signed) == len(tb.codec.parse(signed, signing_key=b"k").payload) == array.nbytes
    assert decode_work(compressed) == array.nbytes
    assert decode_work(both) == array.nbytes + len(tb.codec.parse(both, signing_key=b"k").payload)
    assert decode_work(b"not a frame") == 0 and decode_work(signed[: PREFIX.size]) == 0


def test_incompressible_payload_is_kept_raw() -> None:
    noise = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
    data = tb.dumps(noise, compression="zstd")
    assert tb.codec.parse(data).header["comp"] is None
    assert len(data) == len(tb.dumps(noise))


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_a_large_incompressible_payload_is_judged_from_a_sample_and_never_compressed_whole(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorbus.codec import compression

    seen: list[int] = []
    real = compression._compress
    monkeypatch.setattr(compression, "_compress", lambda name, data: seen.append(len(data)) or real(name, data))
    noise = np.random.default_rng(2).integers(0, 256, 4 << 20, dtype=np.uint8)
    data = tb.dumps(noise, compression=codec)
    assert tb.codec.parse(data).header["comp"] is None
    assert seen and max(seen) < noise.nbytes // 32  # only the sample went through the compressor
    half = noise.copy()
    half[: 2 << 20] = 0  # compressible where the sample looks: the whole is compressed
    seen.clear()
    data = tb.dumps(half, compression=codec)
    assert tb.codec.parse(data).header["comp"] == codec and max(seen) == half.nbytes
    np.testing.assert_array_equal(tb.loads(data), half)


def test_checksum_can_be_turned_off_and_is_then_not_checked() -> None:
    data = bytearray(tb.dumps(np.arange(100), checksum=False))
    data[-1] ^= 0xFF
    assert tb.loads(data)[-1] != 99  # flipped, and no ChecksumMismatch because there is no checksum


def test_metadata_must_be_msgpackable() -> None:
    with pytest.raises(tb.CodecError, match="msgpack"):
        tb.dumps(np.zeros(1), metadata={"f": object()})
    with pytest.raises(tb.MalformedHeader, match="msgpack"):
        tb.dumps(np.zeros(1), metadata={"n": 2**64})  # msgpack's OverflowError, in tensorbus's words


@pytest.mark.parametrize("metadata", [{"labels": {0: "cat"}}, {"a": [1, {(1, 2): 3}]}, {"deep": [[{1.5: 0}]]}])
def test_metadata_map_keys_other_than_strings_are_refused_by_the_sender(metadata: dict) -> None:
    # a receiver unpacks headers with strict map keys: such a frame would be sent, then dropped by every consumer
    with pytest.raises(tb.MalformedHeader, match="map keys must be str or bytes"):
        tb.dumps(np.zeros(1), metadata=metadata)
    with tb.Consumer("memory://int-keys") as consumer, tb.Producer("memory://int-keys") as producer:
        with pytest.raises(tb.MalformedHeader):
            producer.send("k", np.zeros(1), metadata=metadata)
        producer.send("k", np.ones(1), metadata={"labels": {"0": "cat", b"1": "dog"}})
        message = consumer.recv_message("k", timeout=5)
    assert message.metadata == {"labels": {"0": "cat", b"1": "dog"}} and message.tensor[0] == 1


def test_signed_frames_verify_and_reject_tampering() -> None:
    key = b"secret"
    data = tb.dumps(np.arange(10), signing_key=key)
    np.testing.assert_array_equal(tb.loads(data, signing_key=key), np.arange(10))
    with pytest.raises(tb.SignatureError, match="does not match"):
        tb.loads(data, signing_key=b"other")
    with pytest.raises(tb.SignatureError, match="unsigned"):
        tb.loads(tb.dumps(np.arange(10)), signing_key=key)


def test_a_small_tensors_frame_takes_at_most_256_bytes() -> None:
    # (small headers keep small tensors fast; their speed is measured in benchmarks/)
    data = tb.dumps(np.zeros(1, np.float32), key="src;1;dst;name;0:0", metadata={"step": 1})
    assert len(data) <= 256


def test_dumps_into_a_reused_buffer() -> None:
    out = bytearray(1 << 20)
    first = tb.dumps(np.arange(1000.0), key="a", out=out)
    assert isinstance(first, memoryview) and bytes(first) == tb.dumps(np.arange(1000.0), key="a")
    np.testing.assert_array_equal(tb.loads(first), np.arange(1000.0))
    with pytest.raises(tb.LimitExceeded, match="needs"):
        tb.dumps(np.zeros(1 << 20), out=out)


def test_a_byte_swapped_ml_dtype_array_is_refused_when_sent_not_when_received() -> None:
    array = np.arange(3).astype(whitelist()["bfloat16"])
    with pytest.raises(tb.UnsupportedDtype, match="native order only"):
        tb.dumps(array.astype(array.dtype.newbyteorder(">")))


def test_a_deferred_checksum_leaves_the_crc_to_the_sender_unless_the_frame_is_signed() -> None:
    sealed = b"".join(encode(np.arange(10), key="k"))
    deferred = encode(np.arange(10), key="k", deferred_checksum=True)
    assert isinstance(deferred[0], bytearray) and unsealed(deferred[0])
    assert b"".join(deferred) == sealed[:CRC_AT] + bytes(4) + sealed[PREFIX.size :]
    with pytest.raises(tb.ChecksumMismatch):
        tb.loads(b"".join(deferred))
    signed = encode(np.arange(10), key="k", deferred_checksum=True, signing_key=b"s")
    assert not unsealed(signed[0])
    np.testing.assert_array_equal(tb.loads(b"".join(signed), signing_key=b"s"), np.arange(10))
