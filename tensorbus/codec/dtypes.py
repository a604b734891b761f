"""The dtypes a frame may carry, by name: a closed whitelist, so nothing is ever unpickled."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable

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

#: name -> native-order dtype; the only dtypes a decoder will build. numpy's from the start, ml_dtypes' from the
#: first use of one of their names (`_with_ml_dtypes`): ml_dtypes 0.7's import takes most of a process's start
#: (docs/PERFORMANCE.md), which a process that never meets one of its dtypes should not pay. Replaced whole, never
#: changed in place (readers take no lock).
_whitelist: dict[str, np.dtype] = {name: np.dtype(name) for name in dict.fromkeys(NUMPY_DTYPE_NAMES)}
_ml_lock = threading.Lock()  # (one thread imports ml_dtypes and widens the whitelist; the others wait for it)
_ml_loaded = False  # (set after `_whitelist` holds them)
_widened: list[Callable[[], None]] = []  # called once ml_dtypes' dtypes joined the whitelist


def dtype_named(name: str) -> np.dtype | None:
    """The native-order dtype of that name if it may travel, else None (an ml_dtypes name imports ml_dtypes)."""
    dtype = _whitelist.get(name)
    if dtype is None and name in ML_DTYPE_NAMES:
        dtype = _with_ml_dtypes().get(name)
    return dtype


def whitelist() -> dict[str, np.dtype]:
    """Every dtype that may travel, by name (ml_dtypes' included: it imports ml_dtypes)."""
    return _with_ml_dtypes()


def loaded_whitelist() -> dict[str, np.dtype]:
    """The dtypes that may travel that are known so far, without importing ml_dtypes (the C codec's table)."""
    return _whitelist


def when_widened(callback: Callable[[], None]) -> None:
    """Call `callback` each time ml_dtypes' dtypes join the whitelist (the C codec's table follows it)."""
    _widened.append(callback)


def _with_ml_dtypes() -> dict[str, np.dtype]:
    """The whitelist with ml_dtypes' dtypes in it, importing ml_dtypes the first time."""
    global _whitelist, _ml_loaded
    if _ml_loaded:
        return _whitelist
    with _ml_lock:
        if not _ml_loaded:
            import ml_dtypes

            ml = {name: np.dtype(getattr(ml_dtypes, name)) for name in ML_DTYPE_NAMES if hasattr(ml_dtypes, name)}
            _whitelist = {**_whitelist, **ml}
            _ml_loaded = True
            for callback in _widened:
                callback()
    return _whitelist


NATIVE_ORDER = "<" if sys.byteorder == "little" else ">"


@functools.lru_cache(maxsize=256)
def describe(dtype: np.dtype) -> tuple[str, str]:
    """Return (name, byte order) for a dtype that may travel, or raise `UnsupportedDtype`."""
    name = dtype.name
    if dtype_named(name) is None or dtype.fields is not None or dtype.subdtype is not None:
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
    dtype = dtype_named(name) if isinstance(name, str) else None
    if dtype is None:
        raise UnsupportedDtype(f"frame names dtype {brief(name)}, which this build does not know")
    if order not in ("<", ">", "|"):
        raise UnsupportedDtype(f"frame names byte order {brief(order)}; expected '<', '>' or '|'")
    if dtype.itemsize > 1 and order != NATIVE_ORDER:
        if dtype.kind == "V":  # ml_dtypes have no byte-swapped variant
            raise UnsupportedDtype(f"dtype {name} arrives in byte order {order!r}, which numpy cannot hold")
        return dtype.newbyteorder(order)
    return dtype
