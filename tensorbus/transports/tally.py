"""What a transport counts for metrics beyond what it keeps anyway: plain numbers, read when scraped.

Every transport has a `Tally` (`Transport.tally`), whether metrics are on or not: each count is one
addition where the transport learns the thing counted (a frame acknowledged, a reconnect, a
redelivery, a wait for credit), so that nothing calls prometheus_client per tensor (metrics.py reads
these when Prometheus scrapes). Each field has one writer: the thread named beside it, or whoever
holds the lock the transport already takes there.

Send to acknowledgement is timed for one frame in flight at a time: a send starts a timing when none
runs (`timing`), and the acknowledgement that covers that frame ends it (`acked`). That costs a
send one test, samples frames spread over the stream, and makes the count exact for a producer that
waits for each acknowledgement (send, flush, send...).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Hashable

#: upper bounds (seconds) of the send-to-acknowledgement histogram
ACK_BUCKETS = (0.0001, 0.001, 0.01, 0.1, 1.0, 10.0, 60.0)
_clock = time.perf_counter


class Tally:
    """One transport's counts for metrics (see the module). Writers: the thread that learns each thing."""

    def __init__(self) -> None:
        #: metrics read this tally (set when an endpoint with metrics on is made, before it connects): a count
        #: that costs something to gather even off the hot path (librdkafka's statistics) is gathered only then
        self.metered = False
        self.acked_frames = 0  # producer: frames the endpoint acknowledged; consumer: frames it acknowledged
        self.reconnects = 0  # connections made again after one broke (the connecting thread)
        self.redeliveries = 0  # messages the broker delivered again (the consumer's I/O thread)
        self.blocked_s = 0.0  # seconds sends waited for credit or room (the sending thread, under a lock: `blocked`)
        self.ack_waits = [0] * (len(ACK_BUCKETS) + 1)  # timed frames by send-to-ack bucket (the acking thread)
        self.ack_wait_s = 0.0
        #: the position of the frame being timed (None: none is) and when it was sent; set by the sender
        #: when None, cleared by the acknowledger, both under `_timing_lock` (read without it as a hint:
        #: a hot path tests `timed is None` before it calls `timing`, a call's cost saved on most sends)
        self.timed: Hashable | None = None
        self._started = 0.0
        self._timing_lock = threading.Lock()

    def timing(self, position: Hashable) -> bool:
        """A frame at `position` is being sent: time it if no frame is timed now (True: it is)."""
        if self.timed is not None:  # (the common case, decided without the lock)
            return False
        with self._timing_lock:
            if self.timed is not None:
                return False
            self.timed, self._started = position, _clock()
            return True

    def acked(self, frames: int, *, through: int | None = None, at: Hashable | None = None) -> None:
        """`frames` frames were acknowledged: every position before `through` (a cumulative ack), or the
        one at `at`; the timing ends if its frame is among them."""
        self.acked_frames += frames
        timed = self.timed
        if timed is None or not (timed == at if through is None else timed < through):  # type: ignore[operator]
            return
        with self._timing_lock:
            if self.timed is not timed:
                return
            waited = _clock() - self._started
            self.timed = None
        self.ack_waits[bisect.bisect_left(ACK_BUCKETS, waited)] += 1
        self.ack_wait_s += waited

    def renumber(self, first: int, count: int) -> None:
        """Integer positions start again at 0 from `first`, for the `count` frames there (a new connection
        resends them): the frame being timed keeps its timing at its new position, or, not among them, ends it."""
        with self._timing_lock:
            timed = self.timed
            if isinstance(timed, int):
                self.timed = timed - first if first <= timed < first + count else None

    def forget_timing(self) -> None:
        """The positions start again (a new connection): the frame being timed, if any, is not timed."""
        with self._timing_lock:
            self.timed = None

    def blocked(self, started: float) -> float:
        """A send waited for credit or room from `started` (a `time.monotonic()`) until now; returns now.
        Every caller of one transport holds the same lock (its send lock, or the one its wait is under)."""
        now = time.monotonic()
        self.blocked_s += now - started
        return now
