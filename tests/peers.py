"""Deterministic tensors and producer processes for the behaviour suite.

A test describes what a peer should send as a plan of (key, spec) pairs; the peer process builds
each tensor from its spec and the test rebuilds the same tensor to compare, bit for bit.
"""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import numpy as np

import tensorbus as tb

Spec = dict[str, Any]


def make_tensor(spec: Spec) -> Any:
    """Build the tensor a spec names: dense (n, dtype, seed), bundle, or sparse."""
    rng = np.random.default_rng(spec.get("seed", 0))
    kind = spec.get("kind", "dense")
    if kind == "dense":
        return rng.standard_normal(spec.get("n", 16)).astype(spec.get("dtype", "float32"))
    if kind == "bundle":
        return {f"layer{i}.weight": rng.standard_normal((i + 1, 7)).astype("float32") for i in range(spec["n"])}
    if kind == "sparse":
        indices = rng.integers(0, 50, size=(spec["n"], 2))
        return tb.SparseTensor(indices, rng.standard_normal(spec["n"]), (50, 50))
    raise ValueError(kind)


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of tensors as tensorbus carries them."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, tb.SparseTensor):
        return a == b
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def produce(url: str, plan: list[tuple[str, Spec]], options: dict[str, Any]) -> None:
    """Send every planned tensor from a fresh Producer, then flush and close."""
    with tb.Producer(url, **options) as producer:
        for key, spec in plan:
            producer.send(key, make_tensor(spec), metadata={"spec": spec})
        producer.flush(timeout=60)


class Peer:
    """A producer running `plan` in another process (or a thread, for memory://)."""

    def __init__(self, url: str, plan: list[tuple[str, Spec]], **options: Any) -> None:
        if url.startswith("memory://"):
            self._runner: Any = threading.Thread(target=produce, args=(url, plan, options), daemon=True)
        else:
            self._runner = multiprocessing.get_context("spawn").Process(target=produce, args=(url, plan, options))
        self._runner.start()

    def join(self, timeout: float = 120) -> None:
        """Wait for the peer to finish and fail if it did not end cleanly."""
        self._runner.join(timeout)
        if self._runner.is_alive():
            if hasattr(self._runner, "kill"):
                self._runner.kill()
            raise AssertionError(f"producer peer still running after {timeout}s")
        exitcode = getattr(self._runner, "exitcode", 0)
        assert exitcode == 0, f"producer peer exited with {exitcode}"
