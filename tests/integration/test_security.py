"""Signed frames on every transport, and hostile input against a live consumer's limits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec.frame import encode_raw
from tests.conftest import endpoint_url, transport_params
from tests.integration.test_behaviour import TRANSPORTS
from tests.waiting import wait_for


def flush_refused(producer: tb.Producer, timeout: float) -> list[tb.Rejected]:
    """Flush; what a socket consumer said it refused comes back as a `Rejected` per message, one per flush."""
    told = []
    while True:
        try:
            producer.flush(timeout)
            return told
        except tb.Rejected as exc:
            told.append(exc)


@pytest.mark.parametrize("transport", transport_params(*TRANSPORTS))
def test_signed_endpoint_rejects_unsigned_and_tampered_frames(transport: str) -> None:
    with tb.Consumer(endpoint_url(transport), signing_key=b"team-key") as consumer:
        address = consumer.address
        with tb.Producer(address) as unsigned:
            unsigned_id = unsigned.send("w", np.zeros(4))
            told = flush_refused(unsigned, 30)
        tampered = bytearray(tb.dumps(np.zeros(4), key="w", signing_key=b"team-key", message_id=("evil", 1)))
        tampered[-40] ^= 1  # inside the payload; the CRC is also wrong, the signature is checked first
        forged = tb.dumps(np.zeros(4), key="w", signing_key=b"guessed", message_id=("evil", 2))
        with tb.Producer(address) as raw:
            raw.transport.send([bytes(tampered)], key="w")
            raw.transport.send([forged], key="w")
            told += flush_refused(raw, 30)
        with tb.Producer(address, signing_key=b"team-key") as signed:
            signed.send("w", np.full(4, 9.0))
            signed.send("big", np.arange(300_000.0))  # chunked on brokers; every chunk is signed too
            signed.flush(60)
        assert consumer.recv("w", timeout=60)[0] == 9.0
        assert np.array_equal(consumer.recv("big", timeout=60), np.arange(300_000.0))
        assert consumer.stats["rejected"] == 3
        sockets = transport in ("tcp", "unix", "memory", "shm")  # (brokers cannot tell the producer)
        assert [(e.message_id, e.reason.split(":")[0]) for e in told] == [
            (unsigned_id, "frame is unsigned but this endpoint requires a signature"),
            (("evil", 1), "frame signature does not match"),
            (("evil", 2), "frame signature does not match"),
        ][: 3 if sockets else 0]


def test_chunk_flood_claiming_huge_totals_stays_within_the_reassembly_limit() -> None:
    with tb.Consumer("tcp://127.0.0.1:0", max_reassembly_bytes=64 << 20) as consumer:
        with tb.Producer(consumer.address) as attacker:
            for seq in range(2000):
                header = {"kind": "chunk", "key": "x", "id": ["evil", seq], "chunk": [0, 4096, 1 << 34, 1 << 22]}
                attacker.transport.send(encode_raw(header, [bytes(1 << 10)], 1 << 10), key="x")
            assert {e.message_id for e in flush_refused(attacker, 30)} == {("evil", seq) for seq in range(2000)}
        with tb.Producer(consumer.address) as honest:
            honest.send("real", np.arange(1000))
        assert np.array_equal(consumer.recv("real", timeout=30), np.arange(1000))
        assert consumer.intake.reassembler.held_bytes == 0
        assert consumer.stats["rejected"] == 2000


@pytest.mark.parametrize("transport", transport_params(*TRANSPORTS))
def test_a_tiny_chunk_claiming_gigabytes_does_not_crowd_out_an_honest_chunked_tensor(transport: str) -> None:
    with tb.Consumer(endpoint_url(transport)) as consumer:  # the default budget: 2 GiB
        total, stride = (1 << 31) - (64 << 10), 1024  # leaves less free than the honest tensor needs
        count = total // stride
        header = {"kind": "chunk", "key": "junk", "id": ["evil", 1], "chunk": [count - 1, count, total, stride]}
        # (a socket or shm:// consumer never acks a frame of an incomplete message: the attacker cannot flush)
        quick = {"close_timeout_s": 0.5} if transport in ("tcp", "unix", "shm") else {}
        with tb.Producer(consumer.address, **quick) as attacker:
            attacker.transport.send(encode_raw(header, [bytes(stride)], stride), key="junk")  # ~1.1 KB sent
            wait_for(lambda: consumer.intake.reassembler.pending == 1, 30, "the claim to reach the consumer")
            with tb.Producer(consumer.address, max_frame_bytes=64 << 10) as honest:
                honest.send("w", np.arange(100_000.0))
                honest.flush(30)
            assert np.array_equal(consumer.recv("w", timeout=30), np.arange(100_000.0))
            reassembler = consumer.intake.reassembler
            assert reassembler.pending == 1 and reassembler.held_bytes < 1 << 20  # not 2 GB


def test_frames_over_the_consumer_limits_are_refused_before_allocation() -> None:
    with tb.Consumer("tcp://127.0.0.1:0", max_payload_bytes=1 << 20, max_header_bytes=4096) as consumer:
        with tb.Producer(consumer.address, reconnect_timeout_s=2) as producer:
            producer.send("fits", np.zeros(1000))
            producer.flush(10)
            assert np.array_equal(consumer.recv("fits", timeout=10), np.zeros(1000))
            producer.send("huge-meta", np.zeros(1), metadata={"blob": "x" * 10_000})
            producer.send("huge", np.zeros(1 << 20))  # 8 MB > 1 MiB payload limit
            producer.send("after", np.ones(3))
            told = flush_refused(producer, 10)  # refused frames are skipped and acknowledged, never resent forever
            assert [e.key for e in told] == ["huge-meta", "huge"]
        assert np.array_equal(consumer.recv("after", timeout=10), np.ones(3))
        with pytest.raises(tb.Timeout):
            consumer.recv("huge", timeout=0.2)
        assert consumer.stats["rejected"] == 2
        with tb.Producer(consumer.address) as other:
            other.send("still-serving", np.ones(2))
        assert np.array_equal(consumer.recv("still-serving", timeout=10), np.ones(2))


def test_fuzz_script_slice_finds_no_crash_or_hang() -> None:
    """A bounded slice of scripts/fuzz.py (the full run is 1,000,000 cases, by hand)."""
    script = Path(__file__).parents[2] / "scripts" / "fuzz.py"
    result = subprocess.run(
        [
            sys.executable,
            str(script),
            "--cases",
            "20000",
            "--live",
            "2000",
            "--seed",
            "7",
            "--replays",
            "50",
            "--bombs",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "'crashes': 0, 'hangs': 0" in result.stdout
