"""The stand-alone benchmarks still speak the current protocol (a smoke run, not a measurement)."""

from __future__ import annotations

from benchmarks import consumer_floor, native_speedup
from tensorbus.codec import native
from tensorbus.transports import stream
from tests.conftest import require_native


def test_the_consumer_floor_benchmark_reads_a_real_producers_stream() -> None:
    for reader in (consumer_floor.tensorbus_reader, consumer_floor.minimal_reader):
        assert reader(64 << 10, 50) > 0  # each reader takes all 250 tensors, CRC checked, and gets the flush through


def test_the_native_speedup_benchmark_runs_both_ways() -> None:
    require_native(stream.NATIVE_STREAM is not None and native.NATIVE is not None, "the C paths")
    for native_paths in (True, False):
        result = native_speedup.one_run(native_paths, 64 << 10, 50, 20)  # in a fresh interpreter each
        assert result.keys() == {"gbps", "consumer_us", "producer_us", "rtt_us"}
        assert all(value > 0 for value in result.values())
