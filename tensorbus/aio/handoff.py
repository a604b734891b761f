"""Waiting on the event loop for a message of the rendezvous table, without losing one to a cancellation.

The table calls a `Handoff` callback on whichever thread delivered the message (a transport's reading
thread, or the loop itself when the message was buffered already); the result reaches the loop through
`call_soon_threadsafe`. The message counts as taken (`Rendezvous.hand_out`: acknowledged on take,
recorded in the dedup file) only once the awaiting coroutine has it. A message that comes just as its
task is cancelled, or its wait timed out, goes back to the front of its key's queue (`put_back`), so
the next receive gets it: nothing is lost, nothing is taken twice, and the key stays first in, first
out (a message put back by the delivering thread is back before that thread delivers the next one).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable

from ..codec import Message
from ..errors import Timeout
from ..intake_state import ANY
from ..rendezvous import Handoff, Rendezvous
from .turns import Turns


class _Receive(Handoff):
    """One awaited receive: what the delivering thread handed over, until the loop takes it or gives it back.

    It is the waiter's `Handoff` itself (no callback of its own to call: one Python call fewer per message)."""

    def __init__(self, table: Rendezvous, loop: asyncio.AbstractEventLoop) -> None:
        self.table, self.loop = table, loop
        self.future: asyncio.Future[Message] = loop.create_future()
        self._lock = threading.Lock()  # guards `_result` and `_withdrawn` (the delivering thread and the loop)
        self._result: tuple[Message | None, BaseException | None] | None = None
        self._withdrawn = False
        self._loop_thread = threading.get_ident()

    def __call__(self, message: Message | None, error: BaseException | None) -> None:
        """The table's callback, on the delivering thread: on the loop's own (a socket consumer read by the
        loop), the future is settled at once."""
        on_loop = threading.get_ident() == self._loop_thread
        with self._lock:
            withdrawn = self._withdrawn
            if not withdrawn:
                if on_loop and not self.future.done():  # (done: cancelled; `withdraw`, next, gives it back)
                    if error is not None:
                        self.future.set_exception(error)
                    else:
                        self.future.set_result(message)  # type: ignore[arg-type]
                    return
                self._result = message, error
        if withdrawn:  # the receive is gone: the message goes back now, before this thread delivers another
            if message is not None:
                self.table.put_back(message)
        elif not on_loop:
            try:
                self.loop.call_soon_threadsafe(self._settle)
            except RuntimeError:  # the loop is closed: nobody awaits this any more
                self.withdraw()

    def _settle(self) -> None:
        """On the loop: the future gets what arrived (unless the receive was withdrawn meanwhile)."""
        with self._lock:
            if self.future.done():  # cancelled: `withdraw` (next, in the task) gives it back
                return
            result, self._result = self._result, None
        if result is None:
            return
        message, error = result
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(message)  # type: ignore[arg-type]

    def withdraw(self) -> None:
        """The receive was cancelled (or timed out), its waiter withdrawn or served: a message it had goes back."""
        with self._lock:
            self._withdrawn = True
            result, self._result = self._result, None
        future = self.future
        if result is None and future.done() and not future.cancelled() and future.exception() is None:
            result = future.result(), None  # (settled, but the task was cancelled before it ran on)
        if result is not None and result[0] is not None:
            self.table.put_back(result[0])


class _Expired(Exception):
    """What a receive's deadline settles its future with: its timeout passed first."""


class Deadlines:
    """The timeouts of one consumer's waiting receives, kept by one timer of the loop's.

    The timer is armed for the earliest deadline and left armed as receives end: one `call_later` and
    `cancel` per receive (a `TimerHandle` made, pushed on the loop's heap, cancelled) cost a 4 KB
    ping-pong ~4 µs a receive, and receives with one timeout each arm none after the first. When it
    fires, it settles the receives past their deadline and arms itself for the earliest left. A
    deadline is kept by `time.monotonic`, not before: uvloop's timers count whole milliseconds and may
    fire a fraction of one early (the timer is then armed again for what is left).
    """

    def __init__(self) -> None:
        self._due: dict[asyncio.Future[Message], float] = {}  # (the loop's thread alone touches these)
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the armed timer's
        self._at = math.inf  # when the armed timer fires (`time.monotonic`)

    def add(self, future: asyncio.Future[Message], deadline: float) -> None:
        """Settle `future` with `_Expired` at `deadline` (`time.monotonic`) unless it is done or removed first."""
        self._due[future] = deadline
        loop = future.get_loop()
        if deadline < self._at or self._loop is not loop:  # (a consumer awaited on another loop: its own timer)
            self._arm(loop, deadline)

    def remove(self, future: asyncio.Future[Message]) -> None:
        """`future`'s receive ended: no deadline of its own any more (the timer stays armed)."""
        self._due.pop(future, None)

    def _arm(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at, self._loop = deadline, loop
        self._timer = loop.call_later(max(deadline - time.monotonic(), 0.0), self.fire)

    def fire(self) -> None:
        """The timer's callback: settle every receive past its deadline; arm for the earliest left."""
        self._timer, self._loop, self._at = None, None, math.inf
        now = time.monotonic()
        for future, deadline in list(self._due.items()):
            if deadline <= now:
                del self._due[future]
                if not future.done():
                    future.set_exception(_Expired())
        if self._due:
            future, deadline = min(self._due.items(), key=lambda due: due[1])
            self._arm(future.get_loop(), deadline)


async def wait_message(
    table: Rendezvous,
    key: object,
    timeout: float | None,
    turns: Turns,
    taking: Callable[[], None],
    deadlines: Deadlines,
    loop: asyncio.AbstractEventLoop | None = None,
) -> Message:
    """The next message of `key` (ANY: of any key), awaited for at most `timeout` seconds (None: forever);
    `taking()` is called once the receive waits, and once it took its message (the loop may read again);
    `loop`: the running loop, when the caller knows it (`asyncio.get_running_loop` is a `getpid` system call).

    A message there already is taken at once (`Rendezvous.take_now`); one awaited is bounded by
    `deadlines`, whose timer settles the same future (not `asyncio.wait_for`, whose own future and
    callbacks cost two more turns of the loop per receive, nor a timer per receive)."""
    if turns.due():
        await asyncio.sleep(0)
    message = table.take_now(key)
    if message is not None:  # there already: taken with no waiter, future or turn of the loop
        taking()
        return message
    receive = _Receive(table, loop or asyncio.get_running_loop())
    handle = table.wait_async(key, receive)
    future, timed = receive.future, False
    try:
        if not future.done():
            taking()
            if timeout is not None and timeout <= 0:
                raise _Expired
            if timeout is not None:
                deadlines.add(future, time.monotonic() + timeout)
                timed = True
            message = await future
            turns.waited()  # (it suspended: the loop's ends ran nothing since it resumed, now)
        else:
            message = future.result()
    except _Expired:
        handle.cancel()
        receive.withdraw()
        what = "no message" if key is ANY else f"no tensor for key {key!r}"
        raise Timeout(f"{what} within {timeout}s") from None
    except BaseException:  # cancelled: withdraw the receive; a message it had goes back
        handle.cancel()
        receive.withdraw()
        raise
    finally:
        if timed:
            deadlines.remove(future)
    message = table.hand_out(message)
    taking()
    return message
