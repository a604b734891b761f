"""What each `tensorbus` subcommand does (argument parsing lives in cli.py)."""

from __future__ import annotations

import argparse
import glob
import itertools
import math
import multiprocessing
import re
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np

from .api import Consumer, Producer
from .codec import SparseTensor
from .codec.frame import PREFIX, Message, _unpack_header, frame_length, parse
from .codec.native import crc32c
from .errors import BadMagic, CodecError, ConfigError, Timeout, TruncatedFrame, brief
from .fanout import Subscriber
from .fanout.versions import VERSION_FIELD
from .files import check_writable, read_tensor, write_tensor
from .keys import make_key
from .monitoring import serve_metrics
from .options import defaults, redact
from .transports import resolve_transport


def _arrays(obj: Any) -> list[np.ndarray]:
    """The arrays of a received structure (its depth was bounded when it was decoded)."""
    if isinstance(obj, np.ndarray):
        return [obj]
    if isinstance(obj, SparseTensor):
        return [obj.indices, obj.values]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [array for item in items for array in _arrays(item)]


def _describe(tensor: Any) -> str:
    if isinstance(tensor, dict) and all(isinstance(a, np.ndarray) for a in tensor.values()):
        return f"bundle of {len(tensor)} tensors, {sum(a.nbytes for a in tensor.values()):,} bytes"
    if isinstance(tensor, (dict, list, tuple)):
        arrays = _arrays(tensor)
        return f"structure of {len(arrays)} arrays, {sum(a.nbytes for a in arrays):,} bytes"
    if isinstance(tensor, SparseTensor):
        return f"sparse {tensor.values.dtype} {tensor.dense_shape}, nnz={len(tensor.values)}"
    return f"{tensor.dtype} {tuple(tensor.shape)}, {tensor.nbytes:,} bytes"


def _checksum(tensor: Any) -> int:
    if isinstance(tensor, dict):
        return crc32c(b"".join(np.ascontiguousarray(a).tobytes() for a in tensor.values()))
    if isinstance(tensor, SparseTensor):
        return crc32c(tensor.indices.tobytes() + tensor.values.tobytes())
    return crc32c(np.ascontiguousarray(tensor).tobytes())


def _demo_tensors() -> dict[str, Any]:
    rng = np.random.default_rng(42)
    return {
        make_key("trainer", 1, "server", "params"): {
            "dense1.weight": rng.standard_normal((256, 128), dtype=np.float32),
            "dense1.bias": np.zeros(128, np.float32),
            "dense2.weight": rng.standard_normal((128, 10), dtype=np.float32),
        },
        make_key("trainer", 1, "server", "grad/embedding"): SparseTensor(
            rng.integers(0, 1000, (64, 2)), rng.standard_normal(64), (1000, 1000)
        ),
        make_key("trainer", 1, "server", "activations", (0, 1)): rng.standard_normal((32, 1024), dtype=np.float32),
    }


def _demo_producer(address: str) -> None:
    with Producer(address) as producer:
        for key, tensor in _demo_tensors().items():
            producer.send(key, tensor, metadata={"crc32c": _checksum(tensor)})


def demo(args: argparse.Namespace) -> int:
    """Start a consumer, send tensors to it from a second process, and print what arrived."""
    if args.url.startswith("memory:"):
        raise ConfigError(
            "the demo's producer runs in another process, which memory:// cannot reach: use tcp:// or unix://"
        )
    with Consumer(args.url) as consumer:
        print(f"consumer listening on {consumer.address}; starting a producer process")
        process = multiprocessing.get_context("spawn").Process(target=_demo_producer, args=(consumer.address,))
        started = time.perf_counter()
        process.start()
        ok = True
        for key in reversed(list(_demo_tensors())):  # ask in another order than they are sent
            message = consumer.recv_message(key, timeout=60)
            match = message.metadata["crc32c"] == _checksum(message.tensor)
            ok &= match
            print(f"  {key:<48} {_describe(message.tensor):<42} {'checksum ok' if match else 'CHECKSUM BAD'}")
        process.join(30)
        print(f"received 3 tensors in {time.perf_counter() - started:.2f}s, in the order asked for, not the order sent")
    return 0 if ok and process.exitcode == 0 else 1


#: what `send --timeout` bounds, where the transport has the option: an attempt, the retries, a blocked send
SEND_TIMEOUTS = ("connect_timeout_s", "reconnect_timeout_s", "send_timeout_s", "confirm_timeout_s")
#: ... and a receive's: a broker's connect, which a consumer makes before it can wait
RECV_TIMEOUTS = ("connect_timeout_s",)


def _bounded_by(url: str, timeout: float | None, names: tuple[str, ...] = SEND_TIMEOUTS) -> dict[str, Any]:
    """The options `names` that keep a command within `timeout` seconds (none lowered that the URL sets lower;
    none for a timeout of 0, which bounds the wait alone, or inf)."""
    if timeout is None or math.isinf(timeout) or timeout == 0:  # (inf: as long as it takes, each its own default)
        return {}
    cls, parsed = resolve_transport(url)
    query = urllib.parse.parse_qs(parsed.query)
    options = {}
    known = defaults(cls.Options)
    for name in names:
        if name in known:
            try:
                options[name] = min(timeout, float(query.get(name, ["inf"])[-1]))
            except ValueError:  # a bad value in the URL: the producer names it
                continue
    return options


def send(args: argparse.Namespace) -> int:
    """Send a tensor file to a consumer; with --timeout, give up (exit 2) if that does not succeed in time."""
    tensor = read_tensor(args.file)
    with Producer(args.url, compression=args.compression, **_bounded_by(args.url, args.timeout)) as producer:
        producer.send(args.key, tensor)
        producer.flush(timeout=60 if args.timeout is None else args.timeout)
    print(f"sent {args.key}: {_describe(tensor)}")
    return 0


def _monitored(args: argparse.Namespace) -> dict[str, Any]:
    """With --metrics-port: the exposition served on 127.0.0.1 at that port, and the consumer's metrics on."""
    if args.metrics_port is None:
        return {}
    port = serve_metrics(args.metrics_port)
    print(f"metrics on http://127.0.0.1:{port}/metrics", flush=True)
    return {"metrics": True}


def recv(args: argparse.Namespace) -> int:
    """Listen at the URL, wait for one tensor under the key, and write it to a file."""
    check_writable(args.output)  # before the tensor is taken from the endpoint, not after
    with Consumer(args.url, **_monitored(args), **_bounded_by(args.url, args.timeout, RECV_TIMEOUTS)) as consumer:
        print(f"waiting for {args.key!r} on {redact(consumer.address)}", flush=True)
        try:
            message = consumer.recv_message(args.key, timeout=args.timeout)
        finally:  # a typo in the key shows up here: say what did arrive
            _note_dropped(consumer)
        target = _write(args.output, message)
    print(f"received {args.key}: {_describe(message.tensor)} -> {target}")
    return _fell_back(args.output, target, args.tbf_fallback)


def _fell_back(asked: str | Path, target: Path, tbf_fallback: bool) -> int:
    """The exit status of a command that wrote `target` (`_write`) when asked for `asked`: 0 when it is that
    file, or when --tbf-fallback accepts a .tbf beside it; else 2 (and stderr says why)."""
    if target == Path(asked) or tbf_fallback:
        return 0
    print(f"exit status 2: {asked} was not written (--tbf-fallback accepts the .tbf)", file=sys.stderr)
    return 2


#: how many OUTPUT-N.tbf names a fallback tries before giving up
_FALLBACK_NAMES = 1000


def _write(output: str | Path, message: Message) -> Path:
    """Write a received tensor; one the chosen format cannot hold goes to OUTPUT.tbf (or OUTPUT-N.tbf: an
    existing file is never replaced, as the user did not name it) rather than being lost."""
    try:
        write_tensor(output, message.tensor, key=message.key, metadata=message.metadata)
        return Path(output)
    except ConfigError as exc:
        base = Path(output)
        for n in range(_FALLBACK_NAMES):
            fallback = base.with_suffix(".tbf") if n == 0 else base.with_name(f"{base.stem}-{n}.tbf")
            try:
                write_tensor(fallback, message.tensor, key=message.key, metadata=message.metadata, replace=False)
            except FileExistsError:
                continue
            print(f"{exc}; wrote it as a tensorbus frame instead: {fallback}", file=sys.stderr)
            return fallback
        raise ConfigError(f"{exc}; and {base.with_suffix('.tbf')} and {_FALLBACK_NAMES - 1} more names exist") from None


def _note_dropped(consumer: Consumer) -> None:
    """Say so when more tensors arrived than were saved, and under which keys: not taken, they are not
    acknowledged, and a broker or a live producer gives them to the endpoint's next consumer (docs/DELIVERY.md)."""
    keys = consumer.table.buffered_keys()
    if keys:
        first = itertools.islice(keys.items(), 5)
        shown = ", ".join(f"{brief(key)} ({n})" if n > 1 else brief(key) for key, n in first)
        more = f" and {len(keys) - 5} more keys" if len(keys) > 5 else ""
        print(
            f"note: {sum(keys.values())} more tensor(s) arrived here and were not saved: {shown}{more}; not taken, "
            "so a broker (or their producer, while it runs) gives them to the endpoint's next consumer",
            file=sys.stderr,
        )


def _versioned(path: Path, version: int) -> Path:
    return path.with_name(f"{path.stem}-{version:06d}{path.suffix}")


def _last_version(path: Path) -> int:
    """The highest NAME-NNNNNN.EXT already saved, so a restarted `save --follow` never overwrites one."""
    pattern = re.compile(rf"{re.escape(path.stem)}-(\d{{6}}){re.escape(path.suffix)}")
    found = (pattern.fullmatch(p.name) for p in path.parent.glob(f"{glob.escape(path.stem)}-*"))
    return max((int(m.group(1)) for m in found if m), default=0)


def save(args: argparse.Namespace) -> int:
    """Wait for bundles under the key and write each atomically (numbered with --follow)."""
    output = Path(args.output)
    check_writable(output, bundle=True)
    if args.subscribe:
        return _save_subscribed(args, output)
    first = _last_version(output) + 1 if args.follow else 1
    with Consumer(args.url, **_monitored(args)) as consumer:
        print(f"waiting for {args.key!r} on {redact(consumer.address)}", flush=True)
        for version in itertools.count(first):
            try:
                message = consumer.recv_message(args.key, timeout=args.timeout)
            except Timeout:
                _note_dropped(consumer)
                if version == first:
                    raise
                print(f"no new version within {args.timeout}s: stopping after {version - first} saved")
                return 0
            target = _versioned(output, version) if args.follow else output
            started = time.perf_counter()
            asked, target = target, _write(target, message)
            print(f"saved {_describe(message.tensor)} -> {target} ({time.perf_counter() - started:.2f}s)", flush=True)
            if status := _fell_back(asked, target, args.tbf_fallback):
                _note_dropped(consumer)
                return status
            if not args.follow or (args.max_versions and version - first + 1 >= args.max_versions):
                _note_dropped(consumer)
                return 0
    return 0


def _save_subscribed(args: argparse.Namespace, output: Path) -> int:
    """Save the publisher's newest version of the key (with --follow, each newer one, named by its version)."""
    saved, newer_than = 0, (_last_version(output) or None) if args.follow else None
    with Subscriber(args.url) as sub:
        print(f"following {args.key!r} on {redact(args.url)}", flush=True)
        while True:
            try:
                message = sub.latest(args.key, newer_than=newer_than, timeout=args.timeout)
            except Timeout:
                if not saved:
                    raise
                print(f"no new version within {args.timeout}s: stopping after {saved} saved")
                return 0
            kept = Message(message.key, message.tensor, {**message.metadata, VERSION_FIELD: message.version})
            asked = _versioned(output, message.version) if args.follow else output
            target = _write(asked, kept)  # (a .tbf keeps the version with it)
            print(f"saved version {message.version}: {_describe(message.tensor)} -> {target}", flush=True)
            if status := _fell_back(asked, target, args.tbf_fallback):
                return status
            saved, newer_than = saved + 1, message.version
            if not args.follow or (args.max_versions and saved >= args.max_versions):
                return 0


def inspect(args: argparse.Namespace) -> int:
    """Print each frame's header in a file of frames, checking checksums but not building arrays.

    Exit status 1 when a frame fails its checks or the file is not whole frames (empty, truncated,
    not frames at all: a CodecError, which `cli.main` maps to 1 for inspect)."""
    data = memoryview(Path(args.file).read_bytes())
    if not data:
        raise TruncatedFrame(f"{args.file} is empty: no frames")
    offset, count, bad = 0, 0, 0
    while offset < len(data):
        try:
            total = frame_length(data[offset : offset + PREFIX.size])
        except BadMagic as exc:
            where = "is not a file of tensorbus frames" if offset == 0 else f"holds no frame at byte {offset}"
            raise BadMagic(f"{args.file} {where}: {exc}") from None
        if offset + total > len(data):
            raise TruncatedFrame(
                f"frame {count} at byte {offset} needs {total} bytes, the file has {len(data) - offset} from there "
                f"({len(data)} in all)"
            )
        frame_bytes = data[offset : offset + total]
        header_len = PREFIX.unpack_from(frame_bytes)[4]
        try:
            header = _unpack_header(frame_bytes[PREFIX.size : PREFIX.size + header_len])
        except CodecError:  # (parse, below, says what is wrong with it)
            header = {}
        try:
            parse(frame_bytes)
            status = "ok" if frame_bytes[5] & 1 else "absent"
        except CodecError as exc:
            status, bad = f"BAD ({exc})", bad + 1
        meta = header.get("meta")
        version = f", version={meta[VERSION_FIELD]}" if isinstance(meta, dict) and VERSION_FIELD in meta else ""
        print(
            f"frame {count} at byte {offset}: {total:,} bytes, kind={header.get('kind')}, key={header.get('key')!r}"
            f"{version}, id={header.get('id')}, compression={header.get('comp')}, checksum {status}"
        )
        if header.get("chunk"):
            print(f"  chunk {header['chunk'][0] + 1} of {header['chunk'][1]}, message of {header['chunk'][2]:,} bytes")
        for entry in header.get("tensors") or []:
            name = entry.get("name") or "(tensor)"
            print(
                f"  {name}: {entry.get('dtype')} {entry.get('order')} shape={entry.get('shape')} "
                f"{entry.get('nbytes'):,} bytes at payload offset {entry.get('offset')}"
            )
        if header.get("meta"):
            try:
                shown = repr(header["meta"])
            except RecursionError:  # nested deeper than any sender would: a hostile or broken frame
                shown = brief(header["meta"])
            print(f"  metadata: {shown}")
        offset += total
        count += 1
    if bad:
        print(f"{bad} of {count} frames failed their checks", file=sys.stderr)
    return 1 if bad else 0
