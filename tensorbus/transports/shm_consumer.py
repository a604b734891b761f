"""The shm:// consumer: one thread accepts producers, maps their segments read-only and delivers frames.

A received frame is a read-only view of the producer's segment (`_view`: a `_shm.FrameView`, or an ndarray
over the mapping on the Python paths): every array decoded from it is a view that keeps it alive, so its
callback tells the producer "free" exactly when the last view is gone. While the application's arrays (taken
tensors) view `max_pinned_bytes`, a new frame is copied out of shared memory into the consumer's own and freed
at once.
"""

from __future__ import annotations

import collections
import errno
import hmac
import logging
import mmap
import os
import selectors
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..buffers import aligned_empty
from ..codec import native
from ..errors import TransportError
from . import shm_control as control
from . import shm_ring
from .base import Deliver, Held
from .leading import Leadership
from .shm_segments import reserved, sealed_at, touch_pages
from .spinning import NEAR_MISS, STRETCH
from .stream import proof

if TYPE_CHECKING:
    from .shm import ShmOptions

log = logging.getLogger(__name__)
#: a frame's read-only bytes that call back when their last view goes (`_shm.c`), where built; else an ndarray
#: over the mapping with a `weakref.finalize` (`_view`)
_FRAME_VIEW: Any = getattr(native.load("tensorbus.transports._shm"), "FrameView", None)
_CREDENTIALS = struct.Struct("3i")
#: control messages read from one producer before the others get a turn
BATCH = 64
#: after a receive read the control sockets itself, how long the background thread waits before it takes over
LINGER_S = 0.001
#: the most steps of waiting receives that sleep at once, without a spin, after spins that ran out (`_spin`)
SPIN_BACKOFF = 64
#: spins that ran out one after the other before the next steps sleep at once: a reply that came late
#: once (the producer was preempted) costs no back-off, which would make it late in turn (it sleeps)
SPIN_MISSES = 3
#: a spin polling its one producer's socket looks at every socket (new producers, pokes) this often
LOOK_EVERY = 16
#: the most receives in a row that do not read on after their frame, after reads on that found nothing (`_read_on`)
READ_ON_BACKOFF = 64


class Peer:
    """One producer connection: its mappings, its acknowledgement seam, what is held back."""

    def __init__(self, sock: socket.socket, acks: control.Acknowledgements) -> None:
        self.sock = sock
        self.nonce = os.urandom(32)
        self.authed = False
        self.open = True
        self.maps: dict[int, mmap.mmap] = {}
        self.acks = acks
        self.held: Held | None = None
        self.held_at = 0  # the position of the frame held back (its refusal, when offered again, names it)
        self.ring: Any = None  # the producer's notification ring (shm_ring.py), once it passed one


def _view(mapped: mmap.mmap, offset: int, length: int, unviewed: Callable[[int, int], None], pos: int) -> memoryview:
    """`length` read-only bytes of `mapped` from `offset`, calling `unviewed(pos, length)` once nothing views them:
    a `_shm.FrameView` where built, else an ndarray over the mapping (every array decoded from it is a view that
    keeps it alive) with a finalizer."""
    if _FRAME_VIEW is not None:
        return memoryview(_FRAME_VIEW(mapped, offset, length, unviewed, pos))
    frame = np.frombuffer(mapped, np.uint8, length, offset)
    weakref.finalize(frame, unviewed, pos, length).atexit = False
    return frame.data


class ShmListener:
    """Serves shm://NAME at `path`, reporting frames to `deliver`: on the thread of a waiting receive, or
    (while none waits) on the thread `tensorbus-shm-NAME`."""

    def __init__(self, name: str, path: str, options: ShmOptions, deliver: Deliver) -> None:
        self.name, self.path, self.options, self.deliver = name, path, options, deliver
        secret = options.auth_secret
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self._listening = self._bind()
        self._inode = os.stat(path).st_ino
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listening, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._poke_lock = threading.Lock()
        self._poked = False
        self._peers: dict[int, Peer] = {}
        self._pinned = control.PinnedBytes()  # bytes of producers' frames that taken arrays here still view
        self._stop = threading.Event()
        #: the spin of waiting receives (`_spin`), used by the leading thread only
        self._spin_s = options.spin_s
        self._misses = 0  # spins that ran out since one found a message
        self._backoff = 0  # steps that sleep without a spin after the next spin that runs out
        self._skip = 0  # steps left that sleep without a spin
        self._ran_out: float | None = None  # when the last spin ran out, until the wait after it ended
        self._stretch = False  # the next spin lasts STRETCH spins (after a near miss: spinning.py)
        self._read_on_backoff = 0  # receives that skip `_read_on` after the next one that finds nothing
        self._read_on_skip = 0  # receives left that skip it
        self._read_on_turn = 0  # which producer `_read_on` reads first (each in turn)
        self.spins = collections.Counter[str]()  # spins that found a message ("found"), ran out ("out"), near misses
        self._answer_due = 0.0  # when the leading thread next answers, urgent or not (`_answer`)
        self._asked = False  # a producer asked for what it is owed (it waits): the next `_answer` sends all
        self.leadership = Leadership(LINGER_S, self.poke)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"tensorbus-shm-{name}")
        self._thread.start()

    def _bind(self) -> socket.socket:
        """Listen at `path`; a socket file left by a consumer that died is taken over, a live one refused."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                sock.bind(self.path)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or self._alive():
                    raise TransportError(f"shm://{self.name} already has a consumer ({self.path})") from None
                os.unlink(self.path)  # (the consumer that bound it is gone)
                sock.bind(self.path)
            sock.listen(self.options.backlog)
            sock.setblocking(False)
            return sock
        except BaseException:
            sock.close()
            raise

    def _alive(self) -> bool:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.settimeout(1.0)
        try:
            probe.connect(self.path)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.leadership.run_in_background(self._step)
        except Exception:
            log.exception("shm://%s: the consumer's thread failed", self.name)
        finally:
            self.leadership.stop()
            with self.leadership.last_lead():
                self._answer()
                for peer in list(self._peers.values()):
                    self._drop(peer)
                self._selector.close()
                self._listening.close()
                os.close(self._wake_r)
            try:
                if os.stat(self.path).st_ino == self._inode:
                    os.unlink(self.path)
            except OSError:
                pass

    def wait(self, done: threading.Lock, deadline: float | None) -> bool:
        """Wait for a receive's `done`, reading the control socket on this thread meanwhile (leading.py)."""
        return self.leadership.wait(done, deadline, self._step)

    def _step(self, deadline: float | None, stop: Callable[[], bool]) -> bool:
        """One round on the leading thread: wait for control messages until `deadline` (None: a background
        thread's wait; else a waiting receive's, which spins first), handle them; False once closing.

        The acks owed go every `control.LINGER_S`, once urgent (`Acknowledgements.urgent`), or as soon as a
        producer asks (it waits for them: a `flush`, room), never between a read that served the receive and
        its return: a ping-pong's reply goes first, and a receive that keeps finding frames in its spin (which
        the producer sends on without waiting for acks) sends one ack for many frames, not one each. A wait
        that may sleep sends none first: one each time a ping-pong's end slept cost its peer a read of them,
        which in turn made this end's spin run out. Once a receive's frame is in, the frames sent behind it
        are read too (`_read_on`), nothing sent."""
        if self._stop.is_set():
            return False
        for peer in [p for p in self._peers.values() if p.held is not None]:
            self._release(peer)
        self._answer(all_owed=False)
        owed = any(peer.open and peer.acks.owed() for peer in self._peers.values())
        wait = control.LINGER_S if owed else control.IDLE_S if self._peers else None
        if deadline is not None:
            left = max(deadline - time.monotonic(), 0.0)
            wait = left if wait is None else min(wait, left)
        wait_until = None if wait is None else time.monotonic() + wait
        ready = self._spin(stop, wait) if deadline is not None else None
        if ready is None and not stop():  # (what is left of the wait after a spin that ran out)
            self._answer(all_owed=False)
            ready = self._sleep(None if wait_until is None else max(wait_until - time.monotonic(), 0.0))
            if self._ran_out is not None:
                self._judge(ready)
        for selected, _ in ready or ():
            if selected.data == "wake":
                self._woken()
            elif selected.data is None:
                self._accept()
            else:
                self._read(selected.data, stop)
        if not stop():
            self._answer(all_owed=False)
        elif deadline is not None:
            self._read_on()
        return not self._stop.is_set()

    def _sleep(self, timeout: float | None) -> list[Any]:
        """The selector's wait, up to `timeout`. A producer with a ring is told first that this side sleeps (its
        next notice sends a datagram to wake it); one whose ring has notices meanwhile is read at once instead."""
        rings = [peer for peer in self._peers.values() if peer.ring is not None and peer.held is None]
        if not rings or timeout == 0:
            return self._selector.select(timeout)
        noticed = [peer for peer in rings if not peer.ring.sleep()]
        try:
            if noticed:  # (with whatever else is ready: rings kept full must not keep the sockets waiting)
                ready = self._selector.select(0)
                seen = {key.data for key, _ in ready}
                return ready + self._ready([peer for peer in noticed if peer not in seen])
            return self._selector.select(timeout)
        finally:
            for peer in rings:
                if peer.ring is not None:
                    peer.ring.awake()

    def _noticing(self) -> list[Any] | None:
        """The producers whose ring holds notices (a spin's look at memory), as the selector gives ready ones;
        None if none does."""
        noticed = [p for p in self._peers.values() if p.ring is not None and p.held is None and p.ring.pending()]
        return self._ready(noticed) or None

    def _ready(self, peers: list[Peer]) -> list[Any]:
        """`peers` as the selector gives readable connections (key and event), for `_step` to read."""
        return [(self._selector.get_key(peer.sock), selectors.EVENT_READ) for peer in peers]

    def _read_on(self) -> None:
        """After the frame that served a receive: read what the producers sent already (BATCH messages in all,
        the producers taken in turn from one receive to the next), so the receives that follow find it in the
        table, with no lead of their own (a stream of small tensors: each lead costs several times the frame's
        own delivery), and the served receive returns soon. Where it finds nothing (a ping-pong, whose peer
        waits for this side's reply), the next 1, 2, 4... up to READ_ON_BACKOFF receives return at once: a
        reply pays one `recvmsg` that finds nothing now and then, not one a round trip."""
        if self._read_on_skip > 0:
            self._read_on_skip -= 1
            return
        peers = list(self._peers.values())
        first = self._read_on_turn % max(len(peers), 1)
        self._read_on_turn += 1
        found, left = False, BATCH
        for peer in peers[first:] + peers[:first]:
            while left and peer.open and peer.authed and peer.held is None and self._read_one(peer):
                found, left = True, left - 1
            if not left:
                break
        self._read_on_backoff = 0 if found else min(max(1, 2 * self._read_on_backoff), READ_ON_BACKOFF)
        self._read_on_skip = self._read_on_backoff
        self.spins["read on" if found else "read on, none"] += 1

    def _spin(self, stop: Callable[[], bool], wait: float | None) -> list[Any] | None:
        """A waiting receive polls for up to `spin_s` before it sleeps, as a socket receive does: a thread
        asleep on an idle vCPU wakes late (docs/PERFORMANCE.md, "shm://'s round trip"). What it found: the
        selector's events, [] when it handled a message itself, None when it found nothing (sleep now).

        With one producer connected, it polls that producer's socket itself, and everything only every
        LOOK_EVERY polls (a message found is handled at once: one system call a message rather than two).
        From the SPIN_MISSES-th spin in a row that ran out, each makes the next steps sleep at once (1, 2,
        4... up to SPIN_BACKOFF of them): a producer that answers slowly, or a busy machine where the spin
        takes the CPU the producer needs, costs no spin per step. But a message that came just after a spin
        ran out (a near miss, `_judge`) makes the next spin longer instead. A spin cut short by the step's wait
        (acks owed go after LINGER_S; the receive's deadline) is no miss: the next step spins again, stretch kept."""
        if self._spin_s <= 0 or (wait is not None and wait <= 0):
            return None
        if self._skip > 0:
            self._skip -= 1
            return None
        lone = next(iter(self._peers.values())) if len(self._peers) == 1 else None
        if lone is not None and not (lone.open and lone.authed and lone.held is None):
            lone = None
        select = self._selector.select
        stretched, self._stretch = self._stretch, False
        spin_s = self._spin_s * (STRETCH if stretched else 1.0)
        span = spin_s if wait is None else min(spin_s, wait)
        cut = span < spin_s  # (the acks owed go first, or the deadline comes: no miss)
        until = time.monotonic() + span
        polls = 0
        ring = None if lone is None else lone.ring
        while not stop():
            polls += 1
            if lone is None or polls % LOOK_EVERY == 1:  # (the listening socket and the wake-up pipe too)
                ready = select(0) or (self._noticing() if ring is None else None)
                if ready and lone is not None and all(key.data is lone for key, _ in ready):
                    ready = [] if self._read_one(lone) else None  # (a late wake-up alone is nothing found)
            elif ring is not None:  # (its notices in memory: a system call only every LOOK_EVERY polls)
                ready = [] if ring.pending() and self._read_one(lone) else None
            else:
                ready = [] if self._read_one(lone) else None
            if ready is not None:
                self._misses = self._backoff = 0
                self.spins["found"] += 1
                return ready
            if time.monotonic() >= until:
                break
        else:
            return []
        if cut:
            self._stretch = stretched
            return None
        self._misses += 1
        if self._misses >= SPIN_MISSES:
            self._backoff = self._skip = min(max(1, 2 * self._backoff), SPIN_BACKOFF)
        self._ran_out = None if stretched else time.monotonic()  # (a longer spin that ran out is no near miss)
        self.spins["out"] += 1
        return None

    def _judge(self, ready: list[Any]) -> None:
        """The wait after a spin that ran out ended: if a producer's message came within NEAR_MISS spins of it
        (a peer that slept, answering late by its wake-up: spinning.py), the next spin lasts STRETCH spins and
        the spins that ran out are forgotten, so a ping-pong's ends do not sleep in turn round after round."""
        ran_out, self._ran_out = self._ran_out, None
        came = any(selected.data not in (None, "wake") for selected, _ in ready)
        if came and ran_out is not None and time.monotonic() - ran_out <= NEAR_MISS * self._spin_s:
            self._stretch = True
            self._misses = self._backoff = self._skip = 0
            self.spins["near"] += 1

    def poke(self) -> None:
        """Wake the leading thread (from any thread): there are acks to send, or room for a held message."""
        if self.leadership.is_leading():
            return  # (it sends what is urgent, and offers held messages again, before it waits again)
        with self._poke_lock:  # (also keeps the descriptor from being closed, and reused, under the write)
            if self._poked or self._wake_w < 0:
                return
            self._poked = True
            try:
                os.write(self._wake_w, b"x")
            except OSError:  # (full: the thread is woken anyway; its end closed: it stopped)
                pass

    def _woken(self) -> None:
        # The pipe is emptied and `_poked` cleared in one hold of the lock `poke` writes under: a poke
        # between the two would otherwise leave `_poked` set with its byte read, and every later poke
        # would then write nothing (a close waited for its thread until the join timed out). What that
        # poke was for is handled below, after this.
        with self._poke_lock:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            self._poked = False
        for peer in [p for p in self._peers.values() if p.held is not None]:
            self._release(peer)

    def _answer(self, *, all_owed: bool = True) -> None:
        """Send each producer the acks owed to it (what its full socket cannot take yet: next time); with
        `all_owed` False, only once `control.LINGER_S` passed since the last answer, or one is urgent."""
        now = time.monotonic()
        if self._asked:
            all_owed, self._asked = True, False
        if not all_owed and now < self._answer_due and not any(p.acks.urgent() for p in self._peers.values()):
            return
        self._answer_due = now + control.LINGER_S
        for peer in list(self._peers.values()):
            if not peer.open:
                continue
            messages = peer.acks.pending()
            try:
                while messages:
                    control.send(peer.sock, *messages[0])
                    messages.pop(0)
            except BlockingIOError:  # (a producer that has not read for a while: it will)
                peer.acks.requeue(messages)
            except OSError:
                self._close(peer)
            finally:
                peer.acks.sent()

    # -- producers -------------------------------------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self._listening.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("shm://%s: accept failed: %s", self.name, exc)
            return
        if len(self._peers) >= self.options.max_connections:
            log.warning("shm://%s: refused a producer: max_connections=%d", self.name, self.options.max_connections)
            sock.close()
            return
        sock.setblocking(False)
        peer = Peer(sock, control.Acknowledgements(self.deliver.ledger, self.poke, self._pinned))
        self._peers[sock.fileno()] = peer
        self._selector.register(sock, selectors.EVENT_READ, peer)
        try:
            control.send(sock, "hello", peer.nonce, self._secret is not None, shm_ring.available(), True)
        except OSError:
            self._close(peer)

    def _read(self, peer: Peer, stop: Callable[[], bool] = lambda: False) -> None:
        """Handle up to BATCH of `peer`'s control messages; none more once `stop()` (the waiting receive
        is served: what is left is read at the next step, its socket still readable)."""
        for _ in range(BATCH):
            if not peer.open or peer.held is not None or stop() or not self._read_one(peer):
                return

    def _read_one(self, peer: Peer) -> bool:
        """Handle one notice in `peer`'s ring, or else one control message of its: False if none was waiting."""
        try:
            ring = peer.ring
            notice = None if ring is None else ring.take()
            if notice is None:
                got = control.receive(peer.sock, blocking=False)
                if got is None:
                    return False
                if got[0][0] != "wake" or ring is None or got[1]:
                    self._handle(peer, *got)
                    return True
                notice = ring.take()  # (None: its notice was read already, the wake-up came late: nothing found)
                if notice is None:
                    return False
            self._noticed(peer, notice)
        except (OSError, TransportError, ValueError, TypeError, LookupError, MemoryError) as exc:
            # a malformed control message or ring, or a frame the intake could not afford: that producer only
            if not isinstance(exc, ConnectionError):
                log.warning("shm://%s: dropped a producer: %s", self.name, str(exc))  # (not exc: its frames map memory)
            self._close(peer)
        return True

    def _noticed(self, peer: Peer, notice: tuple[int, int, int, int]) -> None:
        """A frame's notice from the ring: its segment's announcement, sent before it, is read first if it is
        still in the socket."""
        seg_id = notice[1]
        while seg_id not in peer.maps:
            got = control.receive(peer.sock, blocking=False)
            if got is None:
                raise TransportError(f"a frame in an unknown segment {seg_id!r}")
            self._handle(peer, *got)
        self._frame(peer, *notice)

    def _handle(self, peer: Peer, message: list[Any], fds: list[int]) -> None:
        kind = message[0]
        if not peer.authed:
            for fd in fds:
                os.close(fd)
            if kind != "proof" or len(message) != 2 or not isinstance(message[1], bytes):
                raise TransportError("no proof in the handshake")
            reason = self._refusal(peer, message[1])
            if reason is not None:
                control.send(peer.sock, "refused", reason)
                raise TransportError(reason)
            peer.authed = True
            control.send(peer.sock, "ok")
        elif kind == "seg":
            self._map(peer, message, fds)
        elif kind == "frame" and not fds:
            self._frame(peer, *message[1:])
        elif kind == "drop" and not fds and len(message) == 2:
            peer.maps.pop(message[1], None)  # (the mapping goes with the last frame viewing it)
        elif kind == "wake" and not fds and len(message) == 1 and peer.ring is not None:
            pass  # (a wake-up for notices read already: one read before a segment's announcement, `_noticed`)
        elif kind == "ask" and not fds and len(message) == 1:
            self._asked = True  # (answered at the end of this step, or the next one's start)
        elif kind == "refusals" and not fds and len(message) == 1:
            peer.acks.tells_refusals = True
        elif kind == "ring" and len(fds) == 1 and len(message) == 2 and peer.ring is None:
            peer.ring = shm_ring.consumer_ring(fds[0], message[1])
        else:
            for fd in fds:
                os.close(fd)
            raise TransportError(f"unexpected control message {kind!r}")

    def _refusal(self, peer: Peer, answer: bytes) -> str | None:
        if self._secret is not None:
            ok = hmac.compare_digest(answer, proof(self._secret, peer.nonce))
            return None if ok else "wrong auth_secret"
        raw = peer.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        uid = _CREDENTIALS.unpack(raw)[1]
        return None if uid == os.getuid() else f"another user (uid {uid}) needs auth_secret"

    def _map(self, peer: Peer, message: list[Any], fds: list[int]) -> None:
        """Map a producer's segment read-only, once its seals say its size cannot change under the mapping."""
        try:
            _, seg_id, size = message
            if len(fds) != 1 or type(seg_id) is not int or type(size) is not int or size <= 0:
                raise TransportError("malformed segment announcement")
            if not sealed_at(fds[0], size):
                raise TransportError("a segment that is not sealed at its size")
            if not reserved(fds[0], size):
                raise TransportError("a segment whose memory its producer did not reserve")
            mapped = peer.maps[seg_id] = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            touch_pages(mapped, write=False)
        finally:
            for fd in fds:
                os.close(fd)

    def _frame(self, peer: Peer, pos: int, seg_id: int, offset: int, length: int) -> None:
        mapped = peer.maps.get(seg_id)
        if mapped is None or type(pos) is not int or type(offset) is not int or type(length) is not int:
            raise TransportError(f"a frame in an unknown segment {seg_id!r}")
        if offset < 0 or length <= 0 or offset + length > len(mapped):
            raise TransportError("a frame outside its segment")
        if self._pinned.total + length > self.options.max_pinned_bytes:  # copied out, its slot freed at once
            copied = aligned_empty(length)
            copied[:] = np.frombuffer(mapped, np.uint8, length, offset)
            copied.flags.writeable = False
            frame = copied.data
            peer.acks.unviewed(pos, 0)
        else:
            peer.acks.viewed(pos, length)
            frame = _view(mapped, offset, length, peer.acks.unviewed, pos)
        fast = self.deliver.fast
        taken = fast(frame, None, peer) if fast is not None else None
        if taken is not None:  # a plain tensor the C delivery took: booked in the fewest steps
            del frame
            peer.acks.record_admitted(pos, taken.message_id, length)
            return
        result = self.deliver(frame, may_hold=True, source=peer)
        if result.refused is not None:  # (told before its free: the producer reads the frame's names in its slot)
            peer.acks.refuse(pos, result.refused)
        del frame  # (the intake and the arrays it made keep it alive now, or nothing does)
        peer.acks.record(pos, result, length)
        if result.held is not None:
            peer.held_at = pos
            self._hold(peer, result.held)

    def _hold(self, peer: Peer, held: Held) -> None:
        """Stop reading a producer whose message the full table cannot take, and stop watching its socket until
        the message is taken (a watched socket with messages waiting made every wait return at once: the
        leading thread spun a core while the application was behind)."""
        peer.held = held
        if peer.open:
            self._selector.unregister(peer.sock)

    def _release(self, peer: Peer) -> None:
        """Offer a held message again; read its producer again once it is taken."""
        assert peer.held is not None
        result = self.deliver.release(peer.held)
        if result is None:
            return
        if result.held is not None:
            peer.held = result.held
            return
        if result.refused is not None:
            peer.acks.refuse(peer.held_at, result.refused)
        peer.held = None
        self.deliver.ledger.apply(result)
        if not peer.open:
            self._peers.pop(id(peer), None)
            return
        self._selector.register(peer.sock, selectors.EVENT_READ, peer)
        self._read(peer)

    def _close(self, peer: Peer) -> None:
        """Stop reading a producer; a message held back from it is still offered (it was sent)."""
        peer.maps.clear()  # (first: whoever sees the socket close sees the mappings gone)
        if peer.open:
            peer.open = False
            if peer.ring is not None:
                peer.ring.close()
                peer.ring = None
            if peer.held is None:  # (a held one's is not watched: `_hold`)
                self._selector.unregister(peer.sock)
            self._peers.pop(peer.sock.fileno(), None)
            peer.sock.close()
            peer.acks.close()
            if peer.held is not None:
                self._peers[id(peer)] = peer
        peer.maps.clear()

    def _drop(self, peer: Peer) -> None:
        self._close(peer)
        self._peers.pop(id(peer), None)

    def room_opened(self) -> None:
        """The table may have room for a held message (under the table's lock: no waiting)."""
        self.poke()

    def close(self) -> None:
        """Stop the thread (from a callback on it: once the callback returns)."""
        self._stop.set()
        self.leadership.stop()
        if threading.current_thread() is not self._thread and not self.leadership.is_leading():
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                log.error("shm://%s: the consumer's thread has not stopped", self.name)
                return
        with self._poke_lock:  # (a finalizer may poke long after: an array kept past close)
            if self._wake_w >= 0:
                os.close(self._wake_w)
                self._wake_w = -1
