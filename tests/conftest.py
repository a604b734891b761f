"""Shared fixtures: a fresh endpoint per test on every transport, brokers read from the environment."""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import tempfile
import urllib.parse
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tensorbus.transports.memory import HUB

AMQP_URL = os.environ.get("TENSORBUS_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
KAFKA_URL = os.environ.get("TENSORBUS_KAFKA_URL", "kafka://127.0.0.1:9092")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: the clients every Kafka suite runs once against (kafka://'s `client` option)
KAFKA_CLIENTS = ("kafka-python", "confluent")


def pytest_configure(config: pytest.Config) -> None:
    """kafka-python 3.0 leaves failed connection attempts' sockets to the garbage collector: close them
    (tests/kafka_sockets.py says where, and why only those)."""
    with contextlib.suppress(ImportError):  # (kafka-python is an extra)
        from tests.kafka_sockets import close_failed_attempts

        close_failed_attempts()


def reachable(url: str) -> bool:
    """True if something accepts TCP connections at the URL's host and port."""
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=2):
            return True
    except OSError:
        return False


def require_native(built: bool, what: str) -> None:
    """Fail in CI, skip (saying why) elsewhere, when the C extension `what` is not built; skip when
    TENSORBUS_NATIVE=0 turned the C paths off on purpose (CI's second pass, of the Python paths)."""
    from tensorbus.codec import native

    if not native.enabled():
        pytest.skip(f"TENSORBUS_NATIVE=0: {what} is off", allow_module_level=True)
    if built:
        return
    message = f"{what} is not built (pip install -e . builds it, given a C compiler)"
    if IN_CI:
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require_module(name: str, extra: str) -> ModuleType:
    """`import name`: CI installs every extra, so there its absence fails; elsewhere it skips, saying why."""
    try:
        return importlib.import_module(name)
    except ImportError:
        message = f"{name} is not installed (the `{extra}` extra: pip install -e '.[{extra}]')"
        if IN_CI:
            pytest.fail(f"CI=true and {message}", pytrace=False)
        pytest.skip(message, allow_module_level=True)


def require_torch() -> ModuleType:
    """torch (the `torch` extra), as `require_module` finds it."""
    return require_module("torch", "torch")


def require_broker(url: str) -> None:
    """Fail in CI, skip (saying why) elsewhere, when the broker at `url` does not answer."""
    if reachable(url):
        return
    message = f"no broker answers at {url} (start one with: bash scripts/brokers.sh up)"
    if IN_CI:
        pytest.fail(f"CI=true and {message}")
    pytest.skip(message)


@contextlib.contextmanager
def consumer_twins(prefix: str, dedup_window: int) -> Iterator[tuple[Any, Any]]:
    """Two memory:// consumers alike, on fresh names, closed after: for tests that deliver the same frames two
    ways and compare what each made of them."""
    import tensorbus as tb

    made = [tb.Consumer(f"memory://{prefix}-{uuid.uuid4().hex}", dedup_window=dedup_window) for _ in range(2)]
    try:
        yield made[0], made[1]
    finally:
        for consumer in made:
            consumer.close()


def with_query(url: str, query: str) -> str:
    """`url` with `query` ("name=value&...") added to its query string."""
    return url + ("&" if "?" in url else "?") + query


@pytest.fixture(params=KAFKA_CLIENTS)
def kafka_client(request: pytest.FixtureRequest) -> str:
    """Each Kafka client in turn, for the tests of kafka:// that run once per client."""
    return str(request.param)


def transport_params(*transports: str) -> list[Any]:
    """`transports` as pytest params, those through a broker marked `broker` (so `-m "not broker"` leaves them out)."""
    return [pytest.param(t, marks=[pytest.mark.broker] * t.startswith(("amqp", "kafka"))) for t in transports]


def endpoint_url(transport: str) -> str:
    """A consumer URL for a fresh endpoint nobody else uses ("kafka-confluent": kafka:// on confluent-kafka)."""
    name = f"tb-{uuid.uuid4().hex[:12]}"
    if transport == "memory":
        return f"memory://{name}"
    if transport == "tcp":
        return "tcp://127.0.0.1:0"
    if transport == "unix":
        return f"unix://{tempfile.gettempdir()}/{name}.sock"
    if transport == "shm":
        return f"shm://{name}"
    if transport == "amqp":
        require_broker(AMQP_URL)
        _CREATED["amqp"].append(name)
        return f"{AMQP_URL}?queue={name}"
    if transport in ("kafka", "kafka-confluent"):
        require_broker(KAFKA_URL)
        _CREATED["kafka"].append(name)
        url = f"{KAFKA_URL.rstrip('/')}/{name}"
        return url if transport == "kafka" else with_query(url, "client=confluent")
    raise ValueError(transport)


_CREATED: dict[str, list[str]] = {"amqp": [], "kafka": []}


@pytest.fixture(scope="session", autouse=True)
def _delete_broker_endpoints() -> Iterator[None]:
    """Delete the queues and topics the session made, so brokers that live on do not fill up with them."""
    yield
    if _CREATED["kafka"] and reachable(KAFKA_URL):
        from kafka import KafkaAdminClient

        with contextlib.suppress(Exception):  # best effort: a left-over topic only takes disk
            admin = KafkaAdminClient(
                bootstrap_servers=urllib.parse.urlsplit(KAFKA_URL).netloc, request_timeout_ms=10000
            )
            existing = set(admin.list_topics())
            admin.delete_topics([t for t in _CREATED["kafka"] if t in existing])
            admin.close()
    if _CREATED["amqp"] and reachable(AMQP_URL):
        import pika

        with contextlib.suppress(Exception), pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as connection:
            channel = connection.channel()
            for queue in _CREATED["amqp"]:
                channel.queue_delete(queue)


#: the ports of the brokers scripts/brokers.sh starts (single nodes, their TLS listeners, the clusters)
BROKER_PORTS = frozenset(
    {urllib.parse.urlsplit(AMQP_URL).port or 5672, urllib.parse.urlsplit(KAFKA_URL).port or 9092}
    | {5671, 5672, 9092, 9093, 9094, 5681, 5682, 5683, 9191, 9192, 9193}
)


@pytest.fixture(autouse=True)
def _broker_marker_kept(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test not marked `broker` that connects to a broker's port (in this process) fails, naming the
    port: `-m "not broker"` must run nothing that needs one."""
    if request.node.get_closest_marker("broker") is not None:
        yield
        return
    touched: list[object] = []
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def noted(address: object) -> None:
        if isinstance(address, tuple) and len(address) >= 2 and address[1] in BROKER_PORTS:
            touched.append(address[:2])

    def guarded_connect(self: socket.socket, address: object) -> None:
        noted(address)
        connect(self, address)  # type: ignore[arg-type]

    def guarded_connect_ex(self: socket.socket, address: object) -> int:
        noted(address)
        return connect_ex(self, address)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", guarded_connect_ex)
    yield
    if touched:
        pytest.fail(f"connected to a broker at {touched[0]} but is not marked `broker`", pytrace=False)


@pytest.fixture(autouse=True)
def _reset_memory_hub() -> Iterator[None]:
    yield
    HUB.reset()
