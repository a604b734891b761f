"""Transports by URL scheme, imported lazily so that unused drivers need not be installed."""

from __future__ import annotations

import difflib
import importlib
import urllib.parse
from typing import Literal, overload

from ..errors import ConfigError
from ..options import redact
from .base import ConsumerSide, Deliver, Delivered, Encoding, Endpoint, ProducerSide, Transport

#: the class of each scheme's endpoints: one `Transport` for both roles, or "PRODUCER_CLASS,CONSUMER_CLASS"
TRANSPORTS: dict[str, str] = {
    "memory": "tensorbus.transports.memory:MemoryTransport",
    "tcp": "tensorbus.transports.socket:SocketProducer,SocketConsumer",
    "tcps": "tensorbus.transports.socket:SocketProducer,SocketConsumer",
    "unix": "tensorbus.transports.socket:SocketProducer,SocketConsumer",
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


@overload
def resolve_transport(
    url: str, role: Literal["producer"] = "producer"
) -> tuple[type[ProducerSide], urllib.parse.SplitResult]: ...
@overload
def resolve_transport(url: str, role: Literal["consumer"]) -> tuple[type[ConsumerSide], urllib.parse.SplitResult]: ...
def resolve_transport(url: str, role: str = "producer") -> tuple[type[Endpoint], urllib.parse.SplitResult]:
    """Return the class of `url`'s endpoints in `role` ("producer" or "consumer": both have the scheme's
    `Options` and capabilities) and the parsed URL."""
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
    producer_class, _, consumer_class = class_name.partition(",")
    cls: type[Endpoint] = getattr(module, consumer_class if role == "consumer" and consumer_class else producer_class)
    return cls, parsed


def _extra(scheme: str) -> str:
    return {"amqp": "rabbitmq", "amqps": "rabbitmq", "kafka": "kafka", "kafkas": "kafka"}.get(scheme, "dev")


__all__ = [
    "TRANSPORTS",
    "ConsumerSide",
    "Deliver",
    "Delivered",
    "Encoding",
    "Endpoint",
    "ProducerSide",
    "Transport",
    "resolve_transport",
]
