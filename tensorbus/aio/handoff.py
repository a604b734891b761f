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
import threading
import time
from collections.abc import Callable

from ..codec import Message
from ..errors import Timeout
from ..intake_state import ANY
from ..rendezvous import Handoff, Rendezvous
from .turns import Turns


class _Receive:
    """One awaited receive: what the delivering thread handed over, until the loop takes it or gives it back."""

    def __init__(self, table: Rendezvous, loop: asyncio.AbstractEventLoop) -> None:
        self.table, self.loop = table, loop
        self.future: asyncio.Future[Message] = loop.create_future()
        self._lock = threading.Lock()  # guards `_result` and `_withdrawn` (the delivering thread and the loop)
        self._result: tuple[Message | None, BaseException | None] | None = None
        self._withdrawn = False
        self._loop_thread = threading.get_ident()

    def arrived(self, message: Message | None, error: BaseException | None) -> None:
        """The table's callback, on the delivering thread."""
        with self._lock:
            withdrawn = self._withdrawn
            if not withdrawn:
                self._result = message, error
        if withdrawn:  # the receive is gone: the message goes back now, before this thread delivers another
            if message is not None:
                self.table.put_back(message)
        elif threading.get_ident() == self._loop_thread:
            self._settle()
        else:
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
    """What a receive's timer settles its future with: its timeout passed first."""


def _expire(future: asyncio.Future[Message], deadline: float) -> None:
    """Settle `future` as timed out, not before `deadline` (`time.monotonic`): uvloop's timers count
    whole milliseconds and may fire a fraction of one early."""
    if future.done():
        return
    early = deadline - time.monotonic()
    if early > 0:
        future.get_loop().call_later(early, _expire, future, deadline)
    else:
        future.set_exception(_Expired())


async def wait_message(
    table: Rendezvous, key: object, timeout: float | None, turns: Turns, taking: Callable[[], None]
) -> Message:
    """The next message of `key` (ANY: of any key), awaited for at most `timeout` seconds (None: forever);
    `taking()` is called once the receive waits, and once it took its message (the loop may read again).

    A message there already is taken at once (`Rendezvous.take_now`); one awaited is bounded by a timer of
    the loop's that settles the same future (not `asyncio.wait_for`, whose own future and callbacks
    cost two more turns of the loop per receive)."""
    await turns.take()
    message = table.take_now(key)
    if message is not None:  # there already: taken with no waiter, future or turn of the loop
        taking()
        return message
    loop = asyncio.get_running_loop()
    receive = _Receive(table, loop)
    handle = table.wait_async(key, Handoff(receive.arrived))
    future, timer = receive.future, None
    try:
        if not future.done():
            turns.waited()  # (it will suspend: as good as done now)
            taking()
            if timeout is not None and timeout <= 0:
                raise _Expired
            if timeout is not None:
                timer = loop.call_later(timeout, _expire, future, time.monotonic() + timeout)
        message = await future  # (a future done already: at once, no suspension)
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
        if timer is not None:
            timer.cancel()
    message = table.hand_out(message)
    taking()
    return message
