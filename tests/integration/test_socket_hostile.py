"""Socket consumers against peers that hold resources: incomplete messages, slow handshakes, idle connections."""

from __future__ import annotations

import numpy as np

import tensorbus as tb
from tensorbus.codec.chunking import chunk_header, encode_raw
from tensorbus.transports.stream import ACK_REQUEST
from tests.faults import wait_for
from tests.integration.test_socket import raw_peer


def _chunk_frames(producer_id: str, count: int) -> bytes:
    """Chunk 0 of `count` two-chunk messages whose second chunk never comes."""
    frames = []
    for sequence in range(count):
        header = chunk_header(None, (producer_id, sequence), 0, 2, 2048, 1024)
        frames.append(b"".join(bytes(memoryview(b).cast("B")) for b in encode_raw(header, [bytes(1024)], 1024)))
    return b"".join(frames)


def test_an_ack_looks_only_at_the_oldest_incomplete_message_not_at_all_of_them(monkeypatch) -> None:
    # a peer holding thousands of incomplete messages made every ack walk all of them: ingestion
    # went quadratic, and a flood of ack requests starved every other producer on the reading thread
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        peer = raw_peer(consumer.address)
        peer.sendall(_chunk_frames("hog", 2000))
        wait_for(lambda: consumer.reassembler.pending == 2000, 20, "2000 incomplete messages")
        calls = []
        real = consumer.reassembler.is_pending
        monkeypatch.setattr(consumer.reassembler, "is_pending", lambda m: calls.append(m) or real(m))
        peer.sendall(ACK_REQUEST * 50)
        with tb.Producer(consumer.address) as producer:
            producer.send("k", np.ones(4))
            assert consumer.recv("k", timeout=10).sum() == 4
        assert 0 < len(calls) <= 50 * 2, f"{len(calls)} is_pending calls for 50 acks"
        peer.close()
