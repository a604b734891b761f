"""Which methods a run measures: the requested transports and baselines, and what keeps one from running."""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import sys
from typing import Any

from . import brokers
from .config import AIO_VARIANTS, BASELINE_QUERY, VARIANTS, BenchConfig
from .results import Method

AMQP_CHUNK_BYTES = 16 * 1024 * 1024 - 4096  # the tensorbus amqp transport's default max_frame_bytes
KAFKA_CHUNK_BYTES = 1024 * 1024 - 4096  # used only when the tensorbus kafka transport cannot say
#: by row name first, then by transport family
_COMPARE = {
    "tcp": ["socket", "zmq", "zmq-recipe", "zmq-frame"],
    "unix": ["socket", "zmq", "zmq-recipe", "zmq-frame", "tcp"],  # (a Unix socket should be the faster of the two)
    "memory": ["tcp"],  # (in one process: no excuse to be slower than tcp:// between two)
    "amqp": ["pika"],
    "kafka": ["kafka-python"],
    "amqp-quorum": ["pika"],
    "amqp-classic": ["pika-classic"],
    "kafka-confluent": ["confluent-kafka", "kafka-python"],
    "aio-tcp": ["tcp", "zmq-asyncio"],  # (its blocking twin too, when it runs)
    "aio-unix": ["unix", "zmq-asyncio"],
    "shm": ["unix"],  # (a tensorbus row: shm:// is held against unix://, the fastest socket on one host)
}
_BASELINE_FAMILY = {
    "socket": "tcp",
    "zmq": "tcp",
    "zmq-recipe": "tcp",
    "zmq-frame": "tcp",
    "zmq-asyncio": "tcp",
    "pickle": "tcp",
    "pika": "amqp",
    "pika-classic": "amqp",
    "kafka-python": "kafka",
    "confluent-kafka": "kafka",
}
_BASELINE_MODULE = {
    "zmq": "zmq",
    "zmq-recipe": "zmq",
    "zmq-frame": "zmq",
    "zmq-asyncio": "zmq",
    "pika": "pika",
    "pika-classic": "pika",
    "kafka-python": "kafka",
    "confluent-kafka": "confluent_kafka",
}


def plan(cfg: BenchConfig) -> list[Method]:
    """Every requested transport and baseline, with the reason when one cannot run here."""
    methods: list[Method] = []
    urls: dict[str, str] = {"tcp": "tcp://127.0.0.1:0", "amqp": cfg.amqp_url, "kafka": cfg.kafka_url}
    names = []
    for entry in cfg.transports:
        if entry in VARIANTS:
            family, query = VARIANTS[entry]
            url = _with_query(_default_url(family, cfg), query)
        else:
            family = entry.partition("://")[0] if "://" in entry else entry
            url = entry if "://" in entry else _default_url(family, cfg)
            if family in ("tcp", "amqp", "kafka") and "://" in entry:
                urls[family] = entry
        name = entry if entry in VARIANTS else family
        names.append(name)
        impl = "tensorbus-aio" if name in AIO_VARIANTS else "tensorbus"
        methods.append(Method(name, "tensorbus", impl, family, url, in_process=family == "memory"))
    for method in methods:  # the same transport twice (two URLs): name them by URL
        if names.count(method.name) > 1:
            method.name = method.url
    for name in cfg.chosen_baselines():
        family = _BASELINE_FAMILY[name]
        methods.append(Method(name, "baseline", name, family, _with_query(urls[family], BASELINE_QUERY.get(name, ""))))
    chosen = {m.name for m in methods}
    for method in methods:
        if method.kind == "tensorbus":
            method.compare = [b for b in _COMPARE.get(method.name, _COMPARE.get(method.family, [])) if b in chosen]
        check(method)
    return methods


def round_order(methods: list[Method]) -> list[Method]:
    """The order rounds run in: each transport, then the baselines it is compared with, then the rest.

    A same-round ratio compares two rounds under the same conditions: run one after the other, no
    other method's round (another broker's disk writes, say) falls between them.
    """
    ordered: list[Method] = []
    for method in methods:
        if method.kind == "tensorbus":
            ordered += [method] if method not in ordered else []  # (compared with another transport: there)
            ordered += [b for b in methods if b.name in method.compare and b not in ordered]
    return ordered + [m for m in methods if m not in ordered]


def check(method: Method) -> None:
    """Mark a method skipped when its driver is missing or its broker does not answer."""
    if method.family == "amqp":
        method.chunk_bytes = _transport_option("amqp://h/?queue=q", "max_frame_bytes") or AMQP_CHUNK_BYTES
    if method.family == "kafka":
        method.chunk_bytes = _transport_option("kafka://h:1/t", "max_frame_bytes") or KAFKA_CHUNK_BYTES
    if method.kind == "tensorbus" and method.family != "memory":
        from ..transports import resolve_transport

        try:
            resolve_transport(method.url)
        except Exception as exc:
            method.status, method.reason = "skipped", f"transport unavailable: {type(exc).__name__}: {exc}"
            return
    module = _BASELINE_MODULE.get(method.name)
    if method.kind == "baseline" and module and importlib.util.find_spec(module) is None:
        method.status, method.reason = "skipped", f"{module} is not installed"
        return
    if method.through_broker:
        reason = brokers.unreachable(method.url)
        if reason is not None:
            method.status, method.reason = "skipped", reason


def _default_url(family: str, cfg: BenchConfig) -> str:
    import tempfile

    return {
        "memory": "memory://bench",
        "tcp": "tcp://127.0.0.1:0",
        "unix": f"unix://{tempfile.gettempdir()}",
        "shm": "shm://bench",
        "amqp": cfg.amqp_url,
        "kafka": cfg.kafka_url,
    }[family]


def _with_query(url: str, query: str) -> str:
    """`url` with `query` added to its query string."""
    if not query:
        return url
    return url + ("&" if "?" in url else "?") + query


def _transport_option(url: str, name: str) -> Any:
    """A tensorbus transport's default for option `name`, or None when the transport cannot be loaded."""
    try:
        from ..options import defaults
        from ..transports import resolve_transport

        cls, _ = resolve_transport(url)
        return defaults(cls.Options).get(name)
    except Exception:
        return None


def environment(cfg: BenchConfig, methods: list[Method]) -> dict[str, Any]:
    """Machine, versions and broker versions, for the record."""
    from .. import __version__

    versions = {"tensorbus": __version__, "python": platform.python_version()}
    for module in ("numpy", "zmq", "pika", "kafka", "confluent_kafka", "crc32c", "uvloop"):
        if importlib.util.find_spec(module) is not None:
            try:
                versions[module] = getattr(importlib.import_module(module), "__version__", "?")
            except Exception:
                continue
    if "zmq" in versions:
        versions["libzmq"] = importlib.import_module("zmq").zmq_version()
    used = {m.family: m.url for m in methods if m.status == "ok"}
    return {
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, {platform.system()} {platform.release()}",
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "argv": sys.argv,
        "versions": versions,
        "brokers": brokers.versions(used.get("amqp"), used.get("kafka")),
    }
