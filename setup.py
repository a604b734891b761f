"""Builds the optional C fast paths (the codec's, the stream sockets', shm://'s ring and frame views, the
intake's, the aligned copy's); the rest is in pyproject.toml.

Each is optional: without a C compiler tensorbus installs and runs on its Python paths.
Each has its source's hash compiled in (its .c and the header the extensions share), so a checkout
whose C changed after the build notices (tensorbus/codec/native.py) instead of running a stale binary.
"""

import hashlib
from pathlib import Path

import numpy
from setuptools import Extension, setup

ROOT = Path(__file__).parent
#: the frame format's constants and loads, shared by the extensions (codec/_frame.h)
HEADER = "tensorbus/codec/_frame.h"
FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]


def extension(name: str, **options: object) -> Extension:
    """An optional C extension of tensorbus, with the hash of its source compiled in."""
    source = name.replace(".", "/") + ".c"
    source_hash = hashlib.sha256((ROOT / source).read_bytes() + (ROOT / HEADER).read_bytes()).hexdigest()
    return Extension(
        name,
        [source],
        depends=[HEADER],
        define_macros=[("TENSORBUS_SOURCE_HASH", f'"{source_hash}"')],
        extra_compile_args=FLAGS,
        optional=True,
        **options,  # type: ignore[arg-type]
    )


setup(
    ext_modules=[
        extension("tensorbus.codec._native", include_dirs=[numpy.get_include()]),
        extension("tensorbus.codec._crc"),
        extension("tensorbus.transports._stream"),
        extension("tensorbus.transports._shm"),
        extension("tensorbus._intake"),
    ]
)
