"""Benchmark settings: defaults, `config/bench.toml`, command-line overrides, all validated by name."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from ..errors import ConfigError

TRANSPORTS = ("memory", "tcp", "unix", "shm", "amqp", "kafka")
#: rows that are a transport with options: name -> (transport, options as a URL query)
VARIANTS: dict[str, tuple[str, str]] = {
    "amqp-quorum": ("amqp", "queue_type=quorum"),
    "amqp-classic": ("amqp", "queue_type=classic"),
    "kafka-confluent": ("kafka", "client=confluent"),
    "aio-tcp": ("tcp", ""),
    "aio-unix": ("unix", ""),
    "shm-empty": ("shm", ""),
}
#: rows run through tensorbus.aio, one event loop per worker (bench/aio_links.py)
AIO_VARIANTS = ("aio-tcp", "aio-unix")
#: rows whose sender keeps its tensors in `producer.empty()` arrays (sent with no copy of their bytes)
IN_PLACE = {"shm-empty"}
#: baseline name -> the transport families it stands in for
BASELINES: dict[str, tuple[str, ...]] = {
    "socket": ("memory", "tcp", "unix"),
    "zmq": ("memory", "tcp", "unix"),
    "zmq-recipe": ("memory", "tcp", "unix"),
    "zmq-frame": ("memory", "tcp", "unix"),
    "zmq-asyncio": AIO_VARIANTS,
    "pickle": ("memory", "tcp", "unix"),
    "pika": ("amqp", "amqp-quorum"),
    "pika-classic": ("amqp-classic",),
    "kafka-python": ("kafka", "kafka-confluent"),
    "confluent-kafka": ("kafka-confluent",),
}
#: baselines that are another baseline on a differently declared queue: name -> URL query
BASELINE_QUERY = {"pika-classic": "queue_type=classic"}
VERIFY_MODES = ("crc32c", "index")
#: the event loops the asyncio rows can run on
EVENT_LOOPS = ("asyncio", "uvloop")
DEFAULT_CONFIG = Path("config/bench.toml")
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_KAFKA_URL = "kafka://127.0.0.1:9092"

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20}
_UNITS |= {"G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """`4KB` -> 4096 (binary units: KB = KiB = 1024 bytes), `1.5MB`, or a plain byte count."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(f"bad tensor size {text!r}: expected e.g. 4KB, 64KB, 1MB, 16MB, 256MB or a byte count")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"bad tensor size {text!r}: must be positive")
    return value


def format_size(nbytes: int) -> str:
    """4096 -> `4KB`, 268435456 -> `256MB` (binary units, as `parse_size` reads them)."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def split_list(text: str | list[Any]) -> list[str]:
    """`"a, b,c"` or `["a", "b"]` -> `["a", "b", "c"]`."""
    items = text if isinstance(text, list) else str(text).split(",")
    return [str(item).strip() for item in items if str(item).strip()]


@dataclass
class BenchConfig:
    """Everything one benchmark run needs; the field names are also the keys of `config/bench.toml`."""

    transports: list[str] = field(default_factory=lambda: list(TRANSPORTS))
    sizes: list[int] = field(default_factory=lambda: [parse_size(s) for s in ("4KB", "64KB", "1MB", "16MB", "256MB")])
    dtype: str = "float32"
    #: timed rounds per (method, size) cell; the median is reported
    repeats: int = 9
    #: seconds per (method, size) cell, warm-up included; a cell stops early when the next round would overrun
    budget_s: float = 8.0
    #: "auto" (every baseline that applies to the chosen transports), "none", or names
    baselines: list[str] = field(default_factory=lambda: ["auto"])
    latency_sizes: list[int] = field(default_factory=lambda: [parse_size("4KB")])
    #: seconds of untimed traffic per cell before timing (fresh memory is slow on VMs)
    warmup_s: float = 0.3
    #: aim for timed rounds about this long (tensors per round are calibrated from the warm-up)
    round_s: float = 0.2
    #: the same for amqp, kafka and their raw clients (brokers are noisier: longer rounds)
    broker_round_s: float = 0.5
    max_tensors_per_round: int = 100_000
    #: "crc32c": checksum every received tensor; "index": only sequence, size and dtype
    verify: str = "crc32c"
    #: broker transports and their raw clients from `broker_cap_from` up: at most this many timed rounds,
    #: within a budget of their own (a round there takes seconds, and the median of the few rounds
    #: that `budget_s` leaves room for is mostly noise) ...
    broker_max_rounds: int = 9
    broker_budget_s: float = 24.0
    broker_cap_from: int = parse_size("64MB")
    #: ... and rounds of at least this many bytes: RabbitMQ's quorum queue log rolls over every
    #: 512 MiB by default (`raft.wal_max_size_bytes`), slowing the round it falls in; with rounds of
    #: one 256 MB tensor every other round took it, in most pairs the same side's
    broker_round_bytes: int = parse_size("512MB")
    #: hard limit for any one step (a round, a connection); a worker pair that exceeds it is killed
    timeout_s: float = 90.0
    amqp_url: str = DEFAULT_AMQP_URL
    kafka_url: str = DEFAULT_KAFKA_URL
    #: the event loop of the asyncio rows (aio-tcp, aio-unix, zmq-asyncio): "asyncio" or "uvloop"
    event_loop: str = "asyncio"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` for any value that cannot work."""
        import numpy as np

        if not self.transports:
            raise ConfigError("no transports to benchmark")
        for name in self.transports:
            scheme = name.partition("://")[0] if "://" in name else name
            if scheme not in TRANSPORTS and name not in VARIANTS:
                known = ", ".join([*TRANSPORTS, *VARIANTS])
                raise ConfigError(f"unknown transport {name!r}; known: {known} (or a URL of one)")
        if not self.sizes:
            raise ConfigError("no tensor sizes given")
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            raise ConfigError(f"unknown dtype {self.dtype!r}") from None
        if dtype.kind not in "biufc":
            raise ConfigError(f"dtype {self.dtype!r} is not numeric")
        for size in [*self.sizes, *self.latency_sizes]:
            if size % dtype.itemsize:
                raise ConfigError(f"tensor size {size} bytes is not a multiple of {dtype}'s {dtype.itemsize} bytes")
        for name in self.baselines:
            if name not in (*BASELINES, "auto", "none"):
                raise ConfigError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}, auto, none")
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}")
        for name in ("repeats", "max_tensors_per_round", "broker_max_rounds", "broker_round_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("budget_s", "broker_budget_s", "round_s", "broker_round_s", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.warmup_s < 0:
            raise ConfigError(f"warmup_s must not be negative, got {self.warmup_s}")
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        if self.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ConfigError("event_loop uvloop: uvloop is not installed (pip install 'tensorbus[aio]')")

    def chosen_baselines(self) -> list[str]:
        """The baselines to run: "auto" picks those whose transport family is benchmarked."""
        families = {name.partition("://")[0] if "://" in name else name for name in self.transports}
        families |= {VARIANTS[name][0] for name in self.transports if name in VARIANTS}
        chosen: list[str] = []
        for name in self.baselines:
            if name == "none":
                continue
            picks = [b for b, f in BASELINES.items() if families & set(f)] if name == "auto" else [name]
            chosen += [b for b in picks if b not in chosen]
        return chosen

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain values (for the JSON report)."""
        return dataclasses.asdict(self)


_SIZE_FIELDS = {"sizes", "latency_sizes"}
_LIST_FIELDS = {"transports", "baselines"}


def coerce(name: str, value: Any) -> Any:
    """Turn a TOML or command-line value into the field's type."""
    fields = {f.name: f for f in dataclasses.fields(BenchConfig)}
    if name not in fields:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"unknown benchmark setting {name!r}; known: {known}")
    if name in _SIZE_FIELDS:
        return [parse_size(item) for item in split_list(value)]
    if name in ("broker_cap_from", "broker_round_bytes"):
        return parse_size(value)
    if name in _LIST_FIELDS:
        return split_list(value)
    kind = type(getattr(BenchConfig, name))
    if kind is bool or not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"setting {name} = {value!r} has the wrong type")
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"setting {name} = {value!r} is not a valid {kind.__name__}") from None


def load(path: str | Path | None, overrides: dict[str, Any]) -> BenchConfig:
    """Defaults, then the TOML file (`config/bench.toml` if it exists and none is named), then overrides."""
    values: dict[str, Any] = {
        "amqp_url": os.environ.get("TENSORBUS_AMQP_URL") or DEFAULT_AMQP_URL,
        "kafka_url": os.environ.get("TENSORBUS_KAFKA_URL") or DEFAULT_KAFKA_URL,
    }
    file = Path(path) if path is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    if file is not None:
        try:
            with open(file, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read benchmark config {file}: {exc}") from None
        for name, value in data.items():
            if name in ("amqp_url", "kafka_url"):
                raise ConfigError(f"{file}: set {name} with --{name.replace('_', '-')} or its environment variable")
            values[name] = coerce(name, value)
    for name, value in overrides.items():
        if value is not None:
            values[name] = coerce(name, value)
    return BenchConfig(**values)
