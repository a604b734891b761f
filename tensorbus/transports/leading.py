"""Who reads an endpoint's frames: the application thread waiting in `recv`, or a background thread.

A thread hand-off costs about as much as a process wake-up, so a frame is best read by the thread
that wants it (reactor.py does this for the socket transports, with its own poller). This is the same
rule for the transports that read one queue or one selector (memory://, shm://): one thread at a
time leads, holding `_lock`, and only the leader reads and delivers, so frames keep their order.

- An application thread waiting in `Consumer.recv` leads until its tensor is in (`wait`).
- A background thread leads while no application thread has led for `linger_s` (`run_in_background`):
  acks flow, held tensors are offered again and producers are read while the application is busy
  elsewhere. It steps aside as soon as an application thread wants to lead: `interrupt` makes its
  blocking wait return. Where the endpoint counts its receives (`received`), a receive that took a
  tensor from the table counts as leading too: the background then steps aside after its step, rather
  than reading on beside an application that drains the table (two threads passing the GIL to and fro,
  each pass a wake-up), and the application leads again once the table is empty. It still leads a step
  every `ASIDE_AT_MOST_S`, so the endpoint's own work goes on (Kafka's commits, and the poll a group
  wants to see) while an application drains a table that stays full.

A transport's `step(deadline, stop)` reads and delivers what is ready, waiting until `deadline`
(None: until something comes or `interrupt` is called) and returning early once `stop()`; it returns
False when the endpoint is done (closed, or turned away by its consumer).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: an application leader looks at its waiter at least this often (an abort releases it from elsewhere)
POLL_S = 0.05
#: the longest the background steps aside for receives that take from the table (`received`) before it leads a step
ASIDE_AT_MOST_S = 1.0

Step = Callable[[float | None, Callable[[], bool]], bool]


class Leadership:
    """The lead over one endpoint's reading, taken by waiting receives and, in between, a background thread."""

    def __init__(
        self, linger_s: float, interrupt: Callable[[], None], received: Callable[[], int] | None = None
    ) -> None:
        self.linger_s, self._interrupt = linger_s, interrupt
        #: how many tensors the application's receives took so far (None: not counted), read by the background
        self._received = received
        self._lock = threading.Lock()  # held by the leader
        #: guards the fields below; `with self._state_lock` where nothing waits or is woken (a Condition's
        #: `__enter__` is a Python-level call, and a receive takes this lock five times)
        self._state_lock = threading.Lock()
        self._state = threading.Condition(self._state_lock)
        self._wanted = 0  # application threads leading or asking to (under `_state`)
        self._asked = 0  # how many receives asked to lead, ever (under `_state`)
        #: whether the background waits longer than `linger_s` for one long receive (under `_state`): the
        #: end of each of that receive's leads (a POLL_S slice, or the receive) then wakes it
        self._backed_off = False
        self._quiet_from = 0.0  # the background may lead from then on (under `_state`)
        #: whether an application thread holds `_lock`, and which thread does: written by the leader, read
        #: by threads deciding whether to wait for it, both under `_state`
        self._app_leads = False
        self._leading: int | None = None
        self._stopped = threading.Event()  # set once, by `stop` or a step that returned False

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def is_leading(self) -> bool:
        """True on the thread that leads now (e.g. in a callback of a tensor it delivers)."""
        with self._state_lock:
            return self._leading == threading.get_ident()

    def _waits_for_another(self) -> bool:
        """Whether this thread should just wait: stopped, or an application thread leads (maybe this one,
        in a callback's recv) and delivers this thread's tensor too."""
        with self._state_lock:
            return self.stopped or self._app_leads or self._leading == threading.get_ident()

    def _lead_as(self, ident: int | None, application: bool = False) -> None:
        """Say who holds `_lock` now (None: about to let it go); the holder alone calls it."""
        with self._state_lock:
            self._leading, self._app_leads = ident, application

    def _wants(self) -> bool:
        """Whether an application thread leads or asks to (a background leader then steps aside)."""
        with self._state_lock:
            return self._wanted > 0

    def wait(self, done: threading.Lock, deadline: float | None, step: Step) -> bool:
        """Wait for `done` (a waiting receive's lock) until `deadline`, leading meanwhile where no other
        application thread does (that one delivers this thread's tensor too): True once acquired."""
        first = True
        while True:
            if done.acquire(blocking=False):
                return True
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            slice_end = now + POLL_S if deadline is None else min(deadline, now + POLL_S)
            if self._waits_for_another():
                if done.acquire(timeout=slice_end - now):
                    return True
                continue
            self._lead(done, slice_end, step, first)
            first = False

    def _lead(self, done: threading.Lock, slice_end: float, step: Step, first: bool) -> None:
        """Lead until `done` or `slice_end`; `first`: the receive's first lead (later ones go on waiting)."""
        me = threading.get_ident()
        with self._state_lock:  # (one hold: it asks for the lead, takes it if free, and says so)
            self._wanted += 1
            if first:
                self._asked += 1
            leads = self._lock.acquire(blocking=False)  # (never waits while `_state_lock` is held)
            if leads:
                self._leading, self._app_leads = me, True
        try:
            if not leads:
                self._interrupt()  # (the background leader's wait returns, and it lets go)
                leads = self._lock.acquire(timeout=max(slice_end - time.monotonic(), 0.0))
                if leads:
                    self._lead_as(me, application=True)
            if leads:
                waiting = done.locked
                while not self.stopped and waiting() and time.monotonic() < slice_end:
                    if not step(slice_end, lambda: not waiting()):
                        self.stop()
        finally:
            with self._state_lock:  # (one hold: it lets go of the lead, says so, and stops asking)
                if leads:
                    self._leading, self._app_leads = None, False
                    self._lock.release()
                self._wanted -= 1
                # (a receive the background waits long for: it may have ended, or only its POLL_S slice did)
                if not self._wanted and self._backed_off:
                    self._state.notify()
                self._quiet_from = time.monotonic() + self.linger_s

    def run_in_background(self, step: Step) -> None:
        """Lead whenever no application thread has for `linger_s`, until stopped (the body of a thread)."""
        received = self._received
        seen, led_at = None if received is None else received(), time.monotonic()
        while not self.stopped:
            with self._state:
                wait_s, asked = self.linger_s, -1
                while not self.stopped:
                    left = self._quiet_from - time.monotonic()
                    if not self._wanted and left <= 0:
                        break
                    # A timed wait, not a notify per receive: an application receiving in a loop pays nothing.
                    # While one receive goes on waiting (no other asked since), the wait doubles up to POLL_S,
                    # and the end of each of its POLL_S slices wakes this thread (as its end does): an idle
                    # `recv` wakes it ~20-40 times a second, not every `linger_s`.
                    if self._asked != asked:  # a receive asked to lead since the last look: look again soon
                        wait_s, asked = self.linger_s, self._asked
                    elif self._wanted:  # the same one waits on (between two of its slices, it keeps its wait)
                        wait_s = min(wait_s * 2, POLL_S)
                    self._backed_off = bool(self._wanted) and wait_s > self.linger_s
                    self._state.wait(max(left, wait_s) if self._wanted else left)
                self._backed_off = False
            now = time.monotonic()
            if received is not None and seen != (seen := received()) and now - led_at < ASIDE_AT_MOST_S:
                with self._state:  # (the application received meanwhile: as if it had led)
                    self._quiet_from = max(self._quiet_from, now + self.linger_s)
                continue
            led_at = now
            if self.stopped or not self._lock.acquire(timeout=POLL_S):
                continue
            try:
                self._lead_as(threading.get_ident())
                if not self._wants() and not step(None, self._wants):
                    self.stop()
            finally:
                try:
                    self._lead_as(None)
                finally:
                    self._lock.release()

    def stop(self) -> None:
        """No thread leads again; the background thread returns (an application leader at its next step)."""
        self._stopped.set()
        with self._state:
            self._state.notify_all()
        self._interrupt()

    def last_lead(self) -> threading.Lock:
        """The leader's lock, for the endpoint's wrap-up once stopped (`with leadership.last_lead():`): taken
        once the last leader let go; a thread that leads already must not ask."""
        return self._lock
