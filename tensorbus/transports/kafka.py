"""`kafka://HOST:PORT/TOPIC` (and `kafkas://`, TLS): tensors through a Kafka topic, one record per frame.

Each frame (or chunk frame) is one record keyed by the tensor key (UTF-8), so all chunks of a tensor
land in one partition, in order (a producer pins its keyless records to one partition). Records go
out through the idempotent producer with `acks=all`; `send` only queues them, `flush` waits for the
acks and raises the first failure. The consumer, a consumer-group member on one thread (kafka-python's
consumer is not thread-safe), commits a partition only up to the oldest record the consumer's ledger
has not released (a tensor the application has not taken, or one whose chunks are incomplete): a
consumer that dies or closes loses nothing, its successor re-reads from there, and the duplicates
(later records that were taken) are dropped above this layer with `dedup_file`. A URL may list
several brokers; topics this transport creates are replicated (`replication_factor`,
`min_insync_replicas`), and a record is retried, across a leader election for one, until
`delivery_timeout_s`.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import socket
import ssl
import struct
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, TypeVar

with warnings.catch_warnings():  # kafka-python 3.0 loads its protocol schemas with importlib.resources.read_text
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka.errors as ke
    from kafka import AsyncConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer
    from kafka.structs import OffsetAndMetadata, TopicPartition

from ..buffers import aligned
from ..codec.frame import Buffer, Limits, Message, MessageId, is_chunk
from ..errors import ConfigError, TensorBusError, TransportError
from ..ledger import Stream
from .base import Deliver, Delivered, Transport, TransportOptions, backoff_s
from .tally import Tally

log = logging.getLogger(__name__)
_T = TypeVar("_T")
#: bytes a record batch adds around one record's value (batch header, record fields, a short key)
RECORD_OVERHEAD = 1024
#: bytes one fetch may bring per partition: 16 records of a 1 MB chunk, not kafka-python's one (1 MiB),
#: for more throughput from 1 MB tensors up (docs/PERFORMANCE.md)
FETCH_PER_PARTITION = 16 << 20
#: the Kafka clients a `client` option may name (the first is the default)
CLIENTS = ("kafka-python", "confluent")
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
#: what the guarantees above rest on (5 in flight is the most idempotence allows)
_PRODUCER = {"acks": "all", "enable_idempotence": True, "max_in_flight_requests_per_connection": 5}
#: metadata refreshed every 5 s (not kafka-python's 5 min): a group joined while the topic's metadata
#: was incomplete (a topic just created) is assigned nothing until a refresh triggers a rejoin
_CONSUMER = {"enable_auto_commit": False, "auto_offset_reset": "earliest", "metadata_max_age_ms": 5000}
#: ApiVersions v0 (api key 18, correlation id 1, no client id): every Kafka listener answers it before any login
#: the topic setting under which the broker stamps each record with its own clock when it stores it,
#: and that setting (tensorbus creates its topics so): a signed tensor's age is then measured to that
#: time, which a producer (or a third party replaying a captured frame) cannot set
TIMESTAMP_TYPE, LOG_APPEND_TIME = "message.timestamp.type", "LogAppendTime"


def take_record(
    fast: Callable[[memoryview, int | None, object], Message | None] | None, value: bytes
) -> tuple[Message | None, Buffer]:
    """A record's frame through the intake's C delivery where that takes it: (the Message it delivered,
    the frame), else (None, the frame to hand the intake). A record's bytes start 32 bytes into their
    object, so its tensors would be misaligned: a whole frame is copied to a 64-byte aligned buffer
    once, for both; a chunk is left as it is (the reassembler copies its payload into place anyway)."""
    if fast is None or not value or is_chunk(memoryview(value)):
        return None, value
    frame = aligned(value)
    return fast(frame, None, None), frame


def appended_at(timestamp_type: int | None, timestamp_ms: int | None) -> float | None:
    """A record's append time in seconds, if the broker set it (type 1, LogAppendTime; 0 is the producer's)."""
    return timestamp_ms / 1000 if timestamp_type == 1 and timestamp_ms is not None and timestamp_ms >= 0 else None


_API_VERSIONS = struct.pack(">ihhih", 10, 18, 0, 1, -1)


def _delivery(timeout_s: float) -> dict[str, int]:
    """kafka-python's retry bounds: a request times out after half the delivery timeout (at most 30 s), so a
    record outlives a dead broker's request and is retried (on the new leader) before it fails for good."""
    delivery = int(timeout_s * 1000)
    return {"delivery_timeout_ms": delivery, "request_timeout_ms": min(30_000, delivery // 2)}


class _Fatal(TransportError):
    retriable = False


def translate(exc: BaseException, where: str, nbytes: int | None = None) -> TensorBusError:
    """The tensorbus error for a kafka-python (or socket) exception, marking what a retry cannot fix."""
    if isinstance(exc, (ke.MessageSizeTooLargeError, ke.RecordListTooLargeError)):
        return _Fatal(
            f"Kafka at {where} refused a record{f' of {nbytes} bytes' if nbytes else ''} as too large ({exc}); lower "
            f"max_frame_bytes under the broker's message.max.bytes (default ~1 MiB) or raise it and max_request_size"
        )
    if isinstance(exc, ke.KafkaConfigurationError):
        return ConfigError(f"kafka-python refused the configuration for {where}: {exc}")
    if nbytes is not None and isinstance(exc, (ke.KafkaTimeoutError, ke.NotEnoughReplicasError)):
        return TransportError(
            f"Kafka at {where} did not acknowledge a record of {nbytes} bytes within delivery_timeout_s ({exc!r}): "
            "no partition leader, or fewer in-sync replicas than the topic's min.insync.replicas"
        )
    refused = (ke.AuthorizationError, ke.UnsupportedSaslMechanismError, ke.InvalidTopicError)
    if isinstance(exc, (*refused, ke.InvalidReplicationFactorError, ke.InvalidConfigurationError)):
        return _Fatal(f"Kafka at {where} refused the request: {exc!r}")
    return TransportError(f"Kafka at {where} failed: {exc!r}")


@contextlib.contextmanager
def map_errors(where: str) -> Iterator[None]:
    """Translate kafka-python's exceptions (and socket errors) into tensorbus's, at the edge."""
    try:
        yield
    except (ke.KafkaError, OSError) as exc:
        raise translate(exc, where) from None


def _count(name: str, value: Any) -> int | None:
    """An optional positive whole number, from a keyword or a URL query's text."""
    if value is None:
        return None
    try:
        count = int(value) if isinstance(value, str) else value
    except ValueError:
        count = None
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ConfigError(f"option {name} must be a whole number of 1 or more, got {value!r}")
    return count


def _retrying(attempt: Callable[[], _T], deadline: float, where: str) -> _T:
    """`attempt()`, made again after each retriable kafka-python error until `deadline` (then that error is raised).

    Such errors come, for one, from a broker killed a moment ago: the cluster lists it until its session
    times out, and kafka-python sends a metadata or admin request to it only once.
    """
    while True:
        try:
            return attempt()
        except ke.RetriableError as exc:
            if time.monotonic() >= deadline:
                raise
            log.info("%s: %r; asking again", where, exc)
            time.sleep(0.5)


def _check_min_insync(min_insync: int | None, replicas: int) -> None:
    """Refuse a topic whose writes could never be acknowledged: more in-sync replicas required than it has."""
    if min_insync is not None and min_insync > replicas:
        raise ConfigError(
            f"min_insync_replicas={min_insync} exceeds the topic's {replicas} replica(s) (replication_factor): "
            "no write to it could ever be acknowledged"
        )


def _ask(host: str, port: int, timeout: float, context: ssl.SSLContext | None) -> bytes:
    """Send ApiVersions to host:port (inside TLS with `context`): the reply's first 8 bytes, fewer if it hangs up."""
    with socket.create_connection((host, port), timeout) as raw:
        with raw if context is None else context.wrap_socket(raw, server_hostname=host) as sock:
            sock.sendall(_API_VERSIONS)
            reply = b""
            while len(reply) < 8 and (data := sock.recv(8 - len(reply))):
                reply += data
            return reply


class _Offsets(AsyncConsumerRebalanceListener):
    """What the group may commit: per partition, up to the oldest record the ledger has not released
    (a tensor nobody took yet, or one still missing chunks).

    `record` and `commit` run on the consumer thread; the rebalance callbacks on kafka-python's I/O
    thread (while the consumer thread waits in `poll`), hence the lock.
    """

    def __init__(self, consumer: KafkaConsumer, deliver: Deliver, shown: str, tally: Tally) -> None:
        self.consumer, self.deliver, self.shown, self.tally = consumer, deliver, shown, tally
        self.assigned: frozenset[int] = frozenset()
        self._lock = threading.Lock()
        self._streams: dict[TopicPartition, Stream] = {}  # each partition's offsets in the consumer's ledger
        self._committed: dict[TopicPartition, int] = {}
        #: the next offset of each partition this consumer has not had yet, kept across rebalances (the
        #: consumer thread's): a record below it is one the group delivers to it again
        self._unseen: dict[TopicPartition, int] = {}

    def record(self, tp: TopicPartition, offset: int, result: Delivered) -> None:
        """The consumer thread delivered the record at `offset` of `tp` (`result`): its ledger stream
        follows it; a record this consumer had before (re-read after a rebalance) counts as a redelivery."""
        stream = self._stream(tp, offset)
        if result == Delivered(result.message_id, True, admitted=True):  # (the commonest: in the fewest steps)
            stream.record_admitted(offset, result.message_id)
        else:
            stream.record(offset, result)

    def record_admitted(self, tp: TopicPartition, offset: int, message_id: MessageId | None) -> None:
        """`record` of a whole plain tensor the intake's C delivery took (`Stream.record_admitted`): the
        commonest record, without a `Delivered` made for it."""
        self._stream(tp, offset).record_admitted(offset, message_id)

    def _stream(self, tp: TopicPartition, offset: int) -> Stream:
        """`tp`'s stream in the ledger, the record at `offset` counted as a redelivery if this consumer had it."""
        if offset < self._unseen.get(tp, 0):
            self.tally.redeliveries += 1
        else:
            self._unseen[tp] = offset + 1
        with self._lock:
            stream = self._streams.get(tp)
            if stream is None:
                stream = self._streams[tp] = self.deliver.ledger.stream()
        return stream

    def committable(self) -> dict[TopicPartition, OffsetAndMetadata]:
        """Offsets safe to commit that differ from the last commit."""
        offsets = {}
        with self._lock:
            for tp, stream in self._streams.items():
                safe = stream.first_open()
                if self._committed.get(tp) != safe:
                    offsets[tp] = OffsetAndMetadata(safe, "", -1)
        return offsets

    def commit(self, timeout_s: float) -> None:
        """Commit what is safe, synchronously; a failure only means records may be read again."""
        offsets = self.committable()
        try:
            if offsets:
                with map_errors(self.shown):
                    self.consumer.commit(offsets, timeout_ms=int(timeout_s * 1000))
                self._committed_now(offsets)
        except TransportError as exc:  # e.g. a rebalance took the partitions: their new owner re-reads
            log.info("commit to %s failed (%s); records since the last commit may be read again", self.shown, exc)

    def _committed_now(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        with self._lock:
            self._committed.update((tp, meta.offset) for tp, meta in offsets.items())

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit the revoked partitions' progress before their new owner starts (awaited: heartbeats go on)."""
        offsets = self.committable()
        try:
            if offsets:
                await self.consumer.commit_async(offsets)
                self._committed_now(offsets)
        except Exception as exc:  # the new owner re-reads from the last commit: duplicates, dropped above
            log.warning("%s: commit before giving up partitions failed: %r", self.shown, exc)
        await self.on_partitions_lost(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.assigned = frozenset(tp.partition for tp in self.consumer.assignment())

    async def on_partitions_lost(self, lost: set[TopicPartition]) -> None:
        self._forget(lost)

    def _forget(self, lost: set[TopicPartition]) -> None:
        """The partitions are no longer this consumer's: close their streams in the ledger, forget their commits."""
        with self._lock:
            for tp in lost:
                stream = self._streams.pop(tp, None)
                if stream is not None:
                    stream.close()
                self._committed.pop(tp, None)
        self.assigned -= {tp.partition for tp in lost}


@dataclass(frozen=True, kw_only=True)
class KafkaOptions(TransportOptions):
    """The options of kafka:// and kafkas:// endpoints."""

    client: str = "kafka-python"  # or "confluent" (librdkafka, extra kafka-fast): see docs/OPTIONS.md
    max_frame_bytes: int | None = 1_000_000  # chunk size: under max_request_size and the broker's message.max.bytes
    max_request_size: int = 1_048_576
    partitions: int = 1  # for topics this transport creates
    replication_factor: int | None = None  # for topics this transport creates; default: 3, or fewer live brokers
    min_insync_replicas: int | None = None  # for topics this transport creates; default: 2 at 3 replicas or more
    delivery_timeout_s: float = 120.0  # a record not acknowledged by then (retried meanwhile) fails the producer
    group: str | None = None  # consumer group; default tensorbus-TOPIC
    max_pending_bytes: int = 256 * 1024 * 1024  # send() blocks while this much is unacknowledged
    connect_timeout_s: float = 10.0
    close_timeout_s: float = 30.0
    fetch_max_bytes: int = 50 * 1024 * 1024
    max_partition_fetch_bytes: int | None = None  # default: FETCH_PER_PARTITION, within fetch_max_bytes
    max_poll_records: int = 64
    max_poll_interval_s: float = 300.0
    #: outlasts a broker's failover (Kafka fences a dead broker after 9 s, then elects new leaders and group
    #: coordinators): librdkafka gives up its partitions by itself when its coordinator stays silent this long
    session_timeout_s: float = 30.0
    commit_interval_s: float = 0.5
    batch_linger_s: float | None = None  # how long the producer waits to batch records; None: the client's default
    ssl_cafile: str | None = None  # kafkas:// (TLS)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = None
    sasl_mechanism: str | None = None  # e.g. PLAIN
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = None

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ConfigError(f"option client must be one of {', '.join(CLIENTS)}, got {self.client!r}")
        for name in self._text_options():  # names, secrets: text (a URL query turns "1234" into a number)
            value = getattr(self, name)
            object.__setattr__(self, name, None if value is None else str(value))
        for name in ("replication_factor", "min_insync_replicas"):  # (a URL query leaves them text)
            object.__setattr__(self, name, _count(name, getattr(self, name)))
        if self.replication_factor:  # (else checked when the topic is created, against the replicas it gets)
            _check_min_insync(self.min_insync_replicas, self.replication_factor)
        if self.delivery_timeout_s < 1:
            raise ConfigError(f"delivery_timeout_s must be at least 1 second, got {self.delivery_timeout_s!r}")
        record, fetch = self._record_bytes, self.partition_fetch_bytes
        if not (record <= self.max_request_size and record <= fetch <= self.fetch_max_bytes):
            raise ConfigError(
                f"max_frame_bytes + {RECORD_OVERHEAD} must be at most max_request_size and max_partition_fetch_bytes "
                f"(at most fetch_max_bytes); got {self.max_frame_bytes}, {self.max_request_size}, {fetch}, "
                f"{self.fetch_max_bytes}. Raise the broker's message.max.bytes along with max_frame_bytes"
            )

    @property
    def _record_bytes(self) -> int:
        """The most bytes one frame's record takes in a batch."""
        return (self.max_frame_bytes or 1 << 62) + RECORD_OVERHEAD

    @property
    def heartbeat_interval_ms(self) -> int:
        """A group member's heartbeat: a tenth of the session, at most a second (rebalances start quickly)."""
        return min(int(self.session_timeout_s * 100), 1000)

    @property
    def partition_fetch_bytes(self) -> int:
        """What one fetch may bring per partition: `max_partition_fetch_bytes`, by default FETCH_PER_PARTITION
        within `fetch_max_bytes`, and never less than one whole record."""
        fetch = min(FETCH_PER_PARTITION, self.fetch_max_bytes)
        return self.max_partition_fetch_bytes or max(self._record_bytes, fetch)

    @classmethod
    def _text_options(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name == "group" or f.name.startswith(("ssl_", "sasl_"))]

    def client_settings(self) -> dict[str, Any]:
        """The TLS and SASL settings, named as kafka-python names them."""
        return {name: getattr(self, name) for name in self._text_options() if name != "group"}


class KafkaTransport(Transport):
    """A topic per endpoint: an idempotent producer, or a consumer-group member on a thread of its own."""

    persists = True
    Options = KafkaOptions
    options: KafkaOptions

    def __new__(cls, url: urllib.parse.SplitResult, options: KafkaOptions) -> KafkaTransport:
        """The transport of the client `options.client` names (kafka_confluent.py for "confluent")."""
        if cls is KafkaTransport and options.client == "confluent":
            try:
                from .kafka_confluent import ConfluentKafkaTransport
            except ImportError as exc:
                raise ConfigError(
                    f"client='confluent' needs confluent-kafka ({exc.name} is not installed): "
                    "pip install 'tensorbus[kafka-fast]'"
                ) from None
            return super().__new__(ConfluentKafkaTransport)
        return super().__new__(cls)

    def __init__(self, url: urllib.parse.SplitResult, options: KafkaOptions) -> None:
        super().__init__(url, options)
        self.topic = urllib.parse.unquote(url.path.lstrip("/"))
        if not _TOPIC.fullmatch(self.topic):
            raise ConfigError(
                f"Kafka URL needs a topic ({_TOPIC.pattern}), e.g. kafka://HOST:9092/tensors: {self.address!r}"
            )
        hosts = url.netloc.rpartition("@")[2]
        self.servers = [h if re.search(r":\d+$", h) else f"{h}:9092" for h in hosts.split(",") if h]
        self._shown = f"{url.scheme}://{','.join(self.servers)}/{self.topic}"
        self._fetch_bytes = options.partition_fetch_bytes
        self.group: str = options.group or f"tensorbus-{self.topic}"
        self._lock = threading.Lock()
        self._producer: KafkaProducer | None = None
        self._failed = False  # a record failed: kafka-python's idempotent producer is stuck, replace it
        self._keyless_partition: int | None = None
        #: guards the pending counts, `_failed` and `_error`; `with self._pending_lock` where nothing waits (a
        #: Condition's `__enter__` is a Python-level call, and every record takes it twice)
        self._pending_lock = threading.RLock()
        self._pending = threading.Condition(self._pending_lock)
        self._pending_waiters = 0  # threads waiting on `_pending` (under it): a record settled with none wakes none
        self._pending_bytes = self._unconfirmed = 0
        self._error: TensorBusError | None = None
        self._offsets: _Offsets | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()

    def signing_identity(self, consumer: bool) -> tuple[str, bytes]:
        """kafka:TOPIC (kafkas:// alike)."""
        return f"kafka:{self.topic}", b""

    @property
    def assignment(self) -> frozenset[int]:
        """The partitions this consumer owns at the moment (they move on rebalances)."""
        return self._offsets.assigned if self._offsets is not None else frozenset()

    def _client_config(self) -> dict[str, Any]:
        """Connection settings shared by the producer, the consumer and the admin client."""
        o = self.options
        protocol = ("SASL_" if o.sasl_mechanism else "") + ("SSL" if self.url.scheme == "kafkas" else "PLAINTEXT")
        return {
            "bootstrap_servers": self.servers,
            "security_protocol": protocol,
            "bootstrap_timeout_ms": int(o.connect_timeout_s * 1000),
            # a broker back from a restart (and maybe leading again) is reconnected to within a second, not after
            # kafka-python 3.0's backoff of up to 30 s per failed attempt
            "reconnect_backoff_max_ms": 1000,
            **o.client_settings(),
        }

    def _probe(self, timeout: float) -> None:
        """Check that a broker answers a Kafka request, over TLS for kafkas://, before kafka-python tries.

        kafka-python 3.0 leaks sockets and threads when no broker answers, and reports an untrusted certificate or
        a listener of the other protocol (TLS or not) only as "Unable to bootstrap", after its timeout: here each
        of those fails at once, saying why. Brokers that refuse or time out are asked again, with backoff, until
        `timeout` has passed (as a socket producer retries a consumer that is not there yet).
        """
        deadline = time.monotonic() + timeout
        for delay in backoff_s():
            try:
                return self._probe_once(max(0.05, deadline - time.monotonic()))
            except _Fatal:
                raise
            except TransportError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                time.sleep(min(delay, left))

    def _probe_once(self, timeout: float) -> None:
        """One round of `_probe`: every server asked once."""
        context = self._ssl_context()
        error: TransportError = TransportError(f"no Kafka broker answers at {self._shown}")
        for host, _, port in (server.rpartition(":") for server in self.servers):
            where = f"{host}:{port}"
            try:
                reply = _ask(host.strip("[]"), int(port), timeout, context)
                if reply[4:8] == b"\0\0\0\1":  # our correlation id: a Kafka response
                    return
                tls = reply[:1] in (b"\x15", b"\x16")  # a TLS alert or handshake record
                hint = "it speaks TLS: use kafkas:// and ssl_cafile" if tls else f"got {reply!r}"
                error = _Fatal(f"Kafka at {where} did not answer a Kafka request ({hint})")
            except ssl.SSLCertVerificationError as exc:
                error = _Fatal(f"Kafka at {where}: certificate not trusted ({exc.verify_message}): check ssl_cafile")
            except ssl.SSLError as exc:
                error = _Fatal(f"Kafka at {where}: TLS handshake failed ({exc.reason}): a plaintext port? (kafka://)")
            except OSError as exc:
                error = error if isinstance(error, _Fatal) else TransportError(f"{error}: {exc!r}")
        raise error

    def _ssl_context(self) -> ssl.SSLContext | None:
        """For kafkas://, TLS configured as kafka-python configures it (for the probe); None for kafka://."""
        if self.url.scheme != "kafkas":
            return None
        o = self.options
        try:
            context = ssl.create_default_context(cafile=o.ssl_cafile)
            if o.ssl_certfile:
                context.load_cert_chain(o.ssl_certfile, o.ssl_keyfile, o.ssl_password)
        except OSError as exc:
            raise ConfigError(f"the TLS files for {self._shown} cannot be used: {exc}") from None
        return context

    def _ensure_topic(self) -> None:
        """Create the topic (partitions, replication_factor) unless it exists."""
        timeout = self.options.connect_timeout_s
        self._probe(timeout)
        with map_errors(self._shown):
            _retrying(self._create_unless_there, time.monotonic() + timeout, self._shown)

    def _create_unless_there(self) -> None:
        """One attempt, with an admin client of its own: kafka-python's keeps asking the broker it first chose."""
        o, timeout = self.options, self.options.connect_timeout_s
        try:
            admin = KafkaAdminClient(**self._client_config())
        except ke.KafkaTimeoutError:  # a broker answered the probe: with SASL, the login is what failed
            if not o.sasl_mechanism:
                raise
            raise _Fatal(
                f"Kafka at {self._shown} answered, but no SASL {o.sasl_mechanism} login succeeded within "
                f"{timeout}s: check sasl_plain_username and sasl_plain_password (kafka-python logs the reason)"
            ) from None
        try:
            if self.topic not in admin.list_topics():
                self._create_topic(admin)
        except ke.TopicAlreadyExistsError:  # created meanwhile (by another producer or consumer): used as it is
            pass
        finally:
            admin.close()

    def _create_topic(self, admin: KafkaAdminClient) -> None:
        """Create the topic, replicated on up to 3 live brokers unless told otherwise (the cluster counted now)."""
        o, timeout = self.options, self.options.connect_timeout_s
        brokers = len(admin.describe_cluster()["brokers"])
        replicas = o.replication_factor or min(3, brokers)
        if not o.replication_factor and brokers < min(3, len(self.servers)):  # a topic's replicas are for good
            log.warning(
                "creating %s with %d replica(s): only %d of the %d brokers in the URL are live "
                "(set replication_factor to wait for them instead)",
                self._shown, replicas, brokers, len(self.servers),
            )  # fmt: skip
        min_insync = o.min_insync_replicas or (2 if replicas >= 3 else None)
        if replicas > brokers:
            raise _Fatal(
                f"cannot create {self._shown} with replication_factor={replicas}: the cluster has {brokers} live "
                "broker(s)"
            )
        _check_min_insync(min_insync, replicas)
        configs = {TIMESTAMP_TYPE: LOG_APPEND_TIME}  # (the broker's clock vouches for a record's age: `appended_at`)
        if min_insync is not None:
            configs["min.insync.replicas"] = str(min_insync)
        spec = {"num_partitions": o.partitions, "replication_factor": replicas, "configs": configs}
        admin.create_topics({self.topic: spec})
        admin.wait_for_topics([self.topic], timeout_ms=int(timeout * 1000))
        log.info(
            "created topic %s: %d partition(s), %d replica(s), min.insync.replicas %s",
            self._shown,
            o.partitions,
            replicas,
            min_insync or "(the broker's default)",
        )

    # -- producer side -------------------------------------------------------------------------------

    def _start_producer(self) -> KafkaProducer:
        """Create the topic if needed and the idempotent producer; after a failed record, a fresh producer."""
        with self._lock:
            if self._producer is not None and self._failed:
                self._producer.close(timeout=0)  # what it still holds fails, and is reported, at once
                self._producer = None
            if self._producer is None:
                self._ensure_topic()
                o = self.options
                with map_errors(self._shown):
                    producer = KafkaProducer(
                        **self._client_config(),
                        **_PRODUCER,
                        max_request_size=o.max_request_size,
                        max_block_ms=int(o.connect_timeout_s * 1000),
                        **_delivery(o.delivery_timeout_s),
                        allow_auto_create_topics=False,
                        **({} if o.batch_linger_s is None else {"linger_ms": int(o.batch_linger_s * 1000)}),
                    )
                    try:
                        deadline = time.monotonic() + o.connect_timeout_s
                        partitions = _retrying(lambda: producer.partitions_for(self.topic), deadline, self._shown)
                    except BaseException:  # (its I/O thread and connections are not left behind)
                        producer.close(timeout=0)
                        raise
                    self._keyless_partition = random.choice(sorted(partitions))
                self._producer, self._failed = producer, False
            return self._producer

    def send(self, frame: list[Buffer], *, key: str | None) -> None:
        """Queue one frame as one record; blocks only while max_pending_bytes are unacknowledged."""
        producer = self._producer if self._producer is not None and not self._failed else self._start_producer()
        value = b"".join(frame)
        nbytes = len(value)
        kafka_key, partition = (None, self._keyless_partition) if key is None else (key.encode(), None)
        limit = self.options.max_pending_bytes - nbytes
        room = lambda: self._error or not self._pending_bytes or self._pending_bytes <= limit  # noqa: E731
        with self._pending:
            if not room():  # backpressure: its seconds counted under `_pending` (tally.py)
                started = time.monotonic()
                self._wait_pending(room, None)
                self.tally.blocked(started)
            self._raise_error()
            self._pending_bytes += nbytes
            self._unconfirmed += 1
        timed = self if self.tally.timing(self) else None  # (before the send: its callback may come at once)
        try:
            with map_errors(self._shown):
                future = producer.send(self.topic, value=value, key=kafka_key, partition=partition)
        except TensorBusError:
            self._settle(nbytes, None)
            raise
        future.add_callback(lambda _, n=nbytes, t=timed: self._settle(n, None, acked=t))
        future.add_errback(lambda exc, n=nbytes: self._settle(n, translate(exc, self._shown, n)))

    def _settle(self, nbytes: int, error: TensorBusError | None, current: bool = True, acked: Any = False) -> None:
        """A record was acknowledged or failed for good (called on kafka-python's sender thread); a failure
        marks the producer failed, unless the record was a replaced producer's (`current` false). `acked`:
        False unless the broker acknowledged it, then `self` if it is the record timed, else None (tally.py)."""
        with self._pending_lock:
            self._pending_bytes -= nbytes
            self._unconfirmed -= 1
            if acked is False:
                self.tally.forget_timing()  # (a record that failed may be the one timed)
            else:
                self.tally.acked(1, at=acked)
            if error is not None:
                self._failed = self._failed or current
                self._error = self._error or error
            if self._pending_waiters:
                self._pending.notify_all()

    def _wait_pending(self, predicate: Callable[[], Any], timeout: float | None) -> bool:
        """`_pending.wait_for(predicate, timeout)`, counted in `_pending_waiters` (caller holds `_pending`)."""
        self._pending_waiters += 1
        try:
            return bool(self._pending.wait_for(predicate, timeout))
        finally:
            self._pending_waiters -= 1

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the broker has acknowledged every record sent so far; raise the first failure."""
        if self._producer is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with contextlib.suppress(TransportError), map_errors(self._shown):
            self._producer.flush(timeout)  # a timeout is reported below, with the count
        with self._pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._wait_pending(lambda: self._error or not self._unconfirmed, remaining):
                raise TransportError(f"{self._unconfirmed} records unacknowledged by {self._shown} after {timeout}s")
            self._raise_error()

    # -- consumer side -------------------------------------------------------------------------------

    def listen(self, deliver: Deliver, limits: Limits) -> None:
        """Create the topic if needed, then join the group and deliver records on a background thread."""
        self._ensure_topic()
        self._thread = threading.Thread(target=self._consume, args=(deliver,), daemon=True, name=f"kafka-{self.topic}")
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread = None
            self._raise_error()

    def _consume(self, deliver: Deliver) -> None:
        """The consumer thread: poll, deliver each record, commit what is complete (periodically and at the end)."""
        o = self.options
        try:
            with map_errors(self._shown):
                consumer = KafkaConsumer(
                    **self._client_config(),
                    group_id=self.group,
                    **_CONSUMER,
                    allow_auto_create_topics=False,
                    fetch_max_bytes=o.fetch_max_bytes,
                    max_partition_fetch_bytes=self._fetch_bytes,
                    max_poll_records=o.max_poll_records,
                    max_poll_interval_ms=int(o.max_poll_interval_s * 1000),
                    session_timeout_ms=int(o.session_timeout_s * 1000),
                    heartbeat_interval_ms=o.heartbeat_interval_ms,
                )
                try:
                    offsets = self._offsets = _Offsets(consumer, deliver, self._shown, self.tally)
                    consumer.subscribe([self.topic], listener=offsets)
                    self._await_metadata(consumer, o.connect_timeout_s)
                except BaseException:  # (its I/O thread and connections are not left behind)
                    consumer.close(autocommit=False, timeout_ms=0)
                    raise
        except TensorBusError as exc:
            self._error = exc
            return
        finally:
            self._ready.set()
        fast = deliver.fast  # the intake's C delivery of whole plain frames, where it is built
        last_commit = time.monotonic()
        turned_away = False
        while not self._stop.is_set() and not turned_away:
            try:
                with map_errors(self._shown):
                    batches = consumer.poll(timeout_ms=200)
            except TransportError as exc:  # kafka-python reconnects by itself, with backoff
                log.warning("%s; polling again", exc)
                self._stop.wait(1.0)
                continue
            for tp, records in batches.items():
                for record in records:
                    if self._stop.is_set() or turned_away:
                        break  # not delivered, so not committed: the group's next consumer reads it
                    taken, frame = take_record(fast, record.value)
                    if taken is not None:  # a whole plain frame the C delivery took: booked in the fewest steps
                        offsets.record_admitted(tp, record.offset, taken.message_id)
                        continue
                    result = deliver(frame, appended_at=appended_at(record.timestamp_type, record.timestamp))
                    offsets.record(tp, record.offset, result)
                    turned_away = result.turned_away  # aborted: leave the group, its partitions go to others
            if time.monotonic() - last_commit >= o.commit_interval_s:
                offsets.commit(o.connect_timeout_s)
                last_commit = time.monotonic()
        offsets.commit(o.close_timeout_s)
        with contextlib.suppress(Exception):
            consumer.close(autocommit=False, timeout_ms=int(o.close_timeout_s * 1000))

    def _await_metadata(self, consumer: KafkaConsumer, timeout: float) -> None:
        """After subscribing, before the first poll: fetch metadata until it lists the topic's partitions.

        The group's first assignment must see them. A join done with empty metadata is assigned
        nothing and rejoins when the metadata arrives, and kafka-python 3.0 can lose a rejoin that
        only changed metadata asked for: when its join outlives a `poll` timeout, the partitions stay
        revoked and the consumer reads nothing, for good. A fetch issued after `subscribe` also
        updates the group's view of the topic (`topics()` always asks the cluster).
        """
        deadline = time.monotonic() + timeout
        while True:
            topics = _retrying(consumer.topics, deadline, self._shown)
            if self.topic in topics and consumer.partitions_for_topic(self.topic):
                return
            if time.monotonic() > deadline:
                raise TransportError(f"{self._shown}: partitions of the topic unknown to the client after {timeout}s")
            time.sleep(0.1)

    def close(self) -> None:
        """Flush and close the producer, or stop the consumer thread (which commits and leaves the group)."""
        if self._producer is not None:
            timeout = self.options.close_timeout_s
            try:
                self.flush(timeout)
            except TransportError as exc:
                log.warning("closing with records not acknowledged: %s", exc)
                timeout = 0
            with contextlib.suppress(Exception):
                self._producer.close(timeout=timeout)
            self._producer = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=self.options.close_timeout_s)
            self._thread = None
