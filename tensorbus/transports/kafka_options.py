"""The options of kafka:// and kafkas:// endpoints (both clients), and the checks they pass when made."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError
from .base import TransportOptions

#: bytes a record batch adds around one record's value (batch header, record fields, a short key)
RECORD_OVERHEAD = 1024
#: bytes one fetch may bring per partition: 16 records of a 1 MB chunk, not kafka-python's one (1 MiB),
#: for more throughput from 1 MB tensors up (docs/PERFORMANCE.md)
FETCH_PER_PARTITION = 16 << 20
#: the Kafka clients a `client` option may name (the first is the default)
CLIENTS = ("kafka-python", "confluent")


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


def check_min_insync(min_insync: int | None, replicas: int) -> None:
    """Refuse a topic whose writes could never be acknowledged: more in-sync replicas required than it has."""
    if min_insync is not None and min_insync > replicas:
        raise ConfigError(
            f"min_insync_replicas={min_insync} exceeds the topic's {replicas} replica(s) (replication_factor): "
            "no write to it could ever be acknowledged"
        )


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
            check_min_insync(self.min_insync_replicas, self.replication_factor)
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
