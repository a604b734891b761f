"""torch CPU tensors in and out, sharing memory with numpy (torch is optional)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ..errors import UnsupportedDtype


def torch_to_numpy(tensor: Any) -> np.ndarray:
    """View a CPU torch tensor as an ndarray without copying; bfloat16 goes through an int16 view."""
    import torch

    if tensor.device.type != "cpu":
        raise UnsupportedDtype(f"only CPU torch tensors travel; got one on {tensor.device}")
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def numpy_to_torch(array: np.ndarray) -> Any:
    """Wrap an ndarray as a torch tensor sharing its memory (read-only arrays are copied)."""
    import torch

    if not array.flags.writeable:
        array = array.copy()
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_like(obj: Any, like: str) -> Any:
    """Convert a decoded object's arrays to the requested framework ("numpy" or "torch")."""
    if like == "numpy":
        return obj
    if like != "torch":
        raise ValueError(f"like must be 'numpy' or 'torch', got {like!r}")
    if isinstance(obj, dict):
        return {name: numpy_to_torch(a) for name, a in obj.items()}
    if isinstance(obj, np.ndarray):
        return numpy_to_torch(obj)
    return obj
