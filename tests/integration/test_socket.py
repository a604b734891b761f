"""Socket transport specifics: hostile peers, shared-secret auth, TLS, acks and resend."""

from __future__ import annotations

import contextlib
import hmac
import logging
import multiprocessing
import os
import platform
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
import trustme

import tensorbus as tb
from tensorbus.transports import reactor
from tensorbus.transports import reader as reader_module
from tensorbus.transports.stream import (
    ACK,
    ACK_REQUEST_MARKER,
    HELLO,
    HELLO_AUTH,
    HELLO_EVERY_CONSUMER,
    HELLO_MAGIC,
    PROOF_BYTES,
    PROTOCOL_VERSION,
    UNIX_SEND_BUFFER,
    proof,
    recv_exact,
)
from tests.conftest import require_native
from tests.faults import fail_feed_once
from tests.peers import Peer, make_tensor, same
from tests.waiting import once_leading, wait_for


def handshake_as_consumer(sock: socket.socket, secret: bytes | None) -> bool:
    """A hand-driven consumer's side of the handshake (greeter.py is the real one, without blocking): send a
    nonce, check the proof, send the verdict. (The producer then sends REFUSALS WANTED first.)"""
    nonce = os.urandom(32)
    flags = HELLO_EVERY_CONSUMER | (HELLO_AUTH if secret else 0)
    sock.sendall(HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, flags, nonce))
    answer = bytearray(PROOF_BYTES)
    got = recv_exact(sock, memoryview(answer))
    if got == 0:
        raise ConnectionResetError("it closed the connection without answering")
    if got < PROOF_BYTES:
        return False
    accepted = secret is None or hmac.compare_digest(bytes(answer), proof(secret, nonce))
    sock.sendall(b"\x01" if accepted else b"\x00")
    return accepted


def raw_peer(address: str, secret: bytes | None = None) -> socket.socket:
    """A hand-driven producer connection that has done the handshake."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    hello = sock.recv(HELLO.size, socket.MSG_WAITALL)
    sock.sendall(proof(secret, HELLO.unpack(hello)[3]))
    assert sock.recv(1) == b"\x01"
    return sock


def test_garbage_truncated_and_vanishing_peers_do_not_disturb_others(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        good = Peer(consumer.address, [(f"g{i}", {"seed": i, "n": 50_000}) for i in range(20)])
        garbage = raw_peer(consumer.address)
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(100))
        truncated = raw_peer(consumer.address)
        truncated.sendall(tb.dumps(np.zeros(1000))[:-100])
        truncated.close()
        mid_prefix = raw_peer(consumer.address)
        mid_prefix.sendall(b"TBUS\x01")
        mid_prefix.close()
        corrupt = raw_peer(consumer.address)
        data = bytearray(tb.dumps(np.zeros(1000), key="corrupt"))
        data[-1] ^= 0xFF
        corrupt.sendall(bytes(data) + tb.dumps(np.ones(3), key="after-corrupt"))
        good.join()
        for i in range(20):
            assert same(consumer.recv(f"g{i}", timeout=30), make_tensor({"seed": i, "n": 50_000}))
        assert same(consumer.recv("after-corrupt", timeout=10), np.ones(3))  # the corrupt frame cost only itself
        assert consumer.stats["rejected"] == 1
        garbage.close()
        corrupt.close()
    assert "not a tensorbus frame" in caplog.text and "mid-frame" in caplog.text


def test_a_peer_without_the_secret_cannot_send_a_single_tensor() -> None:
    with tb.Consumer("tcp://127.0.0.1:0", auth_secret="s3cret") as consumer:
        with pytest.raises(tb.TransportError, match="requires a shared secret"):
            tb.Producer(consumer.address, reconnect_timeout_s=2).send("x", np.ones(1))
        with pytest.raises(tb.TransportError, match="refused"):
            tb.Producer(consumer.address, auth_secret="guess", reconnect_timeout_s=2).send("x", np.ones(1))
        host, port = consumer.address.removeprefix("tcp://").rsplit(":", 1)
        intruder = socket.create_connection((host, int(port)), timeout=5)  # skips the handshake
        intruder.recv(HELLO.size, socket.MSG_WAITALL)
        intruder.sendall(tb.dumps(np.ones(1), key="x"))  # taken as its proof: refused, then closed
        assert intruder.recv(1) == b"\x00"
        intruder.close()
        with tb.Producer(consumer.address, auth_secret="s3cret") as producer:
            producer.send("x", np.full(2, 5.0))
        assert consumer.recv("x", timeout=10)[0] == 5.0
        with pytest.raises(tb.Timeout):
            consumer.recv("x", timeout=0.3)  # nothing from the intruders arrived


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": directory / "ca.pem", "cert": directory / "server.pem", "other_ca": directory / "other.pem"}
    ca.cert_pem.write_to_path(paths["ca"])
    server.private_key_and_cert_chain_pem.write_to_path(paths["cert"])
    trustme.CA().cert_pem.write_to_path(paths["other_ca"])
    return {k: str(v) for k, v in paths.items()}


def test_tls_round_trip(tls: dict[str, str]) -> None:
    with tb.Consumer("tcps://127.0.0.1:0", ssl_certfile=tls["cert"]) as consumer:
        Peer(consumer.address, [("secure", {"seed": 1, "n": 300_000})], ssl_cafile=tls["ca"]).join()
        assert same(consumer.recv("secure", timeout=30), make_tensor({"seed": 1, "n": 300_000}))


def test_plain_connections_are_read_by_the_c_reader_and_tls_ones_in_python(tls: dict[str, str]) -> None:
    require_native(reader_module.NATIVE_STREAM is not None, "the C reader (tensorbus/transports/_stream.c)")
    readers = {}
    for url, options in (("tcp://127.0.0.1:0", {}), ("tcps://127.0.0.1:0", {"ssl_certfile": tls["cert"]})):
        with tb.Consumer(url, **options) as consumer:
            with tb.Producer(consumer.address, ssl_cafile=tls["ca"]) as producer:
                producer.send("k", np.arange(5))
                assert consumer.recv("k", timeout=30).tolist() == [0, 1, 2, 3, 4]
                assert consumer.transport.reactor is not None
                (peer,) = consumer.transport.reactor._peers.values()
                readers[url.split(":")[0]] = not isinstance(peer.reader, reader_module.PyStreamReader)
    assert readers == {"tcp": True, "tcps": False}


def test_tls_wrong_ca_and_plain_client_fail_clearly(tls: dict[str, str]) -> None:
    with tb.Consumer("tcps://127.0.0.1:0", ssl_certfile=tls["cert"]) as consumer:
        with pytest.raises(tb.TransportError, match="CERTIFICATE_VERIFY_FAILED"):
            tb.Producer(consumer.address, ssl_cafile=tls["other_ca"]).send("x", np.ones(1))
        plain = consumer.address.replace("tcps://", "tcp://")
        started = time.monotonic()
        with pytest.raises(tb.TransportError, match="TLS"):
            tb.Producer(plain, connect_timeout_s=1, reconnect_timeout_s=1).send("x", np.ones(1))
        assert time.monotonic() - started < 10
    with tb.Consumer("tcp://127.0.0.1:0") as plain_consumer:
        tls_url = plain_consumer.address.replace("tcp://", "tcps://")
        with pytest.raises(tb.TransportError):
            tb.Producer(tls_url, ssl_cafile=tls["ca"], reconnect_timeout_s=1).send("x", np.ones(1))


def send_numbered(producer: tb.Producer, numbers: range) -> None:
    """Send np.full(10, i) under key a<i> for each i."""
    for i in numbers:
        producer.send(f"a{i}", np.full(10, i))


def test_flush_waits_for_acks_and_unacked_frames_are_resent_after_a_consumer_restart() -> None:
    consumer = tb.Consumer("tcp://127.0.0.1:0")
    address = consumer.address
    producer = tb.Producer(address, reconnect_timeout_s=20)
    send_numbered(producer, range(5))
    producer.flush(10)
    assert producer.transport._unacked_bytes == 0  # everything acknowledged
    consumer.close()  # the consumer goes away; what the producer sends next is not acknowledged
    replacement: list[tb.Consumer] = []
    threading.Timer(1.0, lambda: replacement.append(tb.Consumer(address))).start()
    send_numbered(producer, range(5, 10))  # the first may vanish into the dead socket's buffer
    producer.flush(20)
    wait_for(lambda: replacement, 10, "the replacement consumer")  # (flush may beat the Timer's append)
    received = {i: replacement[0].recv(f"a{i}", timeout=10)[0] for i in range(5, 10)}
    assert received == {i: i for i in range(5, 10)}
    producer.close()
    replacement[0].close()


def test_a_consumer_that_closes_after_receiving_everything_acks_it_on_the_way_out() -> None:
    # the example's race: the saver got every tensor and exited before the trainer's flush asked
    consumer = tb.Consumer("tcp://127.0.0.1:0", ack_every_frames=1000)  # no ack goes out on its own
    producer = tb.Producer(consumer.address, reconnect_timeout_s=1)
    send_numbered(producer, range(5))
    assert [consumer.recv(f"a{i}", timeout=10)[0] for i in range(5)] == list(range(5))
    assert producer.transport._unacked  # sent, received, but not acknowledged yet
    consumer.close()
    producer.flush(5)  # no reconnect (nobody listens any more) and no resend: the farewell ack covered it
    assert not producer.transport._unacked
    producer.close()


TCP_ESTABLISHED, TCP_CLOSE_WAIT = 1, 8  # (include/net/tcp_states.h)


def tcp_state(sock: socket.socket) -> int:
    """A TCP socket's state (Linux's TCP_INFO: `tcpi_state`, its first byte)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="reads a TCP socket's state with Linux's TCP_INFO")
def test_a_closing_consumer_reads_what_comes_after_its_farewell_ack_and_ends_the_stream_without_a_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ack request (a `flush` under way) that reaches a closing consumer after its last read is read and
    dropped before the socket closes: the producer reads the farewell ack, then the end of the stream. Closed
    with bytes unread, a socket is reset instead, and a producer that meets the reset before it read the acks
    (sending its next request) reconnects to nobody: its flush fails though every tensor was taken.
    (The producer's socket says which: CLOSE_WAIT after a FIN, CLOSE after a reset.)"""
    consumer = tb.Consumer("tcp://127.0.0.1:0", ack_every_frames=1000)  # no ack goes out on its own
    producer = tb.Producer(consumer.address, reconnect_timeout_s=1)
    send_numbered(producer, range(5))
    assert [consumer.recv(f"a{i}", timeout=10)[0] for i in range(5)] == list(range(5))
    sock = producer.transport._sock
    ack = reactor.Reactor._ack

    def farewell_then_a_request(self: reactor.Reactor, peer: Any) -> None:
        ack(self, peer)
        if self._closed:  # the close's farewell ack: a request comes after it, before the socket closes
            sock.sendall(ACK_REQUEST_MARKER)
            unread = lambda: peer.conn.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # noqa: E731
            wait_for(unread, 10, "the request in the closing consumer's socket")

    monkeypatch.setattr(reactor.Reactor, "_ack", farewell_then_a_request)
    consumer.close()
    wait_for(lambda: tcp_state(sock) != TCP_ESTABLISHED, 10, "the consumer's end of the stream")
    assert tcp_state(sock) == TCP_CLOSE_WAIT  # its end was closed, not reset (TCP_CLOSE, 7)
    producer.flush(5)  # the farewell ack, read
    assert not producer.transport._unacked
    producer.close()


def test_producer_to_nobody_fails_within_its_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(tb.TransportError, match="cannot connect"):
        tb.Producer("tcp://127.0.0.1:1", reconnect_timeout_s=1).send("x", np.ones(1))
    assert time.monotonic() - started < 5


def test_flush_keeps_its_timeout_while_reconnecting_to_a_gone_consumer() -> None:
    consumer = tb.Consumer("tcp://127.0.0.1:0")
    producer = tb.Producer(consumer.address, reconnect_timeout_s=30, close_timeout_s=0.5)
    producer.send("k", np.arange(10))
    wait_for(lambda: len(consumer.table) == 1, 10, "the tensor in the table")
    consumer.close()  # drops it unreceived, so never acknowledges it
    started = time.monotonic()
    with pytest.raises(tb.TransportError):
        producer.flush(timeout=0.5)
    assert time.monotonic() - started < 5  # not reconnect_timeout_s
    producer.close()


def test_tensors_a_closing_consumer_drops_unreceived_are_resent_to_its_successor() -> None:
    consumer = tb.Consumer("tcp://127.0.0.1:0")
    address = consumer.address
    producer = tb.Producer(address, reconnect_timeout_s=20)
    send_numbered(producer, range(5))
    wait_for(lambda: len(consumer.table) == 5, 10, "5 tensors in the table")  # never received by the application
    consumer.close()  # drops them: so it must not acknowledge them on the way out
    successor = tb.Consumer(address)
    producer.flush(20)
    assert [successor.recv(f"a{i}", timeout=10)[0] for i in range(5)] == list(range(5))
    producer.close()
    successor.close()


def test_frames_an_aborted_consumer_turns_away_are_never_acknowledged() -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        producer = tb.Producer(consumer.address, close_timeout_s=0.5)
        producer.send("before", np.ones(3))
        assert consumer.recv("before", timeout=10)[0] == 1
        consumer.abort("shutting down")
        for i in range(3):
            producer.send(f"after{i}", np.ones(3))
        with pytest.raises(tb.TransportError, match="3 frames unacknowledged"):
            producer.flush(2)  # a flush that returned would claim three lost tensors as delivered
        producer.close()


def test_a_producer_holds_at_most_max_unacked_bytes_for_a_consumer_that_acks_nothing() -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        consumer.abort("step failed")  # still reads, never acknowledges
        producer = tb.Producer(consumer.address, max_unacked_bytes=1 << 20, send_timeout_s=1, close_timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(tb.TransportError, match=r"max_unacked_bytes=1048576.*aborted"):
            for i in range(100):
                producer.send(f"k{i}", np.zeros(100_000, np.uint8))
        assert time.monotonic() - started < 10
        assert producer.transport._unacked_bytes < (1 << 20) + 200_000  # type: ignore[attr-defined]
        producer.close()


def test_a_message_larger_than_max_unacked_bytes_still_goes_out_whole_in_chunks() -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        options = {"max_frame_bytes": 64 << 10, "max_unacked_bytes": 128 << 10, "send_timeout_s": 5}
        with tb.Producer(consumer.address, **options) as producer:
            for i in range(3):  # each far past the limit, and not acknowledged until all its chunks are in
                producer.send(f"big{i}", np.full(250_000, i, np.float32))
            producer.flush(timeout=10)
        for i in range(3):
            assert (consumer.recv(f"big{i}", timeout=10) == i).all()


def test_no_send_timeout_means_sends_wait() -> None:
    # a producer's share of the consumer's table is 50 KB and nobody receives: 20 sends of 32 KB (64 KB
    # unacknowledged at most) must wait
    tensors = [np.full(8192, i, np.float32) for i in range(20)]
    for never in (None, float("inf")):
        with (
            tb.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=100_000) as consumer,
            tb.Producer(consumer.address, send_timeout_s=never, max_unacked_bytes=64 << 10) as producer,
        ):
            failures: list[BaseException] = []

            def send_all(producer: tb.Producer = producer, failures: list[BaseException] = failures) -> None:
                try:
                    for i, tensor in enumerate(tensors):
                        producer.send(f"k{i}", tensor)
                except BaseException as exc:
                    failures.append(exc)

            sender = threading.Thread(target=send_all)
            sender.start()
            wait_for(lambda: consumer.table.buffered_bytes >= 50_000, 10, "the producer's share of the table to fill")
            assert sender.is_alive() and not failures  # it cannot finish before the application receives
            assert [int(consumer.recv(f"k{i}", timeout=10)[0]) for i in range(20)] == list(range(20))
            sender.join(10)
            assert not failures and not sender.is_alive()


def consumer_that_stops_reading() -> tuple[socket.socket, list[socket.socket]]:
    """A listening socket whose one connection does the handshake, then is never read again; and that connection."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept_and_ignore() -> None:
        conn, _ = server.accept()
        accepted.append(conn)
        with contextlib.suppress(OSError):  # (the producer gives up on a handshake after connect_timeout_s)
            handshake_as_consumer(conn, None)

    threading.Thread(target=accept_and_ignore, daemon=True).start()
    return server, accepted


def test_a_send_to_a_consumer_that_stopped_reading_fails_within_send_timeout() -> None:
    server, accepted = consumer_that_stops_reading()
    producer = tb.Producer(f"tcp://127.0.0.1:{server.getsockname()[1]}", send_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(tb.TransportError, match=r"made no progress for 1\.0s"):
        for i in range(200):  # 200 MB: far more than the socket buffers hold
            producer.send(f"k{i}", np.zeros(1 << 18, np.float32))
    assert time.monotonic() - started < 15
    for conn in (*accepted, server):
        conn.close()


def _receive_and_measure(address_out: Any, result_out: Any) -> None:
    """In a fresh process: receive one 256 MB tensor and report how much the peak RSS grew."""
    import resource

    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        address_out.send(consumer.address)
        tensor = consumer.recv("big", timeout=120)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        result_out.send((grown, int(tensor[-1]), tensor.nbytes))


def test_receiving_256_mb_raises_peak_rss_by_at_most_1_2x_its_size() -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    address_in, address_out = context.Pipe(duplex=False)
    result_in, result_out = context.Pipe(duplex=False)
    receiver = context.Process(target=_receive_and_measure, args=(address_out, result_out))
    receiver.start()
    address = address_in.recv()
    Peer(address, [("big", {"n": 64 << 20, "dtype": "float32", "seed": 1})]).join()
    assert result_in.poll(120)
    grown, _, nbytes = result_in.recv()
    receiver.join(30)
    print(f"\npeak RSS grew by {grown / 2**20:.0f} MiB receiving {nbytes / 2**20:.0f} MiB ({grown / nbytes:.2f}x)")
    assert nbytes == 256 << 20 and grown <= 1.2 * nbytes


def test_a_producer_stalled_mid_frame_holds_up_nobody() -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        stalled = raw_peer(consumer.address)
        frame = tb.dumps(np.zeros(100_000), key="stalled")
        stalled.sendall(frame[: len(frame) // 2])  # half a frame, then silence
        good = Peer(consumer.address, [(f"g{i}", {"seed": i, "n": 10_000}) for i in range(10)])
        good.join()
        for i in range(10):
            assert same(consumer.recv(f"g{i}", timeout=10), make_tensor({"seed": i, "n": 10_000}))
        stalled.sendall(frame[len(frame) // 2 :])  # the rest, late: the frame still arrives whole
        assert same(consumer.recv("stalled", timeout=10), np.zeros(100_000))
        stalled.close()


def test_acks_flow_while_the_application_is_not_receiving() -> None:
    # no thread waits in recv: the background reader must read, deliver and acknowledge
    with tb.Consumer("tcp://127.0.0.1:0") as consumer, tb.Producer(consumer.address) as producer:
        for i in range(100):
            producer.send(f"k{i}", np.full(1000, i))
        producer.flush(timeout=10)
        assert len(consumer.table) == 100


class _CountedLooks:
    """The reactor's idle timer, counting the background reader's looks at it (`wait` with a timeout):
    each is a chance it had to take the lead and read."""

    def __init__(self, timer: Any) -> None:
        self.timer, self.looks = timer, 0

    def wait(self, timeout: float) -> bool:
        if timeout > 0:
            self.looks += 1
        return bool(self.timer.wait(timeout))

    def touch(self, linger_s: float) -> None:
        self.timer.touch(linger_s)

    def wake(self) -> None:
        self.timer.wake()


def _sent_and_left_for_recv(consumer: tb.Consumer, producer: tb.Producer) -> None:
    """Send a small tensor: the background reader, kept out for `linger_s`, must leave it for a recv."""
    reactor = consumer.transport.reactor  # type: ignore[attr-defined]
    timer = reactor._idle = _CountedLooks(reactor._idle)
    producer.send("small", np.arange(20))
    looks = timer.looks
    # (not a fixed sleep: on a loaded machine the reader may not have run at all, and proved nothing)
    wait_for(lambda: timer.looks >= looks + 3, 10, "the background reader to look three times after the send")
    assert len(consumer.table) == 0  # it was kept out each time
    assert same(consumer.recv("small", timeout=10), np.arange(20))


@pytest.mark.parametrize("scheme", ["tcp", "unix"])
def test_after_a_large_tensor_the_next_arrives_while_the_application_works(scheme: str, tmp_path: Any) -> None:
    # linger_s keeps the background reader out for a minute after a recv; after a tensor of
    # OVERLAP_FROM bytes it takes over at once, so the next one is read while no recv waits
    where = f"unix://{tmp_path}/c.sock" if scheme == "unix" else "tcp://127.0.0.1:0"
    large = np.arange(reactor.OVERLAP_FROM // 8, dtype=np.float64)
    with tb.Consumer(f"{where}?linger_s=60") as consumer, tb.Producer(consumer.address) as producer:
        first = once_leading(consumer, lambda: producer.send("first", large))
        assert same(consumer.recv("first", timeout=10), large)  # (read by this thread: it waited first)
        first.join()
        second = threading.Thread(target=producer.send, args=("second", large + 1))
        second.start()
        wait_for(lambda: len(consumer.table) == 1, 10, "the second tensor, read with no recv waiting")
        second.join()
        assert same(consumer.recv("second", timeout=0), large + 1)


def test_after_a_small_tensor_the_application_keeps_the_lead_for_linger_s() -> None:
    with tb.Consumer("tcp://127.0.0.1:0?linger_s=2") as consumer, tb.Producer(consumer.address) as producer:
        first = once_leading(consumer, lambda: producer.send("first", np.arange(10)))  # (this recv must be first)
        assert same(consumer.recv("first", timeout=10), np.arange(10))  # (read by this thread: it waited first)
        first.join()
        _sent_and_left_for_recv(consumer, producer)


def test_a_recv_that_read_nothing_keeps_the_background_reader_out_for_linger_s() -> None:
    # what hands the lead over at once is a large frame read by that recv, not one read before it
    large = np.arange(reactor.OVERLAP_FROM // 8, dtype=np.float64)
    with tb.Consumer("tcp://127.0.0.1:0?linger_s=2") as consumer, tb.Producer(consumer.address) as producer:
        producer.send("large", large)
        wait_for(lambda: len(consumer.table) == 1, 10, "the large tensor, read by the background reader")
        assert same(consumer.recv("large", timeout=0), large)
        with pytest.raises(tb.Timeout):
            consumer.recv("missing", timeout=0.2)  # leads, and reads nothing
        _sent_and_left_for_recv(consumer, producer)


def test_a_waiting_recv_reads_its_frame_on_its_own_thread() -> None:
    # a thread hand-off costs about a process wake-up here: the waiting thread reads for itself
    # (linger_s far longer than the default 1 ms: a test thread preempted between its recv and its next
    # send lets the background reader lead, and on a loaded machine 0.2 s was not enough for 45 of 50;
    # a hand-off for every frame would leave this thread none, so 40 still tells the two apart)
    readers: list[str] = []
    with tb.Consumer("tcp://127.0.0.1:0?linger_s=2") as consumer, tb.Producer(consumer.address) as producer:
        feed = consumer.intake._feed

        def spy(frame: Any, crc: Any, *more: Any) -> Any:
            readers.append(threading.current_thread().name)
            return feed(frame, crc, *more)

        consumer.intake._feed = spy  # type: ignore[method-assign]
        reactor = consumer.transport.reactor  # type: ignore[attr-defined]
        take = reactor._fast  # (plain frames are delivered in C, by the intake's FastDelivery)

        def spy_take(frame: Any, crc: Any, source: Any) -> Any:
            readers.append(threading.current_thread().name)
            return take(frame, crc, source)

        if take is not None:  # (None with TENSORBUS_NATIVE=0)
            reactor._fast = spy_take
        # The application waits once first. Until it has, the background reader leads, and on a loaded
        # machine it can read each frame before this thread's recv asks for it, so that recv never
        # waits and never leads: a start that can last many frames, not the property tested here.
        with pytest.raises(tb.Timeout):
            consumer.recv("nothing", timeout=0.05)
        for i in range(50):
            producer.send("k", np.full(10, i))
            assert consumer.recv("k", timeout=5)[0] == i
    assert readers.count(threading.current_thread().name) >= 40, readers


def test_many_threads_waiting_on_one_consumer_each_get_their_key() -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer, tb.Producer(consumer.address) as producer:
        results: dict[int, Any] = {}

        def wait(i: int) -> None:
            results[i] = consumer.recv(f"k{i}", timeout=10)

        threads = [threading.Thread(target=wait, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for i in reversed(range(8)):
            producer.send(f"k{i}", np.full(10, i))
            time.sleep(0.01)
        for t in threads:
            t.join(15)
        assert {i: int(v[0]) for i, v in results.items()} == {i: i for i in range(8)}


OUT_OF_FDS_CONSUMER = """
import logging, os, resource, sys
import tensorbus as tb
logging.basicConfig(level=logging.ERROR)
consumer = tb.Consumer("tcp://127.0.0.1:0")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 2, hard))  # before anyone connects
print(consumer.address, flush=True)
sys.stdin.readline()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print("restored", flush=True)
print(consumer.recv("k", timeout=20).tolist(), flush=True)
consumer.close()
"""


def test_a_consumer_out_of_file_descriptors_accepts_again_once_it_has_some() -> None:
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", OUT_OF_FDS_CONSUMER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    errors: list[str] = []

    def read_errors() -> None:
        assert child.stderr is not None
        for line in child.stderr:
            errors.append(line)

    reading = threading.Thread(target=read_errors, daemon=True)
    reading.start()
    try:
        assert child.stdout is not None and child.stdin is not None
        address = child.stdout.readline().strip()
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        crowd = [socket.create_connection((host, int(port)), timeout=5) for _ in range(10)]
        ran_out = "the consumer to run out of descriptors accepting them, and say it keeps listening"
        wait_for(lambda: any("accepting a producer on" in e and "retrying" in e for e in errors), 30, ran_out)
        for sock in crowd:
            sock.close()
        child.stdin.write("restore\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "restored"
        with tb.Producer(address, reconnect_timeout_s=10) as producer:
            producer.send("k", np.arange(3))
            producer.flush(timeout=15)
        child.stdin.close()
        out = child.stdout.read()
    finally:
        child.kill()
        child.wait(30)
        reading.join(10)
        for stream in (child.stdin, child.stdout, child.stderr):
            if stream is not None:
                stream.close()
    assert out.strip() == "[0, 1, 2]", "".join(errors)


def test_a_unix_path_is_never_taken_from_a_live_consumer_nor_removed_from_under_a_successor(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tensorbus")  # (an in-process CLI test may have raised its level)
    path = str(tmp_path / "tb.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # a consumer killed without cleaning up leaves its file behind
    with tb.Consumer(f"unix://{path}") as first:
        with pytest.raises(tb.TransportError, match="another consumer is listening"):
            tb.Consumer(f"unix://{path}")
        wait_for(lambda: "handshake with" in caplog.text, 15, "the probe noticed by the live consumer")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a probe is not an error
        os.unlink(path)  # e.g. an operator cleaned up, and a successor started on the same path
        with tb.Consumer(f"unix://{path}") as successor:
            first.close()  # the old consumer shuts down last: it must leave the successor's file alone
            assert os.path.exists(path)
            with tb.Producer(f"unix://{path}", reconnect_timeout_s=2) as producer:
                producer.send("k", np.arange(3))
                producer.flush(timeout=5)
            assert successor.recv("k", timeout=5).tolist() == [0, 1, 2]
    assert not os.path.exists(path)  # the successor removed its own file
    with open(path, "w") as mistaken:  # a path that is not a socket at all is never removed
        mistaken.write("data")
    with pytest.raises(tb.TransportError, match="cannot listen"):
        tb.Consumer(f"unix://{path}")
    with open(path) as kept:
        assert kept.read() == "data"


def test_a_handshake_finishing_after_the_consumer_closed_just_closes_its_connection() -> None:
    consumer = tb.Consumer("tcp://127.0.0.1:0")
    reactor = consumer.transport.reactor  # type: ignore[attr-defined]
    consumer.close()
    ours, theirs = socket.socketpair()
    reactor.add(ours, "late producer")  # what a handshake thread does once its producer proved itself
    assert ours.fileno() == -1 and theirs.recv(1) == b""  # closed, and the producer sees it
    theirs.close()


def test_unusual_but_valid_connection_settings_work() -> None:
    with tb.Consumer("tcp://127.0.0.1:0", backlog=0) as consumer:
        settings = {"connect_timeout_s": None, "reconnect_timeout_s": 0}  # wait as long as it takes; never retry
        with tb.Producer(consumer.address, **settings) as producer:
            producer.send("k", np.arange(3))
            producer.flush(timeout=5)
        assert consumer.recv("k", timeout=5).tolist() == [0, 1, 2]


def test_running_out_of_memory_for_a_frame_drops_the_connection_and_the_frame_comes_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        consumer.transport.reactor._fast = None  # type: ignore[attr-defined]  # (the Python delivery: the C one below)
        raised = fail_feed_once(monkeypatch, consumer, MemoryError())
        with tb.Producer(consumer.address, reconnect_timeout_s=5) as producer:
            producer.send("k", np.arange(3))
            producer.flush(timeout=10)  # resent on a new connection, then acknowledged
        assert len(raised) == 1 and consumer.recv("k", timeout=5).tolist() == [0, 1, 2]
        assert consumer.stats["rejected"] == 0


def test_running_out_of_memory_in_the_c_delivery_drops_the_connection_and_the_frame_comes_again() -> None:
    class FailingCounter(int):  # the table's arrival counter: `+ 1` fails once, inside the C delivery
        failed = False

        def __add__(self, other: object) -> int:
            if not FailingCounter.failed:
                FailingCounter.failed = True
                raise MemoryError("injected")
            return int(self) + int(other)  # type: ignore[call-overload]

    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        require_native(consumer.intake.fast_delivery is not None, "the C delivery (tensorbus/_intake.c)")
        consumer.table._counter = FailingCounter(0)
        with tb.Producer(consumer.address, reconnect_timeout_s=5) as producer:
            producer.send("k", np.arange(3))
            producer.flush(timeout=10)  # resent on a new connection, then acknowledged
        assert FailingCounter.failed and consumer.recv("k", timeout=5).tolist() == [0, 1, 2]
        assert consumer.stats["rejected"] == 0 and consumer.stats["duplicates"] == 0
        assert consumer.intake.fast_delivery.taken == 1  # delivered in C (once: the failed attempt took nothing)


def test_half_a_tls_ack_record_does_not_block_a_flush_past_its_timeout(tls: dict[str, str]) -> None:
    """A tcps:// consumer driven by hand (TLS through memory BIOs), so an ack can arrive split mid-record."""
    import ssl

    from tensorbus.transports.stream import ACK

    server = socket.create_server(("127.0.0.1", 0))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls["cert"])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls_object = context.wrap_bio(incoming, outgoing, server_side=True)
    conn: list[socket.socket] = []

    def consumer_side() -> None:  # TLS handshake, then the tensorbus hello; frames are never read
        raw, _ = server.accept()
        conn.append(raw)
        while True:
            try:
                tls_object.do_handshake()
                break
            except ssl.SSLWantReadError:
                raw.sendall(outgoing.read())
                incoming.write(raw.recv(65536))
        raw.sendall(outgoing.read())
        tls_object.write(HELLO.pack(b"TBSK", 1, HELLO_EVERY_CONSUMER, bytes(32)) + b"\x01")  # then "accepted"
        raw.sendall(outgoing.read())

    thread = threading.Thread(target=consumer_side, daemon=True)
    thread.start()
    producer = tb.Producer(f"tcps://127.0.0.1:{server.getsockname()[1]}", ssl_cafile=tls["ca"], close_timeout_s=0.5)
    producer.send("k", np.arange(3))  # connects, and the frame waits unacknowledged
    thread.join(timeout=10)
    tls_object.write(ACK.pack(1))
    record = outgoing.read()
    conn[0].sendall(record[:10])  # the record's header and a little more: not enough to decrypt
    started = time.monotonic()
    with pytest.raises(tb.TransportError, match="unacknowledged"):
        producer.flush(timeout=1)
    assert time.monotonic() - started < 5  # not send_timeout_s (30 s), which a blocking TLS read would take
    conn[0].sendall(record[10:])
    producer.flush(timeout=5)  # the whole record: acknowledged
    producer.close()
    conn[0].close()
    server.close()


def test_a_producer_whose_socket_has_a_descriptor_past_1023_reads_its_acks() -> None:
    # select() cannot watch such descriptors; an application with many files open gets them
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.fail(f"this test needs 1200 file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with tb.Consumer("tcp://127.0.0.1:0") as consumer, tb.Producer(consumer.address) as producer:
            for i in range(70):  # acks are read every 64 sends
                producer.send(f"k{i}", np.full(4, i))
            assert producer.transport._sock.fileno() >= 1024
            producer.flush(10)
            assert [int(consumer.recv(f"k{i}", timeout=10)[0]) for i in range(70)] == list(range(70))
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


#: system call numbers that write to a socket (write, writev, sendto, sendmsg), by machine
SEND_CALLS = {"x86_64": {1, 20, 44, 46}, "aarch64": {64, 66, 206, 211}}


def sleeps_in_a_send(thread: threading.Thread) -> bool:
    """Whether `thread` is asleep in a system call that writes to a socket (Linux: /proc/self/task/TID)."""
    calls, task = SEND_CALLS.get(platform.machine()), f"/proc/self/task/{thread.native_id}"
    if calls is None or not os.path.exists(f"{task}/syscall"):
        pytest.fail(f"cannot tell what a thread waits in on {platform.system()} {platform.machine()}")
    with open(f"{task}/syscall") as call, open(f"{task}/stat") as stat:
        number = call.read().split()[0]  # ("running" while it runs)
        state = stat.read().rpartition(")")[2].split()[0]  # S: asleep (R: woken, or running)
    return state == "S" and number.isdigit() and int(number) in calls


def test_flush_and_close_keep_their_timeouts_while_another_thread_is_stuck_sending() -> None:
    server, accepted = consumer_that_stops_reading()
    producer = tb.Producer(f"tcp://127.0.0.1:{server.getsockname()[1]}", send_timeout_s=None, close_timeout_s=1.0)
    failures: list[BaseException] = []

    def send_forever() -> None:
        try:
            for _ in range(100):
                producer.send("k", np.zeros(1 << 18, np.float32))
        except tb.TensorBusError as exc:
            failures.append(exc)

    def held_for_good() -> bool:  # asleep in a send, twice, no frame sent between: the buffers are full for good
        sent = producer.transport._sent
        if not sleeps_in_a_send(stuck):
            return False
        time.sleep(0.2)
        return sleeps_in_a_send(stuck) and producer.transport._sent == sent

    stuck = threading.Thread(target=send_forever)
    stuck.start()
    wait_for(held_for_good, 30, "the sender to block in a send, holding the connection")
    started = time.monotonic()
    with pytest.raises(tb.TransportError, match="a send has held the connection"):
        producer.flush(timeout=1.0)
    assert time.monotonic() - started < 10  # its 1 s, not the stuck send's for ever (a margin for a loaded machine)
    started = time.monotonic()
    producer.close()  # flush, then wake the stuck sender rather than wait for it forever
    assert time.monotonic() - started < 10  # its close_timeout_s (1 s) and the wake-up
    stuck.join(10)
    assert not stuck.is_alive() and producer.transport._sock is None
    assert len(failures) == 1 and isinstance(failures[0], tb.Closed)  # woken, and told why, not reconnected
    for conn in (*accepted, server):
        conn.close()


def test_a_send_racing_close_does_not_reconnect_after_it() -> None:
    metadata = {str(i): "x" * 50 for i in range(15000)}  # ~0.9 MB of metadata: encoding takes a while
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        leaked = 0
        for _ in range(20):
            producer = tb.Producer(consumer.address)
            producer.send("k", np.arange(3))
            producer.flush(5)
            errors: list[BaseException] = []

            def late_send(p: tb.Producer = producer, out: list[BaseException] = errors) -> None:
                try:
                    p.send("late", np.arange(3), metadata=metadata)
                except tb.TensorBusError as exc:
                    out.append(exc)

            sender = threading.Thread(target=late_send)
            sender.start()
            producer.close()
            sender.join(10)
            leaked += producer.transport._sock is not None
            assert all(isinstance(e, tb.Closed) for e in errors)
        assert leaked == 0


def test_the_chunks_of_a_message_that_failed_part_way_are_not_resent_to_hold_up_acks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # resent, they would make a message that can never complete, and the consumer acks nothing past it
    # until its reassembly expires (60 s here): every flush and wait_for_room would fail meanwhile
    with (
        tb.Consumer("tcp://127.0.0.1:0", reassembly_timeout_s=60) as consumer,
        tb.Producer(consumer.address, max_frame_bytes=256 << 10) as producer,
    ):
        transport, real_send = producer.transport, producer.transport.send
        calls = 0

        def send_then_break(frame: Any, *, key: str | None) -> None:
            nonlocal calls
            calls += 1
            if calls == 3:  # two chunks out, then the connection breaks for good, as `send` leaves it then
                transport._drop_connection()
                raise tb.TransportError("injected: cannot connect")
            real_send(frame, key=key)

        monkeypatch.setattr(transport, "send", send_then_break)
        with pytest.raises(tb.TransportError, match="injected"):
            producer.send("a", np.ones(1 << 18, np.float32))  # 1 MiB: 5 chunks
        monkeypatch.undo()
        producer.send("b", np.arange(3))
        producer.flush(10)
        assert list(consumer.recv("b", timeout=5)) == [0, 1, 2]
        assert transport._acked == transport._sent  # every frame received: nothing holds the acks up


def test_an_ack_for_frames_never_sent_breaks_the_connection_not_the_producer() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def accept_and_overack() -> None:  # a broken (or hostile) consumer
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conns.append(conn)
            with contextlib.suppress(OSError):  # a producer whose flush ran out mid-handshake has left
                handshake_as_consumer(conn, None)
                conn.sendall(ACK.pack(1000))

    threading.Thread(target=accept_and_overack, daemon=True).start()
    with tb.Producer(f"tcp://127.0.0.1:{server.getsockname()[1]}", close_timeout_s=0.5) as producer:
        producer.send("k", np.arange(3))
        with pytest.raises(tb.TransportError, match="unacknowledged"):  # not IndexError from the ack bookkeeping
            producer.flush(1.0)
        assert len(producer.transport._unacked) == 1  # kept, to be sent again
    server.close()
    for conn in conns:
        conn.close()


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:0", "unix"])
def test_a_full_table_holds_up_only_the_producer_that_filled_it(url: str, tmp_path: Any) -> None:
    if url == "unix":
        url = f"unix://{tmp_path}/held.sock"
    with tb.Consumer(url, max_buffered_bytes=1 << 20, max_buffered_bytes_per_producer=1 << 20) as consumer:
        flood = Peer(consumer.address, [(f"a{i}", {"seed": i, "n": 1 << 16}) for i in range(40)])  # 10 MB of "a"
        wait_for(lambda: consumer.table.buffered_bytes >= 1 << 20, 30, "the first producer to fill the table")
        other = Peer(consumer.address, [("b", {"seed": 99, "n": 10})])
        assert same(consumer.recv("b", timeout=20), make_tensor({"seed": 99, "n": 10}))  # not stuck behind "a"
        other.join()
        for i in range(40):  # the held producer then goes on where it stopped: nothing lost, in order
            assert same(consumer.recv(f"a{i}", timeout=20), make_tensor({"seed": i, "n": 1 << 16}))
        flood.join()
        assert consumer.stats["received"] == 41 and consumer.stats["duplicates"] == 0


def test_a_held_back_tensor_is_not_acknowledged_so_a_successor_gets_it() -> None:
    first = tb.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=1 << 20)
    address = first.address
    producer = tb.Producer(address, reconnect_timeout_s=20)
    for i in range(6):  # 256 KB each: four fill the table, the fifth is held back
        producer.send(f"a{i}", np.full(1 << 16, i, np.float32))
    reactor = first.transport.reactor  # type: ignore[attr-defined]
    wait_for(lambda: reactor._held, 10, "a tensor to be held back")
    held_key = reactor._held[0].held.key
    first.close()  # the four in its table were acknowledged (and are lost); the held one was not
    with tb.Consumer(address) as successor:
        producer.flush(timeout=20)  # resends what was never acknowledged, to the successor
        assert successor.recv(held_key, timeout=10)[0] == int(held_key[1:])
    producer.close()


def test_a_ctrl_c_while_recv_reads_for_itself_loses_no_tensor_and_no_ack() -> None:
    # (linger_s: once this thread has led, the background reader stays out while it leads again and again)
    with tb.Consumer("tcp://127.0.0.1:0?linger_s=2") as consumer, tb.Producer(consumer.address) as producer:
        consumer.transport.reactor._fast = None  # type: ignore[attr-defined]  # (the Python delivery, which C leaves the unusual frames to)
        feed, interrupted = consumer.intake.reassembler.feed, []

        def interrupt_once(*args: Any, **options: Any) -> Any:  # the signal lands while the frame is decoded
            if threading.current_thread() is threading.main_thread() and not interrupted:
                interrupted.append(True)
                raise KeyboardInterrupt
            return feed(*args, **options)

        consumer.intake.reassembler.feed = interrupt_once  # type: ignore[method-assign]
        once_leading(consumer, lambda: producer.send("a", np.arange(3)))
        with pytest.raises(KeyboardInterrupt):
            consumer.recv("a", timeout=10)
        assert interrupted and consumer.recv("a", timeout=10).tolist() == [0, 1, 2]  # read again, not lost
        producer.send("b", np.arange(4))
        assert consumer.recv("b", timeout=10).tolist() == [0, 1, 2, 3]
        producer.flush(10)  # the acks still count every frame
        assert consumer.stats["received"] == 2 and consumer.stats["duplicates"] == 0


def test_a_ctrl_c_just_after_the_c_delivery_loses_no_tensor_and_delivers_it_once() -> None:
    # the C delivery runs no Python code, so a signal lands before it or after it: after it, the frame
    # is taken but not yet counted for the acks; the connection is dropped, the producer sends the
    # frame again, and the copy is dropped as a duplicate
    with tb.Consumer("tcp://127.0.0.1:0?linger_s=2") as consumer, tb.Producer(consumer.address) as producer:
        reactor = consumer.transport.reactor  # type: ignore[attr-defined]
        require_native(reactor._fast is not None, "the C delivery (tensorbus/_intake.c)")
        take, interrupted = reactor._fast, []

        def interrupt_once(frame: Any, crc: Any, source: Any) -> Any:
            message = take(frame, crc, source)
            if message is not None and not interrupted:
                interrupted.append(message.key)
                raise KeyboardInterrupt
            return message

        reactor._fast = interrupt_once
        once_leading(consumer, lambda: producer.send("a", np.arange(3)))
        with pytest.raises(KeyboardInterrupt):
            consumer.recv("a", timeout=10)
        assert interrupted == ["a"] and consumer.recv("a", timeout=10).tolist() == [0, 1, 2]  # given back, not lost
        producer.send("b", np.arange(4))  # (may go out on the dropped connection: flush sends it again)
        producer.flush(10)  # every frame acknowledged in the end
        assert consumer.recv("b", timeout=10).tolist() == [0, 1, 2, 3]
        with pytest.raises(tb.Timeout):
            consumer.recv("a", timeout=0.3)  # the copy sent again was not delivered a second time
        assert consumer.stats["received"] == 2 and consumer.stats["duplicates"] == 1
        assert consumer.intake.fast_delivery.taken == 2


def test_a_ctrl_c_in_a_callback_on_the_reading_thread_delivers_its_tensor_once() -> None:
    with tb.Consumer("tcp://127.0.0.1:0?linger_s=2") as consumer, tb.Producer(consumer.address) as producer:
        got: list[list[int]] = []

        def interrupted(message: Any, error: object) -> None:
            got.append(message.tensor.tolist())
            raise KeyboardInterrupt  # as a Ctrl-C landing in the callback would

        consumer.recv_async("a", interrupted)
        once_leading(consumer, lambda: producer.send("a", np.arange(3)))  # read by this thread, in recv
        with pytest.raises(tb.CallbackInterrupted) as caught:  # the application's Ctrl-C, still a KeyboardInterrupt
            consumer.recv("b", timeout=10)
        assert isinstance(caught.value, KeyboardInterrupt) and got == [[0, 1, 2]]
        producer.send("b", np.arange(4))
        assert consumer.recv("b", timeout=10).tolist() == [0, 1, 2, 3]  # the connection reads on
        producer.flush(10)  # every frame acknowledged: nothing is sent again
        with pytest.raises(tb.Timeout):
            consumer.recv("a", timeout=0.3)  # the callback had it: not delivered a second time
        assert got == [[0, 1, 2]] and consumer.stats["received"] == 2 and consumer.stats["duplicates"] == 0


def test_a_ctrl_c_in_a_callback_taking_a_held_back_tensor_delivers_it_once() -> None:
    with (
        tb.Consumer("tcp://127.0.0.1:0?linger_s=2", max_buffered_bytes=1000) as consumer,
        tb.Producer(consumer.address) as producer,
    ):
        producer.send("x", np.zeros(500))  # 4000 bytes: the table is full with it alone
        wait_for(lambda: len(consumer.table) == 1, 10, "x in the table")
        producer.send("a", np.arange(3))
        reactor = consumer.transport.reactor  # type: ignore[attr-defined]
        wait_for(lambda: reactor._held, 10, "a to be held back (no room)")
        got: list[list[int]] = []

        def interrupted(message: Any, error: object) -> None:
            got.append(message.tensor.tolist())
            raise KeyboardInterrupt  # as a Ctrl-C landing in the callback would

        # a receiver for "a" makes room for it: this thread, leading in its recv, hands it over
        once_leading(consumer, lambda: consumer.recv_async("a", interrupted))
        with pytest.raises(tb.CallbackInterrupted):
            consumer.recv("y", timeout=10)
        assert got == [[0, 1, 2]] and not reactor._held
        assert consumer.intake._held_up == 0  # nothing held up any more: partly received tensors age again
        assert consumer.recv("x", timeout=10).shape == (500,)
        producer.send("b", np.arange(4))
        assert consumer.recv("b", timeout=10).tolist() == [0, 1, 2, 3]  # its producer is read again
        producer.flush(10)
        with pytest.raises(tb.Timeout):
            consumer.recv("a", timeout=0.3)  # the callback had it: not delivered a second time
        assert got == [[0, 1, 2]] and consumer.stats["duplicates"] == 0


def test_a_callback_raising_system_exit_does_not_stop_the_reader() -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer, tb.Producer(consumer.address) as producer:

        def leave(message: object, error: object) -> None:
            raise SystemExit("from a callback")

        consumer.recv_async("a", leave)
        producer.send("a", np.arange(3))
        wait_for(lambda: consumer.stats["received"] == 1, 10, "the callback to run")
        producer.send("b", np.arange(4))
        producer.flush(10)  # acked while nobody waits in recv: the background reader is alive
        assert consumer.recv("b", timeout=10).tolist() == [0, 1, 2, 3]


_FORKED: tb.Producer | None = None


def _send_from_a_forked_worker(worker: int) -> None:
    assert _FORKED is not None
    for i in range(10):
        _FORKED.send(f"w{worker}", np.full(3, i))
    _FORKED.flush(20)


def test_a_producer_created_before_a_fork_is_a_producer_of_its_own_in_each_child() -> None:
    global _FORKED
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        _FORKED = tb.Producer(consumer.address)
        _FORKED.send("parent", np.arange(2))  # connected: the children must not write on this connection
        workers = [
            multiprocessing.get_context("fork").Process(target=_send_from_a_forked_worker, args=(w,)) for w in range(3)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        assert [worker.exitcode for worker in workers] == [0, 0, 0]
        _FORKED.send("parent", np.arange(2))
        _FORKED.flush(20)
        for w in range(3):
            assert [int(consumer.recv(f"w{w}", timeout=10)[0]) for _ in range(10)] == list(range(10))
        assert consumer.recv("parent", timeout=10).tolist() == consumer.recv("parent", timeout=10).tolist() == [0, 1]
        assert consumer.stats["received"] == 32 and consumer.stats["duplicates"] == 0
        _FORKED.close()
        _FORKED = None


def test_a_half_received_tensor_of_a_held_back_producer_does_not_expire_while_others_flow() -> None:
    from tensorbus.codec import encode_chunks

    with tb.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=1 << 20, reassembly_timeout_s=1.0) as consumer:
        held, other = tb.Producer(consumer.address), tb.Producer(consumer.address)
        for i in range(4):
            held.send("fill", np.full(1 << 16, i, np.float32))  # 4 x 256 KiB: the table is full
        x = np.arange(1 << 19, dtype=np.float32)
        chunks = encode_chunks(x, max_chunk_bytes=1 << 16, message_id=(held.producer_id, 1000), key="x")
        for part in chunks[:10]:  # as if two threads shared the producer: half of x, then a whole tensor
            held.transport.send(part, key="x")
        held.transport.send(tb.encode(np.zeros(4), key="m", message_id=(held.producer_id, 1001)), key="m")
        for part in chunks[10:]:
            held.transport.send(part, key="x")
        wait_for(lambda: consumer.transport.reactor._held, 10, "the whole tensor to be held back")  # type: ignore[attr-defined]
        for _ in range(25):  # 2.5 s of another producer's traffic, read by recv: x's clock stands still
            other.send("q", np.arange(3))
            consumer.recv("q", timeout=5)
            time.sleep(0.1)
        assert [int(consumer.recv("fill", timeout=5)[0]) for _ in range(4)] == [0, 1, 2, 3]
        assert consumer.recv("m", timeout=5).tolist() == [0, 0, 0, 0]
        assert np.array_equal(consumer.recv("x", timeout=5), x)
        assert consumer.intake.reassembler.stats["expired"] == 0 and consumer.intake.reassembler.held_bytes == 0
        held.close()
        other.close()


def test_a_ctrl_c_while_recv_decodes_a_reassembled_tensor_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorbus.codec.chunking as chunking

    decode, interrupted = chunking.message_from_frame, []

    def interrupt_once(*args: Any, **options: Any) -> Any:  # the signal lands while the whole tensor is decoded
        if threading.current_thread() is threading.main_thread() and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return decode(*args, **options)

    monkeypatch.setattr(chunking, "message_from_frame", interrupt_once)
    with (
        tb.Consumer("tcp://127.0.0.1:0?linger_s=2") as consumer,
        tb.Producer(consumer.address, max_frame_bytes=1 << 16) as producer,
    ):
        x = np.arange(100_000, dtype=np.float32)  # 7 chunks
        once_leading(consumer, lambda: producer.send("x", x))
        with pytest.raises(KeyboardInterrupt):
            consumer.recv("x", timeout=10)
        assert interrupted and np.array_equal(consumer.recv("x", timeout=10), x)  # its last chunk completes it again
        producer.flush(10)


def _flush_then_leave(parent_id: str) -> None:
    assert _FORKED is not None
    _FORKED.flush(5)  # before any send here: must not touch the parent's connection
    assert _FORKED.producer_id != parent_id  # a producer of its own already
    _FORKED.close()


def test_a_forked_child_that_only_flushes_and_closes_leaves_the_parents_connection_alone() -> None:
    global _FORKED
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        _FORKED = tb.Producer(consumer.address)
        for i in range(5):
            _FORKED.send(f"k{i}", np.arange(3))
        child = multiprocessing.get_context("fork").Process(target=_flush_then_leave, args=(_FORKED.producer_id,))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        _FORKED.flush(10)  # the parent's acks were not read away by the child
        assert all(consumer.recv(f"k{i}", timeout=10).tolist() == [0, 1, 2] for i in range(5))
        _FORKED.close()
        _FORKED = None


def test_a_ctrl_c_while_a_reassembled_tensor_enters_the_table_loses_nothing() -> None:
    with (
        tb.Consumer("tcp://127.0.0.1:0?linger_s=2") as consumer,
        tb.Producer(consumer.address, max_frame_bytes=1 << 16) as producer,
    ):
        put, interrupted = consumer.table.put, []

        def interrupt_once(message: Any, **options: Any) -> None:  # the reassembler is done with it by now
            if threading.current_thread() is threading.main_thread() and not interrupted:
                interrupted.append(True)
                raise KeyboardInterrupt
            put(message, **options)

        consumer.table.put = interrupt_once  # type: ignore[method-assign]
        x = np.arange(100_000, dtype=np.float32)
        once_leading(consumer, lambda: producer.send("x", x))
        with pytest.raises(KeyboardInterrupt):
            consumer.recv("x", timeout=10)
        assert interrupted and np.array_equal(consumer.recv("x", timeout=10), x)
        producer.flush(10)


def test_closing_with_tensors_nobody_took_acknowledges_none_of_them(tmp_path: Any) -> None:
    address = f"unix://{tmp_path}/close.sock"
    first = tb.Consumer(address, max_buffered_bytes=1 << 20, max_buffered_bytes_per_producer=1 << 20)
    producer = tb.Producer(address, reconnect_timeout_s=20)
    for i in range(5):  # four fill the table, the fifth is held back behind them
        producer.send(f"a{i}", np.full(1 << 16, i, np.float32))
    wait_for(lambda: first.transport.reactor._held, 10, "a tensor to be held back")  # type: ignore[attr-defined]

    def flush() -> None:
        with contextlib.suppress(tb.TransportError):  # fails: the consumer closes
            producer.flush(2)

    flushing = threading.Thread(target=flush)
    flushing.start()  # its ack request waits behind the held tensor, which close's last pass reads
    wait_for(lambda: producer.transport._ack_requested, 10, "the flush to ask for an ack")
    first.close()
    flushing.join(10)
    with tb.Consumer(address) as successor:
        producer.flush(20)
        assert [int(successor.recv(f"a{i}", timeout=10)[0]) for i in range(5)] == [0, 1, 2, 3, 4]
    producer.close()


@pytest.mark.parametrize("scheme", ["tcp", "unix"])
def test_each_family_of_connection_gets_its_settings_at_both_ends(scheme: str, tmp_path: Any) -> None:
    """TCP: no Nagle, so acks and small frames go out at once. Unix: the send buffer TCP's loopback grows to
    (Linux doubles what is set, after capping it at net.core.wmem_max; its default is wmem_default, undoubled)."""
    url = "tcp://127.0.0.1:0" if scheme == "tcp" else f"unix://{tmp_path}/tuned.sock"
    with tb.Consumer(url) as consumer, tb.Producer(consumer.address) as producer:
        producer.send("t", np.arange(3))
        assert consumer.recv("t", timeout=10).tolist() == [0, 1, 2]
        with consumer.transport.reactor._peers_lock:
            ends = [producer.transport._sock, *(peer.conn for peer in consumer.transport.reactor._peers.values())]
        assert len(ends) == 2
        for sock in ends:
            if scheme == "tcp":
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            else:
                with open("/proc/sys/net/core/wmem_max") as wmem_max:
                    expected = 2 * min(UNIX_SEND_BUFFER, int(wmem_max.read()))
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == expected


def test_a_chunked_send_that_fails_part_way_forgets_its_own_chunks_not_another_threads_tensor(tmp_path: Any) -> None:
    """Another thread's tensor can go out between two chunks of a message: when that message fails part way, the
    frames kept for resending lose its chunks, not the other thread's (they were the last ones sent)."""
    url = f"unix://{tmp_path}/chunks.sock"
    first = tb.Consumer(url)
    producer = tb.Producer(url, max_frame_bytes=4096, reconnect_timeout_s=0.3)
    transport: Any = producer.transport
    send, chunks = transport.send, [0]
    b = np.arange(4.0)

    def send_then_meddle(part: Any, *, key: str | None) -> None:
        send(part, key=key)
        chunks[0] += key == "A"
        if key == "A" and chunks[0] == 1:  # between A's first and second chunk:
            other = threading.Thread(target=producer.send, args=("B", b))  # another thread's whole tensor
            other.start()
            other.join()
            first.close()  # the consumer goes with B untaken
            transport._sock.shutdown(socket.SHUT_RDWR)  # A's next chunk finds the connection broken

    transport.send = send_then_meddle
    try:
        with pytest.raises(tb.TransportError):
            producer.send("A", np.zeros(5000, np.float32))  # (5 chunks: no consumer to reconnect to for the second)
        with tb.Consumer(url) as successor:
            producer.flush(30)
            np.testing.assert_array_equal(successor.recv("B", timeout=30), b)
            with pytest.raises(tb.Timeout):
                successor.recv("A", timeout=0.1)
    finally:
        producer.close()
