"""Tensor files: what a format cannot describe is refused (the CLI then writes .tbf), never stored changed."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tensorbus as tb
from tensorbus.files import read_tensor, write_tensor

ML = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "int4", "uint4", "int2"]


@pytest.mark.parametrize("dtype", ML)
@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_numpys_formats_refuse_ml_dtypes_rather_than_store_raw_bytes(tmp_path: Path, dtype: str, suffix: str) -> None:
    array = np.arange(4).astype(getattr(ml_dtypes, dtype))
    with pytest.raises(tb.ConfigError, match=f"{suffix} cannot describe dtype {dtype}"):
        write_tensor(tmp_path / f"x{suffix}", array)
    assert not list(tmp_path.iterdir())  # nothing written, not even a temp file


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16", "int64", "bool"])
def test_safetensors_holds_bfloat16_and_float8_and_reads_them_back(tmp_path: Path, dtype: str) -> None:
    array = np.arange(6).reshape(2, 3).astype(getattr(ml_dtypes, dtype, None) or np.dtype(dtype))
    write_tensor(tmp_path / "x.safetensors", {"w": array})
    back = read_tensor(tmp_path / "x.safetensors")["w"]
    assert back.dtype == array.dtype and back.shape == array.shape and back.tobytes() == array.tobytes()


@pytest.mark.parametrize("dtype", ["int4", "complex128", "float128"])
def test_safetensors_refuses_what_it_cannot_hold_with_a_config_error(tmp_path: Path, dtype: str) -> None:
    array = np.arange(3).astype(getattr(ml_dtypes, dtype, None) or np.dtype(dtype))
    with pytest.raises(tb.ConfigError, match="safetensors cannot hold"):
        write_tensor(tmp_path / "x.safetensors", {"w": array})


def test_numpy_dtypes_still_round_trip_through_npy_and_npz(tmp_path: Path) -> None:
    for array in (np.arange(5, dtype=">i4"), np.ones(3, np.complex64), np.array(True), np.zeros((2, 0))):
        write_tensor(tmp_path / "x.npy", array)
        write_tensor(tmp_path / "x.npz", {"a": array})
        for back in (read_tensor(tmp_path / "x.npy"), read_tensor(tmp_path / "x.npz")["a"]):
            assert back.dtype == array.dtype and back.tobytes() == array.tobytes()


def test_a_nested_structure_is_not_written_as_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(tb.ConfigError, match=r"cannot write a nested structure as a bundle; use \.tbf"):
        write_tensor(tmp_path / "x.npz", {"a": [np.ones(2)]})  # (numpy would pickle the list)
    write_tensor(tmp_path / "x.tbf", {"a": [np.ones(2)], "n": None})
    assert read_tensor(tmp_path / "x.tbf")["n"] is None


SHAPES = {
    "0-d": np.array(2.5, np.float32),
    "empty": np.zeros((0, 3), np.int16),
    "fortran": np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
}


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".safetensors", ".tbf"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_format_keeps_the_shape_exactly(tmp_path: Path, suffix: str, name: str) -> None:
    array = SHAPES[name]
    write_tensor(tmp_path / f"x{suffix}", array)
    back = read_tensor(tmp_path / f"x{suffix}")
    if suffix in (".npz", ".safetensors"):  # (a bundle of one, named "tensor")
        back = back["tensor"]
    assert back.shape == array.shape and back.dtype == array.dtype and np.array_equal(back, array)
