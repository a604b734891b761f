"""A producer's record of the messages its consumer refused: each raised once, by the next `send` or `flush`.

A consumer refuses a frame for good (a bad or missing signature, a stale incarnation, over a limit) and
tells the producer where the transport can (stream sockets, memory://, shm://; a broker's consumer is not
the producer's peer). The producer raises `Rejected` for it at its next `send` (which then sends
nothing) or `flush`, where the mistake was made, rather than leaving the far end to time out.
"""

from __future__ import annotations

import collections
import logging
import threading

from ..codec.frame import Buffer, MessageId
from ..errors import Rejected
from .stream import names_in

log = logging.getLogger(__name__)


class Refusals:
    """The refusals of one producer's messages not raised yet, oldest first (`pending`: a send's quick look at it
    is one test, without the lock); the other chunks of a message already refused are not told again. Added by
    whichever thread reads the consumer's verdicts, raised by the producer's; both under one lock (a `Rejected`,
    once taken, is raised by one thread only)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._lock = threading.Lock()
        self.pending: collections.deque[Rejected] = collections.deque()
        self._last: MessageId | None = None  # the message last refused (its other chunks: told once)

    def add(
        self, reason: str, head: Buffer | None = None, names: tuple[str | None, MessageId | None] | None = None
    ) -> None:
        """The consumer refused a frame for `reason`: a `Rejected` for the next send or flush, logged here. The
        message is named by the frame's `head` (its prefix and header), or where that is gone by `names` (key,
        message id); another chunk of the message refused last is not told again."""
        key, message_id = _names(head) if head is not None or names is None else names
        what = f"message {message_id} (key {key!r})" if key is not None or message_id is not None else "a message"
        rejected = Rejected(
            f"{self.address} refused {what}: {reason}; it is not sent again",
            key=key,
            message_id=message_id,
            reason=reason,
        )
        with self._lock:
            if message_id is not None and message_id == self._last:
                return
            self._last = message_id
            self.pending.append(rejected)
        log.warning("%s", rejected)

    def raise_oldest(self) -> None:
        """Raise the oldest refusal not raised yet, if there is one."""
        with self._lock:
            if not self.pending:  # (none; or another thread's send raised the last one just now)
                return
            rejected = self.pending.popleft()
        raise rejected

    def clear(self) -> None:
        """Forget the refusals not raised (the producer closes: each was logged when it was told)."""
        with self._lock:
            self.pending.clear()


def _names(head: Buffer | None) -> tuple[str | None, MessageId | None]:
    """The key and message id in a frame's head; None for those not known (no head, or one not readable)."""
    if head is None:
        return None, None
    try:
        return names_in(head)
    except Exception:  # (a head no longer whole: the error then names the reason only)
        return None, None
