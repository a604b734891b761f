"""Receive buffers: 64-byte aligned, and the large ones pooled and reused once nothing references them.

A frame puts every tensor at a multiple of 64 bytes from its start, so a frame received into a
buffer that starts at a multiple of 64 gives arrays that do too (what SIMD loads and some
libraries want). Fresh memory is slow on VMs (the first touch of new pages; docs/PERFORMANCE.md),
so a stream reader that allocates a new 256 MB buffer per tensor loses most of its speed.
Delivered tensors are views of the buffer; a buffer is free again when its reference count says
no view is alive.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

#: buffers at least this large are pooled, `max_buffers` of them
POOLED_FROM = 1 << 20
#: buffers from this size (up to POOLED_FROM) are kept for reuse too, RECYCLED_BYTES of them in all: freed
#: and allocated in turn, they have glibc hand the top of its heap back and fault it in again (a stream of
#: 64 KB tensors: 5-8 page faults and ~15 µs of a consumer's CPU each on the 2-vCPU VM, docs/PERFORMANCE.md);
#: smaller ones are cheap to allocate
RECYCLED_FROM = 32 << 10
RECYCLED_BYTES = 1 << 20
#: the most a pool that asks for more (a socket consumer's: a reader's run, `ack_every_bytes`) keeps of them
RECYCLED_AT_MOST = 8 << 20
#: where receive buffers start: the frame's payload alignment (`codec.tensors.ALIGN`, which a test holds equal)
ALIGN = 64
#: numpy asks for transparent huge pages from this size (`madvise(MADV_HUGEPAGE)`); a pool with `huge_pages`
#: off maps its buffers of this size and up without them (see `small_pages_empty`)
HUGE_PAGES_FROM = 4 << 20


def address(data: bytes | bytearray | memoryview) -> int:
    """The address of a buffer's first byte."""
    view = memoryview(data)
    if not view.readonly and view.nbytes:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])


def aligned_empty(n: int, huge_pages: bool = True) -> np.ndarray:
    """`n` uninitialised bytes starting at a multiple of ALIGN (numpy's own start at a multiple of 16); with
    `huge_pages` False and n from HUGE_PAGES_FROM, in pages of the base size (`small_pages_empty`)."""
    if not huge_pages and n >= HUGE_PAGES_FROM and hasattr(mmap, "MADV_NOHUGEPAGE"):
        return small_pages_empty(n)
    raw = np.empty(n + ALIGN, np.uint8)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % ALIGN  # type: ignore[arg-type]  # (`address` less its checks)
    return raw[start : start + n]


def small_pages_empty(n: int) -> np.ndarray:
    """`n` bytes of fresh anonymous memory (page-aligned, so at a multiple of ALIGN), never backed by transparent
    huge pages: a receive into memory numpy asked them for faults in and zeroes 2 MiB at a time, and the slowest
    1 MiB read of a large frame took 6-9 ms of the reading thread against 1-2 in base pages (docs/PERFORMANCE.md,
    2026-12-02). Unmapped once no array views it."""
    region = mmap.mmap(-1, n)
    region.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(region, np.uint8)


class Releaser:
    """Drops buffers on a thread of its own, `tensorbus-release` (started at the first): unmapping 256 MB of base
    pages (`small_pages_empty`) takes the thread that drops the last reference 54-68 ms on the 2-vCPU VM, an
    event loop's pool evicting one would stand still that long (docs/PERFORMANCE.md, 2026-12-02)."""

    def __init__(self) -> None:
        self._pending: list[np.ndarray] = []
        self._wake = threading.Condition()  # (guards `_pending` and `_running`)
        self._running = False

    def release(self, held: list[np.ndarray]) -> None:
        """Take the buffers out of `held`, which holds the caller's only references to them, and drop them on the
        releasing thread: with no reference left to the caller, the unmap is never the caller's. Where no thread
        can start, they are dropped here (and said so)."""
        with self._wake:
            self._pending.extend(held)
            held.clear()
            if not self._running:
                try:
                    threading.Thread(target=self._run, daemon=True, name="tensorbus-release").start()
                except RuntimeError as exc:  # (no thread to be had)
                    log.warning("no thread to release buffers on (%s): the thread letting them go unmaps them", exc)
                    self._pending.clear()
                    return
                self._running = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending:
                    self._wake.wait()
                dropping, self._pending = self._pending, []
            dropping.clear()  # (here, outside the lock: the unmap)

    def forked(self) -> None:
        """In a forked child: the thread is not there; the next release starts one."""
        self._pending, self._wake, self._running = [], threading.Condition(), False


#: the process's one releasing thread's owner
RELEASER = Releaser()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=RELEASER.forked)


#: copies of this many bytes or more are made by numpy, which lets go of the interpreter lock while it copies: a
#: memoryview's slice assignment holds it (256 MB held another thread, an event loop's, ~35 ms on the 2-vCPU VM,
#: and 128 MB into fresh pages 0.1-0.4 s; numpy's held it 1-2 ms)
COPY_LETS_GO_FROM = 1 << 20


def copy_into(target: memoryview, source: bytes | bytearray | memoryview) -> None:
    """Copy `source` into `target` (of the same length), letting other threads run meanwhile when it is large."""
    if len(target) >= COPY_LETS_GO_FROM:
        np.copyto(np.frombuffer(target, np.uint8), np.frombuffer(source, np.uint8))
    else:
        target[:] = source


def aligned(data: bytes | bytearray | memoryview, pool: BufferPool | None = None) -> memoryview:
    """`data` itself where it starts at a multiple of ALIGN, else a copy that does (into `pool`'s buffers).

    For frames that arrive as `bytes` (the broker clients'), whose data starts 32 bytes into the object:
    those without a pool are copied in C where it is built (`codec/_native.c`, a tenth of the time).
    """
    if _ALIGNED_COPY is not None and pool is None and type(data) is bytes:
        return _ALIGNED_COPY(data)
    view = memoryview(data).cast("B")
    if not view.nbytes or address(view) % ALIGN == 0:
        return view
    copy = pool.take(view.nbytes) if pool is not None else aligned_empty(view.nbytes).data
    copy_into(copy, view)
    return copy


class BufferPool:
    """Hands out writable, 64-byte aligned buffers of `n` bytes; buffers >= 1 MiB are pooled and reused
    (`max_buffers` of them), and those from RECYCLED_FROM up to `recycled_bytes` in all. A buffer reused
    goes to the back of its list, so the front is the one used longest ago (the likeliest free)."""

    def __init__(self, max_buffers: int = 4, recycled_bytes: int = RECYCLED_BYTES) -> None:
        self.max_buffers = max_buffers
        self.recycled_bytes = recycled_bytes
        #: whether new buffers may be backed by transparent huge pages (off for a consumer read on an event
        #: loop: `aligned_empty`, and then a large buffer evicted is dropped by the `RELEASER`); set by its
        #: `Reactor` as it is made, before any buffer is taken
        self.huge_pages = True
        self._buffers: list[np.ndarray] = []  # from POOLED_FROM
        self._recycled: list[np.ndarray] = []  # from RECYCLED_FROM, below POOLED_FROM
        self._recycled_bytes = 0
        self._other_free = False  # (what the last `_free` saw, under `_lock`)
        self._more, self._more_up_to = 0, 0  # `keep_more`'s (under `_lock`)
        self._lock = threading.Lock()
        self.reused = 0

    def keep_more(self, count: int, each_at_most: int) -> None:
        """Keep `count` more buffers of 1 MiB up to `each_at_most` bytes (a reader that runs that many frames
        ahead of its receives): at most `count * each_at_most` bytes more than `max_buffers` keep."""
        with self._lock:
            self._more, self._more_up_to = count, each_at_most

    def take(self, n: int) -> memoryview:
        """A buffer of exactly `n` bytes (a view of a pooled one when a free one fits)."""
        try:
            return self._take(n)
        except ValueError:  # numpy's "array is too big": a size no memory could hold
            raise MemoryError(f"no buffer of {n} bytes") from None

    def take_free(self, n: int) -> memoryview | None:
        """A pooled buffer of exactly `n` bytes if a free one fits, else None: memory the pool holds already
        (the reassembler fills one from a message's first chunk, as that reserves nothing new)."""
        if n < POOLED_FROM:
            return None
        with self._lock:
            return self._free(n)

    def _free(self, n: int, buffers: list[np.ndarray] | None = None) -> memoryview | None:
        """The first free kept buffer from n to 2n bytes, moved to the back; None if none is (and then
        `_other_free` says whether a free one of another size was passed)."""
        kept = self._buffers if buffers is None else buffers
        self._other_free = False
        for index in range(len(kept)):  # (not `enumerate`: its tuple would hold a reference more)
            base = kept[index]
            # references: the list, `base`, and getrefcount's own argument; any more is a live view
            if sys.getrefcount(base) <= 3:
                if n <= len(base) <= 2 * n:
                    self.reused += 1
                    if index < len(kept) - 1:
                        kept.append(kept.pop(index))
                    return base.data[:n]
                self._other_free = True
        return None

    def _take(self, n: int) -> memoryview:
        if n < RECYCLED_FROM:
            return aligned_empty(n).data  # not zero-filled: every byte is about to be received
        if n < POOLED_FROM:
            return self._recycle(n)
        with self._lock:
            reused = self._free(n)
            if reused is not None:
                return reused
            base = aligned_empty(n, self.huge_pages)
            kept = self.max_buffers + (self._more if n <= self._more_up_to else 0)
            if len(self._buffers) >= kept:  # evict the first free buffer, if any
                free = [i for i in range(len(self._buffers)) if sys.getrefcount(self._buffers[i]) <= 2]
                if free:
                    evicted = [self._buffers.pop(free[0])]
                    if not self.huge_pages:  # (base pages: unmapped on the releasing thread, not the loop's)
                        RELEASER.release(evicted)
                    del evicted
            if len(self._buffers) < kept:
                self._buffers.append(base)
            return base.data[:n]

    def _recycle(self, n: int) -> memoryview:
        """A buffer of `n` bytes (RECYCLED_FROM <= n < POOLED_FROM): a free one kept, or a new one, kept
        while those kept hold at most `recycled_bytes` (free ones are let go, oldest first, to make room)."""
        with self._lock:
            reused = self._free(n, self._recycled)
            if reused is not None:
                return reused
            base = aligned_empty(n)
            kept = self._recycled
            index = 0
            # (none free: nothing to let go, and a consumer far behind would look at every busy one again)
            while self._other_free and self._recycled_bytes + len(base) > self.recycled_bytes and index < len(kept):
                if sys.getrefcount(kept[index]) <= 2:  # (the list and getrefcount's argument: free)
                    self._recycled_bytes -= len(kept.pop(index))
                else:
                    index += 1
            if self._recycled_bytes + len(base) <= self.recycled_bytes:
                kept.append(base)
                self._recycled_bytes += len(base)
            return base.data[:n]


def _aligned_copy() -> Callable[[bytes], memoryview] | None:
    """The codec extension's `aligned_copy` where it is built and enabled (and agrees on ALIGN), else None."""
    from .codec.native import NATIVE, agrees  # (here, not at the top: the codec imports this module)

    module = agrees(NATIVE, {"ALIGN": ALIGN})
    return None if module is None else module.aligned_copy


#: the C path of `aligned` for `bytes`, or None (then the Python one serves them too)
_ALIGNED_COPY = _aligned_copy()
