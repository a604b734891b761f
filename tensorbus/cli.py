"""The `tensorbus` command: demo, send, recv, save, inspect, bench, brokers."""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
from collections.abc import Sequence

from . import __version__
from .errors import CodecError, TensorBusError


def _add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    from . import cli_commands as c

    def add_parser(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help, description=help)  # (`COMMAND --help` shows it)

    demo = add_parser("demo", help="send tensors from a second process to a consumer and show what arrived")
    demo.add_argument("--url", default="tcp://127.0.0.1:0", help="consumer endpoint (default: %(default)s)")
    demo.set_defaults(run=c.demo)

    send = add_parser("send", help="send a .npy, .npz or .safetensors file (npz/safetensors as one bundle)")
    send.add_argument("url", help="the consumer's endpoint, e.g. tcp://127.0.0.1:5555")
    send.add_argument("key", help="the key the consumer receives it under")
    send.add_argument("file", help="a .npy, .npz, .safetensors or .tbf (tensorbus frame) file")
    send.add_argument("--compression", choices=["lz4", "zstd"])
    send.add_argument(
        "--timeout",
        type=positive_seconds,
        default=None,
        help="seconds to keep trying to reach the consumer and have the tensor confirmed "
        "(bounds connect_timeout_s, reconnect_timeout_s, send_timeout_s and confirm_timeout_s; default: theirs, "
        "and 60 s to confirm)",
    )
    send.set_defaults(run=c.send)

    recv = add_parser("recv", help="receive one tensor by key and write it (.npy, .npz, .safetensors, .tbf raw)")
    recv.add_argument("url", help="the endpoint to listen on")
    recv.add_argument("key", help="the key to wait for")
    recv.add_argument("-o", "--output", required=True, help="file to write: .npy, .npz, .safetensors or .tbf")
    recv.add_argument("--timeout", type=seconds, default=None, help="seconds to wait (default: forever)")
    recv.add_argument("--metrics-port", type=port, default=None, help=METRICS_PORT_HELP)
    recv.add_argument(
        "--tbf-fallback",
        action="store_true",
        help="a tensor the output format cannot hold is written as a .tbf frame beside it (never replacing a file) "
        "and that succeeds; without this flag it is written so too, but the exit status is 2",
    )
    recv.set_defaults(run=c.recv)

    save = add_parser("save", help="wait for a bundle (e.g. model parameters) and save it atomically")
    save.add_argument("url", help="the endpoint to listen on")
    save.add_argument("key", help="the key the bundle is sent under")
    save.add_argument("-o", "--output", required=True, help="params.safetensors or params.npz")
    save.add_argument(
        "--timeout",
        type=seconds,
        default=None,
        help="seconds to wait for each version (default: forever); "
        "with --follow, a quiet spell this long ends it (successfully, once a version was saved)",
    )
    save.add_argument("--follow", action="store_true", help="keep saving each new version as NAME-000001.EXT, ...")
    save.add_argument("--max-versions", type=count, default=None, help="with --follow: stop after this many")
    save.add_argument("--metrics-port", type=port, default=None, help=METRICS_PORT_HELP)
    save.add_argument(
        "--subscribe",
        action="store_true",
        help="URL is a tb.Publisher's: save its newest version (with --follow, each newer one as NAME-VERSION.EXT)",
    )
    save.add_argument(
        "--tbf-fallback",
        action="store_true",
        help="a tensor the output format cannot hold is written as a .tbf frame beside it (never replacing a file) "
        "and that succeeds; without this flag it is written so too, but the exit status is 2",
    )
    save.set_defaults(run=c.save)

    bench = add_parser("bench", help="compare transports and baselines: throughput and latency, table and plot")
    from .bench import cli as bench_cli

    bench_cli.add_arguments(bench)
    bench.set_defaults(run=bench_cli.run)

    inspect = add_parser(
        "inspect",
        help="print the headers of the frames in a file, without loading payloads "
        "(exit 1 if a frame is bad or the file is empty, truncated or not frames)",
    )
    inspect.add_argument("file", help="a file of tensorbus frames (.tbf), e.g. written by recv -o OUT.tbf")
    inspect.set_defaults(run=c.inspect)


METRICS_PORT_HELP = "serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: any free port; needs tensorbus[metrics])"


def port(text: str) -> int:
    """An argparse type (its name shows in argparse's errors): a TCP port, 0 to 65535."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535)")
    return value


def seconds(text: str) -> float:
    """An argparse type (its name shows in argparse's errors): a number of seconds >= 0."""
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type (its name shows in argparse's errors): a number of seconds > 0 (inf: no bound)."""
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0 (a send takes some time)")
    return value


def count(text: str) -> int:
    """An argparse type (its name shows in argparse's errors): an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count >= 1")
    return value


def _public_name(exc: BaseException) -> str:
    """The nearest class of `exc` that `tensorbus` exports (a transport's own subclass reads as its parent)."""
    import tensorbus

    return next(c.__name__ for c in type(exc).__mro__ if getattr(tensorbus, c.__name__, None) is c)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `tensorbus` command."""
    parser = argparse.ArgumentParser(prog="tensorbus", description="Move tensors between processes and machines.")
    parser.add_argument("--version", action="version", version=f"tensorbus {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log transport events (errors always show)")
    common = argparse.ArgumentParser(add_help=False)  # so that `tensorbus recv -v ...` works too
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_commands(sub, common)
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse; an argument the command does not know is reported with that command's usage, not the top level's."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command = _subparsers(parser).choices[args.command]
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "save" and args.max_versions is not None and not args.follow:
        command.error("--max-versions goes with --follow (without it, save stops after one version)")
    if args.command == "save" and args.subscribe and args.metrics_port is not None:
        command.error("--metrics-port does not go with --subscribe (a subscriber keeps no metrics to serve)")
    return args


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader left (`tensorbus inspect f.tbf | head -1`)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (AttributeError, ValueError, OSError):  # no real stdout (captured, closed), or no poll()
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; errors are one line on stderr and a non-zero exit status."""
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.CRITICAL, format="%(levelname)s %(message)s")
    if not args.verbose:  # tensorbus's own errors (e.g. a frame dropped as bad) show; pika's retry chatter does not
        logging.getLogger("tensorbus").setLevel(logging.ERROR)
    try:
        return int(args.run(args) or 0)
    except TensorBusError as exc:
        print(f"tensorbus {args.command}: {_public_name(exc)}: {exc}", file=sys.stderr)
        return 1 if args.command == "inspect" and isinstance(exc, CodecError) else 2  # a bad file, as documented
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # (a socket's: transports turn those into TransportError, so this is a bug worth a traceback)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes it
        return 128 + signal.SIGPIPE  # what a shell reports for a tool the pipe's end stopped
    except OSError as exc:
        print(f"tensorbus {args.command}: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
