"""`tensorbus bench`: arguments and entry point (importing this module is cheap; the work is lazy)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

EPILOG = """\
Producer and consumer run in separate processes (memory:// in one, it cannot cross processes).
Every received tensor is checked (order, size, dtype, CRC32C). Baselines: socket (bare TCP
sendall + recv_into), zmq (pyzmq PUSH/PULL, a 16-byte header frame and the array, copy=False),
zmq-recipe (pyzmq's send_array recipe: a JSON dtype/shape frame, then the array), zmq-frame (bare
pyzmq: one frame, no metadata), zmq-asyncio (the same on pyzmq's asyncio
sockets, beside aio-tcp and aio-unix: tensorbus.aio), pickle (protocol 5, out-of-band buffers, over
TCP), pika (raw, confirms + manual acks), kafka-python (raw, acks=all), confluent-kafka (raw
librdkafka, acks=all, idempotent, batched consume). A broker that does not answer
is skipped and the table says why. Settings: flags, else the --config file (default
config/bench.toml when it exists), else built-in defaults. A quick look:

  tensorbus bench --transports tcp,unix --sizes 64KB,16MB --budget-s 2 --plot bench.png
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare `tensorbus bench`'s options on `parser` (defaults come from the config, not from here)."""
    from .config import EVENT_LOOPS, VERIFY_MODES  # (the values' one home: the config checks them too)

    parser.description = "Compare tensorbus transports with the baselines users would write instead."
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    add(
        "--transports",
        metavar="LIST",
        help="names or URLs: memory,tcp,unix,shm,amqp,kafka, amqp-quorum,amqp-classic,shm-empty,kafka-confluent, "
        "aio-tcp,aio-unix (default: the first six)",
    )
    add("--sizes", metavar="LIST", help="tensor sizes, binary units (default: 4KB,64KB,1MB,16MB,256MB)")
    add("--dtype", help="element type of the tensors (default: float32)")
    add("--repeats", "--rounds", dest="repeats", type=int, metavar="N", help="timed rounds per cell (median)")
    add("--budget-s", type=float, metavar="S", help="time budget per (method, size) cell, warm-up included")
    add(
        "--baselines",
        metavar="LIST",
        help="socket,zmq,zmq-recipe,zmq-frame,zmq-asyncio,pickle,pika,pika-classic,kafka-python,confluent-kafka, "
        "auto (default) or none",
    )
    add("--latency-sizes", metavar="LIST", help="sizes for round trips (default: 4KB)")
    add("--warmup-s", type=float, metavar="S", help="untimed traffic per cell before timing")
    add("--round-s", type=float, metavar="S", help="target length of a timed round")
    add("--broker-round-s", type=float, metavar="S", help="the same for amqp, kafka and their raw clients")
    add("--verify", choices=VERIFY_MODES, help="check received tensors by CRC32C (default) or order only")
    add(
        "--loop",
        dest="event_loop",
        choices=EVENT_LOOPS,
        help="the event loop of the asyncio rows (aio-tcp, aio-unix, zmq-asyncio; default: asyncio's own)",
    )
    add("--timeout-s", type=float, metavar="S", help="hard limit for any single step")
    add("--amqp-url", metavar="URL", help="broker for amqp and raw pika (env TENSORBUS_AMQP_URL)")
    add("--kafka-url", metavar="URL", help="broker for kafka and raw kafka-python (env TENSORBUS_KAFKA_URL)")
    add("--config", metavar="FILE", help="settings file (default: config/bench.toml if it exists)")
    add("--json", metavar="FILE", help="write every measurement as JSON")
    add("--csv", metavar="FILE", help="write one CSV row per (method, metric, size)")
    add("--plot", metavar="FILE.png", help="draw throughput and latency panels (matplotlib)")
    add("--no-progress", action="store_true", help="no progress bar")
    from ..cli import port  # (loaded already: its parser is being built)

    add(
        "--metrics-port",
        type=port,
        metavar="PORT",
        help="turn metrics on in the tensorbus endpoints measured and serve their Prometheus exposition on "
        "127.0.0.1:PORT/metrics while the bench runs (each sample labelled with its row, `method`); "
        "what is measured then includes the metrics' cost",
    )
    add(
        "--fanout",
        action="store_true",
        help="the fan-out scenario instead: tb.Publisher to N subscriber processes against pyzmq PUB/SUB (tcp) "
        "and raw kafka-python (kafka, kafka-confluent); --transports tcp,kafka, --sizes (16MB,256MB), --repeats (5), "
        "--subscribers",
    )
    add("--subscribers", metavar="LIST", help="with --fanout: subscriber processes per cell (default: 1,2,4)")


_OVERRIDES = (
    "transports", "sizes", "dtype", "repeats", "budget_s", "baselines", "latency_sizes", "warmup_s", "round_s",
    "broker_round_s", "verify", "timeout_s", "amqp_url", "kafka_url", "event_loop",
)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and write the outputs; 1 if a tensor failed verification or a cell failed, else 0."""
    from ..files import check_directory
    from . import config, report
    from .runner import Runner

    if args.fanout:
        if args.metrics_port is not None:
            from ..errors import ConfigError

            raise ConfigError("--metrics-port is for the transport table, not --fanout")
        return _run_fanout(args)
    cfg = config.load(args.config, {name: getattr(args, name, None) for name in _OVERRIDES})
    if args.plot:
        _check_plot_path(args.plot)
    for path in filter(None, (args.json, args.csv, args.plot)):
        check_directory(path)  # before minutes of measuring, not after
    exposition = _serve_metrics(args.metrics_port)
    with _Progress(enabled=not args.no_progress) as progress:
        results = Runner(cfg, progress, verbose=getattr(args, "verbose", False), exposition=exposition).run()
    report.print_report(results)
    if args.json:
        report.write_json(results, args.json)
    if args.csv:
        report.write_csv(results, args.csv)
    if args.plot:
        from .plot import write_plot

        write_plot(results, args.plot)
    written = [f for f in (args.json, args.csv, args.plot) if f]
    if written:
        print(f"wrote {', '.join(written)}")
    if not any(c.ok for c in results.cells):
        print("nothing was measured (every method was skipped or failed)", file=sys.stderr)
        return 1
    return 1 if any(c.failures or c.error for c in results.cells) else 0


def _serve_metrics(port: int | None) -> Any:
    """With `--metrics-port`: the bench's exposition (exposition.py), served from now on; else None."""
    if port is None:
        return None
    from .exposition import BenchExposition

    exposition = BenchExposition()
    exposition.serve(port)
    print(f"metrics of the tensorbus endpoints measured: {exposition.url}", file=sys.stderr)
    return exposition


def _run_fanout(args: argparse.Namespace) -> int:
    """`--fanout`: the table of fan-out cells (and their rounds as JSON with --json)."""
    import json
    import os

    from . import config, fanout

    methods = config.split_list(args.transports or "tcp,kafka")
    unknown = sorted(set(methods) - set(fanout.PAIRS))
    if unknown:
        from ..errors import ConfigError

        raise ConfigError(f"--fanout compares {', '.join(fanout.PAIRS)}; not {', '.join(unknown)}")
    cells = fanout.run(
        methods,
        [config.parse_size(s) for s in config.split_list(args.sizes or "16MB,256MB")],
        [int(n) for n in config.split_list(args.subscribers or "1,2,4")],
        args.repeats or 5,
        args.kafka_url or os.environ.get("TENSORBUS_KAFKA_URL") or config.DEFAULT_KAFKA_URL,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cells, f, indent=1)
    return 0 if cells else 1


def _check_plot_path(path: str) -> None:
    from ..errors import ConfigError

    if not path.lower().endswith(".png"):
        raise ConfigError(f"--plot writes a PNG: give a .png file name, not {path!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'tensorbus[bench]'") from None


class _Progress:
    """A rich progress bar on stderr (plain lines without rich); yields the runner's callback."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.bar: Any = None
        self.task: Any = None
        self.last = 0.0

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        try:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            return self._plain
        self.bar = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self.bar.start()
        self.task = self.bar.add_task("starting workers", total=None)
        return self._rich

    def _rich(self, done: int, total: int, text: str) -> None:
        self.bar.update(self.task, completed=done, total=total, description=text)

    def _plain(self, done: int, total: int, text: str) -> None:
        now = time.monotonic()
        if now - self.last >= 2 or done == total:
            self.last = now
            print(f"[{done}/{total}] {text}", file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
