"""buffers.aligned for `bytes` (a broker client's record): its C path (`codec/_native.c`) and its Python path give
the same bytes, at a multiple of ALIGN, in a buffer of their own."""

from __future__ import annotations

import os

import pytest

from tensorbus import buffers
from tensorbus.buffers import ALIGN, address, aligned
from tests.conftest import require_native

#: record values of every length around a few alignments, and the sizes a 4 KB tensor's frame has
VALUES = [os.urandom(n) for n in (*range(0, 130), 4095, 4096, 4200, 65_600, 1 << 20)]


def python_aligned(data: bytes) -> memoryview:
    """`aligned` on its Python path (the C one set aside for the call)."""
    saved, buffers._ALIGNED_COPY = buffers._ALIGNED_COPY, None
    try:
        return aligned(data)
    finally:
        buffers._ALIGNED_COPY = saved


@pytest.mark.parametrize("path", ["native", "python"])
def test_a_record_comes_out_whole_and_aligned(path: str) -> None:
    if path == "native":
        require_native(buffers._ALIGNED_COPY is not None, "the aligned copy (tensorbus/codec/_native.c)")
    copy = aligned if path == "native" else python_aligned
    for value in VALUES:
        view = copy(value)
        assert isinstance(view, memoryview) and view.format == "B" and view.ndim == 1
        assert view.tobytes() == value
        if value:
            assert address(view) % ALIGN == 0
        if view.readonly:  # (the record's own bytes, where they were aligned already: nothing copied)
            assert view.obj is value
        else:  # a copy: writing to it leaves the record as it was
            view[0] ^= 0xFF
            assert view[0] != value[0]


def test_the_c_copy_agrees_with_buffers_on_the_alignment() -> None:
    require_native(buffers._ALIGNED_COPY is not None, "the aligned copy (tensorbus/codec/_native.c)")
    from tensorbus.codec.native import NATIVE

    assert NATIVE is not None and NATIVE.ALIGN == ALIGN
    with pytest.raises(TypeError, match="bytes"):
        NATIVE.aligned_copy(bytearray(b"frame"))


def test_buffers_other_than_bytes_and_pooled_copies_take_the_python_path() -> None:
    data = bytearray(os.urandom(4200))
    view = aligned(data)
    assert view.tobytes() == bytes(data) and address(view) % ALIGN == 0
    pool = buffers.BufferPool()
    pooled = aligned(os.urandom(4200), pool)
    assert address(pooled) % ALIGN == 0
