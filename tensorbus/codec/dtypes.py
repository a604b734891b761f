"""The dtypes a frame may carry, by name: a closed whitelist, so nothing is ever unpickled."""

from __future__ import annotations

import functools
import sys

import ml_dtypes
import numpy as np

from ..errors import UnsupportedDtype, brief

NUMPY_DTYPE_NAMES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    np.dtype(np.longdouble).name,
    np.dtype(np.clongdouble).name,
]
ML_DTYPE_NAMES = [
    "bfloat16",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e4m3b11fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
    "int2",
    "int4",
    "uint2",
    "uint4",
]

#: name -> native-order dtype; the only dtypes a decoder will build.
DTYPES: dict[str, np.dtype] = {name: np.dtype(name) for name in dict.fromkeys(NUMPY_DTYPE_NAMES)}
DTYPES.update({name: np.dtype(getattr(ml_dtypes, name)) for name in ML_DTYPE_NAMES if hasattr(ml_dtypes, name)})

NATIVE_ORDER = "<" if sys.byteorder == "little" else ">"


@functools.lru_cache(maxsize=256)
def describe(dtype: np.dtype) -> tuple[str, str]:
    """Return (name, byte order) for a dtype that may travel, or raise `UnsupportedDtype`."""
    name = dtype.name
    if DTYPES.get(name) is None or dtype.fields is not None or dtype.subdtype is not None:
        raise UnsupportedDtype(
            f"dtype {dtype!s} cannot be sent: only numeric, bool and ml_dtypes dtypes travel "
            "(object, structured and void dtypes would need pickling)"
        )
    order: str = dtype.byteorder
    if order == "=":
        order = NATIVE_ORDER
    if dtype.kind == "V" and dtype.itemsize > 1 and order != NATIVE_ORDER:  # what `resolve` could not rebuild
        raise UnsupportedDtype(f"a byte-swapped {name} array cannot be sent: ml_dtypes have native order only")
    return name, order


def resolve(name: object, order: object) -> np.dtype:
    """Build the dtype a header names, refusing anything outside the whitelist."""
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise UnsupportedDtype(f"frame names dtype {brief(name)}, which this build does not know")
    if order not in ("<", ">", "|"):
        raise UnsupportedDtype(f"frame names byte order {brief(order)}; expected '<', '>' or '|'")
    if dtype.itemsize > 1 and order != NATIVE_ORDER:
        if dtype.kind == "V":  # ml_dtypes have no byte-swapped variant
            raise UnsupportedDtype(f"dtype {name} arrives in byte order {order!r}, which numpy cannot hold")
        return dtype.newbyteorder(order)
    return dtype
