"""Socket consumers against peers that hold resources: incomplete messages, slow handshakes, idle connections."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec.chunking import chunk_header, encode_raw
from tensorbus.ledger import Stream
from tensorbus.transports import reader as reader_module
from tensorbus.transports.stream import ACK_REQUEST_MARKER, HELLO
from tests.integration.test_socket import raw_peer
from tests.waiting import wait_for


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
        wait_for(lambda: consumer.intake.reassembler.pending == 2000, 20, "2000 incomplete messages")
        calls: list[int] = []
        real = Stream.first_unreceived
        # (the ledger finds the oldest waiting frame first in its order: an ack walks none of the others)
        monkeypatch.setattr(Stream, "first_unreceived", lambda self: calls.append(real(self)) or calls[-1])
        peer.sendall(ACK_REQUEST_MARKER * 50)
        with tb.Producer(consumer.address) as producer:
            producer.send("k", np.ones(4))
            assert consumer.recv("k", timeout=10).sum() == 4
        # (the requests came on another connection than "k": nothing orders their reading before it)
        # each answered with 0: no ack covers the first of the incomplete messages
        wait_for(lambda: calls.count(0) >= 50, 10, "the 50 ack requests answered")
        peer.close()


def test_a_handshake_gets_connect_timeout_s_in_all_not_per_byte() -> None:
    # a peer trickling its proof a byte at a time held its handshake slot forever (the timeout was
    # per read): `backlog` such peers locked every producer out
    with tb.Consumer("tcp://127.0.0.1:0", connect_timeout_s=1.0) as consumer:
        host, port = consumer.address.removeprefix("tcp://").rsplit(":", 1)
        slow = socket.create_connection((host, int(port)), timeout=5)
        slow.recv(HELLO.size, socket.MSG_WAITALL)
        slow.setblocking(False)  # a socket timeout would make recv wait despite MSG_DONTWAIT
        started, closed_after = time.monotonic(), None
        for _ in range(30):  # up to 9 s of one byte every 0.3 s (each well inside the 1 s per read)
            try:
                slow.sendall(b"\0")
                if slow.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed_after = time.monotonic() - started
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed_after = time.monotonic() - started
                break
            time.sleep(0.3)
        slow.close()
        # (a per-read timeout never ends it here; the bound leaves a loaded machine room past the 1 s)
        assert closed_after is not None and closed_after < 8, f"handshake still open after {closed_after}"


def test_close_called_from_a_recv_async_callback_closes_the_consumer(tmp_path) -> None:
    # the callback runs on the reading thread: close waited for the lock that thread held, then
    # raised RuntimeError from joining itself, leaving connections and the socket file behind
    path = str(tmp_path / "c.sock")
    consumer = tb.Consumer(f"unix://{path}", close_timeout_s=30)  # (what waiting for its own lock would take)
    outcome: dict[str, object] = {}

    def on_message(message, error) -> None:
        started = time.monotonic()
        try:
            consumer.close()
            outcome["ok"] = True
        except BaseException as exc:
            outcome["error"] = exc
        outcome["took"] = time.monotonic() - started

    consumer.recv_async("stop", on_message)
    with tb.Producer(f"unix://{path}") as producer:
        producer.send("stop", np.zeros(1))
        wait_for(lambda: "took" in outcome, 10, "the callback")
    assert outcome.get("ok") and outcome["took"] < 10, outcome
    wait_for(lambda: not consumer.transport.reactor._peers, 10, "the connections to close")
    assert not os.path.exists(path)
    with pytest.raises(tb.Closed):
        consumer.recv("other", timeout=1)


def test_idle_connections_hold_no_read_ahead_buffer() -> None:
    # each connection kept a 256 KiB read-ahead buffer for life: 2000 idle peers cost 512 MB
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        reactor = consumer.transport.reactor
        with tb.Producer(consumer.address) as producer:
            for i in range(20):
                producer.send(f"k{i}", np.full(100, i))
            producer.flush(10)
        idle = [raw_peer(consumer.address) for _ in range(50)]
        wait_for(lambda: len(reactor._peers) >= 50, 10, "50 idle peers")
        with tb.Producer(consumer.address) as producer:
            producer.send("last", np.ones(3))
            assert consumer.recv("last", timeout=10).tolist() == [1, 1, 1]

        def none_held() -> bool:
            peers = list(reactor._peers.values())
            return all(not p.reader.inbox_held for p in peers)

        wait_for(none_held, 10, "every buffer returned")
        assert len(reader_module._spare_inboxes) <= 4
        for i in range(20):
            assert consumer.recv(f"k{i}", timeout=10).tolist() == [i] * 100
        for sock in idle:
            sock.close()
