"""The receiving side of the stream sockets: every producer connection read by whichever thread leads.

A thread hand-off costs about as much as a process wake-up, so a frame should be
read by the thread that wants it. Connections are non-blocking and share one selector; one
thread at a time leads (selects and reads whole frames, delivering each). An application thread
waiting in `Consumer.recv` leads itself, so its tensor needs no hand-off, and busy-polls for
`spin_s` before it sleeps, so a reply that comes quickly needs no wake-up; a background thread
leads when no application thread has waited recently (`linger_s`), so acks flow and producers
never stall while the application is busy elsewhere (leadership leaves it in microseconds, and
a background leader is woken through a pipe when an application thread wants to lead). It waits
for that idleness without the GIL (`_stream.IdleTimer`), so it never interrupts an application
that keeps receiving small tensors. After a recv that read a large frame (OVERLAP_FROM) it takes
over at once: the next large tensor then arrives while the application works on this one.

Each connection has a frame reader (reader.py: the C one for plain sockets where it is built, the
Python one for TLS), a small state machine that a producer stalling mid-frame holds up for nobody
else; `_step` handles the events of either. A plain frame goes on into the consumer's table in C
where it can (the intake's `fast`, `_intake.FastDelivery`); the intake's Python delivery takes the rest.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import platform
import re
import select
import selectors
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..buffers import BufferPool
from ..codec.frame import (
    PREFIX,
    Buffer,
    Limits,
    frame_length,
)
from ..errors import CallbackInterrupted, CodecError, LimitExceeded
from ..ledger import Stream
from .base import Deliver, Delivered, Held
from .idle import IdleSweep
from .reader import ACK_REQUEST, CHECK_PREFIX, SKIPPED, stream_reader
from .stream import ACK, CRC_TRAILER, NATIVE_STREAM, REFUSALS_WANTED, TAKEN, SocketOptions, refusal

log = logging.getLogger(__name__)
NO_LIMITS = Limits(max_header_bytes=1 << 32, max_payload_bytes=1 << 64)


def _lowat_is_safe(system: str = sys.platform, release: str | None = None) -> bool:
    """Whether SO_RCVLOWAT can never keep a reader waiting for bytes the kernel will not take in:
    Linux 5.8 on caps it to the receive buffer and wakes the reader anyway under memory pressure or
    a closing window ("tcp: fix SO_RCVLOWAT possible hangs under high mem pressure", 2020)."""
    version = re.match(r"(\d+)\.(\d+)", platform.release() if release is None else release)
    return system == "linux" and version is not None and (int(version[1]), int(version[2])) >= (5, 8)


#: while a TCP connection's reader waits in the middle of a large frame, the kernel wakes it once this
#: many bytes are in (SO_RCVLOWAT), not once per loopback packet (64 KiB); see `_stream.c`, set_lowat.
#: 0 (never set) where the kernel may not be safe with it
RECV_LOWAT = 256 << 10 if _lowat_is_safe() else 0
#: after a recv that read a frame at least this large, the background reader takes over at once
#: rather than after `linger_s`: the next large tensor then arrives while the application works on
#: this one, and the hand-off is a few percent of such a frame's time
OVERLAP_FROM = 4 << 20
#: bytes of a frame one read takes at most on an event loop (tensorbus.aio), whatever pace they come at:
#: what bounds how long a read holds the loop (1 MiB into fresh pages: 1.5-2.5 ms on the 2-vCPU VM)
LOOP_READ_BUDGET = 1 << 20
#: frames read from one connection before the others get a turn
FAIR_SHARE = 16
#: an application leader looks up at least this often (e.g. for an abort)
POLL_S = 0.05
#: how often the leader acks tensors taken since the last acks (between acks sent with frames read)
TAKEN_EVERY_S = 0.1
#: refusals a producer has not taken off its socket, in bytes, at most: past that it is dropped
MAX_OUTBOX = 1 << 20
_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


#: what `_finish` books for a frame a recv_async callback had while it was being delivered (it was taken)
TAKEN_WITHOUT_ID = Delivered(None, True)
#: numbers naming connections as sources of tensors (`_Peer.source`), in this process
_SOURCES = itertools.count(1)


def _never() -> bool:
    return False


class IdleClock:
    """When the application last led: the background reader waits until it has been idle for a while.

    The Python stand-in for `_stream.IdleTimer`, which waits without the GIL (this one wakes with
    it every `linger_s` while the application keeps receiving).
    """

    def __init__(self) -> None:
        self._idle_at = 0.0
        self._woken = False
        self._cond = threading.Condition()

    def touch(self, linger_s: float) -> None:
        """The application stopped leading: idle once `linger_s` pass without another touch."""
        self._idle_at = time.monotonic() + linger_s

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the application is idle (True), or until `timeout_s` pass or `wake` is called (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                if now >= self._idle_at:
                    return True
                if self._woken or now >= deadline:
                    return False
                self._cond.wait(min(self._idle_at, deadline) - now)

    def wake(self) -> None:
        """Make every wait, now and later, return at once (False unless the application is idle): closing."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()


class PeerGone(Exception):
    """The connection ended; the message says why, `level` how loudly to log it (INFO: it just left)."""

    def __init__(self, reason: str, level: int = logging.ERROR) -> None:
        super().__init__(reason)
        self.level = level


class Poller:
    """The readiness of the connections, for the reading thread: epoll itself where there is one.

    A `selectors` select costs about a microsecond of Python around its system call, and a reading
    thread makes several while it waits for a reply; this one returns what was registered with
    each ready descriptor. Elsewhere (not Linux) it is a `selectors.DefaultSelector` underneath.
    """

    def __init__(self) -> None:
        self._data: dict[int, Any] = {}
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._selector = selectors.DefaultSelector() if self._epoll is None else None

    def register(self, fd: int, data: Any) -> None:
        """Report `data` whenever `fd` is readable; raises (OSError, KeyError) if it is registered already."""
        if fd in self._data:
            raise KeyError(f"{fd} is registered already")
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN)
        else:
            assert self._selector is not None
            self._selector.register(fd, selectors.EVENT_READ)
        self._data[fd] = data

    def watches(self, fd: int, data: Any) -> bool:
        """Whether `fd` is watched for `data`."""
        return self._data.get(fd) is data

    def unregister(self, fd: int, data: Any) -> None:
        """Stop watching `fd` for `data` (KeyError if it is not watched for it: a reused number)."""
        if fd not in self._data or self._data[fd] is not data:
            raise KeyError(f"{fd} is not watched for {data!r}")
        del self._data[fd]
        if self._epoll is not None:
            self._epoll.unregister(fd)
        else:
            assert self._selector is not None
            self._selector.unregister(fd)

    def poll(self, timeout_s: float) -> list[Any]:
        """What was registered with each descriptor readable within `timeout_s` (0: now)."""
        data = self._data
        if self._epoll is not None:
            return [data[fd] for fd, _ in self._epoll.poll(timeout_s) if fd in data]
        assert self._selector is not None
        return [data[key.fd] for key, _ in self._selector.select(timeout_s)]

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
        if self._selector is not None:
            self._selector.close()


class _Peer:
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
        self.replay: tuple[memoryview, int | None] | None = None  # a frame whose delivery was interrupted
        self.refusals = False  # the producer asked to be told which frames were refused (stream.REFUSALS_WANTED)
        self.outbox = bytearray()  # refusals not sent yet (the socket was full): they go before the next ack
        self.gone = False  # dropped: no longer read


class Reactor:
    """Reads frames from registered connections on the leading thread and hands them to `deliver`."""

    def __init__(
        self, deliver: Deliver, limits: Limits, options: SocketOptions, pool: BufferPool, poller: Poller | None = None
    ) -> None:
        """`poller`: an event loop's (tensorbus/aio), which then reads through `read_ready`; no thread starts."""
        self.deliver, self.limits, self.options, self.pool = deliver, limits, options, pool
        self._ack_every = (options.ack_every_frames, options.ack_every_bytes)  # (read for every frame)
        self._fast = deliver.fast  # the intake's C delivery of plain frames
        self.linger_s: float = options.linger_s
        self.spin_s: float = options.spin_s
        self._poller = Poller() if poller is None else poller
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, None)
        #: the connections being read, by descriptor: added by the listener's thread, dropped by the leader;
        #: changed and copied under `_peers_lock` (the leader iterates over copies)
        self._peers: dict[int, _Peer] = {}
        self._peers_lock = threading.Lock()
        self._pending: set[_Peer] = set()  # peers with bytes read ahead (or decrypted) that the selector cannot see
        self._held: list[_Peer] = []  # peers not read until the table takes the message they hold
        #: held by the thread that leads; an RLock, which only its owner can release (a Ctrl-C may come
        #: just after it was taken: `read_while_waiting` then releases it if it is this thread's)
        self._leader = threading.RLock()
        #: guards `_wanted`, `_app_leads` and `_leading` (a plain lock, so the leader's check of `_wanted` on
        #: every step is a C call); `_state` waits and notifies on it
        self._wanted_lock = threading.Lock()
        self._state = threading.Condition(self._wanted_lock)
        self._wanted = 0  # application threads waiting to lead (and `close`): under `_wanted_lock`
        #: who holds `_leader`: whether an application thread (not the background one) does, and its ident;
        #: written by the leader, read by threads deciding whether to wait for it, all under `_wanted_lock`
        self._app_leads = False
        self._leading: int | None = None
        #: the background thread leaves leadership to the application until it has been idle for `linger_s`
        self._idle = NATIVE_STREAM.IdleTimer() if NATIVE_STREAM is not None else IdleClock()
        self._closed = False
        self._largest_read = 0  # the largest frame read since an application thread took the lead
        self._taken_due = 0.0  # when the leader next acks what was taken meanwhile (`send_taken`)
        self.idle = IdleSweep(options.idle_timeout_s)
        self.reading: Any = None  # the name of the connection being read (for the consumer's log lines)
        #: the background leader; None when an event loop reads the connections instead (`read_ready`)
        self._background: threading.Thread | None = None
        if poller is None:
            self._background = threading.Thread(target=self._lead_in_background, daemon=True, name="tensorbus-reader")
            self._background.start()

    # -- connections ----------------------------------------------------------------------------

    @property
    def connections(self) -> int:
        """Producer connections being read."""
        with self._peers_lock:
            return len(self._peers)

    def _peer_list(self) -> list[_Peer]:
        """The connections being read now (a copy: the listener's thread adds to them meanwhile)."""
        with self._peers_lock:
            return list(self._peers.values())

    def _reads(self, peer: _Peer) -> bool:
        """Whether `peer` is still read (not dropped: its descriptor's number may be another's now)."""
        with self._peers_lock:
            return self._peers.get(peer.fd) is peer

    def add(self, conn: socket.socket, name: Any) -> None:
        """Start reading a connection that finished its handshake."""
        conn.setblocking(False)
        if conn.family != socket.AF_UNIX:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # acks go out at once
        lowat = RECV_LOWAT if conn.family in (socket.AF_INET, socket.AF_INET6) else 0
        peer = _Peer(conn, name, stream_reader(conn, self.limits, self.pool.take, lowat), self.deliver.ledger.stream())
        if self._background is None:  # read on an event loop: in turns
            peer.reader.budget = LOOP_READ_BUDGET
        with self._peers_lock:
            self._peers[peer.fd] = peer  # (first: a leader that reads it and drops it must find it here)
        try:
            if self._closed:
                raise ValueError("closed")
            # (no TLS bytes can be pending yet: a producer sends nothing until it has read the verdict)
            self._poller.register(peer.fd, peer)
        except (ValueError, KeyError, OSError, RuntimeError):  # the consumer closed during the handshake
            with self._peers_lock:
                if self._peers.get(peer.fd) is peer:
                    del self._peers[peer.fd]
            conn.close()
            return
        # A leader may have read it before it was registered (a lone peer is read unpolled), and either
        # dropped it or held its message for a full table (`_hold` found nothing to unregister then):
        # neither may stay watched (a held peer is registered again when its message is taken).
        if not self._reads(peer) or peer.held is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._poller.unregister(peer.fd, peer)

    def _drop(self, peer: _Peer, reason: str, level: int) -> None:
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

    # -- leadership -----------------------------------------------------------------------------

    def read_while_waiting(self, done: threading.Lock, deadline: float | None) -> bool:
        """Wait for `done` (a waiter's lock) until `deadline`, reading frames on this thread meanwhile.

        True once `done` was acquired, False when the deadline passed. When another application
        thread leads, this just waits for `done`; on an event loop's reactor, only the loop reads.
        """
        me = threading.get_ident()
        if self._background is None or self.leading_thread() == me:  # (the loop reads; or this thread leads
            #                                   already, and is in a recv_async callback's recv: it cannot read)
            return done.acquire(timeout=-1 if deadline is None else max(deadline - time.monotonic(), 0.0))
        while True:
            if done.acquire(blocking=False):
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            slice_s = POLL_S if remaining is None else min(remaining, POLL_S)
            try:
                led = not self._closed and self._take_lead(slice_s)
            except BaseException:  # a Ctrl-C comes out of the call that took the lock, too: give it back
                self._let_go_if_taken(me)
                raise
            if not led:
                if done.acquire(timeout=slice_s):
                    return True
                continue
            try:  # (straight after taking the lead: no call in between, so no Ctrl-C)
                self._largest_read = 0
                self._lead(lambda: not done.locked(), time.monotonic() + slice_s, self.spin_s)
            finally:
                try:
                    self._lead_as(None)
                    self._idle.touch(0.0 if self._largest_read >= OVERLAP_FROM else self.linger_s)
                finally:
                    self._leader.release()

    def _let_go_if_taken(self, me: int) -> None:
        """Give the lead back if this thread (not leading before) was interrupted while taking it."""
        with self._state:
            if self._leading == me:
                self._leading, self._app_leads = None, False
        with contextlib.suppress(RuntimeError):  # (not taken: an RLock refuses a release by a non-owner)
            self._leader.release()

    def _lead_as(self, ident: int | None, application: bool = False) -> None:
        """Say who holds `_leader` now (None: about to let it go); the holder alone calls it."""
        with self._wanted_lock:
            self._leading, self._app_leads = ident, application

    def leading_thread(self) -> int | None:
        """The ident of the thread that leads now, if any (for a thread deciding whether to wait)."""
        with self._wanted_lock:
            return self._leading

    def _take_lead(self, wait_s: float) -> bool:
        """Become the application leader: at once if nobody leads, else by asking a background leader to
        step aside. False when another application thread leads: it delivers this thread's tensor too.
        """
        me = threading.get_ident()
        with self._state:  # (`_app_leads` is read under the lock its leader writes it under)
            if self._leader.acquire(blocking=False):
                self._leading, self._app_leads = me, True
                return True
            if self._app_leads:
                return False
            self._wanted += 1
        taken = False
        try:
            self._wake()
            taken = self._leader.acquire(timeout=wait_s)
            return taken
        finally:
            with self._state:
                self._wanted -= 1
                if taken:
                    self._leading, self._app_leads = me, True

    def _lead_in_background(self) -> None:
        """Lead while no application thread has led recently; step aside as soon as one wants to."""
        while not self._closed:
            if self._someone_wants_to_lead():  # (an application thread is taking over from this one)
                with self._state:
                    self._state.wait(0.001)
                continue
            if not self._idle.wait(POLL_S) or not self._leader.acquire(timeout=POLL_S):
                continue
            if not self._idle.wait(0):  # an application thread led meanwhile (and just let go)
                self._leader.release()
                continue
            try:
                self._lead_as(threading.get_ident())
                self._lead(self._someone_wants_to_lead, time.monotonic() + 1.0)
            except Exception:  # a bug here must not silently stop all reading
                log.exception("the background reader failed; restarting it")
            finally:
                self._lead_as(None)
                self._leader.release()

    def _someone_wants_to_lead(self) -> bool:
        """Whether an application thread (or `close`) waits to take the lead from a background leader."""
        with self._wanted_lock:
            return self._wanted > 0

    def _lead(self, stop: Callable[[], bool], deadline: float, spin_s: float = 0.0) -> bool:
        """Select and read until `stop()` or the deadline; True if `stop()` ended it. Caller leads.

        With `spin_s`, each wait polls without sleeping for that long first (application leaders
        only: that is where a wake-up's latency is felt, and a background thread must not hog the GIL).
        """
        polls = 0
        while not self._closed:
            if self._held:
                self._release_held()
            if stop():
                return True
            polls += 1
            if self._pending and polls % FAIR_SHARE:
                events = []  # bytes already read ahead come first, without a system call (most rounds)
            else:
                events = self._ready(stop, deadline, spin_s)
            ready, self._pending = self._pending, set()
            for peer in events:
                if peer is None:
                    self._drain_wake()
                else:
                    ready.add(peer)
            for peer in ready:
                self._read(peer, stop)
            now = time.monotonic()
            self._upkeep(now)
            if now >= deadline:
                return stop()
        return False

    def _upkeep(self, now: float) -> None:
        """What the leader does now and then: drop idle connections, tell producers what was taken."""
        if self.idle.due(now):
            self.idle.run(self, now)
        if now >= self._taken_due:  # tensors taken since: their producers may drop their copies
            self._taken_due = now + TAKEN_EVERY_S
            self.send_taken()

    def read_ready(self, ready: list[Any], enough: Callable[[], bool] = _never) -> bool:
        """An event loop's turn, in place of a leading thread: read each connection in `ready` (None: the
        wake-up pipe) and each with bytes read ahead, as far as its bytes go (FAIR_SHARE frames at most,
        and no frame more once `enough()` holds: a TCP receive buffer grown to megabytes would otherwise
        be drained whole in one turn, into fresh buffers, while a receive waits), and do the upkeep.
        True while bytes read ahead wait, which the loop cannot see: call again soon.

        Every frame a turn delivered is acked before it ends, whether or not bytes wait read ahead: the
        loop may not run again for a while (an application between two `run_until_complete`), and a
        stopped loop answers no ack request (the producer's `flush` would wait for it in vain)."""
        if not self._leader.acquire(blocking=False):  # (`close` leads)
            return False
        try:
            self._lead_as(threading.get_ident())
            held = list(self._held)
            if held:
                self._release_held()
            peers, self._pending = self._pending, set()
            peers.update(held)  # (a held message the table took now was delivered this turn: acked with it)
            for peer in ready:
                if peer is None:
                    self._drain_wake()
                else:
                    peers.add(peer)
            for peer in peers:
                if not peer.gone and peer.held is None:
                    self._read(peer, _never, enough)
                    if not peer.gone and (peer.frames != peer.acked or peer.ack_owed):
                        self._ack_now(peer)
            self._upkeep(time.monotonic())
        finally:
            self._lead_as(None)
            self._leader.release()
        return bool(self._pending)

    def _ready(self, stop: Callable[[], bool], deadline: float, spin_s: float) -> list[Any]:
        """The peers (None: the wake-up pipe) with bytes to read, waiting for some until `deadline`.

        With `spin_s`, it busy-polls that long before it sleeps: a sleeping thread wakes late.
        While there is one connection (read in C), it busy-polls by reading ahead from it
        (`StreamReader.fill`): the read that finds a frame is the one that would follow the poll, so
        a reply costs a system call fewer. What it finds is delivered here, so this
        returns [] as soon as `stop()` holds or bytes wait.
        """
        poll = self._poller.poll
        if self._pending:  # bytes read ahead wait: only a look at the others, as the fair share's turn
            return poll(0.0)
        spin_until = min(time.monotonic() + spin_s, deadline)
        only = self._peer_list() if spin_s > 0 else []
        if len(only) == 1:
            lone, fill = only[0], only[0].reader.fill
            while not lone.gone and lone.held is None and time.monotonic() < spin_until:
                if fill():  # (a Ctrl-C in here leaves no frame half taken: nothing to drop the connection for)
                    self._read(lone, stop)
                    if self._pending or stop():
                        return []
        else:
            events = poll(0.0)
            while not events and time.monotonic() < spin_until:
                events = poll(0.0)
            if events:
                return events
        left = deadline - time.monotonic()
        return poll(left) if left > 0 else []

    def room_opened(self) -> None:
        """Called under the table's lock when room opens: wake the leader if it holds messages back."""
        if self._held:
            self._wake()

    def _wake(self) -> None:
        if self._wake_w >= 0:
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"\0")

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self._wake_r, 4096)

    # -- reading one connection -----------------------------------------------------------------

    def _read(self, peer: _Peer, stop: Callable[[], bool], enough: Callable[[], bool] = _never) -> None:
        """Deliver up to FAIR_SHARE frames the connection has ready; stop early once `stop()` holds (and
        nothing is read ahead) or `enough()` does (bytes read ahead then wait in `_pending`)."""
        self.reading = peer.name
        try:
            for _ in range(FAIR_SHARE):
                if peer.held is not None or (stop() and not self._has_bytes_ahead(peer)) or enough():
                    break  # held back, done and nothing read ahead says more is on its way, or enough read ahead
                if not self._step(peer):  # read on while bytes come: the next `recv` then finds its tensor waiting
                    break
            if peer.held is None and self._has_bytes_ahead(peer):
                self._pending.add(peer)
        except PeerGone as exc:
            self._drop(peer, str(exc), exc.level)
        except (BrokenPipeError, ConnectionResetError) as exc:
            self._drop(peer, f"went away: {exc}", logging.INFO)
        except MemoryError:
            self._drop(peer, "dropped: no memory for its next frame", logging.ERROR)
        except (OSError, ssl.SSLError) as exc:
            self._drop(peer, f"connection failed: {exc}", logging.INFO if self._closed else logging.ERROR)
        except BaseException as exc:  # e.g. Ctrl-C in a recv reading for itself
            if peer.replay is not None or isinstance(exc, CallbackInterrupted):
                self._pending.add(peer)  # interrupted while delivering: that frame (if any) comes first next time
            else:  # somewhere in the middle of the stream: the producer reconnects and resends instead
                message = f"reading was interrupted ({type(exc).__name__}); its unacknowledged frames come again"
                self._drop(peer, message, logging.WARNING)
            raise

    @staticmethod
    def _has_bytes_ahead(peer: _Peer) -> bool:
        """Bytes already read (or decrypted) that the selector cannot see."""
        return peer.reader.buffered > 0

    def _replay(self, peer: _Peer) -> bool:
        """Deliver again the frame whose delivery was interrupted (`peer.replay`, set); True, as a step."""
        assert peer.replay is not None
        frame, crc = peer.replay
        peer.replay = None
        self._deliver(peer, frame, crc)
        return True

    def _step(self, peer: _Peer) -> bool:
        """Advance the connection by one event of its reader (a frame, an ack request...); False when out of bytes."""
        if peer.replay is not None:
            return self._replay(peer)
        reader = peer.reader
        event = reader.read()
        if event is None:
            return False
        if type(event) is tuple:
            peer.total = reader.last_total  # (what the acks count: with the CRC after the frame, if sent)
            frame, crc = event
            if self._fast is not None and (taken := self._fast(frame, crc, peer.source)) is not None:
                peer.positions.record_admitted(peer.frames, taken.message_id)  # (`_finish` of a plain tensor)
                self._booked(peer)
            else:
                self._deliver(peer, frame, crc)
        elif event == ACK_REQUEST:
            self._ack(peer)
        elif event == SKIPPED:
            peer.total = reader.last_total  # (its prefix)
            self._deliver(peer, memoryview(reader.prefix))  # the consumer counts it as refused
        elif event == CHECK_PREFIX:
            if reader.prefix == REFUSALS_WANTED:  # (not a frame: a marker the readers leave to this step)
                peer.refusals = True
                reader.skip(0)
            else:
                reader.skip(self._skip_length(reader.prefix, CRC_TRAILER.size if reader.crc_after else 0))
        else:  # END
            raise PeerGone("disconnected mid-frame") if reader.mid_frame else PeerGone("went away", logging.INFO)
        return True

    def _deliver(self, peer: _Peer, frame: memoryview, crc: int | None = None) -> None:
        """Hand a whole frame to the consumer and book it. Should that be interrupted (Ctrl-C in a
        `recv` reading for itself), the frame is kept and delivered again before anything else of
        its producer: it was read off the socket, and the acks count every frame."""
        try:
            result = self.deliver(frame, crc, may_hold=True, source=peer.source)
        except CallbackInterrupted:  # in a recv_async callback, which had its message: delivered
            self._finish(peer, TAKEN_WITHOUT_ID)
            raise
        except BaseException:
            peer.replay = (frame, crc)
            raise
        self._finish(peer, result)

    def _skip_length(self, prefix: Buffer, trailer: int) -> int:
        """Bytes to skip after a frame's prefix over this consumer's limits, which the consumer then counts
        as refused; raises PeerGone (drop the connection) for a prefix that is not a frame at all."""
        try:
            frame_length(prefix, self.limits)
        except LimitExceeded:
            return frame_length(prefix, NO_LIMITS) + trailer - PREFIX.size
        except CodecError as exc:
            also = " (and bit 7, its CRC after it)" if trailer else ""
            raise PeerGone(f"dropped: it sent something that is not a tensorbus frame: {exc}{also}") from None
        raise PeerGone("dropped: its reader refused a prefix frame_length takes (a bug: please report it)")

    def _finish(self, peer: _Peer, result: Delivered) -> None:
        """Book a delivered frame in the ledger; ack every `ack_every_frames` frames or `ack_every_bytes` bytes."""
        if result.held is not None:
            self._hold(peer, result.held)
        if result.refused is not None:
            self._refuse(peer, peer.frames, result.refused)
        peer.positions.record(peer.frames, result)
        self._booked(peer)

    def _booked(self, peer: _Peer) -> None:
        """Count a frame booked in the ledger; ack every `ack_every_frames` frames or `ack_every_bytes` bytes."""
        peer.frames += 1
        peer.unacked_bytes += peer.total
        if peer.total > self._largest_read:
            self._largest_read = peer.total
        every_frames, every_bytes = self._ack_every
        if peer.frames - peer.acked >= every_frames or peer.unacked_bytes >= every_bytes or peer.ack_owed:
            self._ack(peer)

    def _refuse(self, peer: _Peer, index: int, reason: str) -> None:
        """Tell the producer (if it asked) that its frame `index` was refused: before the ack that covers it."""
        if not peer.refusals:
            return
        peer.outbox += refusal(index, reason)
        if len(peer.outbox) > MAX_OUTBOX:
            raise PeerGone(f"dropped: it left {len(peer.outbox)} bytes of refusals of its frames unread")
        peer.ack_owed = True  # (sent with the next ack, at the latest)

    def _hold(self, peer: _Peer, message: Held) -> None:
        """Stop reading a peer whose message the full table cannot take: other peers go on."""
        peer.held = message
        self._held.append(peer)
        self._pending.discard(peer)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._poller.unregister(peer.fd, peer)

    def _release_held(self) -> None:
        """Offer held messages to the table again; read their peers again once they are taken."""
        for peer in list(self._held):
            assert peer.held is not None
            try:
                result = self.deliver.release(peer.held)
            except CallbackInterrupted:  # a recv_async callback had it: taken
                self._read_again(peer, Delivered(peer.held.message_id, True, admitted=True))
                raise
            if result is not None and result.held is not None:
                peer.held = result.held  # (no room after all: held again)
            elif result is not None:
                self._read_again(peer, result)

    def _read_again(self, peer: _Peer, result: Delivered) -> None:
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
        if not self._reads(peer):  # dropped while held (an ack failed): nothing left to read
            return
        try:
            if not self._poller.watches(peer.fd, peer):  # (`add` may have registered it meanwhile)
                self._poller.register(peer.fd, peer)
        except (KeyError, ValueError, OSError) as exc:
            self._drop(peer, f"connection failed: {exc}", logging.ERROR)
            return
        if self._has_bytes_ahead(peer):
            self._pending.add(peer)

    def _ack(self, peer: _Peer) -> None:
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
            except _WOULD_BLOCK:
                peer.ack_owed = True
                return
        received, taken = peer.positions.first_unreceived(), peer.positions.first_open()
        record = ACK.pack(received) if taken == peer.taken else ACK.pack(received) + ACK.pack(taken | TAKEN)
        try:
            sent = peer.conn.send(record)
        except _WOULD_BLOCK:
            sent = 0
        if sent != len(record):  # a partial send would need the rest sent: the buffer is never that full
            peer.ack_owed = sent == 0
            if sent:
                raise PeerGone(f"ack cut short ({sent} of {len(record)} bytes)")
            return
        peer.ack_owed = False
        peer.acked, peer.taken, peer.unacked_bytes = received, taken, 0

    def _ack_now(self, peer: _Peer) -> None:
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
                with contextlib.suppress(*_WOULD_BLOCK, OSError):  # (a dead connection is the reader's to drop)
                    sent = peer.conn.send(record)
                    peer.taken = taken
                    if sent < len(record):  # the rest goes first with the next ack
                        peer.outbox += record[sent:]
                        peer.ack_owed = True

    # -- shutdown -------------------------------------------------------------------------------

    def close(self, timeout: float) -> None:
        """Answer what already arrived (ack requests above all), ack every delivered frame, drop every connection.

        Called on the reading thread itself (from a `recv_async` callback), it finishes on a thread of
        its own once that thread stops leading: it cannot wait for a lock its own caller holds.
        """
        if threading.get_ident() == self.leading_thread():
            threading.Thread(target=self.close, args=(timeout,), daemon=True, name="tensorbus-close").start()
            return
        with self._state:
            self._wanted += 1  # a background leader steps aside
        self._wake()
        got = self._leader.acquire(timeout=timeout)
        try:
            if got:
                self._lead(lambda: False, time.monotonic())  # one pass over what is readable now
            self._closed = True
            self._wake()
            self._idle.wake()
            with self._state:
                self._state.notify_all()
            if self._background is not None:
                self._background.join(timeout)
            for peer in self._peer_list():
                with contextlib.suppress(OSError, PeerGone, *_WOULD_BLOCK):
                    if got:
                        self._ack(peer)  # what was received and taken: the producer sends the rest to the next one
                peer.positions.close()
                with contextlib.suppress(OSError):
                    peer.conn.shutdown(socket.SHUT_RDWR)
                peer.conn.close()
            with self._peers_lock:
                self._peers.clear()
            self._poller.close()
            wake_r, wake_w, self._wake_r, self._wake_w = self._wake_r, self._wake_w, -1, -1
            os.close(wake_r)
            os.close(wake_w)
        finally:
            if got:
                self._leader.release()
