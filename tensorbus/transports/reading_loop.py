"""Who leads a socket consumer's reading, and the leader's loop: select, read, deliver, ack now and then.

A thread hand-off costs about as much as a process wake-up, so a frame should be read by the
thread that wants it. One thread at a time leads (holds `_leader`: selects and reads whole frames,
delivering each). An application thread waiting in `Consumer.recv` leads itself, so its tensor needs
no hand-off, and busy-polls for `spin_s` before it sleeps, so a reply that comes quickly needs no
wake-up; a background thread leads when no application thread has waited recently (`linger_s`), so
acks flow and producers never stall while the application is busy elsewhere (leadership leaves it in
microseconds, and a background leader is woken through a pipe when an application thread wants to
lead). It waits for that idleness without the GIL (`_stream.IdleTimer`), so it never interrupts an
application that keeps receiving small tensors. After a recv that read a large frame (OVERLAP_FROM)
it takes over at once: the next large tensor then arrives while the application works on this one.
An event loop (tensorbus.aio) leads a turn at a time instead (`read_ready`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..buffers import BufferPool
from ..codec.frame import Limits
from .base import Deliver
from .idle import IdleSweep
from .peer_frames import FAIR_SHARE, PeerFrames, never, unbounded
from .poller import IdleClock, Poller
from .stream import NATIVE_STREAM, SocketOptions

#: the socket consumer's reading logs under one name, whichever of its modules speaks
log = logging.getLogger("tensorbus.transports.reactor")
#: after a recv that read a frame at least this large, the background reader takes over at once
#: rather than after `linger_s`: the next large tensor then arrives while the application works on
#: this one, and the hand-off is a few percent of such a frame's time
OVERLAP_FROM = 4 << 20
#: an application leader looks up at least this often (e.g. for an abort)
POLL_S = 0.05
#: how often the leader acks tensors taken since the last acks (between acks sent with frames read)
TAKEN_EVERY_S = 0.1


class ReadingLoop(PeerFrames):
    """Leadership of the reading (application threads, the background thread, or an event loop) and its loop."""

    def __init__(
        self, deliver: Deliver, limits: Limits, options: SocketOptions, pool: BufferPool, poller: Poller
    ) -> None:
        super().__init__(deliver, limits, options, pool, poller)
        self.linger_s: float = options.linger_s
        self.spin_s: float = options.spin_s
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, None)
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
        self._taken_due = 0.0  # when the leader next acks what was taken meanwhile (`send_taken`)
        self.idle = IdleSweep(options.idle_timeout_s)
        #: the background leader; None when an event loop reads the connections instead (`read_ready`)
        self._background: threading.Thread | None = None

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
            if self._decoded:
                self.take_decoded()
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

    def read_ready(self, ready: list[Any], room: Callable[[], int] = unbounded, ack: bool = True) -> bool:
        """An event loop's turn, in place of a leading thread: read each connection in `ready` (None: the
        wake-up pipe) and each with bytes read ahead, as far as its bytes go (FAIR_SHARE frames at most,
        and no frame more once the bytes `room()` gives are read: a TCP receive buffer grown to megabytes
        would otherwise be drained whole in one turn, into fresh buffers, while a receive waits), and do
        the upkeep.
        True while bytes read ahead wait, which the loop cannot see: call again soon.

        A turn that leaves a connection with no bytes read ahead acks every frame it delivered from it: the
        loop may not run again for a while (an application between two `run_until_complete`), and a
        stopped loop answers no ack request (the producer's `flush` would wait for it in vain). One that
        leaves bytes read ahead (FAIR_SHARE frames, or READ_AHEAD, read) leaves the acks to the turn that
        reads on, or to the thresholds `_read` acks at, as a reading thread does: those bytes are a frame
        not delivered yet, which the producer's `flush` waits for anyway, and an ack per turn of a stream
        cost the loop a tenth of its time at 64 KB (a system call that wakes the producer: docs/PERFORMANCE.md).
        An ack owed (asked for, refusals) goes at once. With `ack=False` the caller acks them (`ack_read`)
        in a turn of its own, soon after (socket_reading.py: with only the acks owed, while a receive waits
        again)."""
        if not self._leader.acquire(blocking=False):  # (`close` leads)
            return False
        try:
            if self._closed:  # (a turn the loop had due when the consumer closed)
                return False
            self._lead_as(threading.get_ident())
            booked = self.take_decoded() if self._decoded else []  # (frames delivered off the loop: `off_loop`)
            held = list(self._held)
            if held:
                self._release_held()
            peers, self._pending = self._pending, set()
            peers.update(held)  # (a held message the table took now was delivered this turn: acked with it)
            peers.update(booked)  # (... as is a frame delivered off the loop)
            for peer in ready:
                if peer is None:
                    self._drain_wake()
                else:
                    peers.add(peer)
            for peer in peers:
                if not peer.gone and not peer.paused:
                    self._read(peer, never, room)
                    if ack and self._turn_acks(peer):
                        self._ack_now(peer)
            self._upkeep(time.monotonic())
        finally:
            self._lead_as(None)
            self._leader.release()
        return bool(self._pending)

    def ack_read(self, owed_only: bool = False) -> None:
        """Ack the connections `_turn_acks` says a turn's end acks (`owed_only`: only where an ack is owed): an
        event loop's turn of its own, after turns that read with `ack=False`."""
        if not self._leader.acquire(blocking=False):  # (`close` leads, and acks all)
            return
        try:
            self._lead_as(threading.get_ident())
            for peer in self._peer_list():
                if self._turn_acks(peer, owed_only):
                    self._ack_now(peer)
        finally:
            self._lead_as(None)
            self._leader.release()

    def _turn_acks(self, peer: Any, owed_only: bool = False) -> bool:
        """Whether the end of an event loop's turn acks `peer`: an ack is owed, or (unless `owed_only`) frames
        were delivered and no bytes wait read ahead (the turn that reads those on acks them: `read_ready`)."""
        if peer.gone:
            return False
        return peer.ack_owed or (not owed_only and peer.frames != peer.acked and peer not in self._pending)

    def owes_acks(self) -> bool:
        """Whether a connection is owed an ack (asked for, refusals, one the socket had no room for): for
        an event loop, the one thread that reads (and writes these), deciding whether `ack_read` has work."""
        return any(peer.ack_owed for peer in self._peer_list())

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
            while not lone.gone and not lone.paused and time.monotonic() < spin_until:
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

    def _decoded_ready(self) -> None:
        """A delivery off the loop is done: wake the loop (it watches the wake-up pipe), which books it."""
        self._wake()

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
