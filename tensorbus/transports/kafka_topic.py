"""Where a kafka:// or kafkas:// URL points: its brokers (probed before a client tries them), its topic (created,
replicated, unless it exists), and the connection settings every kafka-python client of it shares."""

from __future__ import annotations

import logging
import re
import socket
import ssl
import struct
import time
import urllib.parse
from typing import Any

from ..errors import ConfigError, TransportError
from .base import Transport, backoff_s
from .kafka_options import KafkaOptions, check_min_insync
from .kafka_python import Fatal, KafkaAdminClient, ke, map_errors, retrying
from .tls import context_from_files

log = logging.getLogger(__name__)
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
#: the topic setting under which the broker stamps each record with its own clock when it stores it,
#: and that setting (tensorbus creates its topics so): a signed tensor's age is then measured to that
#: time, which a producer (or a third party replaying a captured frame) cannot set
TIMESTAMP_TYPE, LOG_APPEND_TIME = "message.timestamp.type", "LogAppendTime"
#: ApiVersions v0 (api key 18, correlation id 1, no client id): every Kafka listener answers it before any login
_API_VERSIONS = struct.pack(">ihhih", 10, 18, 0, 1, -1)


def _ask(host: str, port: int, timeout: float, context: ssl.SSLContext | None) -> bytes:
    """Send ApiVersions to host:port (inside TLS with `context`): the reply's first 8 bytes, fewer if it hangs up."""
    with socket.create_connection((host, port), timeout) as raw:
        with raw if context is None else context.wrap_socket(raw, server_hostname=host) as sock:
            sock.sendall(_API_VERSIONS)
            reply = b""
            while len(reply) < 8 and (data := sock.recv(8 - len(reply))):
                reply += data
            return reply


class KafkaEndpoint(Transport):
    """A Kafka topic on its brokers, as a URL names it: the part of a kafka:// transport both clients share
    before they produce or consume (kafka.py, kafka_confluent.py)."""

    options: KafkaOptions

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
            except Fatal:
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
                error = Fatal(f"Kafka at {where} did not answer a Kafka request ({hint})")
            except ssl.SSLCertVerificationError as exc:
                error = Fatal(f"Kafka at {where}: certificate not trusted ({exc.verify_message}): check ssl_cafile")
            except ssl.SSLError as exc:
                error = Fatal(f"Kafka at {where}: TLS handshake failed ({exc.reason}): a plaintext port? (kafka://)")
            except OSError as exc:
                error = error if isinstance(error, Fatal) else TransportError(f"{error}: {exc!r}")
        raise error

    def _ssl_context(self) -> ssl.SSLContext | None:
        """For kafkas://, TLS configured as kafka-python configures it (for the probe); None for kafka://."""
        if self.url.scheme != "kafkas":
            return None
        o = self.options
        return context_from_files(o.ssl_cafile, o.ssl_certfile, o.ssl_keyfile, o.ssl_password)

    def _ensure_topic(self) -> None:
        """Create the topic (partitions, replication_factor) unless it exists."""
        timeout = self.options.connect_timeout_s
        self._probe(timeout)
        with map_errors(self._shown):
            retrying(self._create_unless_there, time.monotonic() + timeout, self._shown)

    def _create_unless_there(self) -> None:
        """One attempt, with an admin client of its own: kafka-python's keeps asking the broker it first chose."""
        o, timeout = self.options, self.options.connect_timeout_s
        try:
            admin = KafkaAdminClient(**self._client_config())
        except ke.KafkaTimeoutError:  # a broker answered the probe: with SASL, the login is what failed
            if not o.sasl_mechanism:
                raise
            raise Fatal(
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
            raise Fatal(
                f"cannot create {self._shown} with replication_factor={replicas}: the cluster has {brokers} live "
                "broker(s)"
            )
        check_min_insync(min_insync, replicas)
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
