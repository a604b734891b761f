"""The `tensorbus` command: demo, send, recv, save, inspect, bench, brokers."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from . import __version__
from .errors import TensorBusError


def _add_commands(sub: argparse._SubParsersAction) -> None:
    from . import cli_commands as c

    demo = sub.add_parser("demo", help="send tensors from a second process to a consumer and show what arrived")
    demo.add_argument("--url", default="tcp://127.0.0.1:0", help="consumer endpoint (default: %(default)s)")
    demo.set_defaults(run=c.demo)

    send = sub.add_parser("send", help="send a .npy, .npz or .safetensors file (npz/safetensors as one bundle)")
    send.add_argument("url")
    send.add_argument("key")
    send.add_argument("file")
    send.add_argument("--compression", choices=["lz4", "zstd"])
    send.set_defaults(run=c.send)

    recv = sub.add_parser("recv", help="receive one tensor by key and write it (.npy, .npz, .safetensors, .tbf raw)")
    recv.add_argument("url", help="the endpoint to listen on")
    recv.add_argument("key")
    recv.add_argument("-o", "--output", required=True)
    recv.add_argument("--timeout", type=_seconds, default=None, help="seconds to wait (default: forever)")
    recv.set_defaults(run=c.recv)

    save = sub.add_parser("save", help="wait for a bundle (e.g. model parameters) and save it atomically")
    save.add_argument("url", help="the endpoint to listen on")
    save.add_argument("key")
    save.add_argument("-o", "--output", required=True, help="params.safetensors or params.npz")
    save.add_argument("--timeout", type=_seconds, default=None, help="seconds to wait for each version")
    save.add_argument("--follow", action="store_true", help="keep saving each new version as NAME-000001.EXT, ...")
    save.add_argument("--max-versions", type=_positive, default=None, help="with --follow: stop after this many")
    save.set_defaults(run=c.save)

    bench = sub.add_parser("bench", help="compare transports and baselines: throughput and latency, table and plot")
    from .bench import cli as bench_cli

    bench_cli.add_arguments(bench)
    bench.set_defaults(run=bench_cli.run)

    inspect = sub.add_parser("inspect", help="print the headers of the frames in a file, without loading payloads")
    inspect.add_argument("file")
    inspect.set_defaults(run=c.inspect)


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count >= 1")
    return value


def _public_name(exc: BaseException) -> str:
    """The name of the first public class of `exc` (a transport's private subclass reads as its parent)."""
    return next(c.__name__ for c in type(exc).__mro__ if not c.__name__.startswith("_"))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `tensorbus` command."""
    parser = argparse.ArgumentParser(prog="tensorbus", description="Move tensors between processes and machines.")
    parser.add_argument("--version", action="version", version=f"tensorbus {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log transport events (errors always show)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; errors are one line on stderr and a non-zero exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.CRITICAL, format="%(levelname)s %(message)s")
    if not args.verbose:  # tensorbus's own errors (e.g. a frame dropped as bad) show; pika's retry chatter does not
        logging.getLogger("tensorbus").setLevel(logging.ERROR)
    try:
        return int(args.run(args) or 0)
    except TensorBusError as exc:
        print(f"tensorbus {args.command}: {_public_name(exc)}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"tensorbus {args.command}: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
