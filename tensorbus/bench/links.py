"""A `Link` is one worker's two channels for a method: the one it receives on and the one it sends on.

Worker A sends "fwd" and receives "bwd"; worker B receives "fwd" and sends "bwd" (round trips
need both). `TensorbusLink` wraps `tensorbus.Producer`/`Consumer`; the baselines live in
`baselines.py` and `broker_baselines.py`. Everything here runs inside a worker process.
"""

from __future__ import annotations

import contextlib
import importlib
import tempfile
import threading
import urllib.parse
from typing import Any

import numpy as np

#: role -> the direction it receives on
INBOUND = {"A": "bwd", "B": "fwd"}
KEY = "bench"


_REGISTRY_LOCK = threading.Lock()
_REGISTRY: list[Any] = []  # this worker process's metrics registry, once made (guarded by the lock)


def worker_registry() -> Any:
    """The registry this worker process's endpoints count into with `--metrics-port` (exposition.py)."""
    with _REGISTRY_LOCK:
        if not _REGISTRY:
            from prometheus_client import CollectorRegistry

            _REGISTRY.append(CollectorRegistry())
        return _REGISTRY[0]


def monitoring(spec: dict[str, Any]) -> dict[str, Any]:
    """The options of a tensorbus endpoint of this worker: metrics on into `worker_registry` with
    `--metrics-port`, else none."""
    return {"metrics": True, "metrics_registry": worker_registry()} if spec.get("metrics") else {}


class Link:
    """One side of a method's connection; subclasses fill in the channel operations."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        self.spec = spec
        self.role = role
        self.name = f"tbbench-{spec['tag']}-{INBOUND[role]}"
        self.timeout_s: float = spec["timeout_s"]

    def open(self) -> str:
        """Start receiving on this side's inbound channel; return the address the peer sends to."""
        raise NotImplementedError

    def connect(self, address: str) -> None:
        """Open the outbound channel to the peer's `address`."""
        raise NotImplementedError

    def prepare(self, nbytes: int) -> None:
        """Get ready for tensors of `nbytes` (e.g. allocate and touch a receive buffer)."""

    def adopt(self, slots: list[np.ndarray]) -> list[np.ndarray]:
        """The tensors the sender will send: `slots`, or copies where the link wants them (shared memory)."""
        return slots

    def release(self) -> None:
        """Drop what `prepare` allocated."""

    def set_timeout(self, seconds: float) -> None:
        """Bound every blocking operation of the next command by `seconds`."""
        self.timeout_s = seconds

    def expect(self, first: int) -> None:
        """The next tensor this end receives is number `first` (told before each step that receives: a link
        whose frames carry no index numbers them from it)."""

    def send(self, array: np.ndarray, index: int) -> None:
        """Send one tensor tagged with `index`."""
        raise NotImplementedError

    def recv(self, timeout: float) -> tuple[int, Any]:
        """Receive one tensor: its index and its bytes (an array or any buffer)."""
        raise NotImplementedError

    def finish(self, timeout: float) -> None:
        """After a timed round, untimed: wait until everything sent is confirmed (where that applies)."""

    def idle(self) -> None:
        """Called about once a second while no command runs (keep broker connections alive)."""

    def close(self) -> None:
        """Close every connection; delete broker queues and topics this side created."""


def split_query(query: str) -> tuple[str, str]:
    """Split a URL query into the consumer's options and the producer's (options both know go to both).

    So `tcp://127.0.0.1:0?checksum=false` benchmarks producers that skip the checksum.
    """
    from ..api import ConsumerOptions, ProducerOptions
    from ..options import defaults

    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    producer_only = set(defaults(ProducerOptions)) - set(defaults(ConsumerOptions))
    consumer_only = set(defaults(ConsumerOptions)) - set(defaults(ProducerOptions))
    consumer = urllib.parse.urlencode([(k, v) for k, v in pairs if k not in producer_only])
    producer = urllib.parse.urlencode([(k, v) for k, v in pairs if k not in consumer_only])
    return consumer, producer


def inbound_url(spec: dict[str, Any], role: str) -> str:
    """The tensorbus endpoint URL this side listens on, derived from the method's base URL."""
    base = urllib.parse.urlsplit(spec["url"])
    name = f"tbbench-{spec['tag']}-{INBOUND[role]}"
    query = split_query(base.query)[0] if spec["impl"].startswith("tensorbus") else ""
    base = base._replace(query=query)
    if base.scheme == "memory":
        return f"memory://{name}" + (f"?{query}" if query else "")
    if base.scheme in ("tcp", "tcps"):
        port = base.port if (role == "B" and base.port) else 0
        return urllib.parse.urlunsplit(base._replace(netloc=f"{base.hostname or '127.0.0.1'}:{port}"))
    if base.scheme == "unix":
        folder = base.path if base.path and not base.path.endswith(".sock") else tempfile.gettempdir()
        if base.path.endswith(".sock"):
            path = base.path if role == "B" else base.path[: -len(".sock")] + "-bwd.sock"
        else:
            path = f"{folder.rstrip('/')}/{name}.sock"
        return urllib.parse.urlunsplit(base._replace(path=path))
    if base.scheme == "shm":
        return f"shm://{name}" + (f"?{query}" if query else "")
    if base.scheme in ("amqp", "amqps"):
        query = "&".join(p for p in (f"queue={name}", query) if p)
        return urllib.parse.urlunsplit(base._replace(path=base.path or "/%2F", query=query))
    if base.scheme in ("kafka", "kafkas"):
        return urllib.parse.urlunsplit(base._replace(path=f"/{name}"))
    raise ValueError(f"no endpoint naming for {spec['url']!r}")


class TensorbusLink(Link):
    """`tensorbus.Producer` on the outbound endpoint, `tensorbus.Consumer` on the inbound one."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        self.url = inbound_url(spec, role)
        self.consumer: Any = None
        self.producer: Any = None

    def open(self) -> str:
        import tensorbus as tb

        self.consumer = tb.Consumer(self.url, **monitoring(self.spec))
        return self.consumer.address

    def connect(self, address: str) -> None:
        import tensorbus as tb

        self.producer = tb.Producer(self.outbound_url(address), **monitoring(self.spec))

    def outbound_url(self, address: str) -> str:
        """The peer's `address` with the producer's options of the method's URL."""
        options = split_query(urllib.parse.urlsplit(self.spec["url"]).query)[1]
        return address + (("&" if "?" in address else "?") + options if options else "")

    def adopt(self, slots: list[np.ndarray]) -> list[np.ndarray]:
        """For the rows of `IN_PLACE`: the slots copied once into `producer.empty()` arrays, as many as the
        producer runs ahead (an array is written again only after it came back, as docs/DELIVERY.md asks:
        sent again while the consumer still views its last send, it is copied)."""
        from ..transports.shm_producer import RUN_AHEAD_SLOTS
        from .config import IN_PLACE

        if self.spec["method"] not in IN_PLACE or self.producer is None:
            return slots
        adopted = []
        for k in range(max(len(slots), RUN_AHEAD_SLOTS)):
            slot = slots[k % len(slots)]
            array = self.producer.empty(slot.shape, slot.dtype)
            array[...] = slot
            adopted.append(array)
        return adopted

    def send(self, array: np.ndarray, index: int) -> None:
        self.producer.send(KEY, array, metadata={"i": index})

    def recv(self, timeout: float) -> tuple[int, Any]:
        message = self.consumer.recv_message(KEY, timeout)
        return message.metadata["i"], message.tensor

    def finish(self, timeout: float) -> None:
        self.producer.flush(timeout)

    def close(self) -> None:
        for end in (self.producer, self.consumer):
            if end is not None:
                with contextlib.suppress(Exception):
                    end.close()
        scheme = urllib.parse.urlsplit(self.url).scheme
        if scheme in ("amqp", "amqps", "kafka", "kafkas"):
            from . import brokers

            brokers.delete_endpoint(self.url)


IMPLEMENTATIONS = {
    "tensorbus": "tensorbus.bench.links:TensorbusLink",
    "socket": "tensorbus.bench.baselines:SocketLink",
    "zmq": "tensorbus.bench.baselines:ZmqLink",
    "zmq-recipe": "tensorbus.bench.baselines:ZmqRecipeLink",
    "zmq-frame": "tensorbus.bench.baselines:ZmqFrameLink",
    "tensorbus-aio": "tensorbus.bench.aio_links:AioTensorbusLink",
    "zmq-asyncio": "tensorbus.bench.aio_links:ZmqAsyncioLink",
    "pickle": "tensorbus.bench.baselines:PickleLink",
    "pika": "tensorbus.bench.broker_baselines:PikaLink",
    "pika-classic": "tensorbus.bench.broker_baselines:PikaLink",
    "kafka-python": "tensorbus.bench.broker_baselines:KafkaLink",
    "confluent-kafka": "tensorbus.bench.confluent_baseline:ConfluentLink",
}


def make_link(spec: dict[str, Any], role: str) -> Link:
    """Build the link for `spec["impl"]`, importing its driver only now."""
    module_name, _, class_name = IMPLEMENTATIONS[spec["impl"]].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(spec, role)
