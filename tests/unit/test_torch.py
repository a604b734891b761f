"""torch CPU tensors in and out. The test command installs the `torch` extra (PyPI's wheel, CUDA
libraries included, ~3 GB); outside CI a missing torch skips these tests, in CI it fails them."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tensorbus as tb

if os.environ.get("CI") == "true":
    import torch  # CI installs the torch extra: its absence is a failure, not a skip
else:
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")


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


def test_a_torch_sparse_tensor_is_refused_with_the_way_to_send_it() -> None:
    with pytest.raises(tb.UnsupportedDtype, match="SparseTensor"):
        tb.dumps(torch.eye(3).to_sparse())


@pytest.mark.parametrize("name", sorted(tb.codec.dtypes.DTYPES))
def test_every_dtype_the_codec_carries_decodes_as_torch_or_says_why_not(name: str) -> None:
    array = np.arange(6).astype(tb.codec.dtypes.DTYPES[name])
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
