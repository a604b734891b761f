"""Tensor files on disk: .npy, .npz, .safetensors and raw tensorbus frames (.tbf), written atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .codec import encode
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
            from safetensors.numpy import load_file

            return load_file(str(path))
        from .codec import loads

        return loads(Path(path).read_bytes(), copy=True)
    except (OSError, TensorBusError):
        raise
    except ModuleNotFoundError as exc:
        raise _needs_package(suffix, exc.name) from None
    except Exception as exc:  # numpy's and safetensors' errors for a corrupt file or an object array
        if "allow_pickle" in str(exc):  # numpy's advice to load it unsafely: tensorbus never does
            exc = ValueError("it holds pickled objects, or is not in numpy's format at all (never unpickled)")
        raise ConfigError(f"cannot read {path} as {suffix}: {exc}") from None


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
    path: str | Path, tensor: Any, *, key: str | None = None, metadata: dict[str, Any] | None = None
) -> None:
    """Write atomically (temp file in the same directory, then rename); a .tbf frame also keeps key and metadata."""
    suffix = _suffix(path)
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent or ".", prefix=f".{target.name}.", suffix=suffix)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as open() would create it: mkstemp makes it private (0600)
        with os.fdopen(fd, "wb") as f:
            if suffix == ".npy":
                np.save(f, _single(tensor, path), allow_pickle=False)
            elif suffix == ".npz":
                np.savez(f, **_bundle(tensor))  # type: ignore[arg-type]  # (the stubs fear a key named allow_pickle)
            elif suffix == ".safetensors":
                from safetensors.numpy import save

                f.write(save({k: np.ascontiguousarray(v) for k, v in _bundle(tensor).items()}))
            else:
                f.writelines(encode(tensor, key=key, metadata=metadata))  # header, then the arrays' own memory
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
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
    if isinstance(tensor, dict):
        return tensor
    if isinstance(tensor, np.ndarray):
        return {"tensor": tensor}
    raise ConfigError(f"cannot write a {type(tensor).__name__} as a bundle; use .tbf")
