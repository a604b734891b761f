"""torch CPU tensors in and out (runs where the `torch` extra is installed; CI does not install it,
because PyPI carries no CPU-only torch wheel and the CUDA one pulls gigabytes)."""

from __future__ import annotations

import numpy as np
import pytest

import tensorbus as tb

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
