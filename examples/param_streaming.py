"""Stream a model's parameters from a trainer to a saver that keeps every version on disk.

A trainer process fits a small linear model with numpy SGD and publishes its state dict (a bundle:
one frame, every tensor 64-byte aligned) every `--every` steps; a saver process runs
`tensorbus save URL params --follow`, writing each version atomically. At the end the trainer's
last parameters are compared with the newest saved file.

    python examples/param_streaming.py                       # tcp://127.0.0.1 (a free port)
    python examples/param_streaming.py --url unix:///tmp/params.sock --steps 200 --every 20
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import tensorbus as tb
from tensorbus.files import read_tensor


def train(url: str, steps: int, every: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Fit y = X @ w_true + b_true by SGD, publishing the parameters every `every` steps."""
    rng = np.random.default_rng(seed)
    w_true, b_true = rng.standard_normal((32, 4)).astype(np.float32), np.float32(0.5)
    params = {"dense.weight": np.zeros((32, 4), np.float32), "dense.bias": np.zeros(4, np.float32)}
    with tb.Producer(url) as producer:
        for step in range(1, steps + 1):
            x = rng.standard_normal((64, 32)).astype(np.float32)
            error = x @ params["dense.weight"] + params["dense.bias"] - (x @ w_true + b_true)
            params["dense.weight"] -= 0.05 * x.T @ error / len(x)
            params["dense.bias"] -= 0.05 * error.mean(axis=0)
            if step % every == 0:
                # send copies: a producer may keep references to unacknowledged frames until flush()
                producer.send("params", {k: v.copy() for k, v in params.items()}, metadata={"step": step})
        producer.flush(timeout=60)
    return params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="tcp://127.0.0.1:0", help="where the saver listens (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--out", type=Path, default=None, help="directory for the saved versions (default: a temp dir)")
    args = parser.parse_args()
    if not 1 <= args.every <= args.steps:
        parser.error("need 1 <= --every <= --steps (at least one version to save)")
    out = args.out or Path(tempfile.mkdtemp(prefix="tensorbus-params-"))
    out.mkdir(parents=True, exist_ok=True)
    versions = args.steps // args.every
    saver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorbus",
            "save",
            args.url,
            "params",
            "-o",
            str(out / "params.npz"),
            "--follow",
            "--max-versions",
            str(versions),
            "--timeout",
            "60",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert saver.stdout is not None
    ready = saver.stdout.readline()  # "waiting for 'params' on tcp://127.0.0.1:PORT"
    if " on " not in ready:  # the saver failed to start (e.g. a bad URL): it said why on stderr
        return saver.wait(timeout=60) or 1
    address = ready.rsplit(" on ", 1)[1].strip()
    final = train(address, args.steps, args.every)
    for line in saver.stdout:
        print(" ", line.rstrip())
    if saver.wait(timeout=60) != 0:
        print("saver failed", file=sys.stderr)
        return 1
    newest = max(out.glob("params-*.npz"))  # numbered on from earlier runs into the same --out
    saved = read_tensor(newest)
    match = saved.keys() == final.keys() and all(np.array_equal(saved[k], final[k]) for k in final)
    print(f"{versions} versions saved in {out}; newest equals the trainer's last parameters: {match}")
    return 0 if match else 1


if __name__ == "__main__":
    raise SystemExit(main())
