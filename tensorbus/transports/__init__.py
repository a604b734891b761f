"""Transports by URL scheme, imported lazily so that unused drivers need not be installed."""

from __future__ import annotations

import difflib
import importlib
import urllib.parse

from ..errors import ConfigError
from ..options import redact
from .base import Deliver, Delivered, Encoding, Transport

TRANSPORTS: dict[str, str] = {
    "memory": "tensorbus.transports.memory:MemoryTransport",
    "tcp": "tensorbus.transports.socket:SocketTransport",
    "tcps": "tensorbus.transports.socket:SocketTransport",
    "unix": "tensorbus.transports.socket:SocketTransport",
    "shm": "tensorbus.transports.shm:ShmTransport",
    "amqp": "tensorbus.transports.rabbitmq:RabbitMQTransport",
    "amqps": "tensorbus.transports.rabbitmq:RabbitMQTransport",
    "kafka": "tensorbus.transports.kafka:KafkaTransport",
    "kafkas": "tensorbus.transports.kafka:KafkaTransport",
}

#: the form of each scheme's URLs, for the error that refuses a malformed one
FORMS: dict[str, str] = {
    "memory": "memory://NAME",
    "shm": "shm://NAME",
    "tcp": "tcp://HOST:PORT",
    "tcps": "tcps://HOST:PORT",
    "unix": "unix:///path/to.sock",
    "amqp": "amqp://USER:PASSWORD@HOST:5672/VHOST?queue=NAME",
    "amqps": "amqps://USER:PASSWORD@HOST:5671/VHOST?queue=NAME",
    "kafka": "kafka://HOST:9092/TOPIC",
    "kafkas": "kafkas://HOST:9093/TOPIC",
}


def resolve_transport(url: str) -> tuple[type[Transport], urllib.parse.SplitResult]:
    """Return the transport class for `url`'s scheme and the parsed URL."""
    parsed = urllib.parse.urlsplit(url)
    target = TRANSPORTS.get(parsed.scheme)
    if target is None:
        known = ", ".join(f"{scheme}://" for scheme in sorted(TRANSPORTS))
        if "://" not in url:
            example = "tcp://127.0.0.1:5555"
            raise ConfigError(f"{redact(url)!r} names no transport: write it as a URL, e.g. {example} ({known})")
        near = difflib.get_close_matches(parsed.scheme, TRANSPORTS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"unknown transport scheme {parsed.scheme!r} in {redact(url)!r}{hint}. Known: {known}")
    # (unix:/path is unix:///path as urlunsplit writes it: the same socket; memory:/x would be another name than x)
    slashes = url[len(parsed.scheme) : len(parsed.scheme) + 3] == "://" or (
        parsed.scheme == "unix" and not parsed.netloc and parsed.path.startswith("/")
    )
    named = parsed.scheme in ("memory", "shm")
    if not slashes or (named and parsed.path and not parsed.netloc):  # memory:/x, memory:///x
        raise ConfigError(f"malformed URL {redact(url)!r}: write it as {FORMS[parsed.scheme]}")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"the {parsed.scheme}:// transport needs a package that is not installed ({exc.name}); "
            f"install tensorbus with the matching extra, e.g. pip install 'tensorbus[{_extra(parsed.scheme)}]'"
        ) from None
    return getattr(module, class_name), parsed


def _extra(scheme: str) -> str:
    return {"amqp": "rabbitmq", "amqps": "rabbitmq", "kafka": "kafka", "kafkas": "kafka"}.get(scheme, "dev")


__all__ = ["TRANSPORTS", "Deliver", "Delivered", "Encoding", "Transport", "resolve_transport"]
