"""The transport interface: carry whole frames from producers to the consumer of an endpoint.

Chunking, deduplication, reassembly and key matching live above this interface, once; a
transport only moves frames (lists of buffers) and reports each received frame to `deliver`.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from typing import Any, ClassVar, NamedTuple, Protocol

from ..codec.frame import Buffer, Limits, Message, MessageId


class Delivered(NamedTuple):
    """What the consumer made of one received frame: which message, and whether it is finished.

    `done` is True once the frame's message was handed to the rendezvous table (or rejected for
    good), so the transport may acknowledge every frame of `message_id`; False while chunks are missing.
    `turned_away` is True when the consumer could not take the message (aborted or closing): no
    frame of it may be acknowledged, so the next consumer gets it. `held` is the decoded message
    when the table had no room for it and the caller offered to hold it (`may_hold`): the caller
    stops reading that source and offers it again with `release` until it is taken.
    `refused` is why the consumer refused the frame for good (over a limit, bad signature, stale
    incarnation...), for a transport that can tell its producer; None when it took it.
    """

    message_id: MessageId | None
    done: bool
    turned_away: bool = False
    held: Message | None = None
    refused: str | None = None


class Deliver(Protocol):
    """What a listening transport reports to: called with each received frame."""

    def __call__(self, frame: Buffer, crc: int | None = None, *, may_hold: bool = False) -> Delivered:
        """Hand one frame to the consumer (with its CRC32C if the transport computed it); never raises.

        The frame's buffer is handed over: the transport must not write to it again.

        While the consumer's table is full this waits for room, unless `may_hold`: then a complete
        message that does not fit comes back as `Delivered.held`, for a caller that can stop
        reading just the source it came from (backpressure per producer, not per transport).
        """
        ...

    def release(self, message: Message) -> Delivered | None:
        """Offer a held message again: what became of it, or None while there is still no room."""
        ...

    def is_pending(self, message_id: MessageId | None) -> bool:
        """True while the message still waits for chunks (False once complete, rejected or expired)."""
        ...

    def handed_over_all(self) -> bool:
        """False once an abort or close dropped delivered tensors nobody received (a last ack must not cover them)."""
        ...


def backoff_s(first_s: float = 0.05, max_s: float = 2.0) -> Iterator[float]:
    """Exponential backoff delays: first_s, 2*first_s, ... capped at max_s."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * 2, max_s)


class Transport:
    """One endpoint connection, used either as a sender (`send`) or as a receiver (`listen`).

    Class attributes declare what the transport can do, so callers branch on data:
    `acknowledges` (the receiver confirms frames back), `persists` (frames survive a restart).
    """

    schemes: ClassVar[tuple[str, ...]] = ()
    acknowledges: ClassVar[bool] = False
    persists: ClassVar[bool] = False
    #: `send` takes frames encoded with `deferred_checksum` and computes their CRC while sending
    seals_frames: ClassVar[bool] = False
    #: option name -> default; every transport also accepts `max_frame_bytes`
    OPTIONS: ClassVar[dict[str, Any]] = {}

    def __init__(self, url: urllib.parse.SplitResult, options: dict[str, Any]) -> None:
        self.url = url
        self.options = options
        #: frames larger than this are chunked above the transport; None means no limit
        self.max_frame_bytes: int | None = options.get("max_frame_bytes")

    @property
    def address(self) -> str:
        """The endpoint URL as it is actually served (e.g. with the port a listener picked)."""
        return urllib.parse.urlunsplit(self.url)

    def send(self, frame: list[Buffer], *, key: str | None) -> None:
        """Send one frame (scatter-gather buffers) to the endpoint."""
        raise NotImplementedError

    def send_ndarray(
        self, array: Any, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, flags: int
    ) -> bool:
        """Encode and send one ndarray in one frame, if this transport has a shortcut for it (one frame
        from `flags` alone: no compression, no signature); False, with nothing sent, to take the general path."""
        return False

    def forget_last(self, count: int) -> None:
        """Drop the last `count` frames sent from anything kept for resending (a message failed part way)."""

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every sent frame is confirmed by the endpoint (a no-op where nothing is pending)."""

    def wait_for_room(self) -> None:
        """Block before a new message while the transport holds as much unconfirmed data as it may."""

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        """Start receiving the endpoint's frames on background threads, calling `deliver` for each."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections and threads; safe to call twice."""
        raise NotImplementedError

    def abandon(self) -> None:
        """In a forked child: let go of this process's copy of the connection without touching it
        (it is the parent's too: no flush, no goodbye). By default the objects are just dropped."""
