"""shm:// control channel: where its socket lives, its messages, and the consumer's acknowledgement seam.

The consumer of `shm://NAME` listens on a SOCK_SEQPACKET Unix socket (message boundaries kept,
descriptors passed with SCM_RIGHTS) at `<shm_dir>/NAME.sock`; `shm_dir` defaults to a directory of
the user's own (`<tmp>/tensorbus-<uid>`, mode 0700, refused if anyone else owns it or could enter
it), so two users' endpoints of the same name never meet and another user cannot reach the socket.

Every message is one msgpack list, its first item the kind:

    consumer -> producer   ["hello", nonce, auth, ring, refusals]  on accept (auth: a proof is required; ring: it
                                                         can read a notification ring, shm_ring.py; refusals: it
                                                         tells a producer that asks which frames it refused)
    producer -> consumer   ["proof", proof]              HMAC of the nonce with auth_secret (stream.proof)
    consumer -> producer   ["ok"] | ["refused", reason]
    producer -> consumer   ["refusals"]                  it wants "rejected" (if the consumer offered it); sent
                                                         before the ring, so it comes before any frame
    producer -> consumer   ["ring", capacity]            with the ring's descriptor, if both sides have it
    producer -> consumer   ["seg", seg_id, size]         with the segment's descriptor
    producer -> consumer   ["frame", pos, seg_id, offset, length]   without a ring; with one, the same four
                                                         numbers are a notice in the ring, and
    producer -> consumer   ["wake"]                      tells a consumer that said it sleeps to read it
    producer -> consumer   ["drop", seg_id]              the producer will never name this segment again
    producer -> consumer   ["ask"]                       it waits for acks (flush, room): the consumer sends
                                                         what it owes at once, not within LINGER_S
    consumer -> producer   ["rejected", pos, reason]     the frame at pos was refused for good (a bad signature,
                                                         over a limit...; reason: UTF-8 bytes, cut as a socket
                                                         consumer's, `stream.reason_told`): before the "ack"
                                                         covering it
    consumer -> producer   ["ack", pos, [taken...], [free...]]
                           every frame before pos is in the table or settled; "taken" positions were
                           released by the ledger (never to be sent again); "free" ones are viewed by
                           no array any more (the producer may reuse their memory)
"""

from __future__ import annotations

import array
import os
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from ..errors import TransportError
from .stream import reason_told

if TYPE_CHECKING:
    from ..codec.frame import MessageId
    from ..ledger import Ledger
    from .base import Delivered

#: the most positions one "ack" or "free" message carries (a SEQPACKET message must fit the socket buffer)
MAX_POSITIONS = 4096
#: "taken" and "free" wake the consumer's thread at once when this many wait, or frees of this many bytes;
#: fewer are sent with its next answer, within LINGER_S once it saw them, and within IDLE_S in any case
#: (its wait while producers are connected): one wake-up per tensor would cost more than it
URGENT_COUNT = 64
URGENT_BYTES = 1 << 20
LINGER_S = 0.005
IDLE_S = 0.05
#: a control message larger than this is a protocol error
MAX_MESSAGE = 1 << 16
_FDS_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)  # (room for a few: more are a protocol error)
#: the flags as plain ints (an enum's operators are Python calls, on every message)
_DONTWAIT = int(socket.MSG_DONTWAIT)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)


def private_dir(shm_dir: str | None) -> Path:
    """The directory of control sockets: `shm_dir`, or `<tmp>/tensorbus-<uid>` made 0700 and checked."""
    if shm_dir is not None:
        return Path(shm_dir)
    path = Path(tempfile.gettempdir()) / f"tensorbus-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise TransportError(f"shm:// cannot make its socket directory {path}: {exc}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise TransportError(
            f"{path} is not a directory of this user's alone (owner uid {info.st_uid}, mode {oct(info.st_mode)}): "
            "shm:// will not put its control socket there; remove it, or set shm_dir"
        )
    return path


def control_path(name: str, shm_dir: str | None) -> str:
    """Where the consumer of shm://NAME listens."""
    if not name or "/" in name or name in (".", ".."):
        raise TransportError(f"shm:// needs a plain name (no '/'), e.g. shm://weights; got {name!r}")
    return str(private_dir(shm_dir) / f"{name}.sock")


def packer() -> msgpack.Packer:
    """A packer of control messages, for one thread at a time (one `packb` call makes a packer each time: a
    producer's "frame" message, one a tensor, is packed in a third of the time by a packer it keeps)."""
    return msgpack.Packer(use_bin_type=True)


def send(
    sock: socket.socket,
    *message: Any,
    fds: list[int] | None = None,
    by: msgpack.Packer | None = None,
    wait: bool = True,
) -> None:
    """Send one control message (with descriptors), packed `by` the caller's packer if it has one; not `wait`ing
    for room in the socket (`BlockingIOError` when it has none: the peer is not reading it). The socket must have
    no timeout: Python waits out a socket's timeout even with MSG_DONTWAIT."""
    data = msgpack.packb(list(message), use_bin_type=True) if by is None else by.pack(list(message))
    flags = 0 if wait else _DONTWAIT
    if fds:
        socket.send_fds(sock, [data], fds, flags)
    else:
        sock.send(data, flags)


def receive(sock: socket.socket, *, blocking: bool = True) -> tuple[list[Any], list[int]] | None:
    """One control message and the descriptors that came with it; None when none is waiting (not blocking).

    Raises `ConnectionError` when the peer closed, `TransportError` for a malformed message."""
    try:  # (not socket.recv_fds: Python 3.11's ignores its flags)
        data, ancillary, msg_flags, _ = sock.recvmsg(MAX_MESSAGE, _FDS_SPACE, 0 if blocking else _DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    fds = descriptors(ancillary) if ancillary else []
    if not data:
        for fd in fds:
            os.close(fd)
        raise ConnectionResetError("the peer closed the control socket")
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=MAX_POSITIONS + 8)
    except Exception as exc:  # (msgpack raises several kinds for bad input)
        message = exc
    if not isinstance(message, list) or not message or msg_flags & _TRUNCATED:
        for fd in fds:
            os.close(fd)
        raise TransportError(f"malformed shm:// control message ({message!r:.80})")
    return message, fds


def descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors passed in a message's ancillary data."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def batches(positions: list[int]) -> Iterator[list[int]]:
    for at in range(0, len(positions), MAX_POSITIONS):
        yield positions[at : at + MAX_POSITIONS]


class PinnedBytes:
    """The bytes of producers' memory that arrays the application took still view, over all the consumer's
    producers (its `max_pinned_bytes` bounds them; frames not taken yet are `max_buffered_bytes`'s):
    added to as the ledger releases a viewed frame (or its connection ends), taken from by whichever thread
    dropped such a frame's last view. One count, not one per producer summed per frame."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # (a finalizer that ran inside `add` must not wait for itself)
        self._total = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._total += nbytes

    @property
    def total(self) -> int:
        with self._lock:
            return self._total


class Acknowledgements:
    """The consumer's one seam between a producer connection and the acknowledgement ledger (ledger.py).

    `record` enters a received frame's position in the connection's ledger stream with what the
    intake made of it; the ledger decides when it is *released* (taken by the application, or settled),
    and `_released` turns that into "taken". `viewed`/`unviewed` follow the frames whose arrays view the
    producer's memory: a viewed frame's bytes count in the consumer's `PinnedBytes` from its release
    (the application has it) or the connection's end, whichever comes first, to its last view's end;
    `unviewed` (called from whichever thread dropped the last view) turns into "free"; both wake the
    consumer's thread in batches only (`URGENT_COUNT`, `URGENT_BYTES`). `pending` gathers the control
    messages owed: "ack" (cumulative: every frame before it is in the table or settled, as
    `Stream.first_unreceived` says), "taken" and "free", after the "rejected" of frames refused (`refuse`).
    Lists are kept under an RLock: a finalizer may run on any thread, even inside these methods.
    """

    def __init__(self, ledger: Ledger, poke: Callable[[], None], pinned: PinnedBytes | None = None) -> None:
        self._lock = threading.RLock()
        self._poke = poke
        self._taken: list[int] = []
        self._frees: list[int] = []
        self._unreleased_views: dict[int, int] = {}  # position -> bytes, of viewed frames not released yet
        self._freed_bytes = 0  # of the frees not sent yet
        self._received_bytes = 0  # of the frames received since the last "ack"
        self._acked = 0  # the last cumulative "ack" sent
        self._refused: list[list[Any]] = []  # the "rejected" messages not sent yet
        self._sending = False  # `pending` gave messages the consumer's thread has not yet sent (or requeued)
        #: the producer asked for "rejected" (a producer of a build without it would take one for an error)
        self.tells_refusals = False
        self.pinned = PinnedBytes() if pinned is None else pinned  # (the consumer's, shared by its producers)
        self.stream = ledger.stream(self._released)

    def record(self, pos: int, result: Delivered, nbytes: int) -> None:
        """Enter the received frame at `pos` (`nbytes` long) with what the intake made of it."""
        self.stream.record(pos, result)
        self._received(nbytes)

    def record_admitted(self, pos: int, message_id: MessageId | None, nbytes: int) -> None:
        """`record` of a plain tensor the intake's C delivery took (ledger.py's fewest steps)."""
        self.stream.record_admitted(pos, message_id)
        self._received(nbytes)

    def refuse(self, pos: int, reason: str) -> None:
        """The frame at `pos` was refused for good: a producer that asked is told (at once), before the ack covering
        it."""
        if not self.tells_refusals:
            return
        with self._lock:
            self._refused.append(["rejected", pos, reason_told(reason)])
        self._poke()

    def _received(self, nbytes: int) -> None:
        with self._lock:
            self._received_bytes += nbytes

    def urgent(self) -> bool:
        """True when what is owed should go now rather than with the next answer (`URGENT_COUNT`,
        `URGENT_BYTES` of frees, or of frames received since the last answer: the producer's credit)."""
        with self._lock:
            return (
                bool(self._refused)
                or len(self._taken) >= URGENT_COUNT
                or len(self._frees) >= URGENT_COUNT
                or self._freed_bytes >= URGENT_BYTES
                or self._received_bytes >= URGENT_BYTES
            )

    def _released(self, positions: list[Any]) -> None:
        with self._lock:
            self._taken.extend(positions)
            urgent = len(self._taken) >= URGENT_COUNT
            views = self._unreleased_views
            if views:
                kept = 0
                for pos in positions:
                    kept += views.pop(pos, 0)
                self.pinned.add(kept)
        if urgent:
            self._poke()

    def viewed(self, pos: int, nbytes: int) -> None:
        """The frame at `pos` is delivered as a view of `nbytes` of the producer's memory (before `record`)."""
        with self._lock:
            self._unreleased_views[pos] = nbytes

    def unviewed(self, pos: int, nbytes: int) -> None:
        with self._lock:
            if self._unreleased_views.pop(pos, None) is None:
                self.pinned.add(-nbytes)
            self._frees.append(pos)
            self._freed_bytes += nbytes
            urgent = self._freed_bytes >= URGENT_BYTES or len(self._frees) >= URGENT_COUNT
        if urgent:
            self._poke()

    def owed(self) -> bool:
        """True while "rejected", "taken" or "free" messages wait to be sent, including those `pending` gave until
        `sent` (the thread answers within `LINGER_S`)."""
        with self._lock:
            return self._sending or bool(self._refused or self._taken or self._frees)

    def pending(self) -> list[list[Any]]:
        """The messages owed to the producer now, "rejected" first, then "ack" (none if nothing changed), emptied;
        `requeue` what could not be sent."""
        received = self.stream.first_unreceived()
        with self._lock:
            refused, self._refused = self._refused, []
            taken, self._taken = self._taken, []
            frees, self._frees = self._frees, []
            self._freed_bytes = self._received_bytes = 0
            if received == self._acked and not taken and not frees:
                self._sending = bool(refused)
                return refused
            self._acked = received
            count = max(len(taken), len(frees), 1)
            self._sending = True
        return refused + [
            ["ack", received, taken[at : at + MAX_POSITIONS], frees[at : at + MAX_POSITIONS]]
            for at in range(0, count, MAX_POSITIONS)
        ]

    def sent(self) -> None:
        """What `pending` gave was sent (or requeued, or the connection ended): no longer owed."""
        with self._lock:
            self._sending = False

    def requeue(self, messages: list[list[Any]]) -> None:
        """Messages `pending` gave that could not be sent (the producer's socket is full): sent later."""
        with self._lock:
            self._refused[:0] = [message for message in messages if message[0] == "rejected"]
            for message in messages:
                if message[0] == "ack":
                    self._taken.extend(message[2])
                    self._frees.extend(message[3])
        self._acked = 0  # (the cumulative ack goes again)

    def close(self) -> None:
        """The connection ended: the ledger forgets its stream (what it did not release is sent again). Its
        viewed frames count in `PinnedBytes` from now on: the ledger releases none of them any more, so a take
        would never move them there, and kept from a producer that has gone they still bound the consumer."""
        with self._lock:
            views, self._unreleased_views = self._unreleased_views, {}
            self.pinned.add(sum(views.values()))
        self.stream.close()
