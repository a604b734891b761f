"""Producer and Consumer: the user-facing ends of a transport, with chunking, dedup and rendezvous."""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .codec import Limits, Message, MessageId, Reassembler, encode, encode_chunks
from .codec.compression import check_codec
from .codec.frame import FLAG_CHECKSUM, NATIVE, Buffer
from .codec.torch_bridge import check_like
from .dedup import SeenIds
from .errors import Aborted, CallbackInterrupted, Closed, CodecError, ConfigError, TensorBusError
from .options import finite_timeout, load_config, merge, redact
from .rendezvous import ANY, Callback, RecvHandle, Rendezvous
from .transports import Delivered, Transport, resolve_transport

log = logging.getLogger(__name__)

#: forks of this process so far, as this process knows them (a producer compares it with the count
#: it started at, instead of a getpid system call per send)
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):  # (no fork, nothing to count: Windows)
    os.register_at_fork(after_in_child=_count_fork)

PRODUCER_OPTIONS: dict[str, Any] = {
    "compression": None,
    "checksum": True,
    "signing_key": None,
    "max_frame_bytes": None,
}
CONSUMER_OPTIONS: dict[str, Any] = {
    "signing_key": None,
    "max_frame_bytes": None,
    "max_buffered_bytes": 1 << 30,
    "max_reassembly_bytes": 1 << 31,
    "reassembly_timeout_s": 60.0,
    "max_header_bytes": Limits.max_header_bytes,
    "max_payload_bytes": Limits.max_payload_bytes,
    "max_decompressed_bytes": Limits.max_decompressed_bytes,
    "max_ndim": Limits.max_ndim,
    "max_tree_depth": Limits.max_tree_depth,
    "max_tree_entries": Limits.max_tree_entries,
    "dedup_window": 100_000,
    "dedup_file": None,
    "like": "numpy",
}


def _key_bytes(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise ConfigError(f"signing_key must be bytes or str, got {type(value).__name__}")


def _open(url: str, own: dict[str, Any], kwargs: dict[str, Any], role: str) -> tuple[Transport, dict[str, Any]]:
    """Resolve the transport and split the options into the endpoint's own and the transport's."""
    cls, parsed = resolve_transport(url)
    try:
        if "," not in parsed.netloc:  # (kafka:// may list several brokers: its transport parses them)
            parsed.port  # noqa: B018 -- parsing it raises for a port that is not a number in range
    except ValueError as exc:
        raise ConfigError(f"bad port in {redact(url)}: {exc}") from None
    options = merge({**own, **cls.OPTIONS}, url=parsed, kwargs=kwargs, where=f"{role} {parsed.scheme}://")
    transport = cls(parsed._replace(query=""), {k: options[k] for k in cls.OPTIONS})
    return transport, {k: options[k] for k in own}


def _config_args(path: str | Path, role: str, url: str | None, overrides: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The url and options a `from_config` builds from: the file's, then `url` and `overrides` on top."""
    file_url, options = load_config(path, role)
    chosen = url or file_url
    if chosen is None:
        raise ConfigError(f"{path} has no url and none was given")
    return chosen, {**options, **overrides}


class Producer:
    """Sends tensors to the consumer at `url`; `send` returns once the transport has taken the frame."""

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self._options = options
        self.transport, opts = _open(url, PRODUCER_OPTIONS, options, "Producer")
        self.compression, self.checksum = opts["compression"], opts["checksum"]
        if self.compression is not None:
            check_codec(self.compression)
        self.signing_key = _key_bytes(opts["signing_key"])
        self._start_identity()
        self._closed = False

    def _start_identity(self) -> None:
        """A fresh producer id (message ids are this id and a sequence number), for this process."""
        self.producer_id = uuid.uuid4().hex[:16]
        self._sequence = itertools.count(1)
        self._forks = _forks
        #: flags of the frame `transport.send_ndarray` builds, or None when this producer's frames need more
        plain = self.compression is None and self.signing_key is None and self.transport.max_frame_bytes is None
        self._plain_flags = (FLAG_CHECKSUM if self.checksum else 0) if plain else None

    def _check_fork(self) -> None:
        """In a forked child: become a producer of its own. With the parent's id its tensors would be
        dropped as duplicates of the parent's (or its siblings'), and the parent's connection is the parent's.

        A fork is counted by Python's at-fork hooks (`os.fork`, multiprocessing): a child made by a raw
        fork() in C code that skips them, and then runs Python, is not noticed."""
        if self._forks == _forks:
            return
        self.transport.abandon()
        self.transport, _ = _open(self.url, PRODUCER_OPTIONS, self._options, "Producer")
        self._start_identity()

    @classmethod
    def from_config(cls, path: str | Path, url: str | None = None, **overrides: Any) -> Producer:
        """Build a producer from a TOML file (`url` plus options); keyword arguments win."""
        chosen, options = _config_args(path, "producer", url, overrides)
        return cls(chosen, **options)

    def send(self, key: str | None, tensor: Any, *, metadata: dict[str, Any] | None = None) -> MessageId:
        """Encode and send one tensor (ndarray, SparseTensor, dict bundle, torch tensor) under `key`."""
        if self._closed:
            raise Closed("send on a closed Producer")
        self._check_fork()
        message_id = (self.producer_id, next(self._sequence))
        transport = self.transport
        flags = self._plain_flags  # most sends: one plain ndarray, built and sent in C where the transport can
        if flags is not None and type(tensor) is np.ndarray:
            if transport.send_ndarray(tensor, key, metadata, message_id, flags):
                return message_id
        transport.wait_for_room()
        options = {
            "key": key,
            "metadata": metadata,
            "compression": self.compression,
            "checksum": self.checksum,
            "message_id": message_id,
            "signing_key": self.signing_key,
        }
        limit = transport.max_frame_bytes
        if limit is None:  # one frame: if it fails, nothing of the tensor went out
            transport.send(encode(tensor, **options, deferred_checksum=transport.seals_frames), key=key)
            return message_id
        parts = encode_chunks(tensor, max_chunk_bytes=limit, **options)
        sent = 0
        try:
            for part in parts:
                transport.send(part, key=key)
                sent += 1
        except BaseException:  # (a Ctrl-C between or inside chunks too)
            if sent:  # the chunks that went out can never make a whole tensor: don't resend them
                transport.forget_last(sent)
            raise
        return message_id

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the transport confirms everything sent so far (where it confirms at all)."""
        self._check_fork()
        self.transport.flush(finite_timeout(timeout))

    def close(self) -> None:
        """Flush what can be flushed and release the connection."""
        self._check_fork()  # (the parent's connection is not this process's to flush or close)
        if not self._closed:
            self._closed = True
            self.transport.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Sink:
    """The consumer as its transport sees it: a frame callback plus a question about chunked messages."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    def __call__(self, frame: Buffer, crc: int | None = None, *, may_hold: bool = False) -> Delivered:
        return self._consumer._deliver(frame, crc, may_hold=may_hold)

    def release(self, message: Message) -> Delivered | None:
        return self._consumer._release(message)

    def is_pending(self, message_id: MessageId | None) -> bool:
        return self._consumer.reassembler.is_pending(message_id)

    @property
    def take(self) -> Any:
        """The consumer's C delivery (`Lane.take`) for transports that read in C, or None."""
        lane = self._consumer.lane
        return None if lane is None else lane.take

    def handed_over_all(self) -> bool:
        return self._consumer.table.dropped == 0


class Consumer:
    """Receives the tensors sent to `url` and matches them to receivers by key (or arrival order)."""

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self._shown = redact(url)  # for logs: no password, no secrets from the query
        self.transport, opts = _open(url, CONSUMER_OPTIONS, options, "Consumer")
        self.signing_key = _key_bytes(opts["signing_key"])
        limits = Limits(
            max_header_bytes=opts["max_header_bytes"],
            max_payload_bytes=opts["max_payload_bytes"],
            max_decompressed_bytes=opts["max_decompressed_bytes"],
            max_ndim=opts["max_ndim"],
            max_tree_depth=opts["max_tree_depth"],
            max_tree_entries=opts["max_tree_entries"],
        )
        self.table = Rendezvous(max_buffered_bytes=opts["max_buffered_bytes"])
        self.reassembler = Reassembler(
            max_bytes=opts["max_reassembly_bytes"],
            timeout_s=opts["reassembly_timeout_s"],
            limits=limits,
            signing_key=self.signing_key,
            like=check_like(opts["like"]),
        )
        self._lock = threading.Lock()
        self._seen = SeenIds(opts["dedup_window"], opts["dedup_file"])
        if opts["dedup_file"] is not None:  # recorded when the application takes a tensor, not on arrival
            self.table.handed_out = self._handed_out
        self.stats = collections.Counter[str]()
        self._closed = False
        self._stopping = threading.Event()
        self._held_up = 0  # deliveries waiting for room in the table (or held back by the transport)
        self._interrupted: tuple[Buffer, Message] | None = None  # a frame whose delivery was interrupted, decoded
        #: the C delivery of plain frames into the table (`_native.Lane`; `lane.taken` counts them), or None
        self.lane = self._lane(limits, opts["like"])
        self.transport.listen(_Sink(self), limits)
        if hasattr(self.transport, "pump"):
            self.table.pump = self.transport.pump  # a waiting recv reads for itself
            self.table.room_opened = self.transport.room_opened  # type: ignore[attr-defined]
        self._expiry = threading.Thread(target=self._expire_loop, daemon=True, name="tensorbus-expiry")
        self._expiry.start()

    @classmethod
    def from_config(cls, path: str | Path, url: str | None = None, **overrides: Any) -> Consumer:
        """Build a consumer from a TOML file (`url` plus options); keyword arguments win."""
        chosen, options = _config_args(path, "consumer", url, overrides)
        return cls(chosen, **options)

    def _lane(self, limits: Limits, like: str) -> Any:
        """The C delivery of plain frames into this consumer's table (`_native.Lane`), where it applies; else None."""
        if NATIVE is None or not limits.native or like != "numpy" or self.signing_key is not None:
            return None
        table = self.table
        return NATIVE.Lane(
            self,
            self._lock,
            table,
            table._lock,
            self._seen._ids,
            self._seen.window,
            self.reassembler._partials,
            table._waiters,
            table._arrivals,
            table._by_key,
            ANY,
            Message,
            collections.deque,
            self.stats,
            table.stats,
            limits.max_header_bytes,
            limits.max_payload_bytes,
            limits.max_ndim,
        )

    @property
    def address(self) -> str:
        """The URL producers should use (for tcp://host:0, with the port actually bound)."""
        return self.transport.address

    def _deliver(self, data: Buffer, crc: int | None = None, *, may_hold: bool = False) -> Delivered:
        """Called by the transport for each received frame; never raises. See `Deliver` for `may_hold`."""
        message: Message | None
        with self._lock:
            try:
                interrupted = self._interrupted
                if interrupted is not None and interrupted[0] is data:  # the same frame again: decoded already
                    message, self._interrupted = interrupted[1], None  # (kept until then: others may come first)
                else:
                    message = self.reassembler.feed(data, crc=crc, owned=True)  # transports hand their buffers over
            except CodecError as exc:
                self.stats["rejected"] += 1
                log.error("%s: dropped a bad frame: %s", self._shown, exc)
                return Delivered(None, True, refused=str(exc))
            except MemoryError:
                raise  # not the frame's fault: the transport drops the connection and the frame comes again
            except Exception:  # a decoder bug must cost this one frame, not the connection or a recv
                self.stats["rejected"] += 1
                log.exception("%s: dropped a frame the decoder failed on", self._shown)
                return Delivered(None, True, refused="the consumer's decoder failed on it (see its log)")
            message_id = self.reassembler.last_message_id if message is None else message.message_id
            if self.table.aborted is not None:
                # every frame, before dedup: a broker may hand a turned-away tensor to this consumer
                # again (kafka:// after a rebalance), and it must not then pass for one already taken
                return Delivered(message_id, False, turned_away=True)
            if message is None:
                self.stats["chunks"] += 1
                return Delivered(message_id, not self.reassembler.is_pending(message_id))
            if self._is_duplicate(message_id):
                return Delivered(message_id, True)
            full = self._full()
            if may_hold and full and not self.table.has_room_for(message.key):
                self._hold()  # not yet seen: a copy sent again meanwhile is taken instead, and this one dropped
                return Delivered(message_id, False, held=message)
            if message_id is not None:
                self._seen.add(message_id)
        try:
            if full and not may_hold and not self.table.has_room_for(message.key):
                self._wait_for_room(message.key)
            return self._admit(message)
        except CallbackInterrupted:  # in a recv_async callback, which had the message: it was delivered
            raise
        except BaseException:  # e.g. Ctrl-C on a thread reading for its recv: the transport offers the frame again
            self._forget(message_id)
            self._interrupted = (data, message)  # (the reassembler is done with a chunked one: keep what it made)
            raise

    def _full(self) -> bool:
        """The table is at its limit (read without its lock: a quick look before asking properly)."""
        return self.table.buffered_bytes >= self.table.max_buffered_bytes

    def _release(self, message: Message) -> Delivered | None:
        """A held message offered again: taken (or turned away, or a duplicate) once it fits; else None."""
        if not self.table.has_room_for(message.key):
            return None
        message_id = message.message_id
        with self._lock:
            if self._is_duplicate(message_id):
                self._unhold()
                return Delivered(message_id, True)
            if message_id is not None:
                self._seen.add(message_id)
        try:
            result = self._admit(message)
        except CallbackInterrupted:  # in a recv_async callback, which had the message: taken
            with self._lock:
                self._unhold()
            raise
        except BaseException:  # still held: offered again later
            self._forget(message_id)
            raise
        with self._lock:
            self._unhold()
        return result

    def _is_duplicate(self, message_id: MessageId | None) -> bool:
        """Whether this message was seen already (then counted); caller holds `_lock`."""
        if message_id is not None and message_id in self._seen:
            self.stats["duplicates"] += 1
            return True
        return False

    def _forget(self, message_id: MessageId | None) -> None:
        """A message marked as seen did not reach the table after all: a copy sent again is not a duplicate."""
        if message_id is not None:
            with self._lock:
                self._seen.discard(message_id)

    def _handed_out(self, message: Message) -> None:
        """Record a message the application now has in the dedup file: a successor drops its resends."""
        if message.message_id is not None:
            with self._lock:
                self._seen.persist(message.message_id)

    def _admit(self, message: Message) -> Delivered:
        """Put a decoded message (already marked as seen) in the table."""
        message_id = message.message_id
        try:
            self.table.put(message)
        except CallbackInterrupted:  # in a recv_async callback, which had it: received all the same
            self.stats["received"] += 1
            raise
        except Aborted:
            return Delivered(message_id, False, turned_away=True)
        except TensorBusError as exc:
            self.stats["refused"] += 1
            log.error("%s: refused message %s: %s", self._shown, message_id, exc)
            return Delivered(message_id, True, refused=str(exc))
        self.stats["received"] += 1
        return Delivered(message_id, True)

    def _wait_for_room(self, key: str | None) -> None:
        """Backpressure: hold this delivery (so the transport reads no more) until the table has room
        or someone waits for `key`."""
        with self._lock:
            self._hold()
        try:
            self.table.wait_for_room(key=key)
        finally:
            with self._lock:
                self._unhold()

    def _hold(self) -> None:
        """A delivery is held up (caller holds `_lock`). Partly received tensors do not age meanwhile:
        their chunks are not late, this consumer just is not reading them, and expiring them would
        drop tensors the broker delivered whole."""
        if not self._held_up:
            self.reassembler.pause()
        self._held_up += 1

    def _unhold(self) -> None:
        """A held-up delivery went through (caller holds `_lock`)."""
        self._held_up -= 1
        if not self._held_up:
            self.reassembler.resume()

    def _expire_loop(self) -> None:
        """Free partly received tensors whose chunks stopped coming, even when no other frame arrives."""
        interval = max(0.05, min(self.reassembler.timeout_s / 4, 5.0))
        while not self._stopping.wait(interval):
            with self._lock:
                self.reassembler.expire()  # (nothing while a delivery is held up: see `_hold`)

    def recv(self, key: str, timeout: float | None = None) -> Any:
        """Return the next tensor sent under `key`, waiting up to `timeout` seconds."""
        return self.table.recv(key, timeout)

    def recv_message(self, key: str, timeout: float | None = None) -> Message:
        """Like `recv`, returning the whole `Message` (tensor, metadata, message id)."""
        return self.table.recv_message(key, timeout)

    def recv_async(self, key: str, callback: Callback) -> RecvHandle:
        """Call `callback(message, error)` once when `key` arrives (or fails); returns a cancel handle.

        The callback runs on the thread that delivered the message (a reading thread): it must not
        block, e.g. by calling `recv`, or no frame is read until it returns.
        """
        return self.table.recv_async(key, callback)

    def next_message(self, timeout: float | None = None) -> Message:
        """The oldest message not yet received, of any key (work-queue use)."""
        return self.table.next_message(timeout)

    def abort(self, reason: str) -> None:
        """Fail every pending and later receive with `Aborted(reason)`."""
        self.table.abort(reason)

    def __iter__(self) -> Iterator[Message]:
        """Yield messages in arrival order until the consumer is closed or aborted."""
        while True:
            try:
                yield self.table.next_message()
            except Aborted:
                if self._closed:
                    return
                raise

    def close(self) -> None:
        """Stop receiving; pending receives fail with `Aborted("consumer closed")`."""
        if not self._closed:
            self._closed = True
            self._stopping.set()
            unreceived = len(self.table)
            self.table.abort("consumer closed")  # first: a delivery waiting for room must not hold up close
            if unreceived:  # acknowledged when they reached the table (most of them): not sent again
                log.warning("%s: closed with %d received tensors nobody took: dropped", self._shown, unreceived)
            self.transport.close()
            with self._lock:
                self._seen.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
