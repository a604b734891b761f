"""shm:// memory: sealed memfd segments, and the producer's slots in them.

A segment is an anonymous `memfd_create` file, sized once, its pages reserved with
`posix_fallocate` (a full memory filesystem fails there with a `TransportError`, never with a
SIGBUS at first touch) and sealed against shrinking, so a consumer that maps it can trust its size.
Segments have no name: nothing ever appears in /dev/shm, no other user can open one, and the kernel
frees a segment when the last process that maps it or holds its descriptor lets go, whichever side
dies first. Its descriptor reaches the consumer over the control socket (SCM_RIGHTS).

Each segment is cut into equal slots of one size class; a frame is written into one slot.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import TransportError

#: the seals every segment carries before its descriptor leaves the producer (checked by the consumer)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_SEAL_SHRINK") else 0
#: no writable mapping of the memfd made after the seal (Linux 5.1; Python 3.11's fcntl does not name it): a
#: segment's consumer cannot write into the producer's memory, while the producer's own mapping, made first, can
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
#: slots of a size class are made this many bytes of segment at a time (one slot per segment above it)
SEGMENT_BYTES = 4 << 20
#: the smallest slot; slots up to 1 MiB are powers of two, larger ones multiples of 1 MiB
MIN_SLOT = 4096
MIB = 1 << 20


def check_available() -> None:
    """Raise a `TransportError` saying what is missing where memfd segments cannot be made."""
    missing = [
        name
        for name, there in [
            ("os.memfd_create", hasattr(os, "memfd_create")),
            ("socket.send_fds", hasattr(socket, "send_fds")),
            ("memfd seals", bool(SEALS)),
        ]
        if not there
    ]
    if missing:
        raise TransportError(
            f"shm:// needs shared memory this system does not offer ({', '.join(missing)}; Linux 3.17 or later, "
            "Python 3.9 or later): use unix:// instead"
        )


def sealed_memfd(name: str, nbytes: int, what: str, *, ours_to_write: bool = False) -> tuple[int, mmap.mmap]:
    """A new memfd of `nbytes` (its descriptor, and a writable mapping of it), its pages
    reserved now (`posix_fallocate`: no SIGBUS when one is first touched) and sealed at that size; `ours_to_write`:
    sealed against writable mappings made after ours too (where the kernel can: `FUTURE_WRITE_SEALS`), so that the
    peer it is passed to can only read it. A failure is a `TransportError` naming `what` it was for."""
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise TransportError(f"shm:// cannot create {what}: {exc}") from None
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        try:
            fcntl.fcntl(
                fd, fcntl.F_ADD_SEALS, SEALS | (F_SEAL_FUTURE_WRITE if ours_to_write and FUTURE_WRITE_SEALS else 0)
            )
        except BaseException:
            mapped.close()
            raise
        return fd, mapped
    except OSError as exc:
        os.close(fd)
        raise TransportError(
            f"shm:// cannot reserve {what} of {nbytes} bytes: {exc} (is memory, or the memory cgroup, full?)"
        ) from None


def _seals_future_write() -> bool:
    """Whether this kernel has F_SEAL_FUTURE_WRITE (Linux 5.1): asked of a memfd of no size, once."""
    try:
        fd = os.memfd_create("tensorbus-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (OSError, AttributeError):
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


#: whether segments are sealed against later writable mappings here; if so a consumer requires it of them
FUTURE_WRITE_SEALS = bool(SEALS) and _seals_future_write()


def touch_pages(mapped: mmap.mmap, *, write: bool) -> None:
    """Fault in every page of a mapping now, by one byte of each written (a producer's new segment: its pages then
    count as data, see `reserved`) or read (a consumer's mapping of one), without the interpreter lock (numpy lets
    go of it over a long strided loop). `mmap.mmap(..., MAP_POPULATE)` does as much holding the lock: ~0.1-0.5 s
    for 256 MB on the 2-vCPU VM of docs/PERFORMANCE.md, every other thread of the process (an event loop) stopped."""
    pages = np.frombuffer(mapped, np.uint8)[:: mmap.PAGESIZE]
    if write:
        pages[:] = 0
    else:
        pages.max()


def sealed_at(fd: int, nbytes: int) -> bool:
    """Whether a peer's memfd is sealed against shrinking and has `nbytes` at least: a mapping of them can trust
    its size (a file shrunk under it would raise SIGBUS)."""
    return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS and os.fstat(fd).st_size >= nbytes)


def reserved(fd: int, nbytes: int) -> bool:
    """Whether a peer's memfd has memory allocated for all of its first `nbytes` (no hole before them: its
    producer reserved them and touched them, as a `Segment` does), and is sealed so that none can be punched out
    later (F_SEAL_FUTURE_WRITE, where the kernel has it): touching its pages then allocates nothing more. A file
    of holes would have the consumer allocate (and be charged for) pages the producer never paid for.
    A page `posix_fallocate` reserved but nobody has touched may read as a hole (Linux's shmem reports a page
    that is not up to date as one; on the 6.18 kernel of docs/PERFORMANCE.md's VM it did in some runs and not
    in others): a producer writes to every page of its segment (`touch_pages`) before passing it on."""
    if FUTURE_WRITE_SEALS and not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE:
        return False
    return os.lseek(fd, 0, os.SEEK_HOLE) >= nbytes


def slot_size(nbytes: int) -> int:
    """The size class of a frame of `nbytes`: a power of two up to 1 MiB, then a multiple of 1 MiB."""
    if nbytes <= MIB:
        return max(MIN_SLOT, 1 << (max(nbytes, 1) - 1).bit_length())
    return -(-nbytes // MIB) * MIB


class Segment:
    """One sealed memfd of `slots` slots of `slot` bytes, mapped writable by its producer."""

    def __init__(self, seg_id: int, slot: int, slots: int) -> None:
        self.seg_id, self.slot, self.slots = seg_id, slot, slots
        self.size = slot * slots
        check_available()
        self.fd, self._map = sealed_memfd("tensorbus-shm", self.size, "a shared memory segment", ours_to_write=True)
        touch_pages(self._map, write=True)
        self.array = np.frombuffer(self._map, np.uint8)  # (writable: the producer's side)
        self.in_use = 0  # slots handed out
        self.retired = False  # a consumer that went away may still map it: never written again

    def view(self, offset: int, nbytes: int) -> memoryview:
        """`nbytes` of the segment from `offset`, writable."""
        return self.array.data[offset : offset + nbytes]

    def close(self) -> None:
        """Close the producer's descriptor; the mapping goes with the last array viewing it (the
        consumer's own mapping keeps the memory for as long as it needs it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class Slot:
    """One frame's place: where it is, and what still keeps it from being written again."""

    segment: Segment
    offset: int
    #: the frame's position in the producer's stream (0 until sent)
    pos: int = 0
    #: the consumer has not said it is in its table (or settled) yet: counts against max_unacked_bytes
    unacked: bool = False
    #: the consumer's ledger has not released it (the application has not taken it): sent again to the
    #: next consumer if this one goes away
    untaken: bool = False
    #: the consumer still maps it (arrays viewing it are alive there)
    pinned: bool = False
    #: the producer's own array from `empty()` is still alive
    leased: bool = False
    #: where the frame starts in the segment, and its length, once sent
    frame: tuple[int, int] = field(default=(0, 0))

    @property
    def busy(self) -> bool:
        return self.untaken or self.pinned or self.leased


class Slots:
    """The producer's slots by size class; segments are made as needed and dropped when retired and idle,
    or when more than `pooled_bytes` of idle ones are kept, but for the `run_ahead` slots of the class
    last taken (a stream of one size cycles through them: a segment dropped at the end of a burst would
    be made again, its fresh pages touched again, at the start of the next one)."""

    def __init__(self, pooled_bytes: int, run_ahead: int = 0) -> None:
        self._free: dict[int, list[Slot]] = {}
        self.segments: dict[int, Segment] = {}
        self._next_id = 1
        self._pooled_bytes = pooled_bytes
        self._run_ahead = run_ahead
        self._last_class = 0  # the size class last taken
        self.dropped: list[int] = []  # ids of segments dropped since the last look (the consumer is told)

    def take(self, nbytes: int, reclaim: Callable[[int], None]) -> Slot:
        """A free slot of at least `nbytes`; when none is free, `reclaim(size)` (which may give some back,
        or wait for them) is called once before a new segment is made."""
        size = self._last_class = slot_size(nbytes)
        free = self._free.setdefault(size, [])
        if not free:
            reclaim(size)
        while free:
            slot = free.pop()
            if not slot.segment.retired:
                slot.segment.in_use += 1
                return slot
        segment = Segment(self._next_id, size, max(1, SEGMENT_BYTES // size))
        self._next_id += 1
        self.segments[segment.seg_id] = segment
        free.extend(Slot(segment, i * size) for i in reversed(range(1, segment.slots)))
        segment.in_use += 1
        return Slot(segment, 0)

    def give_back(self, slot: Slot) -> None:
        """A slot nothing keeps any more: free for the next frame of its class (or its segment dropped)."""
        segment = slot.segment
        segment.in_use -= 1
        if segment.retired:
            if segment.in_use == 0:
                self._drop(segment)
            return
        self._free.setdefault(segment.slot, []).append(Slot(segment, slot.offset))
        if segment.in_use == 0:
            self._trim()

    def _trim(self) -> None:
        """Drop idle segments, oldest first, while more than `pooled_bytes` of them are kept, but for those
        `_streamed` keeps."""
        for segment in list(self.segments.values()):
            if self._idle_bytes() <= self._pooled_bytes:
                return
            if segment.in_use == 0 and not segment.retired and not self._streamed(segment):
                self._drop(segment)

    def _streamed(self, segment: Segment) -> bool:
        """True if `segment` holds some of the `run_ahead` slots of the class last taken (kept past the pool
        bound, unless one segment alone is larger than that bound)."""
        if segment.slot != self._last_class or segment.size > self._pooled_bytes:
            return False
        kept = sum(s.slots for s in self.segments.values() if s.slot == segment.slot and not s.retired)
        return kept <= self._run_ahead

    def has_free(self, size: int) -> bool:
        """True if a slot of size class `size` is free."""
        return any(not slot.segment.retired for slot in self._free.get(size, ()))

    def busy(self, size: int) -> int:
        """Slots of size class `size` in use."""
        return sum(s.in_use for s in self.segments.values() if s.slot == size)

    def retire(self, segment: Segment) -> None:
        """Never write into `segment` again; drop it once its last slot is given back."""
        segment.retired = True
        if segment.in_use == 0:
            self._drop(segment)

    def _idle_bytes(self) -> int:
        return sum(s.size for s in self.segments.values() if s.in_use == 0 and not s.retired)

    def _drop(self, segment: Segment) -> None:
        del self.segments[segment.seg_id]
        free = self._free.get(segment.slot, [])
        free[:] = [slot for slot in free if slot.segment is not segment]
        segment.close()
        self.dropped.append(segment.seg_id)

    def close(self) -> None:
        for segment in list(self.segments.values()):
            segment.close()
        self.segments.clear()
        self._free.clear()
