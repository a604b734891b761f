"""Subscriber processes for the fan-out tests: each reports the version it got and the CRC of its bytes."""

from __future__ import annotations

import multiprocessing
import time
import zlib
from typing import Any

import numpy as np


def crc_of(array: np.ndarray) -> int:
    """CRC-32 of an array's bytes (zlib's: independent of the CRC32C the frames carry)."""
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).data)


def _follow(url: str, options: dict[str, Any], key: str, version: int, out: Any) -> None:
    import tensorbus as tb

    try:
        with tb.Subscriber(url, **options) as sub:
            message = sub.latest(key, newer_than=version - 1, timeout=120)
            out.put((message.version, crc_of(message.tensor)))
    except BaseException as exc:  # reported, so the test fails with the reason
        out.put(("error", repr(exc)))


def start_subscribers(
    count: int, url: str, options: dict[str, Any], key: str, version: int
) -> tuple[list[multiprocessing.process.BaseProcess], Any]:
    """`count` subscriber processes waiting for `version` of `key` (each puts its result on the queue)."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    processes = [context.Process(target=_follow, args=(url, options, key, version, out)) for _ in range(count)]
    for process in processes:
        process.start()
    return processes, out


def check_four_subscriber_processes(pub: Any, url: str, options: dict[str, Any], versions: int) -> None:
    """Four subscriber processes of `url` all get the last of `versions` 16 MB models `pub` publishes, CRC-checked."""
    processes, results = start_subscribers(4, url, options, "model", versions)
    try:
        rng = np.random.default_rng(0)
        for version in range(1, versions + 1):
            model = rng.integers(0, 255, 16 << 20, np.uint8)
            pub.publish("model", model, version=version)
        got = [results.get(timeout=180) for _ in processes]
        assert got == [(versions, crc_of(model))] * 4
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()


def check_idle_subscriber(pub: Any, idle: Any) -> None:
    """A subscriber that is never read neither slows `pub` nor holds more than the newest.

    The publisher hands versions to the broker and never to a subscriber: every publish returns while
    the idle one has read none of them (a publish that waited for it would wait for good; the time
    bound is a generous backstop, not a measurement), and the idle one then holds only the newest.
    """
    from tests.waiting import wait_for

    slowest = 0.0
    for version in range(1, 21):
        started = time.monotonic()
        pub.publish("w", np.full(1 << 18, version), version=version)  # 2 MB
        slowest = max(slowest, time.monotonic() - started)
    assert slowest < 10.0
    wait_for(lambda: idle.version("w") == 20, 60, "the idle subscriber to hold version 20")
    assert len(idle._latest._latest) == 1  # one version held per key, whatever it did not read
