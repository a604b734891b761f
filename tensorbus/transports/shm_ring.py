"""shm://'s notification ring: a producer tells its consumer of each frame through shared memory.

Without it, each frame's notice is a control datagram: a `sendto` on the producer's side, a `recvmsg`
and its msgpack on the consumer's, and the consumer's spin polls its socket with a system call each
time (docs/PERFORMANCE.md, "shm://'s 4 KB send, profiled"). With it, the producer writes the notice into
a ring in a small sealed memfd it passes at the start of the connection, the consumer's spin reads it from
memory, and a datagram goes only to a consumer that said it sleeps (`_shm.c` says how neither side can
miss the other). Segments, drops, acks and frees stay datagrams.

The ring is C alone (`_shm.c`: its ordering needs atomics Python does not have). The readable path is the
datagram protocol itself, which runs where the extension is not built, under TENSORBUS_NATIVE=0, and with a
peer without the ring: the consumer offers it in its "hello", the producer takes it up only if it can too.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

from ..codec import native
from ..errors import TransportError
from .shm_segments import sealed_at, sealed_memfd

_shm: Any = native.load("tensorbus.transports._shm")
#: notices a ring holds: a producer that fills it waits for the consumer to read (as for a full socket)
CAPACITY = 8192


def available() -> bool:
    """Whether this process can use the ring (the extension is built and enabled)."""
    return _shm is not None


def size(capacity: int) -> int:
    """The bytes of a ring of `capacity` notices."""
    assert _shm is not None
    return int(_shm.ENTRIES_AT + capacity * _shm.ENTRY_BYTES)


class ProducerRing:
    """The producer's ring for one connection: its memfd (`fd`, passed to the consumer) and its writer."""

    def __init__(self, capacity: int | None = None) -> None:
        assert _shm is not None
        self.capacity = capacity = CAPACITY if capacity is None else capacity
        self.fd, self._map = sealed_memfd("tensorbus-shm-ring", size(capacity), "its notification ring")
        self._ring = _shm.Ring(self._map, capacity, fresh=True)
        self.put = self._ring.put  # (pos, seg_id, offset, length) -> -1 full, 1 wake the consumer, 0
        self.free = self._ring.free

    def close(self) -> None:
        """Let go of the ring (the consumer's mapping keeps its memory for as long as it needs it)."""
        self._ring.close()
        self._map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def consumer_ring(fd: int, capacity: Any) -> Any:
    """The consumer's side of a producer's ring (`_shm.Ring`: take, pending, sleep, awake, close), mapped
    from `fd` (closed here) once its seals say its size cannot change under the mapping."""
    try:
        if _shm is None:
            raise TransportError("a notification ring, which this consumer did not offer")
        if type(capacity) is not int or capacity <= 0 or capacity & (capacity - 1) or capacity > CAPACITY:
            raise TransportError(f"a notification ring of {capacity!r} notices")
        nbytes = size(capacity)
        if not sealed_at(fd, nbytes):
            raise TransportError("a notification ring that is not sealed at its size")
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    try:
        return _shm.Ring(mapped, capacity)
    except ValueError as exc:
        raise TransportError(f"a malformed notification ring: {exc}") from None
