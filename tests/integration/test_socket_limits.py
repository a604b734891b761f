"""Socket consumers under connection attacks: silent handshakes, too many connections, idle ones.

Every attack is bounded (a count of sockets, a deadline) and runs on loopback only.
"""

from __future__ import annotations

import logging
import resource
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.transports.socket import PROBE_AFTER_S
from tests.integration.test_socket import TCP_CLOSE_WAIT, raw_peer, tcp_state
from tests.integration.test_socket_hostile import _chunk_frames
from tests.waiting import wait_for

SILENT = 2000


@pytest.fixture
def descriptors() -> Iterator[None]:
    """Room for both ends of a few thousand loopback connections in this one process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * SILENT + 512
    if soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.fail(f"the test needs {wanted} descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _silent_connections(address: str, count: int) -> list[socket.socket]:
    """`count` connections that never answer the consumer's hello (each connected before the next: a
    full accept queue drops connection attempts, which the kernel retries only a second or more later)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return [socket.create_connection((host, int(port)), timeout=10) for _ in range(count)]


def test_two_thousand_silent_connections_do_not_keep_an_honest_producer_waiting(descriptors: None) -> None:
    # 128 handshake slots on threads, 5 s each: 2000 silent peers made an honest producer holding
    # the secret fail with "cannot connect ...: timed out"
    # (a silent connection holds its slot for connect_timeout_s: the honest producer must not wait for that,
    # and the bound on its wait leaves a loaded machine a wide margin below it)
    with tb.Consumer("tcp://127.0.0.1:0", auth_secret="s3cret", connect_timeout_s=120) as consumer:
        silent = _silent_connections(consumer.address, SILENT)
        try:
            greeter = consumer.transport._listener._greeter  # type: ignore[attr-defined]
            wait_for(lambda: len(greeter.pending) >= SILENT, 60, f"{SILENT} handshakes in progress")
            started = time.monotonic()
            with tb.Producer(consumer.address, auth_secret="s3cret", reconnect_timeout_s=30) as producer:
                producer.send("k", np.arange(4))
                assert consumer.recv("k", timeout=30).tolist() == [0, 1, 2, 3]
                took = time.monotonic() - started
            assert took < 15, f"connect and delivery took {took:.2f}s under {SILENT} silent connections"
            assert len(greeter.pending) >= SILENT - 10  # (they were all still there: nothing timed out meanwhile)
        finally:
            for sock in silent:
                sock.close()


def test_silent_connections_are_closed_after_connect_timeout_s(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorbus")
    with tb.Consumer("tcp://127.0.0.1:0", connect_timeout_s=0.5) as consumer:
        silent = _silent_connections(consumer.address, 50)
        greeter = consumer.transport._listener._greeter  # type: ignore[attr-defined]
        # (each one's end logged: a loaded machine may take longer than connect_timeout_s to connect all 50,
        # so they are not all in progress at once)
        ended = "timed out (connect_timeout_s)"
        wait_for(lambda: caplog.text.count(ended) == 50, 30, "the 50 handshakes to time out")
        assert not greeter.pending
        for sock in silent:
            sock.setblocking(True)
            sock.settimeout(10)
            assert len(sock.recv(1 << 10)) > 0 and sock.recv(1) == b""  # its hello, then the end
            sock.close()


def test_one_connection_over_max_connections_is_refused_with_the_reason_and_the_others_go_on() -> None:
    with tb.Consumer("tcp://127.0.0.1:0", max_connections=3) as consumer:
        producers = [tb.Producer(consumer.address) for _ in range(3)]
        for i, producer in enumerate(producers):
            producer.send(f"k{i}", np.full(3, i))
            producer.flush(5)
        started = time.monotonic()
        with pytest.raises(tb.TransportError, match="max_connections=3"):
            with tb.Producer(consumer.address, connect_timeout_s=30, reconnect_timeout_s=0.3) as extra:
                extra.send("extra", np.ones(3))
        assert time.monotonic() - started < 10  # told at once, not left to its 30 s connect timeout
        for i, producer in enumerate(producers):  # the three connected before are untouched
            producer.send(f"again{i}", np.full(3, 10 + i))
            producer.flush(5)
            assert consumer.recv(f"k{i}", timeout=5).tolist() == [i] * 3
            assert consumer.recv(f"again{i}", timeout=5).tolist() == [10 + i] * 3
        assert consumer.transport.reactor.connections == 3  # type: ignore[attr-defined]
        producers[0].close()
        wait_for(lambda: consumer.transport.reactor.connections == 2, 5, "the first producer gone")  # type: ignore[attr-defined]
        with tb.Producer(consumer.address) as late:  # its place is free again
            late.send("late", np.zeros(2))
            assert consumer.recv("late", timeout=5).tolist() == [0, 0]
        for producer in producers[1:]:
            producer.close()


def test_an_idle_connection_is_closed_after_idle_timeout_s() -> None:
    with tb.Consumer("tcp://127.0.0.1:0", idle_timeout_s=0.5) as consumer:
        started = time.monotonic()  # (before the connection: its idle time cannot have begun earlier)
        idle = raw_peer(consumer.address)
        idle.settimeout(30)
        assert idle.recv(1) == b""  # closed by the consumer
        assert 0.4 < time.monotonic() - started < 10  # after its idle_timeout_s, not some later clean-up
        idle.close()


def test_connections_stalled_mid_frame_are_closed_and_free_their_places() -> None:
    """A peer that sends part of a frame and then nothing is closed after idle_timeout_s (its producer, were it
    one, would send the frame again): a few such peers cannot keep an honest producer out of max_connections.
    (The C reader here; the Python one in CI's TENSORBUS_NATIVE=0 pass.)"""
    with tb.Consumer("tcp://127.0.0.1:0", max_connections=2, idle_timeout_s=0.5) as consumer:
        stalled = [raw_peer(consumer.address) for _ in range(2)]
        for peer in stalled:
            peer.sendall(b"TB")  # (two bytes of a frame's prefix, then nothing)
            peer.settimeout(30)
        for peer in stalled:
            assert peer.recv(1) == b""  # closed by the consumer
            peer.close()
        with tb.Producer(consumer.address) as honest:
            honest.send("k", np.ones(4))
            assert consumer.recv("k", timeout=30).tolist() == [1.0] * 4


def test_a_connection_with_a_message_in_flight_is_not_idle() -> None:
    with tb.Consumer("tcp://127.0.0.1:0", idle_timeout_s=0.3) as consumer:
        waiting = raw_peer(consumer.address)
        waiting.sendall(_chunk_frames("slow", 1))  # chunk 0 of 2: its message is incomplete
        wait_for(lambda: consumer.intake.reassembler.pending == 1, 5, "the first chunk")
        time.sleep(1.5)
        reactor = consumer.transport.reactor  # type: ignore[attr-defined]
        assert reactor.connections == 1 and reactor.idle.dropped == 0
        waiting.close()


def _tcp_state(producer: tb.Producer) -> int:
    """The TCP state of a socket producer's connection (-1: none)."""
    sock = producer.transport._sock  # type: ignore[attr-defined]
    return -1 if sock is None else tcp_state(sock)


def test_a_quiet_producer_loses_nothing_when_its_idle_connection_is_closed() -> None:
    # idle_timeout_s of at least PROBE_AFTER_S: the producer then always looks at its socket before it
    # sends again, reads the last acks and the close, and resends nothing (with 0.3 s, a send on a busy
    # machine could come sooner, into the closed connection, and frames already acked went again)
    assert PROBE_AFTER_S <= 1.5
    with tb.Consumer("tcp://127.0.0.1:0", idle_timeout_s=1.5) as consumer:
        reactor = consumer.transport.reactor  # type: ignore[attr-defined]
        with tb.Producer(consumer.address) as producer:
            for round_ in range(3):
                for i in range(5):  # delivered, taken, and not yet acknowledged when the producer falls quiet
                    producer.send(f"r{round_}-{i}", np.full(2, i))
                for i in range(5):  # (a connection with tensors nobody took is not idle: see the next test)
                    assert consumer.recv(f"r{round_}-{i}", timeout=5).tolist() == [i, i]
                wait_for(lambda r=round_: reactor.idle.dropped > r, 10, "the idle connection closed")
                # (and its end come to the producer's socket: a send's look before it then finds it; a send
                # a moment sooner would go into the closed connection, and out again only on the next call)
                wait_for(lambda: _tcp_state(producer) == TCP_CLOSE_WAIT, 5, "the close come to the producer")
            producer.send("last", np.ones(2))
            producer.flush(5)
        assert consumer.recv("last", timeout=5).tolist() == [1, 1]
        assert consumer.stats["duplicates"] == 0 and consumer.stats["rejected"] == 0


def test_a_connection_whose_tensors_nobody_took_is_not_closed_as_idle() -> None:
    # closed, its producer would send them all again (it keeps copies until they are taken)
    with tb.Consumer("tcp://127.0.0.1:0", idle_timeout_s=0.3) as consumer:
        reactor = consumer.transport.reactor  # type: ignore[attr-defined]
        with tb.Producer(consumer.address) as producer:
            producer.send("untaken", np.ones(2))
            producer.flush(5)
            for _ in range(5):  # five sweeps, 0.075 s apart: over idle_timeout_s in all
                due = reactor.idle.next_at
                wait_for(lambda d=due: reactor.idle.next_at > d, 5, "the next sweep")
            assert reactor.idle.dropped == 0 and reactor.connections == 1
            assert consumer.recv("untaken", timeout=5).tolist() == [1, 1]
            wait_for(lambda: reactor.idle.dropped == 1, 10, "the connection closed once idle")
            producer.send("next", np.zeros(2))
            producer.flush(5)
        assert consumer.recv("next", timeout=5).tolist() == [0, 0]
        assert consumer.stats["duplicates"] == 0  # the taken one was not sent again


def test_max_connections_stays_under_half_the_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # 249 idle connections exhausted a consumer limited to 256 descriptors: accepting then failed for all
    from tensorbus.transports import listener

    monkeypatch.setattr(listener.resource, "getrlimit", lambda _: (256, 4096))
    assert listener.connection_cap(1024) == 128
    assert listener.connection_cap(100) == 100


def test_a_tensor_nobody_takes_stops_holding_the_table_after_unclaimed_timeout_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # one small zstd frame filled the table with a tensor nobody asked for, and nothing ever cleared
    # it: honest tensors (with no receiver waiting yet) waited for ever
    caplog.set_level(logging.WARNING, logger="tensorbus")
    with tb.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=4 << 20, unclaimed_timeout_s=0.5) as consumer:
        peer = raw_peer(consumer.address)
        bomb = tb.dumps(np.zeros(8 << 20, np.uint8), key="nobody", compression="zstd", message_id=("bomb", 1))
        assert len(bomb) < 64 << 10
        peer.sendall(bomb)
        wait_for(lambda: consumer.stats["received"] == 1, 10, "the unclaimed tensor in the table")
        with tb.Producer(consumer.address) as producer:  # (over its own share too: it cannot evict the other)
            producer.send("honest", np.ones(3 << 17))
            wait_for(lambda: consumer.stats["unclaimed"] == 1, 10, "the unclaimed tensor dropped")
            wait_for(lambda: consumer.stats["received"] == 2, 10, "the honest tensor in the table")
        assert consumer.recv("honest", timeout=5).sum() == 3 << 17 and consumer.stats["evicted"] == 0
        assert "dropped 1 tensors nobody received within unclaimed_timeout_s=0.5 (keys nobody)" in caplog.text
        peer.close()
    with tb.Consumer("tcp://127.0.0.1:0", reassembly_timeout_s=0.2) as consumer:  # off by default
        with tb.Producer(consumer.address) as producer:
            producer.send("kept", np.ones(2))
            producer.flush(5)
        time.sleep(1.0)
        assert consumer.recv("kept", timeout=5).tolist() == [1, 1] and consumer.stats["unclaimed"] == 0


def test_past_the_handshake_cap_the_oldest_silent_connection_makes_way() -> None:
    with tb.Consumer("tcp://127.0.0.1:0", connect_timeout_s=30) as consumer:
        greeter = consumer.transport._listener._greeter  # type: ignore[attr-defined]
        greeter.max_handshakes = 50  # (a quarter of a 200-descriptor limit)
        silent = _silent_connections(consumer.address, 200)
        wait_for(lambda: len(greeter.pending) == 50, 30, "the cap reached")
        started = time.monotonic()
        with tb.Producer(consumer.address, reconnect_timeout_s=30) as producer:
            producer.send("k", np.arange(3))
            assert consumer.recv("k", timeout=30).tolist() == [0, 1, 2]
        assert time.monotonic() - started < 10  # not after a silent one's 30 s connect timeout
        assert len(greeter.pending) <= 50
        for sock in silent:
            sock.close()
