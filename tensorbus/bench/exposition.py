"""`tensorbus bench --metrics-port`: the Prometheus metrics of every row's tensorbus endpoints, served from
the bench's main process.

A row's producers and consumers live in its two worker processes (links.py: metrics on, into a registry
of the process's own). Each worker answers every command with its registry's exposition as it stands
after the command (workers.py), the last one after closing its endpoints; the main process keeps the
last one of each worker process and serves them all, each sample labelled `method` with its row's name
(`tcp`, `amqp-quorum`, ...). A worker pair restarted after a failure is new processes: their counters
are added to those of the pair they replace (same labels are summed), and the gauges of a pair that
ended are dropped (its endpoints are gone).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError

#: the label each sample gets: the table row (a `Method`'s name) whose workers counted it
METHOD_LABEL = "method"


class BenchExposition:
    """The last exposition of every worker process, served as one (a prometheus_client collector)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the two fields below: written by the runner, read by scrapes
        self._texts: dict[tuple[str, str, int], str] = {}  # (method, pair tag, worker pid) -> its exposition
        self._ended: set[str] = set()  # the tags of pairs whose workers ended (their gauges are not served)
        self.url = ""  # where it is served, once it is

    def update(self, method: str, tag: str, pid: int, text: str) -> None:
        """A worker's exposition after its last command (two workers of one process share one)."""
        with self._lock:
            self._texts[(method, tag, pid)] = text

    def ended(self, tag: str) -> None:
        """The pair `tag` closed or was killed: its counters stay, its gauges go."""
        with self._lock:
            self._ended.add(tag)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve `/metrics` on `port` from a daemon thread; returns the port bound (0: a free one)."""
        try:
            from prometheus_client import CollectorRegistry
        except ImportError:
            raise ConfigError("--metrics-port needs prometheus_client: pip install 'tensorbus[metrics]'") from None
        from ..monitoring import serve_metrics

        registry = CollectorRegistry()
        registry.register(self)
        port = serve_metrics(port, addr, registry)
        self.url = f"http://{addr}:{port}/metrics"
        return port

    def describe(self) -> list[Any]:
        return []  # (names vary with the rows measured: nothing to check at registration)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import Metric
        from prometheus_client.parser import text_string_to_metric_families

        with self._lock:
            texts, ended = dict(self._texts), set(self._ended)
        families: dict[str, Any] = {}
        values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for (method, tag, _), text in texts.items():
            for family in text_string_to_metric_families(text):
                if family.type == "gauge" and tag in ended:
                    continue
                families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                summed = values.setdefault(family.name, {})
                for sample in family.samples:
                    labels = tuple(sorted({**sample.labels, METHOD_LABEL: method}.items()))
                    summed[(sample.name, labels)] = summed.get((sample.name, labels), 0.0) + sample.value
        for name, family in families.items():
            for (sample_name, labels), value in values[name].items():
                family.add_sample(sample_name, dict(labels), value)
            yield family
