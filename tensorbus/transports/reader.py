"""A stream connection's frame reader: the C one (`_stream.StreamReader`) or its Python twin, chosen here.

Both turn bytes off a non-blocking stream socket into events, with one interface:

- `read()`: the next event: `(frame, crc)` for a whole frame (a memoryview handed over to the caller;
  `crc` its CRC32C when computed while receiving, else None); `ACK_REQUEST`; `CHECK_PREFIX` (`prefix`
  is over the limits or not a frame: `skip(n)` it, or drop the connection); `SKIPPED` (a skipped
  frame's bytes are all gone); `END` (`mid_frame` says where); None when no more bytes are there yet.
- `fill()`: whether `read()` has anything to look at, found out with one system call that reads ahead
  between frames (a waiting reader's busy-poll, in place of a poll).
- `read_taken(take, source, max_frames, max_bytes)`: `read()` on, handing each whole frame to `take`
  (the consumer's C delivery) while it takes them, in one call: a small tensor's read and delivery
  without a Python step each (the C reader's; the Python one is its readable twin, see `read_taken`).
- `skip(n)`, and `prefix`, `buffered`, `mid_frame`, `progress`, `crc_after`, `inbox_held`, `last_total`.
- `drained`: whether the last read found the socket empty (it took less than it asked for; never on TLS,
  whose records come one at a time): then nothing is there to read until a poll says so, and a reader
  that stops there saves the system call that would find nothing.
- `budget`: bytes of a frame's body one `read()` takes at most before it returns None (0, the default:
  no limit), none of its receives asking for more; an event loop's turn (tensorbus.aio) is bounded so,
  whatever pace the bytes come at and however far the socket's receive buffer grew.

It reads ahead (one system call for several small frames), sizes each frame from its prefix, receives
it into one buffer (large frames straight into place, checksummed slice by slice), and moves a CRC sent
after the frame (stream.TRAILING_CRC) into place. `stream_reader` gives a connection the C reader when the
extension is built and the connection is a plain socket, else the Python one (TLS connections always).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from typing import Any

from ..buffers import RECYCLED_FROM
from ..codec.frame import CRC_AT, FLAG_CHECKSUM, FLAG_SIGNED, PREFIX, SIGNATURE_BYTES, Limits, frame_length
from ..codec.native import crc32c
from ..errors import CodecError
from .stream import ACK_REQUEST_MARKER, CRC_TRAILER, NATIVE_STREAM, TRAILING_CRC

#: what `read` returns besides a frame (a tuple) and None (no more bytes for now); the C reader's values.
#: MORE: what `read_taken` returns when it stopped with bytes perhaps still to come
MORE, ACK_REQUEST, SKIPPED, CHECK_PREFIX, END = 0, 1, 2, 3, 4
#: frames at least this large are checksummed slice by slice as they arrive (smaller ones: in one pass)
CHECKSUM_WHILE_RECEIVING = 4 << 20
#: large frames are received (and checksummed, while still in cache) at most this many bytes at a time
CRC_SLICE = 1 << 20
#: bytes the Python reader reads at once while waiting for a prefix (so a small frame costs one system call)
READ_AHEAD = 256 << 10
#: after a frame of LARGE_FRAME bytes or more, the read-ahead for the next prefix is only SHORT_READ_AHEAD
#: bytes: the rest of such a frame is received straight into place, not read ahead and copied over, and below
#: SCATTER_BELOW the system call that receives it reads the next SHORT_READ_AHEAD bytes too (a scatter read:
#: `_take`), so a stream of 64 KB frames costs one system call a frame and no copy; the C reader's values
LARGE_FRAME = 32 << 10
SHORT_READ_AHEAD = 4 << 10
#: frames from this size are received to their last byte alone (with the scatter read, 1 MB frames were received
#: at half the speed); the C reader's value
SCATTER_BELOW = 128 << 10
#: drained read-ahead buffers kept for the next connection that needs one
SPARE_INBOXES = 4
_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
_spare_inboxes: list[memoryview] = []


class PyStreamReader:
    """The Python reader, for TLS connections and where `_stream.c` is not built (see the module docstring)."""

    def __init__(
        self,
        sock: socket.socket,
        max_header_bytes: int,
        max_payload_bytes: int,
        take_buffer: Callable[[int], memoryview],
        crc32c: Callable[..., int],
        pooled_from: int,
        checksum_from: int,
        crc_slice: int,
        recv_lowat: int = 0,
    ) -> None:
        """As the C reader's; `recv_lowat` is not used (the Python reader wakes per packet)."""
        self._sock = sock
        self._tls = sock if isinstance(sock, ssl.SSLSocket) else None  # (its decrypted bytes count as buffered)
        #: a frame's end may be read together with what follows it (`_take`): not on TLS, nor where the socket
        #: has no `recvmsg_into` (Windows)
        self._scatters = self._tls is None and hasattr(sock, "recvmsg_into")
        self._limits = Limits(max_header_bytes=max_header_bytes, max_payload_bytes=max_payload_bytes)
        self._take_buffer, self._crc32c = take_buffer, crc32c
        self._pooled_from, self._checksum_from, self._crc_slice = pooled_from, checksum_from, crc_slice
        self._prefix = memoryview(bytearray(PREFIX.size))
        self._prefix_got = 0
        self._frame: memoryview | None = None
        self._got = self._total = self._crc_end = 0
        self._crc: int | None = None
        self.crc_after = False
        self._skip_left = 0
        self._inbox: memoryview | None = None
        self._lo = self._hi = 0
        self.last_total = 0
        self._budget = 0
        self.drained = False  # (see the module docstring)
        self._broken = False  # no buffer for the frame a prefix began: the stream cannot go on

    @property
    def prefix(self) -> bytes:
        """The last prefix read (its TRAILING_CRC bit cleared)."""
        return bytes(self._prefix)

    @property
    def buffered(self) -> int:
        """Bytes read ahead (or decrypted) and not yet taken."""
        return self._hi - self._lo + (self._tls.pending() if self._tls is not None else 0)

    @property
    def budget(self) -> int:
        """Bytes of a frame's body one `read()` takes at most before it returns None (0: no limit)."""
        return self._budget

    @budget.setter
    def budget(self, value: int) -> None:
        if value < 0:
            raise ValueError("budget: a count of bytes, 0 or more")
        self._budget = value

    @property
    def mid_frame(self) -> bool:
        """Whether part of a frame has been read."""
        return self._frame is not None or self._skip_left > 0 or self._prefix_got > 0

    @property
    def progress(self) -> int:
        """A figure that changes as bytes of the frame under way come in (a stalled connection keeps it)."""
        return self._got + self._prefix_got + self._hi - self._skip_left

    @property
    def inbox_held(self) -> bool:
        """Whether it holds a read-ahead buffer now."""
        return self._inbox is not None

    def read(self) -> Any:
        """The next event of the stream (see the module docstring)."""
        if self._broken:
            raise RuntimeError("StreamReader failed earlier: drop its connection")
        try:
            return self._next()
        except _WOULD_BLOCK:
            return None
        finally:
            self._give_back_inbox()

    def read_taken(
        self, take: Callable[[memoryview, int | None, Any], Any], source: Any, max_frames: int, max_bytes: int
    ) -> tuple[list[Any], Any, int, int]:
        """`read()` on, handing each whole frame to `take(frame, crc, source)` while it takes them: at most
        `max_frames`, none after the one that brings their bytes to `max_bytes`, after the first only while
        bytes are read ahead. Returns (the `message_id` of each frame taken, what ended it, their bytes, the
        largest's): MORE (a limit, or nothing read ahead), None (no more bytes), another event of `read`, a
        frame `take` declined, or, once frames were taken, the exception that came (book them, then raise it)."""
        ids: list[Any] = []
        nbytes = largest = 0
        try:
            while True:
                event = self.read()
                if type(event) is not tuple:
                    return ids, event, nbytes, largest
                taken = take(event[0], event[1], source)
                if taken is None:
                    return ids, event, nbytes, largest
                ids.append(taken.message_id)
                nbytes += self.last_total
                largest = max(largest, self.last_total)
                if len(ids) >= max_frames or nbytes >= max_bytes or not self.buffered:
                    return ids, MORE, nbytes, largest
        except BaseException as exc:
            if not ids:
                raise
            return ids, exc, nbytes, largest

    def fill(self) -> bool:
        """Whether `read` has anything to look at (bytes, the stream's end, an error)."""
        if self.buffered:
            return True
        try:
            if self.mid_frame:  # part way: `read` reads into place, so only look
                if self._tls is not None:
                    return False  # (no peeking into TLS: the poller says when records come)
                self._sock.recv(1, socket.MSG_PEEK)
            else:
                self._take(None, 0)  # reads ahead, takes nothing
        except _WOULD_BLOCK:
            return False
        except OSError:
            return True  # `read` meets the error and reports it
        finally:
            self._give_back_inbox()
        return True

    def skip(self, n: int) -> None:
        """Discard the next n bytes (the rest of a frame over the limits), then report SKIPPED."""
        if n < 0:
            raise ValueError("skip: a negative count")
        self._skip_left = n
        if not n:
            self._prefix_got = 0

    def _next(self) -> Any:
        while self._skip_left:
            n = self._take(None, min(self._skip_left, READ_AHEAD))
            if not n:
                return END
            self._skip_left -= n
            if not self._skip_left:
                self._prefix_got, self.last_total = 0, PREFIX.size
                return SKIPPED
        prefix = self._prefix
        while self._frame is None:
            n = self._take(prefix[self._prefix_got :], PREFIX.size - self._prefix_got)
            if not n:
                return END
            self._prefix_got += n
            if self._prefix_got < PREFIX.size:
                continue
            if prefix == ACK_REQUEST_MARKER:
                self._prefix_got = 0
                return ACK_REQUEST
            self.crc_after = bool(prefix[5] & TRAILING_CRC)
            prefix[5] &= ~TRAILING_CRC  # the frame as it was sealed (and checksummed)
            try:
                total = frame_length(prefix, self._limits)
            except CodecError:
                return CHECK_PREFIX
            self._start_frame(total)
        frame = self._frame
        taken_now = 0
        while self._got < self._total:
            if self._budget and taken_now >= self._budget:
                return None  # (an event loop's turn is over: the rest comes with the next)
            end = min(self._got + self._crc_slice, self._total) if self._crc is not None else self._total
            # (one receive asks for no more than the turn has left: a receive buffer grown to tens of MB would
            # be copied in one)
            if self._budget:
                end = min(end, self._got + self._budget - taken_now)
            # (the end of a frame of LARGE_FRAME up to SCATTER_BELOW bytes: the next SHORT_READ_AHEAD in the same call)
            scatter = end == self._total and LARGE_FRAME <= self._total < SCATTER_BELOW
            ahead = SHORT_READ_AHEAD if scatter else 0
            n = self._take(frame[self._got : end], end - self._got, straight=True, ahead=ahead)
            if not n:
                return END
            if self._crc is not None and self._got < self._crc_end:
                self._crc = self._crc32c(frame[self._got : min(self._got + n, self._crc_end)], self._crc)
            self._got += n
            taken_now += n
        if self.crc_after:  # its CRC came after it: put it where `encode` puts it
            end = self._total - CRC_TRAILER.size
            frame[CRC_AT : PREFIX.size] = frame[end:]
            frame = frame[:end]
        crc, self._frame, self._prefix_got, self.last_total = self._crc, None, 0, self._total
        return frame, crc

    def _start_frame(self, total: int) -> None:
        """Get the buffer of a frame of `total` bytes (its prefix checked) and start receiving into it."""
        prefix = self._prefix
        whole = total + (CRC_TRAILER.size if self.crc_after else 0)
        try:
            frame = self._take_buffer(whole)  # (the pool's own buffers below `pooled_from` are fresh ones)
        except BaseException:
            self._broken = True
            raise
        frame[: PREFIX.size] = prefix
        self._frame, self._got, self._total, self._crc = frame, PREFIX.size, whole, None
        if total >= self._checksum_from and prefix[5] & FLAG_CHECKSUM:
            self._crc_end = total - (SIGNATURE_BYTES if prefix[5] & FLAG_SIGNED else 0)
            self._crc = self._crc32c(prefix[:CRC_AT])

    def _take(self, into: memoryview | None, want: int, straight: bool = False, ahead: int = 0) -> int:
        """Up to `want` bytes into `into` (None: dropped) from what was read ahead, reading ahead again
        (one system call) when that is empty, unless this is a frame's body or a large read, which go
        straight into place (after a large frame, only SHORT_READ_AHEAD bytes); 0 at the stream's end.
        `ahead`: these are a frame's last `want` bytes, and the system call that reads them reads up to
        `ahead` bytes after them too (0: no; nor on TLS, which has no scatter read, nor where the socket has no
        `recvmsg_into`)."""
        if self._lo == self._hi:
            if into is not None and (straight or want >= READ_AHEAD):
                if not ahead or not self._scatters:
                    return self._recv(into[:want])
                n = self._recv(into[:want], self._ensure_inbox()[:ahead])
                if n > want:
                    self._lo, self._hi = 0, n - want
                return min(n, want)
            inbox = self._ensure_inbox()
            skipping = into is None and want > 0
            n = self._recv(inbox if skipping or self.last_total < LARGE_FRAME else inbox[:SHORT_READ_AHEAD])
            if not n:
                return 0
            self._lo, self._hi = 0, n
        held = self._inbox
        assert held is not None
        n = min(want, self._hi - self._lo)
        if into is not None:
            into[:n] = held[self._lo : self._lo + n]
        self._lo += n
        return n

    def _ensure_inbox(self) -> memoryview:
        """The read-ahead buffer, made (or a spare taken) if the connection holds none."""
        if self._inbox is None:
            try:  # (the spares are shared by every reader of the process: pop, never look then pop)
                self._inbox = _spare_inboxes.pop()
            except IndexError:
                self._inbox = memoryview(bytearray(READ_AHEAD))
        return self._inbox

    def _recv(self, view: memoryview, ahead: memoryview | None = None) -> int:
        """One system call into `view` (and on into `ahead`, the empty read-ahead buffer, if given: a scatter
        read); the bytes received, `drained` saying whether they were fewer than asked for (never on TLS)."""
        try:
            if ahead is None:
                n = self._sock.recv_into(view, len(view))
            else:
                n = self._sock.recvmsg_into([view, ahead])[0]
        except _WOULD_BLOCK:
            self.drained = self._tls is None
            raise
        self.drained = self._tls is None and n < len(view) + (0 if ahead is None else len(ahead))
        return int(n)

    def _give_back_inbox(self) -> None:
        """A drained read-ahead buffer goes back: an idle connection holds none."""
        if self._inbox is not None and self._lo == self._hi:
            if len(_spare_inboxes) < SPARE_INBOXES:
                _spare_inboxes.append(self._inbox)
            self._inbox, self._lo, self._hi = None, 0, 0


def stream_reader(
    conn: socket.socket, limits: Limits, take_buffer: Callable[[int], memoryview], recv_lowat: int
) -> Any:
    """The reader of one connection: the C one for a plain socket where it is built and the limits fit
    it, else the Python one (TLS connections always)."""
    native = NATIVE_STREAM
    make = (
        native.StreamReader
        if native is not None and not isinstance(conn, ssl.SSLSocket) and limits.native
        else PyStreamReader
    )
    return make(
        conn,
        limits.max_header_bytes,
        limits.max_payload_bytes,
        take_buffer,
        crc32c,
        RECYCLED_FROM,  # (frames from there on come from `take_buffer`: the pool's, reused)
        CHECKSUM_WHILE_RECEIVING,
        CRC_SLICE,
        recv_lowat=recv_lowat,
    )
