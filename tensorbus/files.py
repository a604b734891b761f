"""Tensor files on disk: .npy, .npz, .safetensors and raw tensorbus frames (.tbf), written atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .codec import encode
from .codec.dtypes import dtype_named
from .errors import ConfigError, TensorBusError

FORMATS = (".npy", ".npz", ".safetensors", ".tbf")


def _suffix(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError(f"cannot tell the format of {path}: use one of {', '.join(FORMATS)}")
    return suffix


def read_tensor(path: str | Path) -> Any:
    """Load a file: .npy gives an array, .npz and .safetensors a dict bundle; never unpickles."""
    suffix = _suffix(path)
    try:
        if suffix == ".npy":
            return np.load(path, allow_pickle=False)
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                return {name: npz[name] for name in npz.files}
        if suffix == ".safetensors":
            return _read_safetensors(Path(path))
        from .codec import loads

        return loads(Path(path).read_bytes(), copy=True)
    except OSError:
        raise
    except TensorBusError as exc:  # a corrupt or truncated .tbf: say which file (the error alone does not)
        raise type(exc)(f"cannot read {path} as {suffix}: {exc}") from None
    except ModuleNotFoundError as exc:
        raise _needs_package(suffix, exc.name) from None
    except Exception as exc:  # numpy's and safetensors' errors for a corrupt file or an object array
        if "allow_pickle" in str(exc):  # numpy's advice to load it unsafely: tensorbus never does
            exc = ValueError("it holds pickled objects, or is not in numpy's format at all (never unpickled)")
        raise ConfigError(f"cannot read {path} as {suffix}: {exc}") from None


#: safetensors dtype names -> numpy dtypes, including what `safetensors.numpy` cannot load (bfloat16, float8)
SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32", "I32": "int32",
    "U64": "uint64", "I64": "int64", "F16": "float16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A .safetensors file as a dict of arrays: the bfloat16 and float8 tensors that `save` writes too."""
    from safetensors import deserialize

    out = {}
    for name, spec in deserialize(path.read_bytes()):
        dtype = dtype_named(SAFETENSORS_DTYPES.get(spec["dtype"], ""))
        if dtype is None:
            raise ConfigError(f"cannot read {path}: tensor {name!r} is of safetensors dtype {spec['dtype']}")
        out[name] = np.frombuffer(spec["data"], dtype.newbyteorder("<")).reshape(spec["shape"])
    return out


def _npy_holds(array: np.ndarray) -> bool:
    """Whether .npy describes the array's dtype so that it comes back the same (not ml_dtypes': raw |V2)."""
    try:
        return bool(np.lib.format.descr_to_dtype(np.lib.format.dtype_to_descr(array.dtype)) == array.dtype)
    except (TypeError, ValueError):  # a descr numpy writes but cannot read back ('<f1' for float8_e5m2)
        return False


def check_writable(path: str | Path, *, bundle: bool = False) -> None:
    """Fail before anything is received if `path` could not be written (format, directory, package)."""
    suffix = _suffix(path)
    if bundle and suffix == ".npy":
        raise ConfigError(f"{path}: .npy holds one array, not a bundle; use .safetensors, .npz or .tbf")
    if Path(path).is_dir():
        raise ConfigError(f"cannot write {path}: it is a directory")
    check_directory(path)
    if suffix == ".safetensors":
        try:
            import safetensors.numpy  # noqa: F401
        except ModuleNotFoundError:
            raise _needs_package(suffix, "safetensors") from None


def check_directory(path: str | Path) -> None:
    """Fail if the directory `path` would be written into does not exist or is not writable."""
    directory = Path(path).parent
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        raise ConfigError(f"cannot write {path}: {directory} is not a writable directory")


def _needs_package(suffix: str, package: str | None) -> ConfigError:
    return ConfigError(f"{suffix} files need the {package} package: pip install 'tensorbus[cli]'")


def write_tensor(
    path: str | Path,
    tensor: Any,
    *,
    key: str | None = None,
    metadata: dict[str, Any] | None = None,
    replace: bool = True,
) -> None:
    """Write atomically (temp file in the same directory, then rename); a .tbf frame also keeps key and metadata.

    With `replace=False` an existing file is never replaced: FileExistsError instead."""
    suffix = _suffix(path)
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent or ".", prefix=f".{target.name}.", suffix=suffix)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as open() would create it: mkstemp makes it private (0600)
        with os.fdopen(fd, "wb") as f:
            if suffix == ".npy":
                np.save(f, _numpy_holds(path, _single(tensor, path)), allow_pickle=False)
            elif suffix == ".npz":
                arrays = {name: _numpy_holds(path, array) for name, array in _bundle(tensor).items()}
                np.savez(f, **arrays)  # type: ignore[arg-type]  # (the stubs fear a key named allow_pickle)
            elif suffix == ".safetensors":
                f.write(_safetensors(path, _bundle(tensor)))
            else:
                f.writelines(encode(tensor, key=key, metadata=metadata))  # header, then the arrays' own memory
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, target)
        else:  # (a link fails where the name exists: no window in which a check could be outraced)
            os.link(tmp, target)
            Path(tmp).unlink()
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _single(tensor: Any, path: str | Path) -> np.ndarray:
    if not isinstance(tensor, np.ndarray):
        raise ConfigError(f"{path}: .npy holds one array, but a {type(tensor).__name__} arrived; use .npz")
    return tensor


def _bundle(tensor: Any) -> dict[str, np.ndarray]:
    if isinstance(tensor, dict) and all(isinstance(v, np.ndarray) for v in tensor.values()):
        return tensor
    if isinstance(tensor, np.ndarray):
        return {"tensor": tensor}
    what = "nested structure" if isinstance(tensor, (dict, list, tuple)) else type(tensor).__name__
    raise ConfigError(f"cannot write a {what} as a bundle; use .tbf")


def _numpy_holds(path: str | Path, array: np.ndarray) -> np.ndarray:
    """`array`, if numpy's format keeps its dtype; else a ConfigError (the caller writes .tbf instead)."""
    if not _npy_holds(array):
        raise ConfigError(
            f"{path}: {Path(path).suffix} cannot describe dtype {array.dtype} (numpy would store raw bytes)"
        )
    return array


def _safetensors(path: str | Path, arrays: dict[str, np.ndarray]) -> bytes:
    """The bytes of a .safetensors file of `arrays`, or a ConfigError for a dtype it cannot hold."""
    from safetensors.numpy import save

    # (not np.ascontiguousarray: it makes a 0-d array 1-d)
    held = {name: np.require(array, requirements="C") for name, array in arrays.items()}
    for array in held.values():
        if array.dtype.name not in SAFETENSORS_DTYPES.values() and array.dtype != bool:
            raise ConfigError(f"{path}: .safetensors cannot hold dtype {array.dtype}")
    try:
        data: bytes = save(held)
    except Exception as exc:  # safetensors' own errors for what it cannot hold
        raise ConfigError(f"{path}: .safetensors cannot hold these tensors: {exc}") from None
    return data
