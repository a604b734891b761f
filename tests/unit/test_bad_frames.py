"""Hostile and broken frames: every one raises a specific CodecError, never anything else."""

from __future__ import annotations

import random
import struct

import msgpack
import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec.frame import CRC_AT, FLAG_CHECKSUM, MAGIC, PREFIX, VERSION, checksum_of, encode_raw
from tensorbus.codec.tensors import align


def craft(header: dict, payload: bytes = b"", checksum: bool = True) -> bytes:
    """A frame with a correct prefix and checksum around an arbitrary (possibly lying) header."""
    return b"".join(encode_raw(header, [payload] if payload else [], len(payload), checksum=checksum))


def tensor_header(**changes: object) -> dict:
    entry = {"name": "", "dtype": "float32", "order": "<", "shape": [4], "fortran": False, "offset": 0, "nbytes": 16}
    entry.update(changes)
    return {"kind": "ndarray", "key": None, "meta": {}, "id": None, "comp": None, "tensors": [entry]}


GOOD = tb.dumps(np.arange(16, dtype=np.float32), key="k", metadata={"a": 1})


def test_crafted_frame_helper_builds_a_valid_frame() -> None:
    np.testing.assert_array_equal(tb.loads(craft(tensor_header(), bytes(16))), np.zeros(4, np.float32))


@pytest.mark.parametrize("cut", [0, 1, 10, PREFIX.size - 1, PREFIX.size, 100, len(GOOD) - 1])
def test_truncated_frames(cut: int) -> None:
    with pytest.raises(tb.TruncatedFrame, match="needs"):
        tb.decode(GOOD[:cut])


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(tb.MalformedHeader, match="more follow"):
        tb.decode(GOOD + b"x")


def test_bad_magic_and_version() -> None:
    with pytest.raises(tb.BadMagic, match="expected magic b'TBUS'"):
        tb.decode(b"XXXX" + GOOD[4:])
    with pytest.raises(tb.UnsupportedVersion, match="expected format version 1, found 9"):
        tb.decode(GOOD[:4] + b"\x09" + GOOD[5:])


def test_checksum_mismatch_anywhere() -> None:
    for position in (6, PREFIX.size + 3, len(GOOD) - 1):
        corrupt = bytearray(GOOD)
        corrupt[position] ^= 0x40
        with pytest.raises(tb.CodecError):
            tb.decode(corrupt)
    corrupt = bytearray(GOOD)
    corrupt[-1] ^= 1
    with pytest.raises(tb.ChecksumMismatch, match="CRC32C stored"):
        tb.decode(corrupt)


def test_header_and_payload_length_limits() -> None:
    with pytest.raises(tb.LimitExceeded, match="max_header_bytes"):
        tb.decode(GOOD, limits=tb.Limits(max_header_bytes=16))
    with pytest.raises(tb.LimitExceeded, match="max_payload_bytes"):
        tb.decode(GOOD, limits=tb.Limits(max_payload_bytes=8))
    huge = bytearray(GOOD)
    struct.pack_into("<Q", huge, 12, 1 << 62)  # payload length field
    with pytest.raises(tb.LimitExceeded):
        tb.decode(huge)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"shape": [10**18]}, tb.MalformedHeader, "needs"),
        ({"shape": [10**9, 10**9], "nbytes": 4 * 10**18}, tb.MalformedHeader, "payload holds only"),
        ({"shape": [-4]}, tb.MalformedHeader, "non-negative"),
        ({"shape": "4"}, tb.MalformedHeader, "'shape' must be array"),
        ({"shape": [1] * 40, "nbytes": 4}, tb.LimitExceeded, "max_ndim"),
        ({"offset": -64}, tb.MalformedHeader, "offset"),
        ({"offset": 3}, tb.MalformedHeader, "offset"),
        ({"nbytes": 12}, tb.MalformedHeader, "header says 12"),
        ({"dtype": "object"}, tb.UnsupportedDtype, "does not know"),
        ({"dtype": "O"}, tb.UnsupportedDtype, "does not know"),
        ({"dtype": ["<f4"]}, tb.MalformedHeader, "'dtype' must be str"),
        ({"order": "?"}, tb.UnsupportedDtype, "byte order"),
        ({"dtype": "bfloat16", "order": ">", "nbytes": 8}, tb.UnsupportedDtype, "cannot hold"),
        ({"shape": [0, 2**63], "nbytes": 0}, tb.MalformedHeader, "numpy can build"),
        ({"shape": [0, 2**40, 2**40], "nbytes": 0}, tb.MalformedHeader, "numpy can build"),
        ({"offset": 64}, tb.MalformedHeader, "from 0"),
        ({"shape": [1], "nbytes": 4}, tb.MalformedHeader, "cover 4 bytes of a 16-byte payload"),
    ],
)
def test_lying_headers(changes: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        tb.decode(craft(tensor_header(**changes), bytes(16)))


def test_tensors_of_a_bundle_cannot_overlap_or_leave_gaps() -> None:
    entry = {"dtype": "float32", "order": "<", "shape": [4], "fortran": False, "nbytes": 16}
    bundle = {**tensor_header(), "kind": "bundle"}
    bundle["tensors"] = [{**entry, "name": "a", "offset": 0}, {**entry, "name": "b", "offset": 0}]
    with pytest.raises(tb.MalformedHeader, match="from 64"):  # b would alias a
        tb.decode(craft(bundle, bytes(80)))
    bundle["tensors"][1]["offset"] = 128
    with pytest.raises(tb.MalformedHeader, match="from 64"):  # 48 unreferenced bytes between them
        tb.decode(craft(bundle, bytes(144)))
    bundle["tensors"][1]["offset"] = 64
    assert set(tb.loads(craft(bundle, bytes(80)))) == {"a", "b"}


def sparse_frame(indices: np.ndarray, dense_shape: list[int], values: np.ndarray | None = None) -> bytes:
    """A sparse frame as a peer might write it, with whatever indices it likes."""
    values = np.ones(len(indices), np.float32) if values is None else values
    header = tb.codec.parse(tb.dumps(tb.SparseTensor(np.zeros((len(indices), 1), np.int64), values, (1,)))).header
    index_entry, value_entry = header["tensors"]
    name, order = tb.codec.dtypes.describe(indices.dtype)
    index_entry.update(dtype=name, order=order, shape=list(indices.shape), nbytes=indices.nbytes)
    value_entry["offset"] = -(-indices.nbytes // 64) * 64
    payload = indices.tobytes() + bytes(value_entry["offset"] - indices.nbytes) + values.tobytes()
    return craft({**header, "dense_shape": dense_shape}, payload)


@pytest.mark.parametrize(
    ("indices", "dense_shape", "match"),
    [
        (np.array([[5, 1]]), [5, 3], "outside dense_shape"),
        (np.array([[-1, -1]]), [5, 3], "outside dense_shape"),
        (np.array([[0.5, 1.0]]), [5, 3], "must be int64"),
        (np.array([[1, 1]], np.int8), [5, 3], "must be int64"),
        (np.array([[1, 1]]), [5, 3, 2], r"shape \(nnz, 3\)"),
        (np.array([[1, 1]]), [5, -3], "non-negative"),
    ],
)
def test_sparse_tensors_are_checked_before_anyone_scatters_them(
    indices: np.ndarray, dense_shape: list[int], match: str
) -> None:
    assert tb.loads(sparse_frame(np.array([[4, 2]]), [5, 3])).to_dense()[4, 2] == 1  # the helper's frames decode
    with pytest.raises(tb.MalformedHeader, match=match):
        tb.decode(sparse_frame(indices, dense_shape))


def test_sparse_tensors_of_a_huge_space_or_from_a_big_endian_sender_are_accepted() -> None:
    huge = tb.loads(sparse_frame(np.array([[2**40, 7]]), [2**62, 2**62]))  # e.g. a hashed feature space
    assert huge.dense_shape == (2**62, 2**62) and huge.indices.tolist() == [[2**40, 7]]
    big_endian = tb.loads(sparse_frame(np.array([[4, 2]], ">i8"), [5, 3]))
    assert big_endian.indices.dtype == np.int64 and big_endian.to_dense()[4, 2] == 1


def test_sparse_dense_shape_obeys_max_ndim() -> None:
    with pytest.raises(tb.LimitExceeded, match="max_ndim"):
        tb.decode(sparse_frame(np.zeros((1, 40), np.int64), [1] * 40))


def test_a_huge_producer_id_is_refused() -> None:
    with pytest.raises(tb.MalformedHeader, match="producer id of 1000 characters; the limit is 128"):
        tb.decode(craft({**tensor_header(), "id": ["p" * 1000, 1]}, bytes(16)))
    assert tb.decode(craft({**tensor_header(), "id": ["p" * 128, 1]}, bytes(16))).message_id == ("p" * 128, 1)


def test_missing_fields_and_wrong_kinds() -> None:
    header = tensor_header()
    del header["tensors"][0]["dtype"]
    with pytest.raises(tb.MalformedHeader, match="lacks field 'dtype'"):
        tb.decode(craft(header, bytes(16)))
    with pytest.raises(tb.MalformedHeader, match="not one this build knows"):
        tb.decode(craft({**tensor_header(), "kind": "pickle"}, bytes(16)))
    with pytest.raises(tb.MalformedHeader, match="must be a map"):
        tb.decode(craft({**tensor_header(), "tensors": [1]}, bytes(16)))
    with pytest.raises(tb.MalformedHeader, match="'id' must be array or nil"):
        tb.decode(craft({**tensor_header(), "id": "x"}, bytes(16)))
    with pytest.raises(tb.MalformedHeader, match="'key' must be str or nil"):
        tb.decode(craft({**tensor_header(), "key": 5}, bytes(16)))
    with pytest.raises(tb.MalformedHeader, match="Reassembler"):
        tb.decode(craft({"kind": "chunk", "chunk": [0, 1, 1, 1]}, b"x"))


def test_garbage_msgpack_header() -> None:
    for garbage in (b"\xc1", b"\x93\x01", b"\xff" * 8, msgpack.packb([1, 2, 3])):
        head = bytearray(64)
        PREFIX.pack_into(head, 0, b"TBUS", 1, 0, 0, len(garbage), 0, 0)
        head[PREFIX.size : PREFIX.size + len(garbage)] = garbage
        with pytest.raises(tb.MalformedHeader):
            tb.decode(bytes(head))


def test_too_many_tensors_in_a_bundle() -> None:
    data = tb.dumps({f"t{i}": np.zeros(1) for i in range(20)})
    with pytest.raises(tb.LimitExceeded, match="max_tensors"):
        tb.decode(data, limits=tb.Limits(max_tensors=10))


def test_a_small_compressed_frame_cannot_claim_more_than_max_decompressed_bytes() -> None:
    bomb = tb.dumps(np.zeros(16 << 20, np.uint8), compression="zstd")  # 16 MiB of zeros in a few KB
    assert len(bomb) < 64 << 10
    with pytest.raises(tb.LimitExceeded, match="claims 16777216 bytes; the limit is 1048576"):
        tb.decode(bomb, limits=tb.Limits(max_decompressed_bytes=1 << 20))
    assert tb.loads(bomb).nbytes == 16 << 20  # within the default 1 GiB
    with tb.Consumer("memory://bombs", max_decompressed_bytes=1 << 20) as consumer:
        with tb.Producer("memory://bombs", compression="zstd") as producer:
            producer.send("k", np.zeros(16 << 20, np.uint8))
            with pytest.raises(tb.Rejected, match="claims 16777216 bytes"):  # (told to the producer: raised once)
                producer.flush(5)
            producer.send("k", np.zeros(1 << 10, np.uint8))
        assert consumer.recv("k", timeout=5).nbytes == 1 << 10 and consumer.stats["rejected"] == 1


def test_compression_bombs_and_lies() -> None:
    header = {**tensor_header(), "comp": "zstd", "raw": 1 << 40}
    with pytest.raises(tb.LimitExceeded, match="claims"):
        tb.decode(craft(header, b"\x00" * 64), limits=tb.Limits(max_payload_bytes=1 << 20))
    good = tb.dumps(np.zeros(1 << 16, np.float32), compression="zstd")
    frame = tb.codec.parse(good)
    lying = craft({**frame.header, "raw": 100}, bytes(frame.payload))
    with pytest.raises(tb.MalformedHeader, match="zstd frame declares 262144 bytes, header says 100"):
        tb.decode(lying)
    with pytest.raises(tb.MalformedHeader, match="does not decompress"):
        tb.decode(craft({**tensor_header(), "comp": "lz4", "raw": 16}, b"\xff" * 64))
    payload = bytes(frame.payload)
    skippable = struct.pack("<II", 0x184D2A50, 4) + b"abcd"
    # unused bytes after the zstd frame: junk, a second frame, a skippable frame, a bare magic, half a frame
    for extra in (b"junk" * 450, payload, skippable, payload[:4], payload[: len(payload) // 2]):
        with pytest.raises(tb.MalformedHeader, match="not exactly one frame"):
            tb.decode(craft(frame.header, payload + extra))
    with pytest.raises(tb.MalformedHeader, match="not exactly one frame: it is cut short"):
        tb.decode(craft(frame.header, payload[:-3]))
    lying = bytearray(payload)  # its frame header claims 1000 bytes (single segment: the 4-byte field at 5)
    lying[5:9] = (1000).to_bytes(4, "little")
    with pytest.raises(tb.MalformedHeader, match="declares 1000 bytes"):
        tb.decode(craft(frame.header, bytes(lying)))
    with pytest.raises(tb.MalformedHeader, match="does not decompress"):  # (both lie: libzstd stops at 1000)
        tb.decode(
            craft(
                {
                    **frame.header,
                    "raw": 1000,
                    "tensors": [{**frame.header["tensors"][0], "shape": [250], "nbytes": 1000}],
                },
                bytes(lying),
            )
        )
    assert tb.decode(craft(frame.header, bytes(frame.payload))).tensor.nbytes == 1 << 18  # (as crafted, it is fine)
    with pytest.raises(tb.MalformedHeader, match="unknown compression"):
        tb.decode(craft({**tensor_header(), "comp": "rot13", "raw": 16}, bytes(16)))


SEEDS = [
    np.arange(64, dtype=np.float32),
    {"w": np.ones((4, 4)), "b": np.zeros(3, np.int8)},
    tb.SparseTensor(np.array([[0, 0], [1, 2]]), np.array([1.0, 2.0]), (2, 3)),
    np.zeros(300, np.float64),
]


def test_bounded_fuzz_of_mutated_frames() -> None:
    """Mutated frames (checksum off, so mutations reach the parser) raise only CodecError."""
    rng = random.Random(1234)
    frames = [tb.dumps(s, key="k", metadata={"m": [1, "x"]}, checksum=False) for s in SEEDS]
    frames.append(tb.dumps(SEEDS[3], compression="zstd", checksum=False))
    outcomes = {"ok": 0, "rejected": 0}
    for _ in range(6000):
        data = bytearray(rng.choice(frames))
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            position = rng.randrange(len(data))
            if op < 0.6:
                data[position] = rng.randrange(256)
            elif op < 0.8:
                del data[position : position + rng.randint(1, 16)]
            else:
                data[position:position] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        try:
            tb.decode(bytes(data))
            outcomes["ok"] += 1
        except tb.CodecError:
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 3000 and sum(outcomes.values()) == 6000


DEEP = [1]
for _ in range(1000):  # within msgpack's own nesting limit: each level is one byte on the wire
    DEEP = [DEEP]


@pytest.mark.parametrize(
    "header",
    [
        {**tensor_header(), "id": DEEP},
        {**tensor_header(), "kind": DEEP},
        tensor_header(shape=DEEP),
        tensor_header(dtype=DEEP),
        {"kind": "chunk", "key": None, "id": ["p", 1], "chunk": DEEP},
        {**tensor_header(), "meta": {"a": DEEP}},
    ],
    ids=["id", "kind", "shape", "dtype", "chunk", "metadata"],
)
def test_a_value_nested_a_thousand_levels_deep_is_a_codec_error(header: dict) -> None:
    packed = msgpack.packb(header)  # by hand: a tensorbus sender refuses to write such metadata
    head = bytearray(align(PREFIX.size + len(packed)))
    PREFIX.pack_into(head, 0, MAGIC, VERSION, FLAG_CHECKSUM, 0, len(packed), 16, 0)
    head[PREFIX.size : PREFIX.size + len(packed)] = packed
    frame = bytearray(head + bytes(16))
    struct.pack_into("<I", frame, CRC_AT, checksum_of(frame))
    for decode in (tb.decode, tb.Reassembler().feed):
        with pytest.raises(tb.CodecError):  # not a RecursionError from printing it in the message
            decode(frame)


def test_metadata_nested_past_the_limit_is_refused_by_the_sender_too() -> None:
    nested: dict = {"leaf": 1}
    for _ in range(40):
        nested = {"n": nested}
    with pytest.raises(tb.MalformedHeader, match="deeper than 32"):
        tb.encode(np.zeros(1), metadata=nested)


def test_the_buffer_limit_counts_metadata_objects_not_only_their_bytes() -> None:
    metadata = {"x": [{} for _ in range(10_000)]}  # 1 byte per empty map on the wire, ~64 as Python objects
    frame = tb.dumps(np.zeros(1), metadata=metadata)
    message = tb.decode(frame)
    assert len(frame) < 11_000 and message.header_bytes > 10_000 * 64


def _with_reserved(frame: bytes, value: int) -> bytes:
    """`frame` with its reserved prefix bytes (6-7) set to `value` and its CRC made right again."""
    raw = bytearray(frame)
    struct.pack_into("<H", raw, 6, value)
    struct.pack_into("<I", raw, CRC_AT, checksum_of(raw))
    return bytes(raw)


@pytest.mark.parametrize("value", [1, 0x100, 0xFFFF])
def test_reserved_prefix_bytes_that_are_not_zero_are_refused(value: int) -> None:
    with pytest.raises(tb.UnsupportedVersion, match="reserved"):
        tb.decode(_with_reserved(GOOD, value))  # (the C decoder leaves it to the Python one, which says why)
    with pytest.raises(tb.UnsupportedVersion, match="reserved"):
        tb.codec.frame.frame_length(_with_reserved(GOOD, value))


@pytest.mark.parametrize("fortran", ["yes", 1, 0, None, [True]])
def test_a_header_field_of_the_wrong_type_is_refused(fortran: object) -> None:
    frame = craft(tensor_header(fortran=fortran, shape=[2, 2]), bytes(16))
    with pytest.raises(tb.MalformedHeader, match="'fortran' must be bool"):
        tb.decode(frame)


def test_a_key_longer_than_the_limit_is_refused_on_decode_and_at_send() -> None:
    limit = tb.codec.frame.MAX_KEY_CHARS
    assert tb.decode(craft({**tensor_header(), "key": "k" * limit}, bytes(16))).key == "k" * limit
    with pytest.raises(tb.MalformedHeader, match=f"the limit is {limit}"):
        tb.decode(craft({**tensor_header(), "key": "k" * (limit + 1)}, bytes(16)))
    for array in (np.zeros(4), np.zeros((3, 3))[:, ::2]):  # the C head, and the Python layout
        with pytest.raises(tb.ConfigError, match=f"the limit is {limit}"):
            tb.encode(array, key="k" * (limit + 1))


WRONG_TYPES = [
    ("key", 5), ("meta", [1]), ("id", "p1"), ("comp", 1), ("raw", "16"), ("raw", True), ("tensors", {"a": 1}),
    ("dense_shape", 4), ("chunk", "0/1"), ("ts", 1), ("kind", 1),
]  # fmt: skip
ENTRY_WRONG_TYPES = [("name", 5), ("dtype", 7), ("order", 60), ("shape", "4"), ("fortran", 0), ("offset", 0.0)]


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize(("field", "value"), WRONG_TYPES + [(f"entry.{f}", v) for f, v in ENTRY_WRONG_TYPES])
def test_every_known_field_of_the_wrong_msgpack_type_is_malformed(field: str, value: object, native: bool) -> None:
    """In the C decoder (which hands anything not exactly its own to Python) and in Python alone."""
    from tensorbus.codec import frame as frame_module

    header = tensor_header()
    if field.startswith("entry."):
        header["tensors"][0][field[len("entry.") :]] = value
    else:
        header[field] = value
    data = craft(header, bytes(16))
    with pytest.raises(tb.MalformedHeader, match=repr(field.removeprefix("entry."))):
        if native:
            tb.decode(data)
        else:
            frame_module.message_from_frame(frame_module.parse(data))


def test_unknown_header_fields_are_still_ignored() -> None:
    header = tensor_header()
    header["trace"] = {"traceparent": "00-abc-def-01"}  # a newer writer's optional field
    header["tensors"][0]["future"] = 5
    np.testing.assert_array_equal(tb.loads(craft(header, bytes(16))), np.zeros(4, np.float32))
