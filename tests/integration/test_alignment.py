"""Received arrays start at addresses that are multiples of 64, over every transport: not only their
offsets in the frame but the memory they are delivered in (receive, reassembly and copy buffers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trustme

import tensorbus as tb
from tensorbus import buffers
from tensorbus.codec import tensors
from tests.conftest import endpoint_url


def arrays_in(obj: Any) -> list[np.ndarray]:
    if isinstance(obj, np.ndarray):
        return [obj]
    if isinstance(obj, tb.SparseTensor):
        return [obj.indices, obj.values]
    if isinstance(obj, dict):
        obj = list(obj.values())
    return [a for item in obj for a in arrays_in(item)] if isinstance(obj, (list, tuple)) else []


def tensors_to_send() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "tiny": np.arange(5, dtype=np.float32),
        "odd header": np.arange(7, dtype=np.int16),  # (sent with metadata: another header length)
        "100 KB": rng.standard_normal(12_500),
        "3 MB": rng.standard_normal(3 << 17),  # over the pooled size
        "bundle": {"w": np.ones((3, 5), np.float32), "b": np.zeros(3, np.int8)},
        "tree": {"ragged": [np.ones(1), np.ones(33, np.float16)], "sparse": tb.SparseTensor([[1]], [2.0], (4,))},
    }


def check_aligned(consumer: tb.Consumer, producer: tb.Producer, names: list[str] | None = None) -> None:
    sent = tensors_to_send()
    for name in names or list(sent):
        producer.send(name, sent[name], metadata={"pad": "x" * 5} if name == "odd header" else None)
    for name in names or list(sent):
        got = consumer.recv(name, timeout=60)
        for array in arrays_in(got):
            assert array.size and array.ctypes.data % 64 == 0, (name, array.ctypes.data % 64)


@pytest.mark.parametrize("transport", ["memory", "tcp", "unix"])
def test_received_arrays_start_at_multiples_of_64(transport: str) -> None:
    with tb.Consumer(endpoint_url(transport)) as consumer, tb.Producer(consumer.address) as producer:
        check_aligned(consumer, producer)


def test_over_tls_too(tmp_path: Any) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
    with tb.Consumer("tcps://127.0.0.1:0", ssl_certfile=str(tmp_path / "server.pem")) as consumer:
        with tb.Producer(consumer.address, ssl_cafile=str(tmp_path / "ca.pem")) as producer:
            check_aligned(consumer, producer)


@pytest.mark.parametrize("options", [{"max_frame_bytes": 64 << 10}, {"compression": "lz4"}])
def test_reassembled_and_decompressed_arrays_too(options: dict[str, Any]) -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer, tb.Producer(consumer.address, **options) as producer:
        producer.send("sparse-ish", np.repeat(np.arange(40_000.0), 4))
        check_aligned(consumer, producer, ["100 KB", "3 MB", "tree"])
        assert consumer.recv("sparse-ish", timeout=60).ctypes.data % 64 == 0


@pytest.mark.broker
@pytest.mark.parametrize("transport", ["amqp", "kafka", "kafka-confluent"])
def test_arrays_from_brokers_start_at_multiples_of_64(transport: str) -> None:
    """A broker client hands frames over as `bytes`, whose data starts 32 bytes into the object: copied
    into an aligned buffer where it is misaligned."""
    with tb.Consumer(endpoint_url(transport)) as consumer, tb.Producer(consumer.address) as producer:
        check_aligned(consumer, producer, ["tiny", "odd header", "100 KB", "bundle", "tree"])


def test_a_misaligned_buffer_is_copied_and_an_aligned_one_is_not() -> None:
    assert buffers.ALIGN == tensors.ALIGN
    raw = np.zeros(256, np.uint8)
    start = -raw.ctypes.data % 64
    good, bad = raw[start : start + 128].data, raw[start + 16 : start + 144].data
    assert buffers.aligned(good).obj is good.obj  # the same memory
    moved = buffers.aligned(bad)
    assert buffers.address(moved) % 64 == 0 and bytes(moved) == bytes(bad)
    assert buffers.address(buffers.aligned(b"\x01" * 1000)) % 64 == 0
    pool = buffers.BufferPool()
    for n in (1, 100, 5000, 1 << 20, 3 << 20):
        assert buffers.address(pool.take(n)) % 64 == 0
