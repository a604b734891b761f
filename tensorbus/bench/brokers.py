"""Broker helpers for the benchmark: reachability, connection settings, cleanup, versions."""

from __future__ import annotations

import contextlib
import logging
import socket
import urllib.parse
from typing import Any

log = logging.getLogger(__name__)


def host_port(url: str) -> tuple[str, int]:
    """The broker address of an amqp:// or kafka:// URL, with the protocol's default port."""
    parts = urllib.parse.urlsplit(url)
    default = {"amqp": 5672, "amqps": 5671, "kafka": 9092, "kafkas": 9093}.get(parts.scheme, 0)
    return parts.hostname or "127.0.0.1", parts.port or default


def unreachable(url: str, timeout_s: float = 2.0) -> str | None:
    """None if something accepts TCP connections at the URL's broker address, else why not."""
    host, port = host_port(url)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"no broker answers at {host}:{port} ({exc.strerror or exc})"


def amqp_parameters(url: str, timeout_s: float = 10.0) -> Any:
    """pika connection parameters for an amqp:// URL (user, password, host, port, vhost)."""
    import pika

    parts = urllib.parse.urlsplit(url)
    host, port = host_port(url)
    vhost = urllib.parse.unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    return pika.ConnectionParameters(
        host=host,
        port=port,
        virtual_host=vhost,
        heartbeat=60,
        blocked_connection_timeout=timeout_s,
        socket_timeout=timeout_s,
        stack_timeout=timeout_s * 2,
        connection_attempts=1,
        credentials=pika.PlainCredentials(
            urllib.parse.unquote(parts.username or "guest"), urllib.parse.unquote(parts.password or "guest")
        ),
    )


def kafka_bootstrap(url: str) -> str:
    """`host:port` for kafka-python from a kafka:// URL."""
    host, port = host_port(url)
    return f"{host}:{port}"


def delete_endpoint(url: str) -> None:
    """Best effort: delete the queue (amqp) or topic (kafka) a benchmark endpoint URL names."""
    parts = urllib.parse.urlsplit(url)
    try:
        if parts.scheme in ("amqp", "amqps"):
            queue = urllib.parse.parse_qs(parts.query).get("queue", [""])[0]
            if queue:
                delete_queue(url, queue)
        elif parts.scheme in ("kafka", "kafkas"):
            topic = parts.path.strip("/")
            if topic:
                delete_topic(url, topic)
    except Exception as exc:  # cleanup must never fail a benchmark
        log.info("could not delete %s: %s", url, exc)


def delete_queue(url: str, queue: str) -> None:
    """Delete an AMQP queue (best effort)."""
    import pika

    connection = pika.BlockingConnection(amqp_parameters(url, 5.0))
    try:
        connection.channel().queue_delete(queue)
    finally:
        with contextlib.suppress(Exception):
            connection.close()


def delete_topic(url: str, topic: str) -> None:
    """Delete a Kafka topic (best effort)."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap(url), request_timeout_ms=5000)
    try:
        admin.delete_topics([topic], timeout_ms=5000)
    finally:
        admin.close()


def create_topic(url: str, topic: str, timeout_s: float) -> None:
    """Create a one-partition Kafka topic unless it exists, and wait until its partition has a leader: a consumer
    that subscribes before the broker's metadata shows the topic joins its group with no partition (kafka-python
    then waits for its next metadata refresh, minutes away)."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap(url), request_timeout_ms=int(timeout_s * 1000))
    try:
        with contextlib.suppress(TopicAlreadyExistsError):
            admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
        admin.wait_for_topics([topic], timeout_ms=int(timeout_s * 1000))
    finally:
        admin.close()


def versions(amqp_url: str | None, kafka_url: str | None) -> dict[str, str]:
    """Broker versions as the brokers report them (for the record); missing ones are left out."""
    found: dict[str, str] = {}
    if amqp_url and unreachable(amqp_url, 1.0) is None:
        with contextlib.suppress(Exception):
            import pika

            connection = pika.BlockingConnection(amqp_parameters(amqp_url, 5.0))
            try:
                props = connection._impl.server_properties
                version = props.get("version", b"?")
                product = props.get("product", b"RabbitMQ")
                as_text = [v.decode() if isinstance(v, bytes) else str(v) for v in (product, version)]
                found["amqp"] = " ".join(as_text)
            finally:
                connection.close()
    if kafka_url and unreachable(kafka_url, 1.0) is None:
        with contextlib.suppress(Exception):
            from kafka import KafkaAdminClient

            admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap(kafka_url), request_timeout_ms=5000)
            try:
                api = admin._client.check_version(timeout_ms=5000)
                found["kafka"] = "Kafka, API " + ".".join(str(v) for v in api) + " as kafka-python detects it"
            finally:
                admin.close()
    return found
