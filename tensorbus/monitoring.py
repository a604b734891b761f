"""What `Producer.send` and `Consumer.recv` call when metrics or tracing are on: one call each.

Off (the default), an endpoint has no `Monitor` and pays one `is None` test per call; prometheus_client
and opentelemetry are not even imported. On, `metrics.py` counts and `tracing.py` makes spans.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .codec import Message
from .errors import ConfigError

if TYPE_CHECKING:
    from .api import Consumer, Producer
    from .metrics import Meter
    from .options import MonitoringOptions
    from .tracing import Tracing

_ON = {"1", "true", "yes", "on"}
#: option -> (environment variable that turns it on for every endpoint, module it needs, extra that installs it)
_NEEDS = {
    "metrics": ("TENSORBUS_METRICS", "prometheus_client", "metrics"),
    "tracing": ("TENSORBUS_TRACING", "opentelemetry.propagate", "tracing"),
}


def _wanted(option: str, value: bool) -> bool:
    """Whether `option` is on (its value, or its environment variable); `ConfigError` for an option asked
    for whose library is not installed (the variable without it turns nothing on)."""
    variable, module, extra = _NEEDS[option]
    if not value and os.environ.get(variable, "").lower() not in _ON:
        return False
    try:
        installed = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # (a dotted name whose package is missing)
        installed = False
    if not installed and value:
        raise ConfigError(f"{option}=True needs {module.partition('.')[0]}: pip install 'tensorbus[{extra}]'")
    return installed


class Monitor:
    """An endpoint's meter (metrics) and spans (tracing) together: what it calls when tracing is on
    (with metrics only, the `metrics.Meter` alone is the monitor: one call fewer per tensor)."""

    def __init__(self, meter: Meter | None, tracing: Tracing) -> None:
        self.meter, self.tracing = meter, tracing

    @staticmethod
    def of(role: str, endpoint: Producer | Consumer, options: MonitoringOptions) -> Monitor | Meter | None:
        """The monitor of a new Producer or Consumer, or None with metrics and tracing both off."""
        meter = None
        if _wanted("metrics", options.metrics):
            from . import metrics

            meter = metrics.attach(role, endpoint, options.metrics_registry, options.metrics_key_label)
        if not _wanted("tracing", options.tracing):
            return meter
        from .tracing import Tracing

        return Monitor(meter, Tracing(endpoint))

    def send(
        self, send: Callable[..., None], tensor: Any, key: str | None, metadata: Any, message_id: Any, encoding: Any
    ) -> None:
        """`send(tensor, key, metadata, message_id, encoding)` (the transport's `send_message`), spanned and counted."""
        if self.meter is not None:
            traced = functools.partial(self.tracing.send, send)
            self.meter.send(traced, tensor, key, metadata, message_id, encoding)
        else:
            self.tracing.send(send, tensor, key, metadata, message_id, encoding)

    def recv(self, receive: Callable[..., Message], *args: Any) -> Message:
        """`receive(*args)` (the table's `recv_message` or `next_message`), spanned and counted with its wait."""
        if self.meter is not None:
            return self.meter.recv(self.tracing.recv, receive, *args)
        return self.tracing.recv(receive, *args)

    def received(self, message: Message, waited_s: float) -> None:
        """The asyncio consumer handed out `message` after `waited_s`: counted (its spans are the loop's own)."""
        if self.meter is not None:
            self.meter.received(message, waited_s)

    def close(self) -> None:
        """The endpoint closed: no longer scraped; the closing thread's `process` span ends."""
        if self.meter is not None:
            self.meter.close()
        self.tracing.done_processing()


def serve_metrics(port: int, addr: str = "127.0.0.1", registry: Any = None) -> int:
    """Serve the Prometheus exposition of every endpoint with metrics on (`/metrics`) over HTTP, from a
    daemon thread; returns the port bound (0 picks a free one). Needs `pip install 'tensorbus[metrics]'`."""
    if not _wanted("metrics", True):
        raise AssertionError("unreachable: _wanted raises when the library is missing")
    from . import metrics

    return metrics.serve_metrics(port, addr, registry)
