"""kafka-python's side of kafka:// (the default client): the one import of it, its settings, its errors
translated into tensorbus's (marking what a retry cannot fix), and retrying what it may fix."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

with warnings.catch_warnings():  # kafka-python 3.0 loads its protocol schemas with importlib.resources.read_text
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka.errors as ke
    from kafka import AsyncConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer
    from kafka.structs import OffsetAndMetadata, TopicPartition

from ..errors import ConfigError, TensorBusError, TransportError

__all__ = [
    "CONSUMER",
    "PRODUCER",
    "AsyncConsumerRebalanceListener",
    "Fatal",
    "KafkaAdminClient",
    "KafkaConsumer",
    "KafkaProducer",
    "OffsetAndMetadata",
    "TopicPartition",
    "delivery",
    "ke",
    "map_errors",
    "retrying",
    "translate",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
#: what the guarantees of kafka.py rest on (5 in flight is the most idempotence allows)
PRODUCER = {"acks": "all", "enable_idempotence": True, "max_in_flight_requests_per_connection": 5}
#: metadata refreshed every 5 s (not kafka-python's 5 min): a group joined while the topic's metadata
#: was incomplete (a topic just created) is assigned nothing until a refresh triggers a rejoin
CONSUMER = {"enable_auto_commit": False, "auto_offset_reset": "earliest", "metadata_max_age_ms": 5000}


def delivery(timeout_s: float) -> dict[str, int]:
    """kafka-python's retry bounds: a request times out after half the delivery timeout (at most 30 s), so a
    record outlives a dead broker's request and is retried (on the new leader) before it fails for good."""
    timeout_ms = int(timeout_s * 1000)
    return {"delivery_timeout_ms": timeout_ms, "request_timeout_ms": min(30_000, timeout_ms // 2)}


class Fatal(TransportError):
    """A failure no retry fixes (a refused request, an untrusted certificate): reported at once."""

    retriable = False


def translate(exc: BaseException, where: str, nbytes: int | None = None) -> TensorBusError:
    """The tensorbus error for a kafka-python (or socket) exception, marking what a retry cannot fix."""
    if isinstance(exc, (ke.MessageSizeTooLargeError, ke.RecordListTooLargeError)):
        return Fatal(
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
        return Fatal(f"Kafka at {where} refused the request: {exc!r}")
    return TransportError(f"Kafka at {where} failed: {exc!r}")


@contextlib.contextmanager
def map_errors(where: str) -> Iterator[None]:
    """Translate kafka-python's exceptions (and socket errors) into tensorbus's, at the edge."""
    try:
        yield
    except (ke.KafkaError, OSError) as exc:
        raise translate(exc, where) from None


def retrying(attempt: Callable[[], _T], deadline: float, where: str) -> _T:
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
