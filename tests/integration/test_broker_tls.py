"""TLS on the broker transports against the real brokers: amqps:// (RabbitMQ) and kafkas:// (Kafka SSL, SASL_SSL).

`bash scripts/brokers.sh up` generates a test CA and a server certificate for 127.0.0.1 into
TENSORBUS_BROKER_TLS_DIR (default .brokers/tls) and opens the TLS listeners whose ports are read below (the
defaults are brokers.sh's). Every misconfiguration must end in a tensorbus error, well within FAST_S.
"""

from __future__ import annotations

import contextlib
import os
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pika
import pytest
import trustme

import tensorbus as tb
from tests.conftest import AMQP_URL, IN_CI, KAFKA_URL, reachable, require_broker
from tests.peers import make_tensor, same

ROOT = Path(__file__).resolve().parents[2]
TLS_DIR = Path(os.environ.get("TENSORBUS_BROKER_TLS_DIR", str(ROOT / ".brokers" / "tls")))
HOST = "127.0.0.1"
AMQPS_PORT = int(os.environ.get("TENSORBUS_AMQPS_PORT", "5671"))
KAFKA_SSL_PORT = int(os.environ.get("TENSORBUS_KAFKA_SSL_PORT", "9093"))
KAFKA_SASL_PORT = int(os.environ.get("TENSORBUS_KAFKA_SASL_PORT", "9094"))
SASL_USER, SASL_PASSWORD = "tensorbus", "tensorbus-secret"  # the user scripts/brokers.sh creates
#: client timeouts for the failure cases, and the bound each failure must be reported within
AMQP_TIMEOUTS = {"connect_timeout_s": 3.0, "reconnect_timeout_s": 2.0}
KAFKA_TIMEOUTS = {"connect_timeout_s": 3.0}
FAST_S = 15.0

pytestmark = pytest.mark.broker


def require_tls_listener(port: int, what: str) -> str:
    """The test CA's path; fails in CI, skips (saying why) elsewhere, when it or the TLS listener is missing."""
    ca = TLS_DIR / "ca.pem"
    if not ca.is_file():
        problem = f"no test CA at {ca}"
    elif not reachable(f"tcp://{HOST}:{port}"):
        problem = f"no {what} listener answers at {HOST}:{port}"
    else:
        return str(ca)
    message = f"{problem} (start one with: bash scripts/brokers.sh up; or set TENSORBUS_BROKER_TLS_DIR and the ports)"
    if IN_CI:
        pytest.fail(f"CI=true and {message}")
    pytest.skip(message)


def fresh(prefix: str = "tb-tls") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def fails_fast(match: str) -> Iterator[None]:
    """Expect a TransportError whose message matches, raised within FAST_S."""
    started = time.monotonic()
    with pytest.raises(tb.TransportError, match=match):
        yield
    elapsed = time.monotonic() - started
    assert elapsed < FAST_S, f"the error took {elapsed:.1f}s"


def producer_and_consumer_fail(url: str, match: str, **options: Any) -> None:
    """Both ends of `url` fail at once with a TransportError matching `match`."""
    with fails_fast(match), tb.Producer(url, **options) as producer:
        producer.send("never", np.ones(3))
    with fails_fast(match):
        tb.Consumer(url, **options)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A CA that signed nothing the brokers present."""
    path = tmp_path_factory.mktemp("tls") / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(path)
    return str(path)


# ---------------------------------------------------------------------------------------- RabbitMQ


def amqp_url(scheme: str, port: int, password: str = "guest") -> str:
    return f"{scheme}://guest:{password}@{HOST}:{port}/%2F?queue={fresh()}"


@pytest.fixture
def amqps_ca() -> str:
    return require_tls_listener(AMQPS_PORT, "RabbitMQ AMQPS")


def test_amqps_round_trip_is_bit_exact(amqps_ca: str) -> None:
    url = amqp_url("amqps", AMQPS_PORT)
    tensor, bundle = make_tensor({"seed": 1, "n": 300_000}), make_tensor({"kind": "bundle", "n": 4, "seed": 2})
    with tb.Consumer(url, ssl_cafile=amqps_ca) as consumer, tb.Producer(url, ssl_cafile=amqps_ca) as producer:
        producer.send("w", tensor, metadata={"step": 7})
        producer.send("params", bundle)
        producer.flush(30)
        message = consumer.recv_message("w", timeout=30)
        assert same(message.tensor, tensor) and message.metadata == {"step": 7}
        assert same(consumer.recv("params", timeout=30), bundle)


def test_amqps_with_the_wrong_ca_fails_fast(amqps_ca: str, other_ca: str) -> None:
    url = amqp_url("amqps", AMQPS_PORT)
    # default timeouts: an untrusted certificate is reported at once, not retried for reconnect_timeout_s
    producer_and_consumer_fail(url, "CERTIFICATE_VERIFY_FAILED", ssl_cafile=other_ca)


def test_plain_amqp_client_at_the_tls_port_fails_fast(amqps_ca: str) -> None:
    producer_and_consumer_fail(amqp_url("amqp", AMQPS_PORT), "IncompatibleProtocolError", **AMQP_TIMEOUTS)


def test_amqps_client_at_the_plain_port_fails_fast(amqps_ca: str) -> None:
    require_broker(AMQP_URL)
    url = amqp_url("amqps", urllib.parse.urlsplit(AMQP_URL).port or 5672)
    producer_and_consumer_fail(url, "WRONG_VERSION_NUMBER", ssl_cafile=amqps_ca)


@pytest.mark.parametrize("scheme", ["amqps", "amqp"])
def test_amqp_wrong_password_fails_fast(scheme: str) -> None:
    if scheme == "amqps":
        ca = require_tls_listener(AMQPS_PORT, "RabbitMQ AMQPS")
        url, options = amqp_url(scheme, AMQPS_PORT, "wrong"), {"ssl_cafile": ca}
    else:
        require_broker(AMQP_URL)
        url, options = amqp_url(scheme, urllib.parse.urlsplit(AMQP_URL).port or 5672, "wrong"), {}
    producer_and_consumer_fail(url, "refused the credentials", **options, **AMQP_TIMEOUTS)


# ---------------------------------------------------------------------------------------- Kafka


def kafka_url(scheme: str, port: int, client: str) -> str:
    """A fresh topic's URL at `port`, on the Kafka `client` (each Kafka test here runs once per client)."""
    return f"{scheme}://{HOST}:{port}/{fresh()}?client={client}"


def sasl(mechanism: str = "PLAIN", password: str = SASL_PASSWORD) -> dict[str, str]:
    return {"sasl_mechanism": mechanism, "sasl_plain_username": SASL_USER, "sasl_plain_password": password}


@pytest.fixture
def kafka_ssl_ca() -> str:
    return require_tls_listener(KAFKA_SSL_PORT, "Kafka SSL")


@pytest.fixture
def kafka_sasl_ca() -> str:
    return require_tls_listener(KAFKA_SASL_PORT, "Kafka SASL_SSL")


def kafka_round_trip(url: str, **options: Any) -> None:
    """A chunked tensor and a small one through `url`, bit-exact."""
    big, small = make_tensor({"seed": 3, "n": 750_000}), make_tensor({"seed": 4, "n": 10, "dtype": "float64"})
    with tb.Consumer(url, **options) as consumer, tb.Producer(url, **options) as producer:
        producer.send("big", big)  # 3 MB: chunked under Kafka's 1 MiB record limit
        producer.send("small", small, metadata={"secure": True})
        producer.flush(60)
        assert same(consumer.recv("big", timeout=60), big)
        message = consumer.recv_message("small", timeout=60)
        assert same(message.tensor, small) and message.metadata == {"secure": True}
        assert consumer.stats["chunks"] >= 3


def test_kafka_ssl_round_trip_is_bit_exact(kafka_ssl_ca: str, kafka_client: str) -> None:
    kafka_round_trip(kafka_url("kafkas", KAFKA_SSL_PORT, kafka_client), ssl_cafile=kafka_ssl_ca)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_kafka_sasl_ssl_round_trip_is_bit_exact(kafka_sasl_ca: str, mechanism: str, kafka_client: str) -> None:
    kafka_round_trip(kafka_url("kafkas", KAFKA_SASL_PORT, kafka_client), ssl_cafile=kafka_sasl_ca, **sasl(mechanism))


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_kafka_sasl_wrong_password_fails_fast(kafka_sasl_ca: str, mechanism: str, kafka_client: str) -> None:
    url = kafka_url("kafkas", KAFKA_SASL_PORT, kafka_client)
    options = {"ssl_cafile": kafka_sasl_ca, **sasl(mechanism, "wrong"), **KAFKA_TIMEOUTS}
    producer_and_consumer_fail(url, f"no SASL {mechanism} login succeeded", **options)


def test_kafka_with_the_wrong_ca_fails_fast(kafka_ssl_ca: str, other_ca: str, kafka_client: str) -> None:
    url = kafka_url("kafkas", KAFKA_SSL_PORT, kafka_client)
    producer_and_consumer_fail(url, "certificate not trusted", ssl_cafile=other_ca, **KAFKA_TIMEOUTS)


@pytest.mark.parametrize("port", [KAFKA_SSL_PORT, KAFKA_SASL_PORT], ids=["ssl", "sasl_ssl"])
def test_plaintext_kafka_client_at_a_tls_port_fails_fast(port: int, kafka_client: str) -> None:
    require_tls_listener(port, "Kafka TLS")
    producer_and_consumer_fail(kafka_url("kafka", port, kafka_client), "it speaks TLS", **KAFKA_TIMEOUTS)


def test_kafkas_client_at_the_plaintext_port_fails_fast(kafka_ssl_ca: str, kafka_client: str) -> None:
    require_broker(KAFKA_URL)
    url = kafka_url("kafkas", urllib.parse.urlsplit(KAFKA_URL).port or 9092, kafka_client)
    producer_and_consumer_fail(url, "TLS handshake failed", ssl_cafile=kafka_ssl_ca, **KAFKA_TIMEOUTS)


# ---------------------------------------------------------------------------------------- fan-out


def check_fan_out(url: str, **options: Any) -> None:
    """Fan-out through `url`: a late subscriber gets the latest whole version of a chunked tensor, then a newer one."""
    with tb.Publisher(url, max_frame_bytes=256_000, **options) as pub:
        for version in (1, 2):
            pub.publish("w", np.full(300_000, version, np.float32), version=version)  # 1.2 MB: five chunks
            pub.publish("b", np.full(4, version), version=version * 10)
        pub.flush(60)  # the broker holds them all: what a subscriber joining now reads
        with tb.Subscriber(url, **options) as sub:
            message = sub.latest("w", timeout=60)
            assert message.version == 2 and message.tensor.min() == message.tensor.max() == 2.0
            assert sub.latest("b", timeout=60).version == 20
            pub.publish("w", np.full(300_000, 3, np.float32), version=3)
            message = sub.latest("w", newer_than=2, timeout=60)
            assert message.version == 3 and message.tensor.min() == message.tensor.max() == 3.0


def test_fan_out_over_amqps_reaches_a_late_subscriber(amqps_ca: str) -> None:
    url = amqp_url("amqps", AMQPS_PORT)
    try:
        check_fan_out(url, ssl_cafile=amqps_ca)
    finally:  # (a stream keeps its messages: not left on the shared broker)
        with contextlib.suppress(Exception), pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as connection:
            connection.channel().queue_delete(urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["queue"][0])


@pytest.mark.parametrize("port", [KAFKA_SSL_PORT, KAFKA_SASL_PORT], ids=["ssl", "sasl_ssl"])
def test_fan_out_over_kafkas_reaches_a_late_subscriber(port: int) -> None:
    """On kafka-python, the client fan-out runs on (a compacted topic the publisher creates over TLS)."""
    ca = require_tls_listener(port, "Kafka TLS")
    options = {"ssl_cafile": ca, **(sasl() if port == KAFKA_SASL_PORT else {})}
    check_fan_out(f"kafkas://{HOST}:{port}/{fresh('tb-tls-fanout')}", **options)
