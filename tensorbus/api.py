"""Producer and Consumer: the user-facing ends of a transport, with chunking, dedup and rendezvous."""

from __future__ import annotations

import itertools
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .codec import Limits, Message, MessageId
from .codec.compression import check_codec
from .codec.signing import frame_key
from .codec.torch_bridge import check_like
from .errors import Aborted, Closed, ConfigError
from .intake import Intake
from .ledger import check_ack
from .monitoring import Monitor
from .options import UNSET, MonitoringOptions, build, defaults, finite_timeout, given, load_config, merge, redact
from .rendezvous import Callback, RecvHandle
from .transports import ConsumerSide, Encoding, ProducerSide, resolve_transport

if TYPE_CHECKING:
    from .metrics import Meter

log = logging.getLogger(__name__)

#: forks of this process so far, as this process knows them (a producer compares it with the count
#: it started at, instead of a getpid system call per send)
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):  # (no fork, nothing to count: Windows)
    os.register_at_fork(after_in_child=_count_fork)


@dataclass(frozen=True, kw_only=True)
class ProducerOptions(MonitoringOptions):
    """A producer's own options (its transport's are the transport's `Options`)."""

    compression: str | None = None
    checksum: bool = True
    signing_key: bytes | str | None = None
    max_frame_bytes: int | None = None
    max_header_bytes: int = Limits.max_header_bytes  # what its consumers take: a larger header is refused at send


@dataclass(frozen=True, kw_only=True)
class ConsumerOptions(MonitoringOptions):
    """A consumer's own options (its transport's are the transport's `Options`)."""

    signing_key: bytes | str | None = None
    max_frame_bytes: int | None = None
    max_buffered_bytes: int = 1 << 30
    #: what one producer (a connection, on sockets) may have buffered; None: half of max_buffered_bytes
    max_buffered_bytes_per_producer: int | None = None
    max_reassembly_bytes: int = 1 << 31
    reassembly_timeout_s: float = 60.0
    max_header_bytes: int = Limits.max_header_bytes
    max_payload_bytes: int = Limits.max_payload_bytes
    max_decompressed_bytes: int = Limits.max_decompressed_bytes
    max_ndim: int = Limits.max_ndim
    max_frame_age_s: float | None = 300.0  # signed frames older (or further ahead) than this are refused
    unclaimed_timeout_s: float | None = None  # tensors nobody received within this are dropped (logged, counted)
    max_tree_depth: int = Limits.max_tree_depth
    max_tree_entries: int = Limits.max_tree_entries
    dedup_window: int = 100_000
    dedup_file: str | Path | None = None
    like: str = "numpy"
    #: when a tensor is acknowledged: "take" (once the application has it), "arrival" (once it is in the
    #: table) or "manual" (once the application calls `Consumer.ack`)
    ack: str = "take"


_Own = TypeVar("_Own", ProducerOptions, ConsumerOptions)


def _key_bytes(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise ConfigError(f"signing_key must be bytes or str, got {type(value).__name__}")


def _open(url: str, own: type[_Own], kwargs: dict[str, Any], role: str) -> tuple[Any, _Own]:
    """Resolve the transport's class for `role` ("Producer" or "Consumer") and split the options into the
    endpoint's own and the transport's (each checked once)."""
    cls, parsed = resolve_transport(url, "consumer" if role == "Consumer" else "producer")
    try:
        if "," not in parsed.netloc:  # (kafka:// may list several brokers: its transport parses them)
            parsed.port  # noqa: B018 -- parsing it raises for a port that is not a number in range
    except ValueError as exc:
        raise ConfigError(f"bad port in {redact(url)}: {exc}") from None
    known = {**defaults(own), **defaults(cls.Options)}
    options = merge(known, url=parsed, kwargs=kwargs, where=f"{role} {parsed.scheme}://")
    transport = cls(parsed._replace(query=""), build(cls.Options, options))
    return transport, build(own, options)


def _config_args(path: str | Path, role: str, url: str | None, overrides: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The url and options a `from_config` builds from: the file's, then `url` and `overrides` on top."""
    file_url, options = load_config(path, role)
    chosen = url or file_url
    if chosen is None:
        raise ConfigError(f"{path} has no url and none was given")
    return chosen, {**options, **overrides}


#: the options of each transport, by scheme, which Producer and Consumer take as further keyword arguments
#: (checked at run time against the URL's scheme; tests/unit/test_api_signature.py keeps this in step)
TRANSPORT_OPTIONS = """
    Options of the URL's transport, also keyword arguments (docs/OPTIONS.md; checked for the URL's scheme):

    - tcp://, tcps://, unix://: connect_timeout_s, reconnect_timeout_s, send_timeout_s, max_unacked_bytes,
      max_untaken_bytes, ack_every_frames, ack_every_bytes, close_timeout_s, backlog, max_connections, idle_timeout_s,
      pooled_buffers, linger_s, spin_s, auth_secret, ssl_cafile, ssl_certfile, ssl_keyfile, ssl_context
    - memory://: max_unacked_bytes, send_timeout_s, reconnect_timeout_s, spin_s
    - shm://: shm_dir, auth_secret, connect_timeout_s, reconnect_timeout_s, send_timeout_s, close_timeout_s,
      max_unacked_bytes, max_pinned_bytes, max_connections, backlog, spin_s
    - amqp://, amqps://: queue, queue_type, offset, durable, persistent, prefetch_count, heartbeat_s,
      connect_timeout_s, reconnect_timeout_s, confirm_timeout_s, close_timeout_s, max_pending_bytes, ssl_cafile,
      ssl_certfile, ssl_keyfile
    - kafka://, kafkas://: client, batch_linger_s, max_request_size, partitions, replication_factor,
      min_insync_replicas, delivery_timeout_s, group, max_pending_bytes, connect_timeout_s, close_timeout_s,
      fetch_max_bytes, max_partition_fetch_bytes, max_poll_records, max_poll_interval_s, session_timeout_s,
      commit_interval_s, ssl_cafile, ssl_certfile, ssl_keyfile, ssl_password, sasl_mechanism,
      sasl_plain_username, sasl_plain_password
"""


def _state(closed: bool) -> str:
    return "closed" if closed else "open"


class Producer:
    """Sends tensors to the consumer at `url`; `send` returns once the transport has taken the frame.

    The keyword-only parameters are the producer's own options (docs/OPTIONS.md, "Producer"); one left
    out keeps the URL's value or the default.
    """

    def __init__(
        self,
        url: str,
        *,
        compression: str | None = UNSET,
        checksum: bool = UNSET,
        signing_key: bytes | str | None = UNSET,
        max_frame_bytes: int | None = UNSET,
        max_header_bytes: int = UNSET,
        metrics: bool = UNSET,
        metrics_registry: Any = UNSET,
        metrics_key_label: Callable[[str | None], str] | None = UNSET,
        tracing: bool = UNSET,
        **transport_options: Any,
    ) -> None:
        options = {**given(ProducerOptions, locals()), **transport_options}
        self.url = url
        self._options = options
        self.transport: ProducerSide
        self.transport, opts = _open(url, ProducerOptions, options, "Producer")
        self._send_message = self.transport.send_message  # (bound once: a monitored send passes it on)
        self.compression, self.checksum = opts.compression, opts.checksum
        if self.compression is not None:
            check_codec(self.compression)
        self.signing_key = _key_bytes(opts.signing_key)
        wanted = Encoding(self.compression, self.checksum, self.signing_key, opts.max_header_bytes)
        self._encoding = self.transport.encoding(wanted)
        self._start_identity()
        self._closed = False
        self._monitor = Monitor.of("producer", self, opts)  # None unless metrics or tracing are on

    def _start_identity(self) -> None:
        """A fresh producer id (message ids are this id and a sequence number), for this process."""
        self.producer_id = uuid.uuid4().hex[:16]
        self._sequence = itertools.count(1)
        self._forks = _forks

    def _check_fork(self) -> None:
        """In a forked child: become a producer of its own. With the parent's id its tensors would be
        dropped as duplicates of the parent's (or its siblings'), and the parent's connection is the parent's.

        A fork is counted by Python's at-fork hooks (`os.fork`, multiprocessing): a child made by a raw
        fork() in C code that skips them, and then runs Python, is not noticed."""
        if self._forks == _forks:
            return
        self.transport.abandon()
        self.transport, _ = _open(self.url, ProducerOptions, self._options, "Producer")
        self._send_message = self.transport.send_message
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
        if self._monitor is None:
            self.transport.send_message(tensor, key, metadata, message_id, self._encoding)
        else:
            self._monitor.send(self._send_message, tensor, key, metadata, message_id, self._encoding)
        return message_id

    def empty(self, shape: Any, dtype: Any = "float32") -> Any:
        """An uninitialised array in the transport's shared memory (shm://): fill it, then `send` it with
        no copy of its bytes. It is the consumer's once sent: do not write to it again."""
        if self._closed:
            raise Closed("empty on a closed Producer")
        self._check_fork()
        make = getattr(self.transport, "empty", None)
        if make is None:
            raise ConfigError(f"{self.transport.url.scheme}:// has no shared memory: empty() is for shm:// producers")
        return make(shape, dtype)

    def zeros(self, shape: Any, dtype: Any = "float32") -> Any:
        """`empty()` filled with zeros."""
        array = self.empty(shape, dtype)
        array.fill(0)
        return array

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
            if self._monitor is not None:
                self._monitor.close()

    def __repr__(self) -> str:
        return f"<Producer {redact(self.url)} {_state(self._closed)}>"

    def __enter__(self) -> Producer:
        if self._closed:
            raise Closed("`with` on a closed Producer")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Producer.__doc__ = f"{Producer.__doc__}{TRANSPORT_OPTIONS}"


class Consumer:
    """Receives the tensors sent to `url` and matches them to receivers by key (or arrival order).

    The keyword-only parameters are the consumer's own options (docs/OPTIONS.md, "Consumer"); one left
    out keeps the URL's value or the default.
    """

    def __init__(
        self,
        url: str,
        *,
        signing_key: bytes | str | None = UNSET,
        max_frame_bytes: int | None = UNSET,
        max_buffered_bytes: int = UNSET,
        max_buffered_bytes_per_producer: int | None = UNSET,
        max_reassembly_bytes: int = UNSET,
        reassembly_timeout_s: float = UNSET,
        max_header_bytes: int = UNSET,
        max_payload_bytes: int = UNSET,
        max_decompressed_bytes: int = UNSET,
        max_ndim: int = UNSET,
        max_frame_age_s: float | None = UNSET,
        unclaimed_timeout_s: float | None = UNSET,
        max_tree_depth: int = UNSET,
        max_tree_entries: int = UNSET,
        dedup_window: int = UNSET,
        dedup_file: str | Path | None = UNSET,
        like: str = UNSET,
        ack: str = UNSET,
        metrics: bool = UNSET,
        metrics_registry: Any = UNSET,
        metrics_key_label: Callable[[str | None], str] | None = UNSET,
        tracing: bool = UNSET,
        **transport_options: Any,
    ) -> None:
        options = {**given(ConsumerOptions, locals()), **transport_options}
        self.url = url
        self._shown = redact(url)  # for logs: no password, no secrets from the query
        self.transport: ConsumerSide
        self.transport, opts = _open(url, ConsumerOptions, options, "Consumer")
        signing_key = _key_bytes(opts.signing_key)
        identity = self.transport.signing_identity(consumer=True) if signing_key is not None else ("", b"")
        limits = Limits(
            max_header_bytes=opts.max_header_bytes,
            max_payload_bytes=opts.max_payload_bytes,
            max_decompressed_bytes=opts.max_decompressed_bytes,
            max_ndim=opts.max_ndim,
            max_frame_age_s=opts.max_frame_age_s,
            max_tree_depth=opts.max_tree_depth,
            max_tree_entries=opts.max_tree_entries,
        )
        #: where received frames become messages in the table (dedup, reassembly, holds, expiry)
        self.intake = Intake(
            limits=limits,
            max_buffered_bytes=opts.max_buffered_bytes,
            max_buffered_bytes_per_producer=opts.max_buffered_bytes_per_producer,
            max_reassembly_bytes=opts.max_reassembly_bytes,
            reassembly_timeout_s=opts.reassembly_timeout_s,
            dedup_window=opts.dedup_window,
            dedup_file=opts.dedup_file,
            signing_key=None if signing_key is None else frame_key(signing_key, *identity),
            whole_signing_key=signing_key,  # (a chunked message's own MAC: see `encode_chunks`)
            unclaimed_timeout_s=opts.unclaimed_timeout_s,
            sender=self.transport.sender,
            like=check_like(opts.like),
            name=self._shown,
            ack=check_ack(opts.ack),
        )
        self.table = self.intake.table
        self.stats = self.intake.stats
        self._closed = False
        self._monitor = Monitor.of("consumer", self, opts)  # None unless metrics or tracing are on
        try:
            self.transport.listen(self.intake, limits)
        except BaseException:
            if self._monitor is not None:  # (never listened: no series of it stays, its gauges least of all)
                self._monitor.close()
            raise
        self._shown = redact(self.transport.address)  # (with the port a listener bound)
        self.intake.name = self._shown
        if not self.transport.runs_on_loop:  # (on a loop, the loop's reading runs the expiry)
            self.intake.start()
        if self.transport.reads_while_waiting:
            self.table.read_while_waiting = self.transport.read_while_waiting  # a waiting recv reads for itself
        self.table.room_opened = self.transport.room_opened

    @classmethod
    def from_config(cls, path: str | Path, url: str | None = None, **overrides: Any) -> Consumer:
        """Build a consumer from a TOML file (`url` plus options); keyword arguments win."""
        chosen, options = _config_args(path, "consumer", url, overrides)
        return cls(chosen, **options)

    @property
    def address(self) -> str:
        """The URL producers should use (for tcp://host:0, with the port actually bound)."""
        return self.transport.address

    @property
    def monitor(self) -> Monitor | Meter | None:
        """What counts and spans the receives (None with metrics and tracing off): the asyncio consumer's too."""
        return self._monitor

    def recv(self, key: str, timeout: float | None = None) -> Any:
        """Return the next tensor sent under `key`, waiting up to `timeout` seconds."""
        if self._closed:  # (`_check_open`, as in `recv_message`)
            self._check_open("recv")
        if self._monitor is None:
            return self.table.recv(key, timeout)
        return self._monitor.recv(self.table.recv_message, key, timeout).tensor

    def recv_message(self, key: str, timeout: float | None = None) -> Message:
        """Like `recv`, returning the whole `Message` (tensor, metadata, message id)."""
        if self._closed:  # (`_check_open`, without a call: a small tensor's receive is mostly such steps)
            self._check_open("recv_message")
        if self._monitor is None:
            return self.table.recv_message(key, timeout)
        return self._monitor.recv(self.table.recv_message, key, timeout)

    def recv_async(self, key: str, callback: Callback) -> RecvHandle:
        """Call `callback(message, error)` once when `key` arrives (or fails); returns a cancel handle.

        The callback runs on the thread that delivered the message (a reading thread): it must not
        block, e.g. by calling `recv`, or no frame is read until it returns.
        """
        self._check_open("recv_async")
        return self.table.recv_async(key, callback)

    def next_message(self, timeout: float | None = None) -> Message:
        """The oldest message not yet received, of any key (work-queue use)."""
        self._check_open("next_message")
        if self._monitor is None:
            return self.table.next_message(timeout)
        return self._monitor.recv(self.table.next_message, timeout)

    def ack(self, message: Message) -> None:
        """With `ack="manual"`: acknowledge a message the application is done with (until then it counts
        against `max_buffered_bytes`, and a successor of this consumer is handed it again)."""
        self.intake.acknowledge(message)

    def reject(self, message: Message) -> None:
        """With `ack="manual"`: give a message back unacknowledged; it is delivered again, first in line."""
        self.intake.reject(message)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise Closed(f"{what} on a closed Consumer")

    def abort(self, reason: str) -> None:
        """Fail every pending and later receive with `Aborted(reason)`."""
        self.table.abort(reason)

    def __iter__(self) -> Iterator[Message]:
        """Yield messages in arrival order until the consumer is closed or aborted."""
        while True:
            try:
                yield self.next_message()
            except (Aborted, Closed):  # (Closed: next_message after close)
                if self._closed:
                    return
                raise

    def close(self) -> None:
        """Stop receiving; pending receives fail with `Aborted("consumer closed")`."""
        if not self._closed:
            self._closed = True
            unreceived = len(self.table)
            self.table.abort("consumer closed")  # first: a delivery waiting for room must not hold up close
            if unreceived and self.intake.ledger.mode == "arrival":  # acknowledged on arrival: not sent again
                log.warning("%s: closed with %d received tensors nobody took: dropped", self._shown, unreceived)
            elif unreceived:  # not acknowledged: the endpoint hands them to the next consumer
                log.info(
                    "%s: closed with %d received tensors nobody took: left to the next consumer",
                    self._shown,
                    unreceived,
                )
            self.transport.close()
            self.intake.close()
            if self._monitor is not None:
                self._monitor.close()

    def __repr__(self) -> str:
        return f"<Consumer {self._shown} {_state(self._closed)}>"

    def __enter__(self) -> Consumer:
        if self._closed:
            raise Closed("`with` on a closed Consumer")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Consumer.__doc__ = f"{Consumer.__doc__}{TRANSPORT_OPTIONS}"
