"""What a frame's payload holds: ndarrays, sparse COO tensors, named bundles and nested structures of
them, as a table of entries (the arrays, in payload order) and, for a structure, a tree that places them."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from ..errors import InvalidTensor, LimitExceeded, MalformedHeader, UnsupportedDtype, brief
from .dtypes import describe, resolve

ALIGN = 64
#: how deeply a structure may nest (a container in a container counts two levels), sent or received
MAX_TREE_DEPTH = 32
#: how many containers and leaves a structure may hold, sent or received
MAX_TREE_ENTRIES = 1 << 18
#: the Python scalars a structure may hold as leaves (exactly these types: they come back as themselves)
SCALARS = (type(None), bool, int, float, str)
_MASKED = np.ma.MaskedArray


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
            raise InvalidTensor(f"indices must have shape (nnz, {len(shape)}), got {indices.shape}")
        if values.ndim != 1 or values.shape[0] != indices.shape[0]:
            raise InvalidTensor(f"values must have shape ({indices.shape[0]},), got {values.shape}")
        if indices.dtype != np.int64:
            if indices.size and indices.dtype.kind not in "iu":
                raise InvalidTensor(f"indices must be integers, got {indices.dtype}")
            indices = indices.astype(np.int64)
        object.__setattr__(self, "indices", indices)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "dense_shape", shape)
        _checked(self)

    def outside(self) -> bool:
        """Whether an index lies outside `dense_shape` (each receiver refuses such a tensor)."""
        indices = self.indices
        return bool(indices.size) and bool((indices < 0).any() or (indices >= self.dense_shape).any())

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


def _checked(sparse: SparseTensor, where: str = "") -> SparseTensor:
    """`sparse`, checked again when sent: its arrays may have been written to since it was made."""
    if sparse.outside():
        raise InvalidTensor(f"sparse indices{where} fall outside dense_shape {sparse.dense_shape}")
    return sparse


Tensor = Union[np.ndarray, SparseTensor, "dict[str, np.ndarray]", "dict[Any, Any]", "list[Any]", "tuple[Any, ...]"]

#: what the error for an object that cannot travel says can
TRAVELS = (
    "a numpy array, SparseTensor or torch tensor, or a dict (str or int keys), list or tuple "
    "nesting them with int, float, str, bool and None"
)


def _is_torch(obj: Any) -> bool:
    """Whether `obj` is a torch tensor (torch need not be installed: then nothing is one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _as_array(obj: Any, where: str = "") -> np.ndarray:
    """Accept an ndarray, a numpy scalar, or a CPU torch tensor (shared memory, no copy)."""
    if isinstance(obj, np.ndarray):
        if isinstance(obj, _MASKED):  # its .data is the unmasked array: the mask would be lost
            raise InvalidTensor(
                f"cannot send a masked array{where}: the mask would be lost; send its parts, "
                "e.g. {'data': a.filled(0), 'mask': np.ma.getmaskarray(a)}"
            )
        return obj
    if isinstance(obj, np.generic):
        return np.asarray(obj)
    if _is_torch(obj):
        from .torch_bridge import torch_to_numpy

        return torch_to_numpy(obj)
    if type(obj) in SCALARS and not where:  # the one rule for scalars: docs/FORMAT.md, "Scalars"
        raise UnsupportedDtype(
            f"cannot send {_a(type(obj).__name__)} on its own: a Python scalar travels inside a structure "
            f"(e.g. {{'value': {brief(obj)}}}, back as itself) or as a numpy scalar (np.asarray(x), back as a "
            "0-d array)"
        )
    raise UnsupportedDtype(f"cannot send {_a(type(obj).__name__)}{where}: what travels is {TRAVELS}")


def _a(noun: str) -> str:
    """`noun` with its indefinite article ("an int", "a float")."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _from_torch_sparse(obj: Any) -> Any:
    """A torch sparse COO tensor as a SparseTensor; anything else as it is."""
    if not _is_torch(obj):
        return obj
    from .torch_bridge import is_torch_sparse, torch_sparse_parts

    return SparseTensor(*torch_sparse_parts(obj)) if is_torch_sparse(obj) else obj


def _is_bundle(obj: dict[Any, Any]) -> bool:
    """A flat dict of str -> array (the common case, kept as the "bundle" kind), not a nested structure."""
    for name, value in obj.items():
        if type(name) is not str or not (isinstance(value, (np.ndarray, np.generic)) or _is_torch(value)):
            return False
        if _is_torch(value) and value.layout != sys.modules["torch"].strided:  # sparse: a structure's leaf
            return False
        if isinstance(value, _MASKED):  # (refused, with its place named, by the structure's writer)
            return False
    return True


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
    named: list[tuple[str, np.ndarray]]
    obj = _from_torch_sparse(obj)
    if isinstance(obj, SparseTensor):
        kind, extra = "sparse", {"dense_shape": list(obj.dense_shape)}
        named = [("indices", _checked(obj).indices), ("values", obj.values)]
    elif isinstance(obj, dict) and _is_bundle(obj):
        kind, extra = "bundle", {}
        named = [(name, _as_array(value)) for name, value in obj.items()]
    elif isinstance(obj, (dict, list, tuple)):
        kind, named = "tree", []
        extra = {"tree": _TreeWriter(named).node(obj, "", 1)}
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


class _TreeWriter:
    """Turns a nested structure into its tree (see docs/FORMAT.md), collecting its arrays in payload order."""

    def __init__(self, named: list[tuple[str, np.ndarray]]) -> None:
        self.named, self.entries = named, 0

    def node(self, obj: Any, path: str, depth: int) -> Any:
        """The tree node of `obj`, found at `path` (for error messages and entry names)."""
        self.entries += 1
        if self.entries > MAX_TREE_ENTRIES:
            raise LimitExceeded(f"the structure holds more than {MAX_TREE_ENTRIES} entries, the limit")
        kind = type(obj)
        if kind in SCALARS:
            return _fits(obj, path)
        if isinstance(obj, (dict, list, tuple)):
            if depth > MAX_TREE_DEPTH:
                raise LimitExceeded(f"the structure nests deeper than {MAX_TREE_DEPTH} levels (at {path})")
            if isinstance(obj, dict):
                node: list[Any] = ["dict"]
                for name, value in obj.items():
                    if type(name) not in (str, int):
                        raise InvalidTensor(
                            f"dict key {brief(name)} at {path or 'the top'} is a {type(name).__name__}: "
                            "keys must be str or int"
                        )
                    node += [_fits(name, path), self.node(value, f"{path}/{name}", depth + 1)]
                return node
            if kind is not list and kind is not tuple:  # e.g. a namedtuple: its class cannot travel
                raise InvalidTensor(
                    f"cannot send {_a(kind.__name__)} at {path or 'the top'}: only plain lists and tuples "
                    "travel (convert it, e.g. with tuple(x) or x._asdict())"
                )
            return ["list" if kind is list else "tuple"] + [
                self.node(value, f"{path}/{i}", depth + 1) for i, value in enumerate(obj)
            ]
        obj = _from_torch_sparse(obj)
        if isinstance(obj, SparseTensor):
            self.named += [(f"{path}/indices", _checked(obj, f" at {path}").indices), (f"{path}/values", obj.values)]
            return ["sparse", list(obj.dense_shape)]
        self.named.append((path, _as_array(obj, f" at {path}")))
        return ["tensor"]


def _fits(value: Any, path: str) -> Any:
    """`value`, unless it is an int msgpack cannot hold (it holds 64 bits, signed or unsigned)."""
    if type(value) is int and not -(1 << 63) <= value < 1 << 64:
        raise InvalidTensor(f"int {brief(value)} at {path or 'the top'} does not fit in 64 bits")
    return value


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
        return SparseTensor(indices, values, tuple(dense_shape))  # checks the shapes agree, the indices in range
    except ValueError as exc:
        raise MalformedHeader(f"inconsistent sparse tensor: {exc}") from None


class _TreeReader:
    """Rebuilds a received structure from its tree, placing the arrays in table order; checks every node."""

    def __init__(self, arrays: list[np.ndarray], max_ndim: int, max_depth: int, max_entries: int) -> None:
        self.arrays, self.next = arrays, 0
        self.max_ndim, self.max_depth, self.max_entries = max_ndim, max_depth, max_entries
        self.entries = 0

    def take(self) -> np.ndarray:
        if self.next >= len(self.arrays):
            raise MalformedHeader(f"the tree places more tensors than the table's {len(self.arrays)}")
        self.next += 1
        return self.arrays[self.next - 1]

    def node(self, node: Any, depth: int) -> Any:
        self.entries += 1
        if self.entries > self.max_entries:
            raise LimitExceeded(f"the structure holds more than {self.max_entries} entries, the limit")
        if type(node) in SCALARS:
            return node
        if type(node) is not list or not node or type(node[0]) is not str:
            raise MalformedHeader(f"tree node must be a scalar or a tagged list, got {brief(node)}")
        tag, rest = node[0], node[1:]
        if tag == "tensor" and not rest:
            return self.take()
        if tag == "sparse" and len(rest) == 1:
            indices = self.take()
            return _sparse(indices, self.take(), rest[0], self.max_ndim)
        if tag not in ("dict", "list", "tuple"):
            raise MalformedHeader(f"tree node {brief(node)} is not one this build knows")
        if depth > self.max_depth:
            raise LimitExceeded(f"the structure nests deeper than max_tree_depth={self.max_depth}")
        if tag != "dict":
            items = [self.node(value, depth + 1) for value in rest]
            return items if tag == "list" else tuple(items)
        if len(rest) % 2:
            raise MalformedHeader("a dict node holds keys and values in pairs: its length is odd")
        out: dict[str | int, Any] = {}
        for i in range(0, len(rest), 2):
            name = rest[i]
            if type(name) not in (str, int) or name in out:
                raise MalformedHeader(f"dict keys must be distinct strs or ints, got {brief(name)}")
            out[name] = self.node(rest[i + 1], depth + 1)
        return out


def rebuild(
    header: dict[str, Any],
    payload: memoryview,
    *,
    copy: bool,
    max_ndim: int,
    max_tree_depth: int = MAX_TREE_DEPTH,
    max_tree_entries: int = MAX_TREE_ENTRIES,
) -> tuple[Any, int]:
    """Turn a validated header and its payload back into the object that was sent; also how many
    entries its structure holds (0 unless a structure), which a consumer's buffer limit counts."""
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
        return arrays[0], 0
    if kind == "bundle":
        names = [entry.get("name") for entry in entries]
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise MalformedHeader("bundle entry names must be distinct strings")
        return dict(zip(names, arrays, strict=False)), 0
    if kind == "sparse" and len(arrays) == 2:
        return _sparse(arrays[0], arrays[1], header.get("dense_shape"), max_ndim), 0
    if kind == "tree":
        reader = _TreeReader(arrays, max_ndim, max_tree_depth, max_tree_entries)
        tree = reader.node(header.get("tree"), 1)
        if type(tree) not in (dict, list, tuple):
            raise MalformedHeader(f"a structure's top must be a dict, list or tuple, got {brief(tree)}")
        if reader.next != len(arrays):
            raise MalformedHeader(f"the tree places {reader.next} of the table's {len(arrays)} tensors")
        return tree, reader.entries
    raise MalformedHeader(f"payload kind {brief(kind)} with {len(arrays)} tensors is not one this build knows")
