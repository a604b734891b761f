"""A small pool of large receive buffers, reused once nothing references them any more.

Fresh memory is slow on VMs (the first touch of new pages; docs/PERFORMANCE.md), so a stream
reader that allocates a new 256 MB buffer per tensor loses most of its speed. Delivered tensors
are views of the buffer; a buffer is free again when its reference count says no view is alive.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

#: buffers at least this large are pooled (smaller ones are cheap to allocate)
POOLED_FROM = 1 << 20


class BufferPool:
    """Hands out writable buffers of at least `n` bytes; buffers >= 1 MiB are pooled and reused."""

    def __init__(self, max_buffers: int = 4) -> None:
        self.max_buffers = max_buffers
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0

    def take(self, n: int) -> memoryview:
        """A buffer of exactly `n` bytes (a view of a pooled one when a free one fits)."""
        try:
            return self._take(n)
        except ValueError:  # numpy's "array is too big": a size no memory could hold
            raise MemoryError(f"no buffer of {n} bytes") from None

    def _take(self, n: int) -> memoryview:
        if n < POOLED_FROM:
            return np.empty(n, np.uint8).data  # not zero-filled: every byte is about to be received
        with self._lock:
            for base in self._buffers:
                # references: the list, `base`, and getrefcount's own argument; any more is a live view
                if n <= len(base) <= 2 * n and sys.getrefcount(base) <= 3:
                    self.reused += 1
                    return base.data[:n]
            base = np.empty(n, np.uint8)
            if len(self._buffers) >= self.max_buffers:  # evict the first free buffer, if any
                free = [i for i in range(len(self._buffers)) if sys.getrefcount(self._buffers[i]) <= 2]
                if free:
                    del self._buffers[free[0]]
            if len(self._buffers) < self.max_buffers:
                self._buffers.append(base)
            return base.data[:n]
