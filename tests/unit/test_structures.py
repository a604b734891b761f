"""Nested structures (dicts, lists, tuples of tensors and scalars) as one frame, and what cannot travel."""

from __future__ import annotations

import collections
from typing import Any

import msgpack
import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec.frame import PREFIX, Limits, encode_raw, layout
from tensorbus.codec.tensors import ALIGN, MAX_TREE_DEPTH, MAX_TREE_ENTRIES
from tensorbus.rendezvous import tensor_nbytes
from tests.conftest import require_torch
from tests.unit import frames_v1
from tests.waiting import wait_for


def same_structure(a: Any, b: Any) -> bool:
    """Equal with container types, key types and dtypes: arrays bit for bit, scalars by type and value."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return (
            list(a) == list(b)
            and all(type(k) is type(j) for k, j in zip(a, b, strict=True))
            and all(same_structure(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_structure(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, tb.SparseTensor):
        return a == b and a.values.dtype == b.values.dtype
    return a == b or (a != a and b != b)  # (NaN)


def tf_style() -> dict[str, Any]:
    """A TensorFlow-style nested structure: ragged lists of differently sized tensors, sparse tensors, tuples."""
    rng = np.random.default_rng(0)
    return {
        "ragged": [rng.standard_normal(n).astype(np.float32) for n in (1, 7, 0, 300)],
        "pair": (np.arange(5, dtype=np.int16), tb.SparseTensor([[0, 2], [1, 1]], [1.5, -2.0], (2, 3))),
        "nested": {"deeper": [{"x": np.ones((2, 3), np.uint8)}, ()], "empty": {}, "none": None},
        "scalars": [0, -(2**63), 2**64 - 1, 1.25, float("nan"), "", "ünïcode", True, False],
        7: np.float64(3.5),  # a numpy scalar travels as a 0-d array
    }


def test_a_nested_structure_comes_back_with_its_containers_key_types_and_values() -> None:
    tree = tf_style()
    message = tb.decode(tb.dumps(tree, key="k", metadata={"step": 1}))
    assert message.kind == "tree" and message.key == "k" and message.metadata == {"step": 1}
    expected = {**tree, 7: np.asarray(np.float64(3.5))}
    assert same_structure(message.tensor, expected)
    assert isinstance(message.tensor["pair"], tuple) and 7 in message.tensor and "7" not in message.tensor


def test_each_tensor_of_a_structure_is_aligned_in_the_payload_and_a_view_of_the_frame() -> None:
    buffer = np.empty(1 << 16, np.uint8)
    start = -buffer.ctypes.data % ALIGN  # a 64-byte aligned receive buffer, as transports give
    data = tb.dumps(tf_style())
    frame = buffer[start : start + len(data)]
    frame[:] = np.frombuffer(data, np.uint8)
    tree = tb.loads(frame.data)
    arrays = [*tree["ragged"], tree["pair"][0], tree["pair"][1].values, tree["nested"]["deeper"][0]["x"]]
    for array in arrays:
        if array.size:
            assert array.ctypes.data % ALIGN == 0
            assert np.shares_memory(array, frame)  # received without a copy


def test_an_adam_optimizer_state_dict_travels_as_one_frame() -> None:
    torch = require_torch()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    frames = tb.encode(state)
    assert tb.codec.parse(b"".join(frames)).header["kind"] == "tree"
    back = tb.loads(b"".join(frames), like="torch")
    assert back["param_groups"] == state["param_groups"]  # floats, ints, bools, None, the betas tuple
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    assert list(back["state"]) == list(state["state"]) == [0, 1, 2, 3]  # int keys stay ints
    for index, entry in state["state"].items():
        for name, tensor in entry.items():
            assert back["state"][index][name].dtype == tensor.dtype and torch.equal(back["state"][index][name], tensor)
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3)
    fresh.load_state_dict(back)  # what the receiver does with it


def test_a_flat_dict_of_tensors_stays_a_bundle_and_an_ordered_dict_comes_back_a_dict() -> None:
    bundle = collections.OrderedDict(w=np.ones(3), b=np.zeros(2))
    message = tb.decode(tb.dumps(bundle))
    assert message.kind == "bundle" and type(message.tensor) is dict and list(message.tensor) == ["w", "b"]


@pytest.mark.parametrize(
    ("obj", "error", "needle"),
    [
        ({"a": {1, 2}}, tb.UnsupportedDtype, r"cannot send a set at /a: what travels is a numpy array"),
        ([object()], tb.UnsupportedDtype, r"cannot send an object at /0"),
        ({(1, 2): np.ones(1)}, tb.InvalidTensor, r"dict key \(1, 2\) at the top is a tuple: keys must be str or int"),
        ({True: np.ones(1)}, tb.InvalidTensor, r"dict key True at the top is a bool"),
        ([2**64], tb.InvalidTensor, r"does not fit in 64 bits"),
        ({"a": {-(2**63) - 1: np.ones(1)}}, tb.InvalidTensor, r"at /a does not fit in 64 bits"),
        ({"p": collections.namedtuple("P", "x")(1)}, tb.InvalidTensor, r"cannot send a P at /p: only plain lists"),
        ([b"bytes"], tb.UnsupportedDtype, r"cannot send a bytes at /0"),
    ],
)
def test_what_cannot_travel_in_a_structure_is_named_with_its_place(obj: Any, error: type, needle: str) -> None:
    with pytest.raises(error, match=needle):
        tb.dumps(obj)


def test_the_message_for_an_unsupported_object_no_longer_contradicts_itself() -> None:
    with pytest.raises(tb.UnsupportedDtype) as refused:
        tb.dumps(frozenset())
    assert "cannot send a frozenset: what travels is" in str(refused.value)
    assert "dict" in str(refused.value)  # and a dict does travel:
    assert tb.loads(tb.dumps({"nested": {"a": 1}})) == {"nested": {"a": 1}}


def nested(depth: int) -> Any:
    tree: Any = np.ones(1)
    for _ in range(depth):
        tree = [tree]
    return tree


def test_depth_and_entry_limits_apply_when_sending() -> None:
    assert tb.loads(tb.dumps(nested(MAX_TREE_DEPTH)))  # at the limit: fine
    with pytest.raises(tb.LimitExceeded, match=f"deeper than {MAX_TREE_DEPTH} levels"):
        tb.dumps(nested(MAX_TREE_DEPTH + 1))
    with pytest.raises(tb.LimitExceeded, match=f"more than {MAX_TREE_ENTRIES} entries"):
        tb.dumps([0] * MAX_TREE_ENTRIES)


def frame_with_tree(tree: Any, arrays: tuple[np.ndarray, ...] = ()) -> bytes:
    """A frame whose header carries `tree` as given (what a hostile or broken sender could write)."""
    header, body, end = layout(list(arrays))
    header["tree"] = tree
    return b"".join(bytes(b) for b in encode_raw(header, body, end))


@pytest.mark.parametrize(
    ("tree", "arrays", "error", "needle"),
    [
        (["list", ["tensor"]], (), tb.MalformedHeader, "places more tensors"),
        (["list"], (np.ones(1),), tb.MalformedHeader, "places 0 of the table's 1"),
        (["dict", "a"], (), tb.MalformedHeader, "pairs"),
        (["dict", "a", 1, "a", 2], (), tb.MalformedHeader, "distinct"),
        (["dict", 1.5, 1], (), tb.MalformedHeader, "distinct strs or ints"),
        (["set", 1], (), tb.MalformedHeader, "not one this build knows"),
        ({"a": 1}, (), tb.MalformedHeader, "tagged list"),
        ([], (), tb.MalformedHeader, "tagged list"),
        (b"raw", (), tb.MalformedHeader, "tagged list"),
        (5, (), tb.MalformedHeader, "top must be a dict"),
        (["list", ["sparse", [2]]], (np.array([[5]]), np.ones(1)), tb.MalformedHeader, "outside dense_shape"),
    ],
)
def test_a_received_tree_is_checked_node_by_node(tree: Any, arrays: tuple, error: type, needle: str) -> None:
    with pytest.raises(error, match=needle):
        tb.loads(frame_with_tree(tree, arrays))


def test_a_received_tree_past_the_receivers_limits_is_refused() -> None:
    deep: Any = 0
    for _ in range(40):
        deep = ["list", deep]
    with pytest.raises(tb.LimitExceeded, match="max_tree_depth=32"):
        tb.loads(frame_with_tree(deep))
    wide = frame_with_tree(["list", *[0] * 1000])
    with pytest.raises(tb.LimitExceeded, match="more than 999 entries"):
        tb.decode(wide, limits=Limits(max_tree_entries=999))
    assert len(tb.loads(wide)) == 1000


def test_a_structures_entries_count_against_the_consumers_buffer_like_metadata() -> None:
    small, big = tb.decode(tb.dumps({"a": [0]})), tb.decode(tb.dumps({"a": list(range(1000))}))
    assert big.header_bytes - small.header_bytes > 999 * 64


def test_every_array_of_a_structure_counts_against_the_consumers_buffer() -> None:
    tree = tb.loads(tb.dumps(tf_style()))
    arrays = [*tree["ragged"], tree["pair"][0], tree["nested"]["deeper"][0]["x"], tree[7]]
    sparse = tree["pair"][1]
    assert tensor_nbytes(tree) == sum(a.nbytes for a in arrays) + sparse.indices.nbytes + sparse.values.nbytes
    with tb.Consumer("memory://counted") as consumer, tb.Producer("memory://counted") as producer:
        producer.send("big", ([np.ones(1 << 17)],))  # 1 MiB of float64 in a list in a tuple
        wait_for(lambda: len(consumer.table) == 1, 10, "the structure to arrive")
        assert consumer.table.buffered_bytes > 1 << 20  # (was counted as its header alone)


@pytest.mark.parametrize("name", ["NDARRAY", "BUNDLE", "SPARSE"])
def test_frames_of_the_earlier_encoder_still_decode(name: str) -> None:
    message = tb.decode(getattr(frames_v1, name))
    if name == "NDARRAY":
        assert message.key == "a" and message.metadata == {"step": 3} and message.message_id == ("p", 1)
        assert same_structure(message.tensor, np.arange(6, dtype=np.float32).reshape(2, 3))
    elif name == "BUNDLE":
        expected = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, 2], np.int64)}
        assert message.kind == "bundle" and same_structure(message.tensor, expected)
    else:
        assert message.tensor == tb.SparseTensor(np.array([[0, 1], [2, 0]]), np.array([1.5, -2.0]), (3, 2))
    # and today's encoder still writes these kinds byte for byte as it did
    header_len = PREFIX.unpack_from(getattr(frames_v1, name))[4]
    assert msgpack.unpackb(getattr(frames_v1, name)[PREFIX.size : PREFIX.size + header_len])["kind"] != "tree"


def test_the_earlier_encoders_frames_are_what_the_encoder_writes_today() -> None:
    again = tb.dumps(np.arange(6, dtype=np.float32).reshape(2, 3), key="a", metadata={"step": 3}, message_id=("p", 1))
    assert bytes(again) == frames_v1.NDARRAY
    bundle = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, 2], np.int64)}
    assert bytes(tb.dumps(bundle, key="params")) == frames_v1.BUNDLE


def test_a_masked_array_is_refused_with_the_reason_not_an_attribute_error() -> None:
    masked = np.ma.array([1, 2], mask=[0, 1])
    with pytest.raises(tb.InvalidTensor, match="masked array: the mask would be lost"):
        tb.dumps(masked)
    with pytest.raises(tb.InvalidTensor, match="masked array at /m"):
        tb.dumps({"m": masked, "other": np.ones(1)})
    parts = {"data": masked.filled(0), "mask": np.ma.getmaskarray(masked)}  # what the message suggests travels
    back = tb.loads(tb.dumps(parts))
    assert np.ma.array(back["data"], mask=back["mask"]).tolist() == masked.tolist()


def test_a_sparse_tensor_with_indices_outside_its_shape_is_refused_when_made() -> None:
    with pytest.raises(tb.InvalidTensor, match=r"indices fall outside dense_shape \(3, 3\)"):
        tb.SparseTensor([[3, 0]], [1.0], (3, 3))
    with pytest.raises(tb.InvalidTensor, match="outside"):
        tb.SparseTensor([[-1, 0]], [1.0], (3, 3))
    with pytest.raises(tb.InvalidTensor, match="integers"):
        tb.SparseTensor([[0.5, 0]], [1.0], (3, 3))
    assert tb.SparseTensor([[2, 2]], [1.0], (3, 3)).to_dense()[2, 2] == 1.0


def test_a_consumer_takes_its_structure_limits_as_options() -> None:
    with tb.Consumer("memory://limits", max_tree_depth=2) as consumer, tb.Producer("memory://limits") as producer:
        producer.send("deep", [[[1]]])
        producer.send("flat", [[1]])
        assert consumer.recv("flat", timeout=10) == [[1]]
        assert consumer.stats["rejected"] == 1  # the deeper one, dropped as every bad frame is (and logged)


@pytest.mark.parametrize("scalar", [3.14, 7, "text", True, None])
def test_a_python_scalar_travels_in_a_structure_and_is_refused_alone_with_both_ways_named(scalar: object) -> None:
    assert tb.loads(tb.dumps([scalar])) == [scalar] and type(tb.loads(tb.dumps([scalar]))[0]) is type(scalar)
    with pytest.raises(tb.UnsupportedDtype, match=r"on its own: a Python scalar travels inside a structure") as refused:
        tb.dumps(scalar)
    assert "np.asarray" in str(refused.value)


@pytest.mark.parametrize("scalar", [np.float32(1.5), np.int64(-3), np.bool_(True)])
def test_a_numpy_scalar_travels_as_a_0d_array_alone_and_in_a_structure(scalar: np.generic) -> None:
    for back in (tb.loads(tb.dumps(scalar)), tb.loads(tb.dumps({"x": scalar}))["x"], tb.loads(tb.dumps([scalar]))[0]):
        assert isinstance(back, np.ndarray) and back.shape == () and back.dtype == scalar.dtype
        assert back[()] == scalar


def test_refusals_use_the_right_article() -> None:
    with pytest.raises(tb.UnsupportedDtype, match="cannot send an object:"):
        tb.dumps(object())
    with pytest.raises(tb.UnsupportedDtype, match="cannot send an int on its own"):
        tb.dumps(5)
