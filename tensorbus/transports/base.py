"""The transport interface: carry whole frames from producers to the consumer of an endpoint.

Chunking, deduplication, reassembly and key matching live above this interface, once; a
transport only moves frames (lists of buffers) and reports each received frame to `deliver`.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import numpy as np

from ..codec import encode, encode_chunks
from ..codec.frame import DEFAULT_LIMITS, FLAG_CHECKSUM, Buffer, Limits, Message, MessageId
from ..codec.signing import frame_key
from ..errors import ConfigError
from .tally import Tally

if TYPE_CHECKING:
    from ..ledger import Ledger


@dataclass(frozen=True)
class Encoding:
    """How a producer encodes every tensor it sends (`Transport.send_message` takes it)."""

    compression: str | None = None
    checksum: bool = True
    signing_key: bytes | None = None
    #: the largest header the consumers take: a tensor whose header is larger is refused at `send`
    max_header_bytes: int = DEFAULT_LIMITS.max_header_bytes
    #: a whole frame's CRC is left to the transport, which computes it while sending (see `Transport.encoding`)
    deferred_checksum: bool = False
    #: the flags of its frames when they need nothing but the optional checksum (no compression, no
    #: signature, the default header limit, which the C heads apply): what a transport's shortcut for
    #: plain frames needs to know; else None
    plain_flags: int | None = field(init=False)

    def __post_init__(self) -> None:
        plain = (
            self.compression is None
            and self.signing_key is None
            and self.max_header_bytes >= DEFAULT_LIMITS.max_header_bytes  # (the C head leaves larger ones to Python)
        )
        object.__setattr__(self, "plain_flags", (FLAG_CHECKSUM if self.checksum else 0) if plain else None)

    def encode(
        self,
        tensor: Any,
        key: str | None,
        metadata: dict[str, Any] | None,
        message_id: MessageId,
        signing_key: bytes | None,
    ) -> list[Buffer]:
        """`tensor` as one whole frame encoded this way, signed with `signing_key` (the key bound to the endpoint)."""
        return encode(
            tensor,
            key=key,
            metadata=metadata,
            compression=self.compression,
            checksum=self.checksum,
            message_id=message_id,
            signing_key=signing_key,
            deferred_checksum=self.deferred_checksum,
            max_header_bytes=self.max_header_bytes,
        )

    def encode_chunks(
        self,
        tensor: Any,
        key: str | None,
        metadata: dict[str, Any] | None,
        message_id: MessageId,
        max_chunk_bytes: int,
        chunk_signing_key: bytes | None,
    ) -> list[list[Buffer]]:
        """`tensor` as chunks of at most `max_chunk_bytes` encoded this way: the whole message signed with
        `signing_key`, each chunk with `chunk_signing_key` (the key bound to the endpoint)."""
        return encode_chunks(
            tensor,
            max_chunk_bytes=max_chunk_bytes,
            key=key,
            metadata=metadata,
            compression=self.compression,
            checksum=self.checksum,
            message_id=message_id,
            signing_key=self.signing_key,
            chunk_signing_key=chunk_signing_key,
            max_header_bytes=self.max_header_bytes,
        )


@dataclass(frozen=True, kw_only=True)
class TransportOptions:
    """What every transport takes: each transport's options extend these (validated by options.merge)."""

    #: frames larger than this are chunked above the transport; None means no limit
    max_frame_bytes: int | None = None


class Held(NamedTuple):
    """A message the full table could not take. A whole message's frame is kept as it came (undecoded,
    still compressed) until it is admitted: it costs its size on the wire, not its tensors'. A message
    its last chunk completed is kept as `message` (the reassembler has paid for it already). `source`:
    the producer it came from, as the transport named it."""

    frame: Buffer | None
    crc: int | None
    key: str | None
    message_id: MessageId | None
    nbytes: int = 0
    message: Message | None = None
    source: object = None


class Delivered(NamedTuple):
    """What the consumer made of one received frame: which message, and whether it is finished.

    `done` is True once the frame's message was handed to the rendezvous table (or rejected for
    good), so the transport may acknowledge every frame of `message_id`; False while chunks are missing.
    `turned_away` is True when the consumer could not take the message (aborted or closing): no
    frame of it may be acknowledged, so the next consumer gets it. `held` is the message's frame
    (`Held`, undecoded) when the table had no room for it and the caller offered to hold it (`may_hold`): the caller
    stops reading that source and offers it again with `release` until it is taken.
    `refused` is why the consumer refused the frame for good (over a limit, bad signature, stale
    incarnation...), for a transport that can tell its producer; None when it took it.
    `admitted` is True when the message went into the table (or straight to a receiver): its frames
    are released once the application took it (see ledger.py); a `done` message not admitted was
    settled otherwise (a duplicate, refused, given up on). `duplicate` is True for a whole message whose id the
    consumer had taken in already (a copy, dropped).
    """

    message_id: MessageId | None
    done: bool
    turned_away: bool = False
    held: Held | None = None
    refused: str | None = None
    admitted: bool = False
    duplicate: bool = False


class Deliver(Protocol):
    """What a listening transport reports to: called with each received frame (the consumer's intake).

    A transport records each received frame's position in `ledger` (ledger.py) with what `__call__`
    returned, and acknowledges only the positions the ledger released."""

    #: the consumer's acknowledgement ledger
    ledger: Ledger

    #: the C delivery of a whole plain frame, for transports that read frames in C (`fast(frame, crc,
    #: source)`): the Message it delivered, or None when it changed nothing (then call the intake
    #: itself); None where there is none
    fast: Callable[[memoryview, int | None, object], Message | None] | None

    #: `fast` over a run of broker records (`take_records(records, partition, offset)`, _intake.c): takes the
    #: records at the left of a deque while `fast` takes each, one offset after another; the ids it took, in
    #: order. None where there is no C delivery
    take_records: Callable[[Any, object, int], list[MessageId]] | None

    def taken_count(self) -> int:
        """How many messages receives have taken from the consumer's table so far (`Rendezvous.taken_count`)."""
        ...

    def __call__(
        self,
        frame: Buffer,
        crc: int | None = None,
        *,
        may_hold: bool = False,
        source: object = None,
        redelivered: bool = False,
        appended_at: float | None = None,
    ) -> Delivered:
        """Hand one frame to the consumer (with its CRC32C if the transport computed it); never raises.

        `redelivered`: the transport vouches that the frame is a redelivery of one handed to a consumer
        of the endpoint before (a broker's own mark, which no publisher can set): a signed message is
        then not refused for its age alone (docs/SECURITY.md, "A redelivery is not a replay").
        `appended_at`: the broker's own clock when it stored the frame (Kafka's LogAppendTime, which
        no producer can set): a signed message's age is measured to it rather than to now, so a
        record read again later is not refused while one appended again late (a replay) is.

        The frame's buffer is handed over: the transport must not write to it again.

        While the consumer's table is full this waits for room, unless `may_hold`: then a complete
        message that does not fit comes back as `Delivered.held`, for a caller that can stop
        reading just the source it came from (backpressure per producer, not per transport).
        `source` (hashable, with `may_hold`) names that producer: its tensors count against its share of the
        table (`max_buffered_bytes_per_producer`), and past it its next one is held the same way.
        """
        ...

    def deliver_decoded_apart(
        self, frame: Buffer, crc: int | None = None, *, may_hold: bool = False, source: object = None
    ) -> Delivered:
        """`__call__`, a whole message's frame decoded outside the consumer's lock: for a thread that may take its
        time over a large signed or compressed frame while others deliver (tensorbus.aio's decoding thread)."""
        ...

    def fits(self, held: Held) -> bool:
        """Whether `release` would find room for a held message now."""
        ...

    def release(self, held: Held, apart: bool = False) -> Delivered | None:
        """Offer a held message again: what became of it, or None while there is still no room (or a
        `Delivered` whose `held` replaces it, when the room went while it was being decoded). `apart`: as
        `deliver_decoded_apart` decodes."""
        ...


def backoff_s(first_s: float = 0.05, max_s: float = 2.0) -> Iterator[float]:
    """Exponential backoff delays: first_s, 2*first_s, ... capped at max_s."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * 2, max_s)


class Endpoint:
    """What either side of an endpoint connection is: its URL, options, signing identity, counts, closing.

    Class attributes declare what the transport can do, so callers branch on data:
    `persists` (frames wait in a broker, and survive a restart of either end: the bench's "through a
    broker"). A transport is a `ProducerSide` and a `ConsumerSide` in one class (`Transport`), or
    one class for each (sockets: socket_producer.py, socket_consumer.py); `resolve_transport` says
    which class serves which role.
    """

    persists: ClassVar[bool] = False
    #: the transport's options (their names, defaults and types)
    Options: ClassVar[type[TransportOptions]] = TransportOptions

    def __init__(self, url: urllib.parse.SplitResult, options: TransportOptions) -> None:
        self.url = url
        self.options = options
        #: frames larger than this are chunked above the transport; None means no limit
        self.max_frame_bytes: int | None = options.max_frame_bytes
        self.tally = Tally()  # what metrics read beyond `counts()` (acks, reconnects, waits: tally.py)

    @property
    def address(self) -> str:
        """The endpoint URL as it is actually served (e.g. with the port a listener picked)."""
        return urllib.parse.urlunsplit(self.url)

    def signing_identity(self, consumer: bool) -> tuple[str, bytes]:
        """What signed frames are bound to (see `codec.signing`): the endpoint's name, the same for its
        producers and consumers, and the consumer run's incarnation (b"" where there is none)."""
        raise ConfigError(f"{self.url.scheme}:// endpoints cannot sign frames")

    def counts(self) -> dict[str, int]:
        """What the transport counts for metrics (tensorbus/metrics.py names them: `unacked_bytes`,
        `resent_frames`, `reconnects`...), read when they are scraped; none by default."""
        return {}

    def close(self) -> None:
        """Release connections and threads; safe to call twice."""
        raise NotImplementedError

    def abandon(self) -> None:
        """In a forked child: let go of this process's copy of the connection without touching it
        (it is the parent's too: no flush, no goodbye). By default the objects are just dropped."""


class ProducerSide(Endpoint):
    """What a `Producer` holds: `send_message` (and `send`), `flush`, `wait_for_room`.

    The optional methods (`encoding`, `forget`, `flush`, `wait_for_room`) have a default that
    is right for a transport without the capability.
    """

    #: a producer's `signing_key` (set by `send_message`), for a transport that signs frames again (sockets)
    signing_key: bytes | None = None
    _bound: tuple[tuple[bytes, str, bytes], bytes] | None = None  # (key, endpoint, consumer run), its frame key

    def send(self, frame: list[Buffer], *, key: str | None) -> None:
        """Send one frame (scatter-gather buffers) to the endpoint."""
        raise NotImplementedError

    def send_message(
        self, tensor: Any, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, encoding: Encoding
    ) -> None:
        """Encode one tensor and send it: in one frame, or in chunks where frames are limited (`max_frame_bytes`).

        What `Producer.send` calls; a transport with a faster way for a plain ndarray in one frame
        overrides `_send_ndarray` (a transport with another way for some tensors, this, calling it for
        the rest). If a chunk fails, the chunks sent before it are forgotten.
        """
        flags = encoding.plain_flags
        if (
            flags is not None
            and type(tensor) is np.ndarray
            and self._send_ndarray(tensor, key, metadata, message_id, flags)
        ):
            return
        self.wait_for_room()
        bound_key = self._frame_key(encoding.signing_key)
        limit = self.max_frame_bytes
        if limit is None:  # one frame: if it fails, nothing of the tensor went out
            self.send(encoding.encode(tensor, key, metadata, message_id, bound_key), key=key)
            return
        parts = encoding.encode_chunks(tensor, key, metadata, message_id, limit, bound_key)
        sent: list[list[Buffer]] = []
        try:
            for part in parts:
                self.send(part, key=key)
                sent.append(part)
        except BaseException:  # (a Ctrl-C between or inside chunks too)
            if sent:  # the chunks that went out can never make a whole tensor: don't resend them
                self.forget(sent)
            raise

    def _send_ndarray(
        self, array: np.ndarray, key: str | None, metadata: dict[str, Any] | None, message_id: MessageId, flags: int
    ) -> bool:
        """`encode` and `send` of one plain ndarray in the fewest steps, where the transport has a way:
        False, with nothing sent, where it has none (here) or it does not apply."""
        return False

    def encoding(self, wanted: Encoding) -> Encoding:
        """How this transport encodes a producer's tensors (`Producer` asks once): `wanted`, or a variant
        of it for a transport that finishes frames while it sends them."""
        return wanted

    def _frame_key(self, signing_key: bytes | None) -> bytes | None:
        """The key frames are signed with: `signing_key` bound to the endpoint (and consumer run) now served."""
        if signing_key is None:
            return None
        self.signing_key = signing_key
        endpoint, run = self.signing_identity(consumer=False)
        if self._bound is None or self._bound[0] != (signing_key, endpoint, run):
            self._bound = (signing_key, endpoint, run), frame_key(signing_key, endpoint, run)
        return self._bound[1]

    def forget(self, frames: list[list[Buffer]]) -> None:
        """Drop these sent frames from anything kept for resending (the chunks of a message failed part way)."""

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every sent frame is confirmed by the endpoint (a no-op where nothing is pending)."""

    def wait_for_room(self) -> None:
        """Block before a new message while the transport holds as much unconfirmed data as it may."""


class ConsumerSide(Endpoint):
    """What a `Consumer` holds: `listen`, which reports each received frame to a `Deliver`.

    `reads_while_waiting` (a waiting receive reads frames on its own thread: `read_while_waiting`).
    The optional methods (`read_while_waiting`, `room_opened`, `sender`) have a default that is
    right for a transport without the capability.
    """

    reads_while_waiting: ClassVar[bool] = False
    #: its frames are read on an asyncio loop (the aio API's socket consumers): the consumer starts no
    #: thread of its own, and the loop's reading runs the intake's expiry (`Intake.expire`)
    runs_on_loop: bool = False

    def sender(self) -> str | None:
        """Who sent the frame being delivered right now, where the transport knows (a socket peer's address)."""
        return None

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        """Start receiving the endpoint's frames on background threads, calling `deliver` for each."""
        raise NotImplementedError

    def read_while_waiting(self, done: threading.Lock, deadline: float | None) -> bool:
        """Wait for `done` (a waiting receive's lock) until `deadline`: True once acquired, False when the
        deadline passed. A transport that `reads_while_waiting` reads frames on this thread meanwhile, so
        the receive needs no hand-off from a reading thread; by default this just waits."""
        timeout = -1.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
        return done.acquire(timeout=timeout)

    def room_opened(self) -> None:
        """The consumer's table has room again, or a receiver started waiting (called under the table's
        lock: must not block). A transport that holds messages back offers them again; by default nothing."""


class Transport(ProducerSide, ConsumerSide):
    """One endpoint connection, used either as a sender (`send_message`) or as a receiver (`listen`):
    the transports whose two sides are one class."""
