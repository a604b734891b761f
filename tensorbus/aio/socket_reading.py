"""A socket consumer (tcp://, unix://, tcps://) read on the event loop itself, with no thread of its own.

The consumer is made as every consumer of tensorbus.aio is (on a worker thread: a broker's handshake
must not block the loop), with `LOOP_POLLER` set: its `Reactor` then registers its connections with a
`LoopPoller` and starts no reading thread, and its `Listener` starts no accept thread. `attach` has the
loop watch each connection (`add_reader`; readiness calls `Reactor.read_ready`, which reads it with the
same C or Python frame reader into the same pooled, aligned buffers, delivers into the table, records
into the ledger and acks, as a reading thread would), the wake-up pipe (room opened in the table) and
the listener's selector (accepts and handshakes: `Listener.turn`). A timer does the upkeep: acks of
what was taken, idle connections, handshakes past their deadline.

While receives come, the loop reads ahead of them only up to READ_AHEAD bytes in the table: past that
it stops reading the connections (and soon watching them: PAUSED_LOOKS) until the receives took half
of that or one waits (a turn then reads several frames, acked once). Frames read far ahead each land in
a freshly allocated buffer, and fresh pages cost 0.4-0.7 GB/s on the 2-vCPU VM (docs/PERFORMANCE.md);
frames read just ahead reuse the memory of those just taken. When no receive came for `linger_s`, it
reads on freely, into the table up to its limits, until one comes (as the blocking reactor's background
thread takes over after `linger_s`): sends and `flush` never wait for a receive.

A frame whose decoding would hold the loop (a signature checked over, or a payload decompressed into, a
MiB or more: `peer_frames.DECODE_ON_LOOP_BELOW`) is delivered on the consumer's decoding thread
(`tensorbus-aio-decode`, made at the first such frame); its connection is read again once the loop
booked it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..rendezvous import Rendezvous
from ..transports.peer_frames import UNBOUNDED
from ..transports.reactor import TAKEN_EVERY_S, Poller
from ..transports.socket_consumer import SocketConsumer
from ..transports.spinning import NEAR_MISS, STRETCH
from .turns import replying

log = logging.getLogger(__name__)
#: bytes buffered in the table past which the loop stops reading ahead of the receives (see the module): a
#: few 1 MB frames (at 1 MiB the loop stopped and started reading at every one of them; the consumer's pool
#: keeps that many buffers of up to 2 MiB more than `pooled_buffers`, lest they land in fresh memory:
#: `SocketConsumer.read_ahead`, docs/PERFORMANCE.md)
READ_AHEAD = 4 << 20
#: readable connections found while reading is paused before the loop stops watching them: a receive
#: that yields once (turns.py) before it takes ends the pause during the first, most often
PAUSED_LOOKS = 2
#: the most receives that sleep at once, without a spin, after spins that ran out (see `LoopReading.spin`)
SPIN_BACKOFF = 64


class LoopPoller(Poller):
    """A `Poller` whose descriptors an event loop watches too, once attached: readiness calls `ready(data)`.

    Registering and unregistering happen on the loop's thread once attached (the listener's handshakes
    and the reactor's reads run there); before `attach` and after `detach` the loop is not involved.

    A pause stops the connections' watches lazily: they stay until `unwatch` (called once they were found
    readable PAUSED_LOOKS times while paused), so a pause that a receive ends before (the common case: one
    large frame read ahead, then taken) costs no `remove_reader` and `add_reader`, two system calls.
    """

    def __init__(self) -> None:
        super().__init__()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: Any = None
        self.paused = False  # the connections are not to be read (the wake-up pipe, data None, always is)
        self.unwatched = False  # ... and the loop does not watch them any more (`unwatch`)

    def _watched(self, data: Any) -> bool:
        return self._loop is not None and (data is None or not self.unwatched)

    def register(self, fd: int, data: Any) -> None:
        super().register(fd, data)
        if self._loop is not None and self._watched(data):
            self._loop.add_reader(fd, self._ready, data)

    def unregister(self, fd: int, data: Any) -> None:
        super().unregister(fd, data)
        if self._loop is not None and self._watched(data):
            self._loop.remove_reader(fd)

    def pause(self, paused: bool) -> None:
        """Read the connections no more (True: the loop watches them until `unwatch`), or again (False)."""
        if paused == self.paused or self._loop is None:
            return
        self.paused = paused
        if not paused and self.unwatched:
            self.unwatched = False
            for fd, data in list(self._data.items()):
                if data is not None:
                    self._loop.add_reader(fd, self._ready, data)

    def unwatch(self) -> None:
        """Paused, a connection was found readable: stop watching the connections (until the pause ends)."""
        if not self.paused or self.unwatched or self._loop is None:
            return
        self.unwatched = True
        for fd, data in list(self._data.items()):
            if data is not None:
                self._loop.remove_reader(fd)

    def attach(self, loop: asyncio.AbstractEventLoop, ready: Any) -> None:
        """Have `loop` call `ready(data)` whenever a registered descriptor is readable."""
        self._loop, self._ready = loop, ready
        for fd, data in list(self._data.items()):
            if self._watched(data):  # (not the connections a pause stopped watching: `pause(False)` does)
                loop.add_reader(fd, ready, data)

    def detach(self) -> None:
        """Stop watching (on the loop's thread)."""
        loop, self._loop = self._loop, None
        if loop is not None:
            for fd, data in list(self._data.items()):
                if data is None or not self.unwatched:
                    loop.remove_reader(fd)


class LoopReading:
    """Reads a socket consumer's producers on the running loop (see the module docstring)."""

    def __init__(self) -> None:
        self.poller: LoopPoller | None = None  # made by `make_poller`, when the consumer is a socket one
        self._consumer: SocketConsumer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._again: asyncio.Handle | None = None  # a turn soon, for bytes read ahead the loop cannot see
        self._timer: asyncio.TimerHandle | None = None
        self._listening: int | None = None  # the listener's selector, watched
        self._table: Rendezvous | None = None
        self._intake: Any = None
        self._free = False  # no receive came for linger_s: read ahead without the READ_AHEAD bound
        self._idle: asyncio.TimerHandle | None = None  # when reading goes free, while paused
        self._takes = 0  # receives that took or waited (`taken`), counted
        self._takes_seen = 0  # ... when `_idle` was armed
        self._expire: Callable[[], None] | None = None  # the intake's expiry, run here rather than on a thread
        self._expiring: asyncio.TimerHandle | None = None
        self._spinning: asyncio.Handle | None = None  # the next step of a spin (`spin`)
        self._acking: asyncio.Handle | None = None  # acks of what turns read, soon (`_ack_soon`)
        self._spin_until = 0.0  # when the spin ends (`time.monotonic`)
        self._ran_out: float | None = None  # when the last spin ran out, until bytes came or a receive waits
        self._stretch = False  # the next spin lasts STRETCH spins (after a near miss)
        self._stretched = False  # the spin under way does
        self._reply = False  # the spin under way is a reply's: a send on the loop's thread came before it
        self._backoff = 0  # receives that sleep without a spin after the next spin that runs out, halved
        self._skip = 0  # receives left that sleep without a spin
        self._looks = 0  # readable connections found since reading paused (see PAUSED_LOOKS)
        #: the decoding thread (`decode_off_loop`), made on the loop's thread at the first frame it takes; shut
        #: by `stop_decoding` once the reading is detached
        self._decoding: ThreadPoolExecutor | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop that reads (attached), on which the consumer's receives run."""
        return self._loop

    def make_poller(self) -> LoopPoller:
        """`LOOP_POLLER`'s value: called (once) by the socket consumer as it starts listening."""
        self.poller = LoopPoller()
        return self.poller

    def attach(
        self, transport: Any, loop: asyncio.AbstractEventLoop, table: Rendezvous | None = None, intake: Any = None
    ) -> bool:
        """Start reading `transport` on `loop` (on the loop's thread), and running `intake`'s expiry there
        (a thread would make the loop wait for the GIL whenever the kernel makes it wait for a CPU);
        False if it is no socket consumer made for the loop (it reads on threads of its own)."""
        if self.poller is None or not isinstance(transport, SocketConsumer) or transport.reactor is None:
            return False
        listener = transport._listener
        assert listener is not None
        self._consumer, self._loop, self._table, self._intake = transport, loop, table, intake
        transport.read_ahead(READ_AHEAD)
        transport.reactor.off_loop = self.decode_off_loop
        self.poller.attach(loop, self._ready)
        self._listening = listener.selector
        loop.add_reader(self._listening, self._turn)
        self._tick()
        if intake is not None:
            self._expire, every_s = intake.expire, intake.expiry_interval_s
            self._expiring = loop.call_later(every_s, self._expiry, every_s)
        return True

    def move_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read on `loop` from now on (on its thread): the loop this reading was attached to has closed (a
        consumer opened in one `asyncio.run` and used in the next). Its pending callbacks died with it: the
        upkeep (which acks) and a turn over bytes read ahead are due on `loop` at once."""
        assert self._consumer is not None
        self.detach()
        self.attach(self._consumer, loop, self._table, self._intake)
        if self._again is None:  # (the upkeep's turn `attach` ran may have asked for one)
            self._again = loop.call_soon(self._read_ahead)

    def decode_off_loop(self, delivery: Callable[[], None]) -> None:
        """`PeerFrames.off_loop`: run a frame's `delivery` on the decoding thread (which then wakes the loop
        through the reactor's wake-up pipe, for a turn that books it)."""
        if self._decoding is None:
            self._decoding = ThreadPoolExecutor(1, thread_name_prefix="tensorbus-aio-decode")
        self._decoding.submit(delivery)

    def stop_decoding(self) -> None:
        """Wait for the frame being decoded off the loop, if any, and end the decoding thread (off the loop,
        as the consumer closes)."""
        if self._decoding is not None:
            self._decoding.shutdown(wait=True)

    def _expiry(self, every_s: float) -> None:
        """The intake's expiry (`Intake.expire`), every `every_s`."""
        assert self._loop is not None and self._expire is not None
        self._expiring = self._loop.call_later(every_s, self._expiry, every_s)
        try:
            self._expire()
        except Exception:  # (a bug: never stop expiring)
            log.exception("expiring on %s failed; going on", self._consumer and self._consumer.address)

    def _ready(self, data: Any) -> None:
        """A connection (None: the wake-up pipe) is readable: read it."""
        assert self._consumer is not None and self._consumer.reactor is not None and self._loop is not None
        assert self.poller is not None
        if data is not None and self.poller.paused:  # (watched still: the pause is lazy)
            if not self._wanted(READ_AHEAD // 2):
                self._looks += 1
                if self._looks >= PAUSED_LOOKS:
                    self.poller.unwatch()
                return
            self.poller.pause(False)  # (as `resume` would: the receives took enough meanwhile)
        if data is not None:
            if self._spinning is not None:  # bytes came: spin on as long again
                self._spin_until = time.monotonic() + self._spin_s()
            elif self._ran_out is not None:
                self._judge(time.monotonic() - self._ran_out <= NEAR_MISS * self._consumer.reactor.spin_s)
        served = self._receive_waits()  # (a receive this turn may serve: its reply first, then the acks)
        if self._consumer.reactor.read_ready([data], self._room, ack=not served) and self._again is None:
            self._again = self._loop.call_soon(self._read_ahead)
        if served:
            self._ack_soon()
        if data is not None and not self._wanted():
            self._stop_reading()

    def _stop_reading(self) -> None:
        """Read ahead no further: stop watching the connections until the receives took half of READ_AHEAD
        or one waits (`taken`), or none came for `linger_s` (`_go_free`)."""
        assert self.poller is not None and self._loop is not None and self._consumer is not None
        assert self._consumer.reactor is not None
        if not self.poller.paused:
            self._looks = 0
        self.poller.pause(True)
        if self._idle is None:
            self._takes_seen = self._takes
            self._idle = self._loop.call_later(self._consumer.reactor.linger_s, self._go_free)

    def _wanted(self, below: int | None = None) -> bool:
        """Whether the loop should read the connections now: no receive came for a while, fewer than
        `below` bytes (READ_AHEAD) are buffered, or a receive waits (`_room`'s rule)."""
        return self._room(below) > 0

    def _receive_waits(self) -> bool:
        """Whether a receive (of any key) waits in the table."""
        table = self._table
        return table is not None and any(table._waiters.values())

    def _room(self, limit: int | None = None) -> int:
        """The bytes a turn may still read ahead (`Reactor.read_ready` stops with the frame that uses them up):
        `limit` (READ_AHEAD) less what the table holds, at least a frame while a receive waits, no bound while free (no
        receive came for a while); 0 or less when the loop should not read."""
        table = self._table
        if self._free or table is None:
            return UNBOUNDED
        left = (READ_AHEAD if limit is None else limit) - table.buffered_bytes
        return left if left > 0 or not self._receive_waits() else 1

    def _go_free(self) -> None:
        """No receive came for `linger_s` while reading was paused: read on freely. One came meanwhile: if
        reading is paused still (the receives took too little to resume it), wait `linger_s` again."""
        assert self._loop is not None and self._consumer is not None and self._consumer.reactor is not None
        self._idle = None
        if self._takes != self._takes_seen:
            if self.poller is not None and self.poller.paused:
                self._takes_seen = self._takes
                self._idle = self._loop.call_later(self._consumer.reactor.linger_s, self._go_free)
            return
        self._free = True
        self.resume()

    def taken(self) -> None:
        """A receive took a tensor or waits: read ahead only a little again, and now if it had stopped;
        spin while a receive waits. (The pause's timer stays: it looks at `_takes` when it fires, rather
        than a timer cancelled and made again at every receive while reading is paused.)"""
        self._free = False
        self._takes += 1
        self.resume()
        if self._receive_waits():
            self.spin()

    def spin(self) -> None:
        """A receive waits: keep the loop from sleeping for up to `spin_s` (the consumer's option), as a
        blocking receive busy-polls before it sleeps (an idle vCPU wakes late: docs/PERFORMANCE.md).

        Each step is a callback of its own (`call_soon`): while one is due the loop selects with a zero
        timeout, reading whatever came, and runs its other tasks, timers and I/O as ever. The spin ends
        at the first step that finds no receive waiting, or `spin_s` after bytes last came (a large frame
        comes in many reads, as the blocking reactor's spin goes on after each). One that ran out makes
        the next receives sleep at once (1, 2, 4... up to SPIN_BACKOFF of them), so a peer that answers
        slowly, or a busy machine where spinning takes the CPU the peer needs, does not cost a spin per
        receive; but one that waited for a reply (a send on the loop's thread came before it: turns.py) is
        judged by when bytes came next (`_judge`), and if they came soon after (NEAR_MISS) the next spin is
        longer (STRETCH) instead. A stream's receives, which wait for a producer's own pace, keep to `spin_s`."""
        reply = replying()
        if self._loop is None or self._consumer is None or self._consumer.reactor is None:
            return
        spin_s = self._consumer.reactor.spin_s
        if spin_s <= 0 or self._spinning is not None:
            return
        if self._ran_out is not None:  # (no bytes since the last spin ran out: a late answer, or none)
            self._judge(False)
        if self._skip > 0:
            self._skip -= 1
            return
        self._stretched, self._stretch, self._reply = self._stretch and reply, False, reply
        self._spin_until = time.monotonic() + self._spin_s()
        self._spinning = self._loop.call_soon(self._spin_step)

    def _spin_step(self) -> None:
        """One step of `spin`: another unless no receive waits (found: spin freely again) or time is up."""
        assert self._loop is not None
        self._spinning = None
        if not self._receive_waits():
            self._backoff = 0
            return
        now = time.monotonic()
        if now >= self._spin_until:
            if self._reply and not self._stretched:
                self._ran_out = now  # (judged when bytes come: `_judge`)
            else:  # (a stream's, or a longer one: late)
                self._judge(False)
            return
        self._spinning = self._loop.call_soon(self._spin_step)

    def _spin_s(self) -> float:
        """How long the spin under way lasts (after the last bytes that came)."""
        assert self._consumer is not None and self._consumer.reactor is not None
        return self._consumer.reactor.spin_s * (STRETCH if self._stretched else 1.0)

    def _judge(self, near: bool) -> None:
        """The spin that ran out last, judged: after a reply's near miss (its bytes came within NEAR_MISS spins
        after it ran out) the next reply's receive spins STRETCH times as long, the back-off kept for when that
        one runs out too (on a busy machine, where the peer waits for a CPU, the longer spins stay rare);
        otherwise the next receives sleep at once, twice as many as last time.

        Two ends of a ping-pong that once both slept (a round's first receive waited long, the machine was
        busy a moment) each wait for the other's wake-up and reply: on a quiet VM ~100 µs and the loop's
        work, more than `spin_s`. So each spin runs out, each end sleeps, and the other waits as long in
        turn: a round trip of two wake-ups, whether the ends back off or spin on as long. One longer spin
        catches the reply of an end that slept; its own reply then comes within the other end's spin, and
        neither sleeps again."""
        self._ran_out = None
        if near:
            self._skip = 0
            self._stretch = True
        else:
            self._backoff = self._skip = min(max(1, 2 * self._backoff), SPIN_BACKOFF)
            self._stretch = False

    def resume(self) -> None:
        """Read again if reading stopped and is wanted now: once the receives took half of what was read
        ahead (not at each one: every stop and start costs two system calls and a turn of its own)."""
        if self.poller is not None and self.poller.paused and self._wanted(READ_AHEAD // 2):
            self.poller.pause(False)
            if self._again is None and self._loop is not None:  # (bytes read ahead wait too)
                self._again = self._loop.call_soon(self._read_ahead)

    def _read_ahead(self) -> None:
        """Deliver what was read ahead (a fair share per turn: the loop's other tasks run in between)."""
        assert self._consumer is not None and self._consumer.reactor is not None and self._loop is not None
        self._again = None
        if not self._wanted():  # (bytes read ahead wait too: `resume` comes back here)
            self._stop_reading()
            return
        if self._consumer.reactor.read_ready([], self._room):
            self._again = self._loop.call_soon(self._read_ahead)

    def _ack_soon(self) -> None:
        """Ack what a turn that served a waiting receive read in a callback of its own, just after: the
        receive's task is due first, so an application's reply goes out ahead of these acks. The loop runs
        it before it stops (`run_until_complete` stops a turn after the task ends; `loop.stop()` in the
        task, after the turn that follows); a turn that serves no receive acks what it read itself (when it
        leaves no bytes read ahead: `ReadingLoop.read_ready`)."""
        if self._acking is None and self._loop is not None:
            self._acking = self._loop.call_soon(self._ack)

    def _ack(self) -> None:
        """`_ack_soon`'s acks. When a receive waits again by then (the application took its tensor and asked
        for the next: a ping-pong, a receiving loop), the loop runs on until that one is served, so only an
        ack owed goes now (asked for, refusals): the rest go every `ack_every_frames` or `ack_every_bytes`
        and with the upkeep's, as a reading thread's do, not one system call per tensor on both ends. (A loop
        stopped while another receive waits leaves them unacked until it runs again: a producer's `flush`
        meanwhile waits, as it does for the frames such a loop has not read.)"""
        assert self._consumer is not None and self._consumer.reactor is not None
        self._acking = None
        reactor, waits = self._consumer.reactor, self._receive_waits()
        if not waits or reactor.owes_acks():  # (most often none is: no lead taken, no connection looked at)
            reactor.ack_read(owed_only=waits)

    def _turn(self) -> None:
        """Accept producers and advance their handshakes."""
        assert self._consumer is not None and self._consumer._listener is not None
        try:
            self._consumer._listener.turn(0.0)
        except Exception:  # (a bug: never stop accepting)
            log.exception("the handshakes on %s failed; going on", self._consumer.address)

    def _tick(self) -> None:
        """The upkeep, every TAKEN_EVERY_S: held messages, acks of what was taken, idle connections, deadlines."""
        assert self._loop is not None
        self._timer = self._loop.call_later(TAKEN_EVERY_S, self._tick)
        self._ready(None)
        self.resume()
        self._turn()

    def detach(self) -> None:
        """Stop reading (on the loop's thread), before the consumer closes: the close reads what already arrived
        on a thread of its own, and decodes there (`attach` hands decoding off the loop again)."""
        if self._consumer is not None and self._consumer.reactor is not None:
            self._consumer.reactor.off_loop = None
        for handle in (self._again, self._timer, self._idle, self._expiring, self._spinning, self._acking):
            if handle is not None:
                handle.cancel()
        self._again = self._timer = self._idle = self._expiring = self._spinning = self._acking = None
        if self._loop is not None and self._listening is not None:
            self._loop.remove_reader(self._listening)
        self._listening = None
        if self.poller is not None:
            self.poller.detach()
