"""torch CPU tensors in and out. The test command installs the `torch` extra (PyPI's wheel, CUDA
libraries included, ~3 GB); outside CI a missing torch skips these tests, in CI it fails them."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import tensorbus as tb
from tests.conftest import require_torch

torch = require_torch()


def test_torch_tensors_travel_without_a_copy_and_come_back_as_torch() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buffers = tb.encode(t)
    assert np.shares_memory(np.frombuffer(buffers[1], np.uint8), t.numpy())
    back = tb.loads(b"".join(buffers), like="torch")
    assert isinstance(back, torch.Tensor) and torch.equal(back, t)


def test_bfloat16_and_state_dicts() -> None:
    state = {"w": torch.randn(4, 4, dtype=torch.bfloat16), "b": torch.zeros(4)}
    back = tb.loads(tb.dumps(state), like="torch")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert back["w"].dtype == torch.bfloat16


def test_a_state_dict_through_a_producer_and_consumer() -> None:
    state = {"layer.weight": torch.randn(8, 4), "layer.bias": torch.zeros(8, dtype=torch.float16)}
    with tb.Consumer("memory://torch-state") as consumer, tb.Producer("memory://torch-state") as producer:
        producer.send("state", state)
        received = consumer.recv("state", timeout=5)
    back = {name: torch.from_numpy(np.array(array)) for name, array in received.items()}
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_float8_torch_tensors_travel_both_ways(name: str) -> None:
    t = torch.arange(6.0).to(getattr(torch, name))
    back = tb.loads(tb.dumps(t), like="torch")
    assert back.dtype == t.dtype and torch.equal(back.view(torch.int8), t.view(torch.int8))
    assert tb.loads(tb.dumps(t)).dtype.name == name  # as numpy: the ml_dtypes type of the same name


def test_conjugate_and_negative_views_are_sent_as_their_values() -> None:
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert torch.equal(tb.loads(tb.dumps(z.conj()), like="torch"), z.conj().resolve_conj())
    x = torch.tensor([1.0, -2.0])
    assert torch.equal(tb.loads(tb.dumps(torch._neg_view(x)), like="torch"), -x)


def test_a_torch_sparse_coo_tensor_travels_as_a_sparse_tensor_with_its_layout_kept() -> None:
    # torch's indices are (ndim, nnz); nnz == ndim here, so a transposed layout would go unnoticed
    t = torch.sparse_coo_tensor(
        torch.tensor([[0, 1], [2, 3]]), torch.tensor([0.5, -1.0]), (4, 4), check_invariants=True
    )
    back = tb.loads(tb.dumps(t))
    assert isinstance(back, tb.SparseTensor) and back.dense_shape == (4, 4)
    assert np.array_equal(back.to_dense(), t.to_dense().numpy())
    as_torch = tb.loads(tb.dumps(t), like="torch")
    assert as_torch.layout == torch.sparse_coo and torch.equal(as_torch.to_dense(), t.to_dense())
    nested = tb.loads(tb.dumps({"grads": [t], "w": torch.zeros(2)}), like="torch")
    assert torch.equal(nested["grads"][0].to_dense(), t.to_dense())


def test_a_sparse_tensor_comes_back_as_torch_sparse_with_like_torch() -> None:
    sparse = tb.SparseTensor(np.array([[0, 2], [1, 0], [3, 3]]), np.array([1.0, 2.0, 3.0]), (4, 4))
    back = tb.loads(tb.dumps(sparse), like="torch")
    assert back.layout == torch.sparse_coo and np.array_equal(back.to_dense().numpy(), sparse.to_dense())


def test_other_torch_layouts_are_refused_with_the_way_to_send_them() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("sparse CSR support is in beta")
        csr = torch.eye(3).to_sparse_csr()
    with pytest.raises(tb.UnsupportedDtype, match="SparseTensor"):
        tb.dumps(csr)


@pytest.mark.parametrize("name", sorted(tb.codec.dtypes.whitelist()))
def test_every_dtype_the_codec_carries_decodes_as_torch_or_says_why_not(name: str) -> None:
    array = np.arange(6).astype(tb.codec.dtypes.whitelist()[name])
    swapped = array.dtype.kind != "V" and array.dtype.itemsize > 1  # ml_dtypes have native order only
    for sent in (array, array.astype(array.dtype.newbyteorder(">")) if swapped else array):
        try:
            back = tb.loads(tb.dumps(sent), like="torch")
        except tb.UnsupportedDtype as exc:
            assert name in str(exc) and "like='numpy'" in str(exc)
            assert name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float32", "int64", "uint16")
            continue
        assert isinstance(back, torch.Tensor) and tuple(back.shape) == array.shape
        assert back.view(torch.uint8).numpy().tobytes() == array.tobytes()  # the same bits, native order


def test_a_consumer_with_like_torch_hands_out_torch_tensors_and_counts_what_torch_cannot_hold() -> None:
    with tb.Consumer("memory://torch-like", like="torch") as consumer:
        with tb.Producer("memory://torch-like") as producer:
            producer.send("t", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
            producer.send("np", np.arange(4, dtype=np.int32))  # sent as numpy: received as torch all the same
            producer.send("bundle", {"w": torch.ones(2, 2), "b": np.zeros(2)})
            producer.send("k", np.zeros(3, dtype=np.complex64).astype(">c8"))  # big-endian: converted, not refused
            producer.send("int4", np.zeros(4, dtype=ml_dtypes.int4))  # torch has no int4 of numpy's layout
            producer.send("after", np.ones(2))
        t = consumer.recv("t", timeout=5)
        assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.tolist() == [[0, 1, 2], [3, 4, 5]]
        assert torch.equal(consumer.recv("np", timeout=5), torch.arange(4, dtype=torch.int32))
        bundle = consumer.recv("bundle", timeout=5)
        assert all(isinstance(v, torch.Tensor) for v in bundle.values()) and torch.equal(bundle["w"], torch.ones(2, 2))
        assert isinstance(consumer.recv("k", timeout=5), torch.Tensor)
        assert torch.equal(consumer.recv("after", timeout=5), torch.ones(2, dtype=torch.float64))
        assert consumer.stats["rejected"] == 1  # the int4 tensor: dropped, logged and counted, as documented
    with pytest.raises(tb.ConfigError, match="like must be"):
        tb.Consumer("memory://torch-like-bad", like="jax")
