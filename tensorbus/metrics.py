"""Prometheus metrics of producers and consumers, read when scraped from the counts they keep anyway.

prometheus_client takes a lock in every `inc` and `observe`; at ~10 µs per tensor a few of those would
cost more than the metrics are worth. So nothing here calls it per tensor: each Producer and Consumer
with metrics on has a `Meter` of plain integers (what the intake, the table and the transport do not
count already: tensors and bytes by key label, tensor sizes, recv waits), and one `Collector` per
registry reads every live meter and the counts beside it (`Consumer.stats`, the C delivery's
included, the table's, the transport's `counts()`) when Prometheus scrapes. The extra `metrics`
(`pip install 'tensorbus[metrics]'`) installs prometheus_client; without it nothing here is used.
"""

from __future__ import annotations

import bisect
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .codec import Message
from .errors import ConfigError
from .rendezvous import tensor_nbytes
from .transports.tally import ACK_BUCKETS

if TYPE_CHECKING:
    from .api import Consumer, Producer
    from .transports.base import Endpoint

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
except ImportError:  # the extra is not installed: metrics stay off (monitoring.py checks)
    prometheus_client = None  # type: ignore[assignment]

#: upper bounds of the tensor size histogram (bytes) and of the recv wait one (seconds)
SIZE_BUCKETS = tuple(float(1 << shift) for shift in range(10, 32, 2))
WAIT_BUCKETS = (0.0001, 0.001, 0.01, 0.1, 1.0, 10.0, 60.0)
_FIRST_WAIT = WAIT_BUCKETS[0]
_clock, _bisect, _ndarray = time.perf_counter, bisect.bisect_left, np.ndarray  # (one lookup fewer each)
#: the reasons a consumer counts refused frames under (errors.py's `reason_label`s)
REJECTION_REASONS = ("checksum", "signature", "replay", "limit", "malformed", "stale", "refused")
#: what `Consumer.stats` counts, as (metric, help, stats key)
_CONSUMER_COUNTS = (
    ("delivered_tensors", "tensors that reached the consumer's table (acknowledged from there)", "received"),
    ("chunks", "chunk frames received", "chunks"),
    ("duplicates", "messages dropped as already delivered (dedup)", "duplicates"),
)


def endpoint_label(url: str) -> str:
    """What the `endpoint` label says: the queue or topic of a broker endpoint, else the URL's place
    (host:port, socket path, memory name), never credentials or the query."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme in ("amqp", "amqps"):
        return urllib.parse.parse_qs(parts.query).get("queue", [""])[-1]
    if parts.scheme in ("kafka", "kafkas"):
        return parts.path.strip("/")
    return parts.netloc.rpartition("@")[2] + parts.path


def cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus' buckets of a histogram counted by upper bound (`counts` has one more, above every
    bound): (le, observations at or below it), ending with +Inf."""
    running, out = 0, []
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
    return out


class _Run:
    """A thread's tensors since the size of its tensors last changed: `count` tensors of `size` bytes (counted
    by that thread alone), on top of the tensors before the run (`sizes` by bucket, `bytes`: fixed).

    A stream's tensors are mostly of one size: a tensor costs one addition, and a new size a new run
    (so that a scrape, which reads `count` once, never sees a tensor twice or a counter go down)."""

    __slots__ = ("bucket", "bytes", "count", "size", "sizes")

    def __init__(self, size: int, sizes: list[int], nbytes: int, count: int = 0) -> None:
        self.size, self.bucket, self.count = size, _bisect(SIZE_BUCKETS, size), count
        self.sizes, self.bytes = sizes, nbytes

    def totals(self) -> tuple[list[int], int]:
        """The tensors by size bucket, and their bytes, this run's included."""
        count = self.count  # (read once: the writer may add to it meanwhile)
        sizes = list(self.sizes)
        sizes[self.bucket] += count
        return sizes, self.bytes + count * self.size


def _empty_run() -> _Run:
    return _Run(0, [0] * (len(SIZE_BUCKETS) + 1), 0)


class _Cell:
    """One thread's counts of one endpoint: written by that thread alone, read by scrapes (each field a
    snapshot: a count read while its thread adds to it is the old or the new one, never torn)."""

    __slots__ = ("__weakref__", "by_label", "run", "waited_s", "waits")

    def __init__(self) -> None:
        self.run = _empty_run()  # the tensors, by size (replaced by the next run, never changed but its count)
        self.by_label: dict[str, list[int]] = {}  # with metrics_key_label: label -> [tensors, bytes]
        self.waits = [0] * (len(WAIT_BUCKETS) + 1)  # recvs by wait bucket
        self.waited_s = 0.0


class Meter:
    """What one Producer or Consumer counts for the collector beyond what it keeps anyway: tensors and
    their bytes (by key label), sizes, recv waits. It is the endpoint's monitor when only metrics are on
    (`send`, `recv`, `close`, as monitoring.Monitor's), so a tensor costs one call: a comparison and an
    addition in a run of the calling thread's own (no lock)."""

    def __init__(self, role: str, endpoint: Producer | Consumer, key_label: Callable[[str | None], str] | None) -> None:
        if key_label is not None and not callable(key_label):
            raise ConfigError(f"metrics_key_label must be a callable (key -> label), got {type(key_label).__name__}")
        self.role, self.endpoint, self.key_label = role, endpoint, key_label
        self.transport = endpoint.transport.url.scheme
        self.lock = threading.Lock()
        self.cells: list[_Cell] = []  # one per live thread that sent or received (guarded by `lock`)
        self.retired = _Cell()  # the counts of threads that ended (guarded by `lock`)
        #: what folds each live thread's cell in when the thread ends (guarded by `lock`; detached at close)
        self._finalizers: list[weakref.finalize[Any, Any]] = []
        self._local = threading.local()  # the thread's `cell`, and its cell's `run`

    def _cell(self) -> _Cell:
        """The calling thread's counts, made on its first tensor; folded into `retired` once the thread
        is gone (so that threads coming and going cost no memory)."""
        cell = _Cell()
        finalizer = weakref.finalize(threading.current_thread(), _retire, weakref.ref(self), cell)
        with self.lock:
            self.cells.append(cell)
            self._finalizers = [*(f for f in self._finalizers if f.alive), finalizer]
        self._local.cell, self._local.run = cell, cell.run
        return cell

    def _new_size(self, nbytes: int) -> None:
        """The calling thread's tensor of `nbytes` bytes starts a new run (its last one's sizes before it)."""
        cell: _Cell = self._local.cell
        sizes, total = cell.run.totals()
        cell.run = self._local.run = _Run(nbytes, sizes, total, 1)

    def _labelled(self, cell: _Cell, key: str | None, nbytes: int) -> None:
        counts = cell.by_label.setdefault(str(self.key_label(key)), [0, 0])  # type: ignore[misc]
        counts[0] += 1
        counts[1] += nbytes

    def send(
        self, send: Callable[..., None], tensor: Any, key: str | None, metadata: Any, message_id: Any, encoding: Any
    ) -> None:
        """`send(tensor, key, metadata, message_id, encoding)` (the transport's `send_message`), counted."""
        send(tensor, key, metadata, message_id, encoding)
        try:  # (the thread's run, made on its first tensor)
            run: _Run = self._local.run
        except AttributeError:
            run = self._cell().run
        nbytes = tensor.nbytes if type(tensor) is _ndarray else tensor_nbytes(tensor)
        if nbytes == run.size:
            run.count += 1
        else:
            self._new_size(nbytes)
        if self.key_label is not None:
            self._labelled(self._local.cell, key, nbytes)

    def recv(self, receive: Callable[..., Message], *args: Any) -> Message:
        """`receive(*args)` (the table's `recv_message` or `next_message`), counted with its wait."""
        started = _clock()
        message = receive(*args)
        self.received(message, _clock() - started)
        return message

    def received(self, message: Message, waited_s: float) -> None:
        """The application has `message`, after waiting `waited_s` (the asyncio consumer's receives come here).

        (What it counts is what `send` counts, written out again: a call is a tenth of what metrics may
        cost a 4 KB tensor.)"""
        try:
            cell: _Cell = self._local.cell
        except AttributeError:
            cell = self._cell()
        tensor = message.tensor
        nbytes = tensor.nbytes if type(tensor) is _ndarray else tensor_nbytes(tensor)
        run = cell.run
        if nbytes == run.size:
            run.count += 1
        else:
            self._new_size(nbytes)
        if self.key_label is not None:
            self._labelled(cell, message.key, nbytes)
        cell.waits[0 if waited_s <= _FIRST_WAIT else _bisect(WAIT_BUCKETS, waited_s)] += 1  # (mostly no wait)
        cell.waited_s += waited_s

    def close(self) -> None:
        """The endpoint closed: its counts go to the collector's retired totals, and no thread (the main
        one included, which never ends) keeps a cell of it."""
        detach(self)
        with self.lock:
            finalizers, self._finalizers = self._finalizers, []
        for finalizer in finalizers:
            finalizer.detach()

    def read(self) -> tuple[dict[str, list[int]], list[int], list[int], float]:
        """The counts of every thread, summed: by label [tensors, bytes], size and wait buckets, seconds waited."""
        total = _Cell()
        with self.lock:
            cells = list(self.cells)
            _fold(total, self.retired)
        for cell in cells:
            _fold(total, cell)
        sizes, nbytes = total.run.totals()
        if self.key_label is None:
            total.by_label = {"": [sum(sizes), nbytes]}  # (every tensor is in one size bucket)
        return total.by_label, sizes, total.waits, total.waited_s


def _fold(total: _Cell, cell: _Cell) -> None:
    """Add a cell's counts to `total` (one the caller owns)."""
    for label, (tensors, nbytes) in dict(cell.by_label).items():
        counts = total.by_label.setdefault(label, [0, 0])
        counts[0] += tensors
        counts[1] += nbytes
    (sizes, nbytes), (more, more_bytes) = total.run.totals(), cell.run.totals()
    total.run = _Run(0, [a + b for a, b in zip(sizes, more, strict=True)], nbytes + more_bytes)
    total.waits = [a + b for a, b in zip(total.waits, cell.waits, strict=True)]
    total.waited_s += cell.waited_s


def _retire(meter_ref: weakref.ref[Meter], cell: _Cell) -> None:
    """A thread that counted is gone: its counts move to the meter's `retired` (written by nobody else now)."""
    meter = meter_ref()
    if meter is not None:
        with meter.lock:
            meter.cells.remove(cell)
            _fold(meter.retired, cell)


def attach(role: str, endpoint: Producer | Consumer, registry: Any, key_label: Any) -> Meter:
    """A meter for `endpoint`, read by the collector of `registry` (None: prometheus_client's default)."""
    meter = Meter(role, endpoint, key_label)
    endpoint.transport.tally.metered = True
    registry = prometheus_client.REGISTRY if registry is None else registry
    if not hasattr(registry, "register"):
        raise ConfigError(f"metrics_registry must be a prometheus_client CollectorRegistry, got {registry!r}")
    with _COLLECTORS_LOCK:
        collector = _COLLECTORS.get(registry)
        if collector is None:
            collector = _COLLECTORS[registry] = Collector()
            registry.register(collector)
        with collector.lock:
            collector.meters.add(meter)
    return meter


def detach(meter: Meter) -> None:
    """A closed endpoint is no longer read: its counters' last values stay, in its collector's retired totals."""
    with _COLLECTORS_LOCK:
        collectors = list(_COLLECTORS.values())
    for collector in collectors:
        collector.retire(meter)


class Collector:
    """Reads every live meter of one registry, and the counts beside it, when the registry is scraped.

    A Prometheus counter must never go down (a lower value reads as a reset): when an endpoint closes,
    its counters' values are added to `retired`, summed by label set with those of endpoints closed
    before, and every scrape starts from them; its gauges go."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards `meters` and `retired`, held through a scrape and a retirement
        self.meters: weakref.WeakSet[Meter] = weakref.WeakSet()
        self.retired = _Samples()  # counters and histograms of the endpoints closed

    def describe(self) -> list[Any]:
        return []  # (names vary with the endpoints alive: nothing to check at registration)

    def retire(self, meter: Meter) -> None:
        """`meter`'s endpoint closed: its counters go to `retired` (in one step with a scrape's reading)."""
        with self.lock:
            if meter not in self.meters:
                return
            samples = _Samples()
            _read(samples, meter)
            self.retired.fold(samples, counters_only=True)
            self.meters.discard(meter)

    def collect(self) -> Iterator[Any]:
        samples = _Samples()
        with self.lock:
            samples.fold(self.retired)
            for meter in list(self.meters):
                _read(samples, meter)
        yield from samples.families()


def _read(samples: _Samples, meter: Meter) -> None:
    """Everything one meter's endpoint counts, added to `samples`."""
    base = (meter.role, meter.transport, endpoint_label(meter.endpoint.transport.address))
    by_label, size_counts, wait_counts, wait_sum = meter.read()
    sizes, waits = cumulative(SIZE_BUCKETS, size_counts), cumulative(WAIT_BUCKETS, wait_counts)
    size_sum = sum(nbytes for _, nbytes in by_label.values())  # (every tensor counts under one label)
    verb, how = ("sent", "sent") if meter.role == "producer" else ("received", "handed to the application by recv")
    for label, (tensors, nbytes) in by_label.items():
        keyed = (*base, label) if meter.key_label is not None else base
        samples.counter(f"{verb}_tensors", f"tensors {how}", keyed, tensors)
        samples.counter(f"{verb}_bytes", f"bytes of the tensors {how}", keyed, nbytes)
    samples.histogram("tensor_bytes", "size of the tensors sent or handed out", base, sizes, size_sum)
    if meter.role == "consumer":
        samples.histogram("recv_wait_seconds", "from a recv call to its tensor", base, waits, wait_sum)
        _consumer(samples, base, meter.endpoint)  # type: ignore[arg-type]
    _transport(samples, base, meter.role, meter.endpoint.transport)


def _consumer(samples: _Samples, base: tuple[str, ...], consumer: Consumer) -> None:
    """What a consumer's intake and table count (read key by key: a lookup is one step, a copy is not)."""
    stats, table, held = consumer.intake.stats, consumer.table, consumer.intake.reassembler.held_bytes
    rejected, dropped = "frames refused, by reason", "tensors dropped unreceived, by reason"
    for name, what, stat in _CONSUMER_COUNTS:
        samples.counter(name, what, base, stats.get(stat, 0))
    for reason in REJECTION_REASONS:
        samples.counter("rejected_frames", rejected, (*base, reason), stats.get("rejected " + reason, 0))
    samples.counter("dropped_tensors", dropped, (*base, "abort"), table.dropped)
    samples.counter("dropped_tensors", dropped, (*base, "unclaimed"), stats.get("unclaimed", 0))
    samples.gauge("buffered_bytes", "bytes received and not yet taken, in the table", base, table.buffered_bytes)
    samples.gauge("reassembly_bytes", "bytes held for tensors part way reassembled", base, held)
    acked = consumer.intake.ledger.released_frames
    samples.counter("acknowledged_frames", _ACKED["consumer"], base, acked)


#: a transport's `counts()`, as (metric, help, kind)
_TRANSPORT_COUNTS = {
    "unacked_bytes": ("bytes sent and not yet acknowledged (kept to resend)", "gauge"),
    "resent_frames": ("frames sent again after a reconnect", "counter"),
    "reconnects": ("connections made again after one broke", "counter"),
    "connections": ("open connections", "gauge"),
    "redeliveries": ("messages the broker delivered again", "counter"),
}


def _transport(samples: _Samples, base: tuple[str, ...], role: str, transport: Endpoint) -> None:
    """What the transport counts: its `counts()`, and its tally's (tally.py)."""
    tally = transport.tally
    counts = {"reconnects": tally.reconnects, **transport.counts()}
    if role == "consumer":
        counts["redeliveries"] = tally.redeliveries
    for name, value in counts.items():
        what, kind = _TRANSPORT_COUNTS[name]
        (samples.counter if kind == "counter" else samples.gauge)(name, what, base, value)
    if role == "producer":
        samples.counter("acknowledged_frames", _ACKED[role], base, tally.acked_frames)
        samples.counter("backpressure_seconds", _BLOCKED, base, tally.blocked_s)
        acks = cumulative(ACK_BUCKETS, list(tally.ack_waits))
        samples.histogram("ack_seconds", _ACK_SECONDS, base, acks, tally.ack_wait_s)


_BLOCKED = "seconds sends waited for credit or room (max_unacked_bytes, max_pending_bytes)"
_ACK_SECONDS = "from a frame's send to its acknowledgement (one frame in flight timed at a time)"
#: what `acknowledged_frames` counts, by role
_ACKED = {
    "producer": "frames the endpoint acknowledged (socket ack, AMQP confirm, Kafka delivery report)",
    "consumer": "frames the consumer acknowledged as done (released: socket TAKEN, AMQP ack, Kafka commit)",
}


_LABELS = ("role", "transport", "endpoint")
_EXTRA_LABEL = {"rejected_frames": "reason", "dropped_tensors": "reason", "sent_tensors": "key",
                "sent_bytes": "key", "received_tensors": "key", "received_bytes": "key"}  # fmt: skip


class _Samples:
    """The samples of one scrape by metric, summed where two endpoints share their labels."""

    def __init__(self) -> None:
        self.kinds: dict[str, tuple[str, str]] = {}
        self.values: dict[str, dict[tuple[str, ...], Any]] = {}

    def _add(self, kind: str, name: str, what: str, labels: tuple[str, ...], value: Any) -> None:
        self.kinds.setdefault(name, (kind, what))
        by_labels = self.values.setdefault(name, {})
        had = by_labels.get(labels)
        if had is None:
            by_labels[labels] = value
        elif kind == "histogram":
            buckets = [(le, a + b) for (le, a), (_, b) in zip(had[0], value[0], strict=True)]
            by_labels[labels] = (buckets, had[1] + value[1])
        else:
            by_labels[labels] = had + value

    def fold(self, other: _Samples, counters_only: bool = False) -> None:
        """Add `other`'s samples (without its gauges if `counters_only`)."""
        for name, (kind, what) in other.kinds.items():
            if kind != "gauge" or not counters_only:
                for labels, value in other.values[name].items():
                    self._add(kind, name, what, labels, value)

    def counter(self, name: str, what: str, labels: tuple[str, ...], value: float) -> None:
        self._add("counter", name, what, labels, value)

    def gauge(self, name: str, what: str, labels: tuple[str, ...], value: float) -> None:
        self._add("gauge", name, what, labels, value)

    def histogram(
        self, name: str, what: str, labels: tuple[str, ...], buckets: list[tuple[str, float]], total: float
    ) -> None:
        self._add("histogram", name, what, labels, (buckets, total))

    def families(self) -> Iterator[Any]:
        for name, (kind, what) in self.kinds.items():
            by_labels = self.values[name]
            width = max(len(label_values) for label_values in by_labels)  # (endpoints without a key label: "")
            labels = [*_LABELS, _EXTRA_LABEL[name]] if width > len(_LABELS) else list(_LABELS)
            full = f"tensorbus_{name}"
            family: Any
            if kind == "counter":
                family = CounterMetricFamily(full, what, labels=labels)
            elif kind == "gauge":
                family = GaugeMetricFamily(full, what, labels=labels)
            else:
                family = HistogramMetricFamily(full, what, labels=labels)
            for label_values, value in by_labels.items():
                label_values = (*label_values, "")[:width] if len(label_values) < width else label_values
                if kind == "histogram":
                    family.add_metric(list(label_values), buckets=value[0], sum_value=value[1])
                else:
                    family.add_metric(list(label_values), value)
            yield family


_COLLECTORS_LOCK = threading.Lock()
#: the collector registered with each registry (a registry refuses a second one with the same names)
_COLLECTORS: dict[Any, Collector] = {}


def serve_metrics(port: int, addr: str = "127.0.0.1", registry: Any = None) -> int:
    """Serve the Prometheus exposition (`/metrics`) over HTTP on a daemon thread; returns the port bound
    (0 picks a free one). Needs prometheus_client (`pip install 'tensorbus[metrics]'`)."""
    if prometheus_client is None:
        raise ConfigError("serve_metrics needs prometheus_client: pip install 'tensorbus[metrics]'")
    server, _ = prometheus_client.start_http_server(
        port, addr=addr, registry=prometheus_client.REGISTRY if registry is None else registry
    )
    return int(server.server_port)
