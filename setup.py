"""Builds the optional C fast path of the frame codec; everything else is in pyproject.toml.

The extension is optional: without a C compiler tensorbus installs and runs on its Python path.
Its source hash is compiled in, so a checkout whose _native.c changed after the build notices
(tensorbus/codec/native.py) instead of running a stale binary.
"""

import hashlib
from pathlib import Path

import numpy
from setuptools import Extension, setup

SOURCE = "tensorbus/codec/_native.c"
source_hash = hashlib.sha256(Path(SOURCE).read_bytes()).hexdigest()

setup(
    ext_modules=[
        Extension(
            "tensorbus.codec._native",
            [SOURCE],
            include_dirs=[numpy.get_include()],
            define_macros=[("TENSORBUS_SOURCE_HASH", f'"{source_hash}"')],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
            optional=True,
        )
    ]
)
