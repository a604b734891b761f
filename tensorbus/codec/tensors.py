"""What a frame's payload holds: ndarrays, sparse COO tensors and named bundles, as a table of entries."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from ..errors import LimitExceeded, MalformedHeader, UnsupportedDtype, brief
from .dtypes import describe, resolve

ALIGN = 64


def align(n: int) -> int:
    """Round `n` up to the next multiple of the 64-byte payload alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class SparseTensor:
    """A COO sparse tensor: `indices` is (nnz, ndim) int64, `values` is (nnz,), `dense_shape` the full shape."""

    indices: np.ndarray
    values: np.ndarray
    dense_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        indices = np.asarray(self.indices)
        values = np.asarray(self.values)
        shape = tuple(int(d) for d in self.dense_shape)
        if indices.ndim != 2 or indices.shape[1] != len(shape):
            raise ValueError(f"indices must have shape (nnz, {len(shape)}), got {indices.shape}")
        if values.ndim != 1 or values.shape[0] != indices.shape[0]:
            raise ValueError(f"values must have shape ({indices.shape[0]},), got {values.shape}")
        if indices.dtype != np.int64:
            indices = indices.astype(np.int64)
        object.__setattr__(self, "indices", indices)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "dense_shape", shape)

    def to_dense(self) -> np.ndarray:
        """Scatter the values into a new dense array (duplicate indices are summed)."""
        dense = np.zeros(self.dense_shape, dtype=self.values.dtype)
        if not self.dense_shape:  # a scalar: every entry (indices of zero columns) names the one element
            dense[()] = self.values.sum(dtype=dense.dtype.newbyteorder("="))  # ufuncs take native order only
        elif self.indices.shape[0]:
            np.add.at(dense, tuple(self.indices.T), self.values)
        return dense

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SparseTensor):
            return NotImplemented
        return (
            self.dense_shape == other.dense_shape
            and np.array_equal(self.indices, other.indices)
            and np.array_equal(self.values, other.values)
        )

    __hash__ = None  # type: ignore[assignment]


Tensor = Union[np.ndarray, SparseTensor, "dict[str, np.ndarray]"]


def _as_array(obj: Any) -> np.ndarray:
    """Accept an ndarray, a numpy scalar, or a CPU torch tensor (shared memory, no copy)."""
    if isinstance(obj, np.ndarray):
        return obj
    if isinstance(obj, np.generic):
        return np.asarray(obj)
    if type(obj).__module__.startswith("torch"):
        from .torch_bridge import torch_to_numpy

        return torch_to_numpy(obj)
    raise UnsupportedDtype(
        f"cannot send {type(obj).__name__}: expected a numpy array, SparseTensor, torch tensor or dict of them"
    )


def _entry(name: str, array: np.ndarray, offset: int) -> tuple[dict[str, Any], np.ndarray]:
    dtype_name, order = describe(array.dtype)
    fortran = array.ndim > 1 and not array.flags.c_contiguous and array.flags.f_contiguous
    if not (array.flags.c_contiguous or fortran):
        array = np.ascontiguousarray(array)  # the one unavoidable copy: strided views
    entry = {
        "name": name,
        "dtype": dtype_name,
        "order": order,
        "shape": list(array.shape),
        "fortran": fortran,
        "offset": offset,
        "nbytes": array.nbytes,
    }
    return entry, array


def flatten(obj: Any) -> tuple[str, dict[str, Any], list[dict[str, Any]], list[np.ndarray]]:
    """Split an object into (kind, extra header fields, table of entries, arrays in payload order)."""
    if isinstance(obj, SparseTensor):
        kind, extra = "sparse", {"dense_shape": list(obj.dense_shape)}
        named = [("indices", obj.indices), ("values", obj.values)]
    elif isinstance(obj, dict):
        kind, extra = "bundle", {}
        for name in obj:
            if not isinstance(name, str):
                raise UnsupportedDtype(f"bundle keys must be str, got {type(name).__name__}")
        named = [(name, _as_array(value)) for name, value in obj.items()]
    else:
        kind, extra = "ndarray", {}
        named = [("", _as_array(obj))]
    entries, arrays, offset = [], [], 0
    for name, array in named:
        entry, array = _entry(name, array, offset)
        entries.append(entry)
        arrays.append(array)
        offset = align(offset + array.nbytes)
    return kind, extra, entries, arrays


def _array(entry: Any, payload: memoryview, max_ndim: int, at: int) -> np.ndarray:
    """The array one table entry describes, a view of `payload`; it must start at `at` (see `rebuild`)."""
    if not isinstance(entry, dict):
        raise MalformedHeader(f"tensor entry must be a map, got {type(entry).__name__}")
    try:
        dtype = resolve(entry["dtype"], entry["order"])
        shape, offset, nbytes, fortran = entry["shape"], entry["offset"], entry["nbytes"], entry["fortran"]
    except KeyError as missing:
        raise MalformedHeader(f"tensor entry lacks field {missing}") from None
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise MalformedHeader(f"shape must be a list of non-negative ints, got {brief(shape)}")
    if len(shape) > max_ndim:
        raise LimitExceeded(f"tensor has {len(shape)} dimensions; the limit is max_ndim={max_ndim}")
    if type(offset) is not int or type(nbytes) is not int:
        raise MalformedHeader(f"offset and nbytes must be ints, got {brief(offset)} and {brief(nbytes)}")
    if type(fortran) is not bool:
        raise MalformedHeader(f"fortran must be true or false, got {brief(fortran)}")
    if offset != at:
        raise MalformedHeader(f"tensor at offset {offset}: tensors follow one another (64-byte aligned) from {at}")
    expected = math.prod(shape) * dtype.itemsize
    if nbytes != expected:
        raise MalformedHeader(f"shape {shape} of {dtype.name} needs {expected} bytes, header says {nbytes}")
    if offset + nbytes > len(payload):
        raise MalformedHeader(f"tensor at offset {offset} needs {nbytes} bytes; the payload holds only {len(payload)}")
    try:
        flat = np.frombuffer(payload, dtype=dtype, count=math.prod(shape), offset=offset)
        return flat.reshape(shape, order="F" if fortran is True else "C")
    except ValueError as exc:  # e.g. [0, 2**63]: no bytes, but dimensions numpy cannot represent
        raise MalformedHeader(f"shape {shape} of {dtype.name} is not one numpy can build: {exc}") from None


def _sparse(indices: np.ndarray, values: np.ndarray, dense_shape: Any, max_ndim: int) -> SparseTensor:
    """The received COO tensor, indices int64 and inside `dense_shape`: `to_dense` cannot fail or misplace values."""
    if not isinstance(dense_shape, list) or not all(type(d) is int and 0 <= d < 1 << 63 for d in dense_shape):
        raise MalformedHeader(f"sparse dense_shape must be a list of non-negative int64s, got {brief(dense_shape)}")
    if len(dense_shape) > max_ndim:
        raise LimitExceeded(f"sparse tensor has {len(dense_shape)} dimensions; the limit is max_ndim={max_ndim}")
    if not (indices.dtype.kind == "i" and indices.dtype.itemsize == 8):  # either byte order: the sender's
        raise MalformedHeader(f"sparse indices must be int64, got {indices.dtype}")
    try:
        tensor = SparseTensor(indices, values, tuple(dense_shape))  # checks the shapes agree
    except ValueError as exc:
        raise MalformedHeader(f"inconsistent sparse tensor: {exc}") from None
    if tensor.indices.size and ((tensor.indices < 0).any() or (tensor.indices >= tensor.dense_shape).any()):
        raise MalformedHeader(f"sparse indices fall outside dense_shape {dense_shape}")
    return tensor


def rebuild(header: dict[str, Any], payload: memoryview, *, copy: bool, max_ndim: int) -> Any:
    """Turn a validated header and its payload back into the object that was sent."""
    kind, entries = header.get("kind"), header.get("tensors")
    if not isinstance(entries, list):
        raise MalformedHeader("header has no 'tensors' list")
    arrays: list[np.ndarray] = []
    end = 0
    for entry in entries:  # back to back, as `flatten` lays them out: no overlap, no unreferenced bytes
        arrays.append(_array(entry, payload, max_ndim, at=align(end)))
        end = entry["offset"] + arrays[-1].nbytes
    if end != len(payload):
        raise MalformedHeader(f"the tensors cover {end} bytes of a {len(payload)}-byte payload")
    if copy:
        arrays = [np.array(a, order="K") for a in arrays]
    if kind == "ndarray" and len(arrays) == 1:
        return arrays[0]
    if kind == "bundle":
        names = [entry.get("name") for entry in entries]
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise MalformedHeader("bundle entry names must be distinct strings")
        return dict(zip(names, arrays, strict=False))
    if kind == "sparse" and len(arrays) == 2:
        return _sparse(arrays[0], arrays[1], header.get("dense_shape"), max_ndim)
    raise MalformedHeader(f"payload kind {brief(kind)} with {len(arrays)} tensors is not one this build knows")
