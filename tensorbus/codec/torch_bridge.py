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


#: ml_dtypes floats whose bits torch reads the same way, under the same name (sub-byte ints differ: torch packs them)
_TORCH_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")


def numpy_to_torch(array: np.ndarray) -> Any:
    """Wrap an ndarray as a torch tensor sharing its memory (read-only and big-endian arrays are copied).

    Raises `UnsupportedDtype` for dtypes torch has no exact counterpart of (decode with like="numpy").
    """
    import torch

    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    elif not array.flags.writeable:
        array = array.copy()
    name = array.dtype.name
    if name in _TORCH_FLOATS and hasattr(torch, name):
        return torch.from_numpy(array.view(f"i{array.dtype.itemsize}")).view(getattr(torch, name))
    try:
        return torch.from_numpy(array)
    except TypeError:
        raise UnsupportedDtype(f"torch has no dtype for {name}; decode with like='numpy'") from None


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
