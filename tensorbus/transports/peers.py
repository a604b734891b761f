"""The producer connections a socket consumer reads: each one's state, dropping it, holding it back, acking it.

A connection (`Peer`) counts the frames booked in the consumer's ledger; the acks tell the producer
two cumulative counts (stream.py): frames received (its credit and `flush`) and frames taken (it drops
its copies). A frame the full table cannot take holds its connection back (no more of it is read)
until the table takes it; other connections go on. Refusals, when the producer asked for them, go
before the ack that covers their frames.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import ssl
import threading
from typing import Any

from ..buffers import BufferPool
from ..codec.frame import Limits
from ..errors import CallbackInterrupted
from ..ledger import Stream
from .base import Deliver, Delivered, Held
from .poller import Poller
from .stream import ACK, TAKEN, SocketOptions, refusal

#: the socket consumer's reading logs under one name, whichever of its modules speaks
log = logging.getLogger("tensorbus.transports.reactor")
#: refusals a producer has not taken off its socket, in bytes, at most: past that it is dropped
MAX_OUTBOX = 1 << 20
WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
#: numbers naming connections as sources of tensors (`Peer.source`), in this process
_SOURCES = itertools.count(1)


class PeerGone(Exception):
    """The connection ended; the message says why, `level` how loudly to log it (INFO: it just left)."""

    def __init__(self, reason: str, level: int = logging.ERROR) -> None:
        super().__init__(reason)
        self.level = level


class Peer:
    """One producer connection: its reader, and what has been delivered and acknowledged of it."""

    def __init__(self, conn: socket.socket, name: Any, reader: Any, positions: Stream) -> None:
        self.conn, self.name = conn, name
        self.fd = conn.fileno()  # (what the poller knows it by, even once the socket is closed)
        #: what the consumer counts this connection's buffered tensors by (its share of the table): a
        #: number of its own, never reused, unlike a descriptor
        self.source = next(_SOURCES)
        self.reader = reader  # the connection's frame reader (reader.py: C, or Python for TLS)
        self.total = 0  # bytes of the frame being booked (what the acks count)
        self.frames = self.acked = self.taken = self.unacked_bytes = 0
        self.ack_owed = False
        #: the connection's frames (by index) in the consumer's ledger: what may be acked as received, as taken
        self.positions = positions
        self.held: Held | None = None  # a message the full table could not take: this peer is not read meanwhile
        self.decoding = False  # its last frame is being decoded off the event loop: not read meanwhile
        self.replay: tuple[memoryview, int | None] | None = None  # a frame whose delivery was interrupted
        self.refusals = False  # the producer asked to be told which frames were refused (stream.REFUSALS_WANTED)
        self.outbox = bytearray()  # refusals not sent yet (the socket was full): they go before the next ack
        self.gone = False  # dropped: no longer read

    @property
    def paused(self) -> bool:
        """Not to be read now: a message held back, or a frame being decoded off the loop (its next frames wait)."""
        return self.held is not None or self.decoding


class Peers:
    """The connections being read, and what the leader does to one: drop it, hold it back, ack it."""

    def __init__(
        self, deliver: Deliver, limits: Limits, options: SocketOptions, pool: BufferPool, poller: Poller
    ) -> None:
        self.deliver, self.limits, self.options, self.pool = deliver, limits, options, pool
        self._poller = poller
        #: the connections being read, by descriptor: added by the listener's thread, dropped by the leader;
        #: changed and copied under `_peers_lock` (the leader iterates over copies)
        self._peers: dict[int, Peer] = {}
        self._peers_lock = threading.Lock()
        self._pending: set[Peer] = set()  # peers with bytes read ahead (or decrypted) that the selector cannot see
        self._held: list[Peer] = []  # peers not read until the table takes the message they hold
        self._closed = False

    # -- connections ----------------------------------------------------------------------------

    @property
    def connections(self) -> int:
        """Producer connections being read."""
        with self._peers_lock:
            return len(self._peers)

    def _peer_list(self) -> list[Peer]:
        """The connections being read now (a copy: the listener's thread adds to them meanwhile)."""
        with self._peers_lock:
            return list(self._peers.values())

    def _reads(self, peer: Peer) -> bool:
        """Whether `peer` is still read (not dropped: its descriptor's number may be another's now)."""
        with self._peers_lock:
            return self._peers.get(peer.fd) is peer

    def _drop(self, peer: Peer, reason: str, level: int) -> None:
        if peer.gone:  # (dropped already: a delivery off the loop that failed after)
            return
        log.log(level, "producer %s: %s", peer.name, reason)
        peer.positions.close()  # (what it did not ack, the producer sends again to whoever is there)
        self._pending.discard(peer)
        with self._peers_lock:
            ours = self._peers.get(peer.fd) is peer  # (not dropped before: its number may be another's now)
            if ours:
                del self._peers[peer.fd]
        peer.gone = True
        if ours:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._poller.unregister(peer.fd, peer)
        peer.conn.close()

    @staticmethod
    def _has_bytes_ahead(peer: Peer) -> bool:
        """Bytes already read (or decrypted) that the selector cannot see."""
        return peer.reader.buffered > 0

    # -- holds and acks ---------------------------------------------------------------------------

    def _refuse(self, peer: Peer, index: int, reason: str) -> None:
        """Tell the producer (if it asked) that its frame `index` was refused: before the ack that covers it."""
        if not peer.refusals:
            return
        peer.outbox += refusal(index, reason)
        if len(peer.outbox) > MAX_OUTBOX:
            raise PeerGone(f"dropped: it left {len(peer.outbox)} bytes of refusals of its frames unread")
        peer.ack_owed = True  # (sent with the next ack, at the latest)

    def _hold(self, peer: Peer, message: Held) -> None:
        """Stop reading a peer whose message the full table cannot take: other peers go on."""
        peer.held = message
        self._held.append(peer)
        self._unwatch(peer)

    def _release_held(self) -> None:
        """Offer held messages to the table again; read their peers again once they are taken."""
        for peer in list(self._held):
            if not peer.decoding:  # (else offered already, off the loop: peer_frames.py)
                self._release(peer)

    def _release(self, peer: Peer) -> None:
        """Offer a peer's held message to the table again: book it, if taken, and read the peer again."""
        assert peer.held is not None
        try:
            result = self.deliver.release(peer.held)
        except CallbackInterrupted:  # a recv_async callback had it: taken
            self._read_again(peer, Delivered(peer.held.message_id, True, admitted=True))
            raise
        self._released(peer, result)

    def _released(self, peer: Peer, result: Delivered | None) -> None:
        """What became of a held message offered again (`Deliver.release`), booked."""
        if result is not None and result.held is not None:
            peer.held = result.held  # (no room after all: held again)
        elif result is not None:
            self._read_again(peer, result)

    def _read_again(self, peer: Peer, result: Delivered) -> None:
        """A held message was taken (or turned away): book it, and read its peer again."""
        self._held.remove(peer)
        peer.held = None
        if result.refused is not None:  # (a held message is the last frame read from its peer)
            try:
                self._refuse(peer, peer.frames - 1, result.refused)
            except PeerGone as exc:
                self._drop(peer, str(exc), exc.level)
                return
        self.deliver.ledger.apply(result)
        self._watch_again(peer)

    def _unwatch(self, peer: Peer) -> None:
        """Stop watching a peer that is not to be read for now (`Peer.paused`)."""
        self._pending.discard(peer)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._poller.unregister(peer.fd, peer)

    def _watch_again(self, peer: Peer) -> None:
        """Watch (and read) a peer again that was not read for a while (`Peer.paused`)."""
        if not self._reads(peer):  # dropped meanwhile (an ack failed): nothing left to read
            return
        try:
            if not self._poller.watches(peer.fd, peer):  # (`add` may have registered it meanwhile)
                self._poller.register(peer.fd, peer)
        except (KeyError, ValueError, OSError) as exc:
            self._drop(peer, f"connection failed: {exc}", logging.ERROR)
            return
        if self._has_bytes_ahead(peer):
            self._pending.add(peer)

    def _ack(self, peer: Peer) -> None:
        """Send the refusals queued, then the two cumulative counts the ledger allows: ACK (frames
        received: in the table or settled; the producer's credit and `flush`) and TAKEN (frames
        released: the producer drops its copies). Retried if the socket is full.

        Refusals go first (the counts cover their frames); a frame the consumer turned away
        (aborted or closing), or whose tensor nobody took, is covered by neither, so the producer
        sends it again to the next consumer.
        """
        while peer.outbox:  # refusals first: the ack covers their frames
            try:
                del peer.outbox[: peer.conn.send(peer.outbox)]
            except WOULD_BLOCK:
                peer.ack_owed = True
                return
        received = peer.positions.first_unreceived()
        taken = min(peer.positions.first_open(), received)  # (read after: a release meanwhile may pass `received`)
        record = ACK.pack(received) if taken == peer.taken else ACK.pack(received) + ACK.pack(taken | TAKEN)
        try:
            sent = peer.conn.send(record)
        except WOULD_BLOCK:
            sent = 0
        if sent != len(record):  # a partial send would need the rest sent: the buffer is never that full
            peer.ack_owed = sent == 0
            if sent:
                raise PeerGone(f"ack cut short ({sent} of {len(record)} bytes)")
            return
        peer.ack_owed = False
        peer.acked, peer.taken, peer.unacked_bytes = received, taken, 0

    def _ack_now(self, peer: Peer) -> None:
        """`_ack`, dropping a connection that fails it."""
        try:
            self._ack(peer)
        except PeerGone as exc:
            self._drop(peer, str(exc), exc.level)
        except OSError as exc:
            self._drop(peer, f"connection failed: {exc}", logging.INFO)

    def send_taken(self) -> None:
        """Tell every producer what was taken since the last acks, of what they were told was received
        (the leader calls it now and then: between acks, tensors are taken on other threads)."""
        for peer in self._peer_list():
            taken = min(peer.positions.first_open(), peer.acked)
            if taken != peer.taken and not peer.outbox and not peer.ack_owed:
                record = ACK.pack(taken | TAKEN)
                with contextlib.suppress(*WOULD_BLOCK, OSError):  # (a dead connection is the reader's to drop)
                    sent = peer.conn.send(record)
                    peer.taken = taken
                    if sent < len(record):  # the rest goes first with the next ack
                        peer.outbox += record[sent:]
                        peer.ack_owed = True
