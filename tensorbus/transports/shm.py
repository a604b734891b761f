"""`shm://NAME`: producers and a consumer on one host, tensor bytes through shared memory.

Frames are written into memfd segments the producer owns (shm_segments.py) and the consumer maps
read-only; a Unix control socket (shm_control.py) carries where each frame is, the consumer's acks
and the "free" that hands a frame's memory back once no array views it. Received arrays are
read-only views of that memory, never copies (up to `max_pinned_bytes` of them kept by the application).
`Producer.empty()` gives an array that already lives in a segment: sending it copies no tensor bytes.

Why memfd rather than shm_open: a memfd has no name, so nothing can collide between users, nobody
else can open it, and nothing is ever left in /dev/shm: the kernel frees it with the last process
that maps it, whichever side was killed. (Python's multiprocessing.shared_memory is not used: in
3.11 its resource tracker unlinks segments that a process merely attached to when it exits.)
"""

from __future__ import annotations

import dataclasses
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..codec.frame import NATIVE, Buffer, Limits, MessageId, flat_bytes
from ..errors import Closed
from ..options import finite_timeout
from .base import Deliver, Encoding
from .named import NamedOptions, NamedTransport
from .shm_consumer import ShmListener
from .shm_control import control_path
from .shm_producer import ShmSender
from .shm_segments import check_available


@dataclass(frozen=True, kw_only=True)
class ShmOptions(NamedOptions):
    """The options of shm:// endpoints."""

    shm_dir: str | None = None  # where control sockets live; None: <tmp>/tensorbus-<uid> (0700)
    auth_secret: str | bytes | None = None
    connect_timeout_s: float = 5.0
    close_timeout_s: float = 10.0
    max_pinned_bytes: int = 1 << 30  # consumer: bytes of producers' memory the arrays it handed out may view
    spin_s: float = 0.0001  # consumer: how long a waiting recv polls before it sleeps (an idle vCPU wakes late)
    max_connections: int = 1024
    backlog: int = 128


class ShmTransport(NamedTransport):
    """Frames through shared memory segments; notifications and acks over a Unix SEQPACKET socket."""

    Options = ShmOptions
    options: ShmOptions
    reads_while_waiting = True

    def __init__(self, url: urllib.parse.SplitResult, options: ShmOptions) -> None:
        super().__init__(url, options)
        check_available()
        self.path = control_path(self.name, options.shm_dir)
        self._sender: ShmSender | None = None
        self._listener: ShmListener | None = None
        #: held by a thread using the producer side (ShmSender is not for two threads at once)
        self._sending = threading.RLock()
        self._closed = False  # (under `_sending`: no producer side is made once closed)

    @property
    def sender_side(self) -> ShmSender:
        """The producer side, made at first use."""
        with self._sending:
            if self._sender is None:
                if self._closed:  # (a send that passed the producer's own check as close ran)
                    raise Closed(f"shm://{self.name}: the producer is closed")
                self._sender = ShmSender(self.name, self.path, self.options, self.tally)
            return self._sender

    def encoding(self, wanted: Encoding) -> Encoding:
        """`wanted` without a CRC32C: the consumer reads the very memory the producer wrote, no wire
        between them could corrupt it (and a CRC computed before it reads could not catch a later write)."""
        return dataclasses.replace(wanted, checksum=False)

    def empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """An uninitialised array in shared memory: sent as it is, with no copy of its bytes."""
        with self._sending:
            return self.sender_side.empty(shape, dtype)

    def send_message(
        self, tensor: Any, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, encoding: Encoding
    ) -> None:
        """An `empty()` array in place (its header written before it); anything else copied into a slot."""
        with self._sending:
            sender = self.sender_side
            if self.max_frame_bytes is None and type(tensor) is np.ndarray and sender.leased(tensor):
                self.wait_for_room()
                buffers = encoding.encode(tensor, key, metadata, message_id, self._frame_key(encoding.signing_key))
                if not sender.send_in_place(tensor, buffers):
                    sender.send(buffers)
                return
            super().send_message(tensor, key, metadata, message_id, encoding)

    def _send_ndarray(
        self, array: np.ndarray, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, flags: int
    ) -> bool:
        """A plain ndarray's frame in the fewest steps: its head made in C (`ndarray_head`), then the head and the
        array's bytes copied into a slot. False, with nothing sent, where it does not apply (no C extension, frames
        limited, a tensor the C head leaves to `encode`)."""
        if self.max_frame_bytes is not None or NATIVE is None:
            return False
        head = NATIVE.ndarray_head(array, key, metadata, message_id, flags)
        if head is None:
            return False
        with self._sending:
            sender = self._sender or self.sender_side
            sender.wait_for_room()
            sender.send_plain(head, flat_bytes(array))
        return True

    def send(self, frame: list[Buffer], *, key: str | None) -> None:
        with self._sending:
            self.sender_side.send(frame)

    def wait_for_room(self) -> None:
        with self._sending:
            self.sender_side.wait_for_room()

    def flush(self, timeout: float | None = None) -> None:
        with self._sending:
            if self._sender is not None:
                self._sender.flush(timeout)

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        self._listener = ShmListener(self.name, self.path, self.options, deliver)

    def read_while_waiting(self, done: threading.Lock, deadline: float | None) -> bool:
        """Wait for `done`, reading the control socket on this thread meanwhile (a round trip's wake-up fewer)."""
        listener = self._listener
        if listener is None:
            return super().read_while_waiting(done, deadline)
        return listener.wait(done, deadline)

    def room_opened(self) -> None:
        if self._listener is not None:
            self._listener.room_opened()

    def close(self) -> None:
        with self._sending:
            sender, self._sender, self._closed = self._sender, None, True
        if sender is not None:
            sender.close(finite_timeout(self.options.close_timeout_s, "close_timeout_s"))
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()

    def abandon(self) -> None:
        """In a forked child: the parent's connection and segments are left to the parent."""
        self._sender = None
        self._listener = None
