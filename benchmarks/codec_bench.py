"""Codec benchmark: encode + decode round trip of one float32 tensor in one process, tensorbus vs. the usual ways.

What it measures
    For each size (default 4 KB, 64 KB, 1 MB, 16 MB, 256 MB) and each method, the time of one encode plus
    one decode that yields a usable ndarray, reported as GB/s of tensor bytes (1 GB = 1e9 bytes), the
    median over rounds. Allocating and freeing each method's buffers is part of the time, as it is for a
    user. No transport is involved: this is the CPU cost of the codec alone.

    tensorbus, each with the CRC32C checksum on (the default) and off (`checksum=False`):
      - `tb.loads(tb.dumps(x))`: what a user writes; `dumps` joins the frame into new bytes (one copy),
        `loads` returns a view of them.
      - zero-copy path: `tb.encode(x)` (scatter-gather list whose payload is `x`'s own memory, as the socket
        transport sends it), then `tb.loads(rx)` of a contiguous receive buffer holding the frame (as a
        transport's reused receive buffer would; filled once before timing, so the socket's copy is not
        counted).
    Baselines, each as a user would write it:
      - msgpack-numpy: `msgpack.packb(x, default=m.encode)` / `msgpack.unpackb(b, object_hook=m.decode)`
      - pickle protocol 5 with out-of-band buffers (`buffer_callback` / `buffers=`); in one process the
        decoded array aliases `x`, so this is the do-nothing floor rather than a codec;
      - `np.save` into a BytesIO, `getvalue()`, `np.load` of a BytesIO over those bytes;
      - safetensors: `safetensors.numpy.save({"t": x})` / `safetensors.numpy.load(b)["t"]`;
      - pyarrow tensor IPC: `pa.ipc.write_tensor(pa.Tensor.from_numpy(x), pa.BufferOutputStream())`,
        `pa.ipc.read_tensor(buf).to_numpy()` (a view of `buf`).
    Also the header alone: `tb.decode(tb.dumps(np.zeros(1, np.float32)))` in microseconds.

    Methods are interleaved within each round (order rotated per round) after a warm-up, because the
    machine is shared and single rounds vary by about ±30 %. Ratios to pyarrow are medians of per-round
    ratios. Targets: at 16 MB and 256 MB without checksum at least as fast as pyarrow; with
    CRC32C at least 5 GB/s at 16 MB; header encode + decode under 20 µs.

How to run (from the repository root)
    .venv/bin/python -m benchmarks.codec_bench                       # all sizes, under a minute here
    .venv/bin/python -m benchmarks.codec_bench --sizes 4K,16M --rounds 15 --json codec.json
    .venv/bin/python -m benchmarks.codec_bench --methods tb-crc,tb-zc-crc,pyarrow --markdown

Memory: one size at a time. At 256 MB the tensor and the two zero-copy receive buffers stay alive while
each method's output is freed after every call; peak RSS of a default run is about 1.7 GB.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import tensorbus as tb

from .common import (
    Stats,
    format_size,
    machine_info,
    package_versions,
    paired_ratio,
    parse_sizes,
    print_table,
    run_interleaved,
    write_json,
)

DEFAULT_SIZES = "4K,64K,1M,16M,256M"
DEFAULT_ROUNDS = 9
TARGET_CRC_GBPS = 5.0
TARGET_CRC_SIZE = 16 << 20
TARGET_NOCRC_SIZES = (16 << 20, 256 << 20)
TARGET_HEADER_US = 20.0

RoundTrip = Callable[[], np.ndarray]


@dataclass(frozen=True)
class Method:
    """One way to turn a tensor into bytes and back; `prepare(x)` returns the timed round trip."""

    key: str
    label: str
    copies: str  # what the encode / decode do with the tensor bytes
    prepare: Callable[[np.ndarray], RoundTrip]
    tensorbus: bool = False


def _tb_dumps(checksum: bool) -> Callable[[np.ndarray], RoundTrip]:
    def prepare(x: np.ndarray) -> RoundTrip:
        return lambda: tb.loads(tb.dumps(x, checksum=checksum))

    return prepare


def _tb_dumps_into(checksum: bool) -> Callable[[np.ndarray], RoundTrip]:
    def prepare(x: np.ndarray) -> RoundTrip:
        out = bytearray(len(tb.dumps(x, checksum=checksum)))  # one buffer, reused every call
        return lambda: tb.loads(tb.dumps(x, checksum=checksum, out=out))

    return prepare


def _tb_zero_copy(checksum: bool) -> Callable[[np.ndarray], RoundTrip]:
    def prepare(x: np.ndarray) -> RoundTrip:
        rx = bytearray(b"".join(tb.encode(x, checksum=checksum)))  # the buffer a transport received into

        def round_trip() -> np.ndarray:
            tb.encode(x, checksum=checksum)  # the parts a transport would sendmsg()
            return tb.loads(rx)

        return round_trip

    return prepare


def _msgpack_numpy(x: np.ndarray) -> RoundTrip:
    import msgpack
    import msgpack_numpy

    return lambda: msgpack.unpackb(msgpack.packb(x, default=msgpack_numpy.encode), object_hook=msgpack_numpy.decode)


def _pickle5(x: np.ndarray) -> RoundTrip:
    def round_trip() -> np.ndarray:
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(x, protocol=5, buffer_callback=buffers.append)
        return pickle.loads(data, buffers=buffers)

    return round_trip


def _npy(x: np.ndarray) -> RoundTrip:
    def round_trip() -> np.ndarray:
        sink = io.BytesIO()
        np.save(sink, x, allow_pickle=False)
        return np.load(io.BytesIO(sink.getvalue()), allow_pickle=False)

    return round_trip


def _safetensors(x: np.ndarray) -> RoundTrip:
    import safetensors.numpy

    return lambda: safetensors.numpy.load(safetensors.numpy.save({"t": x}))["t"]


def _pyarrow(x: np.ndarray) -> RoundTrip:
    import pyarrow as pa

    def round_trip() -> np.ndarray:
        sink = pa.BufferOutputStream()
        pa.ipc.write_tensor(pa.Tensor.from_numpy(x), sink)
        return pa.ipc.read_tensor(sink.getvalue()).to_numpy()

    return round_trip


METHODS = [
    Method("tb-crc", "tensorbus loads(dumps()) crc", "enc 1 copy, dec view", _tb_dumps(True), tensorbus=True),
    Method("tb-nocrc", "tensorbus loads(dumps()) no crc", "enc 1 copy, dec view", _tb_dumps(False), tensorbus=True),
    Method(
        "tb-out-crc",
        "tensorbus loads(dumps(out=buf)) crc",
        "enc 1 copy, dec view",
        _tb_dumps_into(True),
        tensorbus=True,
    ),
    Method(
        "tb-out-nocrc",
        "tensorbus loads(dumps(out=buf)) no crc",
        "enc 1 copy, dec view",
        _tb_dumps_into(False),
        tensorbus=True,
    ),
    Method("tb-zc-crc", "tensorbus encode + loads(rx) crc", "enc view, dec view", _tb_zero_copy(True), tensorbus=True),
    Method(
        "tb-zc-nocrc", "tensorbus encode + loads(rx) no crc", "enc view, dec view", _tb_zero_copy(False), tensorbus=True
    ),
    Method("msgpack-numpy", "msgpack-numpy", "enc copies, dec 1 copy", _msgpack_numpy),
    Method("pickle5", "pickle 5, out-of-band buffers", "enc view, dec view (aliases x)", _pickle5),
    Method("npy", "np.save / np.load (BytesIO)", "enc copies, dec copies", _npy),
    Method("safetensors", "safetensors.numpy", "enc copies, dec 1 copy", _safetensors),
    Method("pyarrow", "pyarrow tensor IPC", "enc 1 copy, dec view", _pyarrow),
]


def bench_size(methods: list[Method], size: int, rounds: int, min_sample_s: float) -> dict[str, Stats]:
    """Round-trip times (seconds) of every method for one float32 tensor of `size` bytes."""
    x = np.random.default_rng(size).random(size // 4, dtype=np.float32)
    cases: dict[str, RoundTrip] = {}
    for method in methods:
        round_trip = method.prepare(x)
        y = round_trip()
        if not (isinstance(y, np.ndarray) and y.dtype == x.dtype and y.shape == x.shape and np.array_equal(x, y)):
            raise AssertionError(f"{method.key} did not round-trip a {format_size(size)} tensor")
        del y
        cases[method.key] = round_trip
    return run_interleaved(cases, rounds=rounds, min_sample_s=min_sample_s)


def bench_header(rounds: int, min_sample_s: float) -> dict[str, Stats]:
    """Microsecond-scale cost of a frame with a 1-element tensor: the header's encode and decode."""
    x = np.zeros(1, np.float32)
    frame = tb.dumps(x)
    cases: dict[str, Callable[[], object]] = {
        "dumps + decode, crc": lambda: tb.decode(tb.dumps(x)),
        "dumps + decode, no crc": lambda: tb.decode(tb.dumps(x, checksum=False)),
        "dumps alone, crc": lambda: tb.dumps(x),
        "decode alone, crc": lambda: tb.decode(frame),
    }
    return run_interleaved(cases, rounds=rounds, min_sample_s=min_sample_s)


def gbps(size: int, seconds: float) -> float:
    return size / seconds / 1e9


def fmt_rate(value: float) -> str:
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def report(
    methods: list[Method],
    sizes: list[int],
    results: dict[int, dict[str, Stats]],
    header: dict[str, Stats],
    rounds: int,
    markdown: bool,
) -> dict[str, Any]:
    """Print the tables and target verdicts; return the summary for the JSON file."""
    size_names = [format_size(s) for s in sizes]
    rows = [[m.label, m.copies, *(fmt_rate(gbps(s, results[s][m.key].median)) for s in sizes)] for m in methods]
    print_table(
        f"Encode + decode round trip, float32, GB/s of tensor bytes (median of {rounds} rounds)",
        ["method", "copies of the tensor bytes", *size_names],
        rows,
        markdown=markdown,
    )
    spreads = [(results[s][m.key].spread, m.key, format_size(s)) for s in sizes for m in methods]
    worst = max(spreads)
    print(
        f"spread (interquartile range / median) per cell: median {statistics.median(v for v, _, _ in spreads):.0%}, "
        f"worst {worst[0]:.0%} ({worst[1]}, {worst[2]})\n"
    )

    ratios: dict[str, dict[str, float]] = {}
    has_pyarrow = any(m.key == "pyarrow" for m in methods)
    if has_pyarrow:
        for m in methods:
            if m.tensorbus:
                ratios[m.key] = {format_size(s): paired_ratio(results[s][m.key], results[s]["pyarrow"]) for s in sizes}
        print_table(
            "tensorbus speed / pyarrow speed (median of per-round ratios; > 1 is faster)",
            ["method", *size_names],
            [[m.label, *(f"{ratios[m.key][n]:.2f}" for n in size_names)] for m in methods if m.tensorbus],
            markdown=markdown,
        )

    print_table(
        f"Header alone: 1-element float32 tensor, µs per call (median of {rounds} rounds)",
        ["case", "µs"],
        [[name, f"{stats.median * 1e6:.1f}"] for name, stats in header.items()],
        markdown=markdown,
    )

    targets: list[dict[str, Any]] = []
    by_key = {m.key: m for m in methods}
    for key in ("tb-nocrc", "tb-out-nocrc", "tb-zc-nocrc"):
        for size in TARGET_NOCRC_SIZES:
            if key in by_key and has_pyarrow and size in results:
                ratio = ratios[key][format_size(size)]
                targets.append(
                    {
                        "target": f"{by_key[key].label} >= pyarrow at {format_size(size)}",
                        "measured": f"{ratio:.2f}x pyarrow",
                        "met": ratio >= 1.0,
                    }
                )
    for key in ("tb-crc", "tb-out-crc", "tb-zc-crc"):
        if key in by_key and TARGET_CRC_SIZE in results:
            rate = gbps(TARGET_CRC_SIZE, results[TARGET_CRC_SIZE][key].median)
            targets.append(
                {
                    "target": f"{by_key[key].label} >= {TARGET_CRC_GBPS:g} GB/s at {format_size(TARGET_CRC_SIZE)}",
                    "measured": f"{rate:.2f} GB/s",
                    "met": rate >= TARGET_CRC_GBPS,
                }
            )
    header_us = header["dumps + decode, crc"].median * 1e6
    targets.append(
        {
            "target": f"header dumps + decode < {TARGET_HEADER_US:g} µs",
            "measured": f"{header_us:.1f} µs",
            "met": header_us < TARGET_HEADER_US,
        }
    )
    print_table(
        "Targets",
        ["target", "measured", "met"],
        [[t["target"], t["measured"], "yes" if t["met"] else "NO"] for t in targets],
        markdown=markdown,
    )
    return {"ratios_to_pyarrow": ratios, "targets": targets}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"comma-separated tensor sizes (default {DEFAULT_SIZES})"
    )
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help=f"timed rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument(
        "--min-sample-ms", type=float, default=30.0, help="each sample repeats the round trip to last this long"
    )
    parser.add_argument(
        "--methods",
        default=",".join(m.key for m in METHODS),
        help="comma-separated subset of: " + ", ".join(m.key for m in METHODS),
    )
    parser.add_argument("--json", metavar="FILE", help="also write every sample and the summary to FILE")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a target is missed")
    args = parser.parse_args(argv)

    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    if any(s % 4 or s <= 0 for s in sizes):
        parser.error("sizes must be positive multiples of 4 bytes (float32)")
    wanted = [k.strip() for k in args.methods.split(",") if k.strip()]
    unknown = set(wanted) - {m.key for m in METHODS}
    if unknown:
        parser.error(f"unknown methods: {', '.join(sorted(unknown))}")
    methods = [m for m in METHODS if m.key in wanted]
    min_sample_s = args.min_sample_ms / 1000

    load_before = os.getloadavg()
    results: dict[int, dict[str, Stats]] = {}
    for size in sizes:
        print(f"measuring {format_size(size)} ...", file=sys.stderr, flush=True)
        results[size] = bench_size(methods, size, args.rounds, min_sample_s)
    print("measuring the header ...", file=sys.stderr, flush=True)
    header = bench_header(args.rounds, min_sample_s)

    info = machine_info()
    versions = package_versions(["numpy", "msgpack", "msgpack-numpy", "pyarrow", "safetensors", "crc32c"])
    print(
        f"codec_bench: {info.get('cpu', '?')}, {info['cpus']} CPUs, load average before the run "
        f"{' '.join(f'{v:.2f}' for v in load_before)}; python {info['python']}, "
        + ", ".join(f"{name} {version}" for name, version in versions.items())
    )
    summary = report(methods, sizes, results, header, args.rounds, args.markdown)
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "codec_bench",
                "machine": {**info, "load_avg_before": load_before},
                "versions": {"tensorbus": tb.__version__, **versions},
                "config": {"sizes": sizes, "rounds": args.rounds, "min_sample_ms": args.min_sample_ms},
                "results": {
                    m.key: {
                        format_size(s): {
                            "label": m.label,
                            "gbps": gbps(s, results[s][m.key].median),
                            "median_s": results[s][m.key].median,
                            "q1_s": results[s][m.key].q1,
                            "q3_s": results[s][m.key].q3,
                            "samples_s": results[s][m.key].samples,
                        }
                        for s in sizes
                    }
                    for m in methods
                },
                "header_us": {name: stats.median * 1e6 for name, stats in header.items()},
                **summary,
            },
        )
    return 1 if args.check and not all(t["met"] for t in summary["targets"]) else 0


if __name__ == "__main__":
    sys.exit(main())
