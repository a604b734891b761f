"""torch CPU tensors in and out, sharing memory with numpy (torch is optional)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..errors import ConfigError, UnsupportedDtype
from . import dtypes

#: ml_dtypes floats whose bits torch reads the same way, under the same name (sub-byte ints differ: torch packs them)
_TORCH_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")


def torch_to_numpy(tensor: Any) -> np.ndarray:
    """View a CPU torch tensor as an ndarray without copying; bfloat16 and float8 go through an int view.

    Conjugate and negative views are materialised first (numpy has no lazy conjugation).
    """
    import torch

    if tensor.device.type != "cpu":
        raise UnsupportedDtype(f"only CPU torch tensors travel; got one on {tensor.device}")
    if tensor.layout != torch.strided:
        raise UnsupportedDtype(
            f"only dense and sparse COO torch tensors travel (or send a tensorbus.SparseTensor); got {tensor.layout}"
        )
    tensor = tensor.detach().resolve_conj().resolve_neg()
    name = str(tensor.dtype).removeprefix("torch.")
    if name in _TORCH_FLOATS and (ml := dtypes.dtype_named(name)) is not None:
        as_int = torch.int8 if tensor.element_size() == 1 else torch.int16
        return tensor.view(as_int).numpy().view(ml)
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError) as exc:
        raise UnsupportedDtype(f"cannot send a torch tensor of {tensor.dtype}: {exc}") from None


def is_torch_sparse(obj: Any) -> bool:
    """Whether `obj` is a torch sparse COO tensor (torch need not be installed: then nothing is one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor) and obj.layout == torch.sparse_coo


def torch_sparse_parts(tensor: Any) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """A torch sparse COO tensor's (indices as (nnz, ndim), values, dense shape): torch keeps its indices as
    (ndim, nnz), tensorbus.SparseTensor one row per value. Coalesced first (duplicates summed), as torch would."""
    tensor = tensor.detach().coalesce()
    if tensor.dense_dim():
        raise UnsupportedDtype(f"a hybrid sparse torch tensor ({tensor.dense_dim()} dense dims) cannot travel")
    return tensor.indices().numpy().T, torch_to_numpy(tensor.values()), tuple(tensor.shape)


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


#: what decoded arrays may come back as
LIKES = ("numpy", "torch")


def check_like(like: object) -> str:
    """Refuse a `like` other than LIKES, and "torch" where torch is not installed, before anything arrives."""
    if like not in LIKES:
        raise ConfigError(f"like must be 'numpy' or 'torch', got {like!r}")
    if like == "torch":
        try:
            import torch  # noqa: F401
        except ModuleNotFoundError:
            raise ConfigError("like='torch' needs torch: pip install 'tensorbus[torch]'") from None
    return str(like)


def to_like(obj: Any, like: str) -> Any:
    """Convert a decoded object's arrays to the requested framework ("numpy" or "torch"); through a
    structure's dicts, lists and tuples too (their depth is bounded when they are decoded)."""
    if like == "numpy":
        return obj
    if like != "torch":
        raise ValueError(f"like must be one of {LIKES}, got {like!r}")
    if isinstance(obj, np.ndarray):
        return numpy_to_torch(obj)
    if hasattr(obj, "dense_shape"):  # a SparseTensor: torch's sparse COO tensor, indices as (ndim, nnz)
        import torch

        indices = torch.from_numpy(np.array(obj.indices.T, np.int64, order="C"))  # (a copy, writable, native)
        return torch.sparse_coo_tensor(indices, numpy_to_torch(obj.values), obj.dense_shape, check_invariants=True)
    if isinstance(obj, dict):
        return {name: to_like(value, like) for name, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [to_like(value, like) for value in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj
