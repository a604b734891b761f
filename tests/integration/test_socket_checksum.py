"""Large frames checksummed while they are sent: the CRC follows the frame (stream.TRAILING_CRC)."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec.frame import CRC_AT, PREFIX, checksum_of, frame_length
from tensorbus.transports import stream
from tensorbus.transports.stream import (
    CRC_TRAILER,
    HELLO,
    HELLO_EVERY_CONSUMER,
    HELLO_INCARNATION,
    HELLO_MAGIC,
    HELLO_REFUSALS,
    HELLO_TRAILING_CRC,
    PROTOCOL_VERSION,
    REFUSALS_WANTED,
    SEAL_WHILE_SENDING,
    TRAILING_CRC,
    recv_exact,
)
from tests.integration.test_socket import handshake_as_consumer, raw_peer
from tests.waiting import wait_for

BIG = np.arange(SEAL_WHILE_SENDING // 4 + 1000, dtype=np.float32)  # just over the threshold


def _read_frame(conn: socket.socket) -> tuple[bytes, bytes]:
    """One frame off a stream as it travelled: (frame, the 4 bytes after it if its CRC follows it)."""
    prefix = bytearray(PREFIX.size)
    assert recv_exact(conn, memoryview(prefix)) == PREFIX.size
    after = prefix[5] & TRAILING_CRC
    prefix[5] &= ~TRAILING_CRC
    rest = bytearray(frame_length(prefix) - PREFIX.size + (CRC_TRAILER.size if after else 0))
    assert recv_exact(conn, memoryview(rest)) == len(rest)
    if after:
        return bytes(prefix) + bytes(rest[: -CRC_TRAILER.size]), bytes(rest[-CRC_TRAILER.size :])
    return bytes(prefix) + bytes(rest), b""


def _fake_consumer(hello_flags: int | None) -> tuple[socket.socket, list[Any]]:
    """One connection that gets `handshake_as_consumer`'s hello (None), or one with `hello_flags`."""
    server = socket.create_server(("127.0.0.1", 0))
    got: list[Any] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            if hello_flags is None:
                handshake_as_consumer(conn, None)
                assert conn.recv(len(REFUSALS_WANTED), socket.MSG_WAITALL) == REFUSALS_WANTED  # (it asks for them)
                got.append(_read_frame(conn))
            else:
                conn.sendall(HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, hello_flags, bytes(32)))
                got.append(conn.recv(1))  # (b"": the producer went without answering)

    threading.Thread(target=serve, daemon=True).start()
    return server, got


def test_a_large_frame_carries_its_crc_after_it() -> None:
    server, got = _fake_consumer(None)
    producer = tb.Producer(f"tcp://127.0.0.1:{server.getsockname()[1]}", send_timeout_s=10)
    producer.send("big", BIG)
    wait_for(lambda: got, 30, "the frame at the fake consumer")
    frame, trailer = got[0]
    (sent, _), *_ = producer.transport._unacked  # type: ignore[attr-defined]  # kept for a resend
    producer.transport.abandon()
    server.close()
    (stored,) = struct.unpack_from("<I", frame, CRC_AT)  # checksummed while sent: a zero CRC field, the CRC after
    assert stored == 0 and trailer == CRC_TRAILER.pack(checksum_of(frame))
    frame = frame[:CRC_AT] + trailer + frame[PREFIX.size :]
    np.testing.assert_array_equal(tb.loads(frame), BIG)  # sealed now:
    assert struct.unpack_from("<I", sent[0], CRC_AT)[0] == checksum_of(frame)


@pytest.mark.parametrize("missing", [HELLO_TRAILING_CRC, HELLO_REFUSALS, HELLO_INCARNATION])
def test_a_producer_refuses_a_hello_without_the_flags_every_consumer_sets(missing: int) -> None:
    # (the protocol was never released without them: no path for consumers that do not set them)
    server, got = _fake_consumer(HELLO_EVERY_CONSUMER & ~missing)
    producer = tb.Producer(f"tcp://127.0.0.1:{server.getsockname()[1]}")
    try:
        with pytest.raises(tb.TransportError, match="never released"):  # at once: connecting again cannot help
            producer.send("t", np.arange(3))
        wait_for(lambda: got, 10, "the producer gone without a proof")
        assert got == [b""]
    finally:
        producer.close()
        server.close()


def _wire(tensor: np.ndarray, key: str, *, flip: int | None = None) -> bytes:
    """`tensor`'s frame as a stream carries it with its CRC after it, optionally with byte `flip` inverted."""
    data = bytearray(tb.dumps(tensor, key=key))
    crc = data[CRC_AT : PREFIX.size]
    data[CRC_AT : PREFIX.size] = bytes(4)
    data[5] |= TRAILING_CRC
    data += crc
    if flip is not None:
        data[flip] ^= 0xFF
    return bytes(data)


@pytest.mark.parametrize("n", [1000, BIG.size], ids=["checked-after", "checked-while-received"])
def test_a_frame_whose_crc_follows_it_is_checked_and_a_bad_one_costs_only_itself(n: int) -> None:
    tensor = np.arange(n, dtype=np.float32)
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        peer = raw_peer(consumer.address)
        peer.sendall(_wire(tensor, "good"))
        peer.sendall(_wire(tensor, "bad-payload", flip=-CRC_TRAILER.size - 1))
        peer.sendall(_wire(tensor, "bad-trailer", flip=-1))
        peer.sendall(tb.dumps(np.ones(3), key="after"))  # a sealed frame on the same connection
        np.testing.assert_array_equal(consumer.recv("good", timeout=20), tensor)
        np.testing.assert_array_equal(consumer.recv("after", timeout=20), np.ones(3))
        for key in ("bad-payload", "bad-trailer"):
            with pytest.raises(tb.Timeout):
                consumer.recv(key, timeout=0.2)
        assert consumer.stats["rejected"] == 2
        peer.close()


def test_a_large_tensor_sent_again_after_a_consumer_restart_arrives_intact() -> None:
    consumer = tb.Consumer("tcp://127.0.0.1:0")
    address = consumer.address
    producer = tb.Producer(address, reconnect_timeout_s=20)
    producer.send("warm", np.ones(3))
    producer.flush(10)
    consumer.close()  # what is sent next is not acknowledged: it goes out again, sealed, to the successor
    replacement: list[tb.Consumer] = []
    threading.Timer(1.0, lambda: replacement.append(tb.Consumer(address))).start()
    for i in range(3):
        producer.send(f"big{i}", BIG + i)
    producer.flush(30)
    wait_for(lambda: replacement, 10, "the replacement consumer")  # (flush may beat the Timer's append)
    for i in range(3):
        np.testing.assert_array_equal(replacement[0].recv(f"big{i}", timeout=20), BIG + i)
    assert replacement[0].stats["rejected"] == 0
    producer.close()
    replacement[0].close()


def test_many_small_arrays_go_out_in_few_system_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = {f"p{i}": np.full(1000, i, np.float32) for i in range(2000)}  # 8 MB in 4000 buffers
    calls: list[int] = []
    real = stream.sendmsg_all
    monkeypatch.setattr(stream, "sendmsg_all", lambda sock, buffers: calls.append(len(buffers)) or real(sock, buffers))
    with tb.Consumer("tcp://127.0.0.1:0") as consumer, tb.Producer(consumer.address) as producer:
        producer.send("bundle", bundle)
        got = consumer.recv("bundle", timeout=20)
        assert got.keys() == bundle.keys() and all(np.array_equal(got[k], bundle[k]) for k in bundle)
    assert sum(calls) > 4000 and 6 <= len(calls) <= 16  # one per ~1 MiB: not one per buffer, nor all at once


def test_a_ctrl_c_part_way_through_a_large_send_costs_only_that_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer, tb.Producer(consumer.address, send_timeout_s=20) as producer:
        producer.send("warm", np.ones(3))
        producer.flush(10)
        slices = iter(range(100))
        real = stream.crc32c

        def interrupted(data: Any, crc: int = 0) -> int:
            if len(data) == stream.SEAL_SLICE and next(slices) == 2:  # two slices already on their way
                raise KeyboardInterrupt
            return real(data, crc)

        monkeypatch.setattr(stream, "crc32c", interrupted)  # the sender's only (large frames are sent from Python)
        with pytest.raises(KeyboardInterrupt):
            producer.send("big", BIG)
        monkeypatch.undo()
        producer.send("after", np.arange(1000.0))  # far fewer bytes than the cut-off frame still owed
        producer.flush(10)
        np.testing.assert_array_equal(consumer.recv("after", timeout=10), np.arange(1000.0))
        producer.send("big-again", BIG)
        np.testing.assert_array_equal(consumer.recv("big-again", timeout=10), BIG)
        with pytest.raises(tb.Timeout):
            consumer.recv("big", timeout=0.2)


def test_an_over_limit_frame_whose_crc_follows_it_is_skipped_with_its_crc() -> None:
    with tb.Consumer("tcp://127.0.0.1:0", max_payload_bytes=SEAL_WHILE_SENDING) as consumer:
        with tb.Producer(consumer.address, send_timeout_s=10) as producer:
            producer.send("too-big", BIG)
            producer.send("small", np.arange(5.0))  # the next frame on that connection
            np.testing.assert_array_equal(consumer.recv("small", timeout=10), np.arange(5.0))
            assert consumer.stats["rejected"] == 1
            with pytest.raises(tb.Rejected, match=r"too-big.*exceeds max_payload_bytes"):
                producer.flush(10)  # the consumer said so
            producer.flush(10)


def _interrupt_on_call(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, call: int) -> None:
    """Make the `call`-th call of `owner.name` raise KeyboardInterrupt (as a Ctrl-C there would)."""
    if owner is stream and name == "sendmsg_all":  # the Python sender: its system calls can be interrupted one by one
        monkeypatch.setattr(stream, "NATIVE_STREAM", None)
    real, count = getattr(owner, name), iter(range(1, 1000))

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        if next(count) == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)


@pytest.mark.parametrize("where", ["inside-a-chunk", "between-chunks"])
def test_a_ctrl_c_part_way_through_a_chunked_send_holds_up_no_acks(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        with tb.Producer(consumer.address, max_frame_bytes=1 << 20, send_timeout_s=10) as producer:
            producer.send("warm", np.ones(3))
            producer.flush(10)
            if where == "inside-a-chunk":
                _interrupt_on_call(monkeypatch, stream, "sendmsg_all", 3)
            else:
                _interrupt_on_call(monkeypatch, producer.transport, "send", 3)
            with pytest.raises(KeyboardInterrupt):
                producer.send("big", BIG)  # 5 chunks
            monkeypatch.undo()
            producer.send("after", np.arange(10.0))
            producer.flush(5)  # the two chunks that went out are not sent again to wait for the rest
            np.testing.assert_array_equal(consumer.recv("after", timeout=10), np.arange(10.0))


def test_a_ctrl_c_while_unacked_frames_are_resent_leaves_no_half_sent_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with tb.Consumer("tcp://127.0.0.1:0", ack_every_frames=1 << 20, ack_every_bytes=1 << 40) as consumer:
        producer = tb.Producer(consumer.address, send_timeout_s=10)
        for i in range(3):
            producer.send(f"b{i}", BIG + i)
        producer.transport._drop_connection()  # as if it broke: the next send reconnects and resends all three
        wait_for(lambda: not consumer.transport.reactor._peers, 5, "the consumer to see it go")
        _interrupt_on_call(monkeypatch, stream, "sendmsg_all", 3)
        with pytest.raises(KeyboardInterrupt) as kept:  # (the exception, and its frames, stay referenced)
            producer.send("x", np.ones(3))
        monkeypatch.undo()
        wait_for(lambda: not consumer.transport.reactor._peers, 5, "the half-sent connection to be closed")
        producer.send("y", np.ones(3))
        producer.flush(10)
        for key in ("b0", "b1", "b2", "y"):
            consumer.recv(key, timeout=10)
        assert kept.value is not None
        producer.close()
