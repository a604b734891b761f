"""shm://'s notification ring: frames noticed through shared memory, a sleeping consumer woken, a full ring
waited on, the datagram protocol kept with a peer on the Python paths, and a hostile ring refused."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.transports import leading, shm_ring
from tensorbus.transports import shm_control as control
from tensorbus.transports.shm_producer import ShmSender
from tensorbus.transports.shm_segments import SEALS
from tests.conftest import endpoint_url, require_native
from tests.peers import same
from tests.shm_hostile import dropped_and_served_on, raw_producer
from tests.waiting import catching, wait_for

require_native(shm_ring.available(), "shm://'s notification ring (tensorbus/transports/_shm.c)")


def _peer(consumer: tb.Consumer) -> Any:
    """The consumer's one producer connection."""
    listener = consumer.transport._listener  # type: ignore[attr-defined]
    wait_for(lambda: len(listener._peers) == 1, 10, "one producer connected")
    return next(iter(listener._peers.values()))


def _counting_sends(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the control messages sent from this process, by kind."""
    counts: dict[str, int] = {}
    send = control.send

    def counted(sock: socket.socket, *message: Any, **options: Any) -> None:
        counts[message[0]] = counts.get(message[0], 0) + 1
        send(sock, *message, **options)

    monkeypatch.setattr(control, "send", counted)
    return counts


def test_frames_are_noticed_through_the_ring_not_one_datagram_each(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _counting_sends(monkeypatch)
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        for i in range(200):
            producer.send(f"k{i}", np.full(1024, i, np.float32))
        for i in range(200):
            assert same(consumer.recv(f"k{i}", timeout=10), np.full(1024, i, np.float32))
        assert _peer(consumer).ring is not None and producer.transport.sender_side._ring is not None  # type: ignore[attr-defined]
    assert counts.get("frame", 0) == 0 and counts["ring"] == 1, counts


class _Watched:
    """A consumer's ring that notes (in an event another process waits on) when its consumer said it sleeps, once
    `armed`; and whose first `take` after that waits for `hold` (a test's frames all sent)."""

    def __init__(self, ring: Any, events: dict[str, Any]) -> None:
        self._ring, self._events, self._held = ring, events, False

    def sleep(self) -> bool:
        asleep = bool(self._ring.sleep())
        if asleep and self._events["armed"].is_set():
            self._events["slept"].set()
        return asleep

    def take(self) -> Any:
        hold = self._events.get("hold")
        if hold is not None and self._events["slept"].is_set() and not self._held:
            self._held = True
            hold.wait(30)
        return self._ring.take()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ring, name)


def _watch_rings(monkeypatch: pytest.MonkeyPatch, events: dict[str, Any]) -> None:
    """Every ring a consumer of this process maps is `_Watched` (made on the consumer's own thread)."""
    mapped = shm_ring.consumer_ring
    monkeypatch.setattr(shm_ring, "consumer_ring", lambda fd, capacity: _Watched(mapped(fd, capacity), events))


def _asleep_consumer(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Consumers that sleep for a minute unless a datagram wakes them (no spin: `spin_s=0` at the call), with
    their rings watched: the events "armed" (set by the test), "slept", "received" (set by the test)."""
    for name in ("IDLE_S", "LINGER_S"):
        monkeypatch.setattr(control, name, 60.0)
    monkeypatch.setattr(leading, "POLL_S", 60.0)
    context = multiprocessing.get_context("fork")
    events = {"armed": threading.Event(), "slept": context.Event(), "received": context.Event()}
    _watch_rings(monkeypatch, events)
    return events


def _send_to_a_sleeper(url: str, events: dict[str, Any], sizes: list[int], wakes: Any) -> None:
    """A producer: "warm" at once; once the consumer sleeps, "k0", "k1"... of `sizes` floats (then `hold` is set);
    puts how many wake-ups those sent, and flushes only once the test received them (a flush asks for acks,
    which would wake the consumer too)."""
    counts: dict[str, int] = {}
    send = control.send

    def counted(sock: socket.socket, *message: Any, **options: Any) -> None:
        counts[message[0]] = counts.get(message[0], 0) + 1
        send(sock, *message, **options)

    control.send = counted
    with tb.Producer(url) as producer:
        producer.send("warm", np.zeros(1024, np.float32))  # (1024 floats: their segment announced now)
        events["slept"].wait(30)
        before = counts.get("wake", 0)
        for i, size in enumerate(sizes):
            producer.send(f"k{i}", np.full(size, i, np.float32))
        if "hold" in events:
            events["hold"].set()
        wakes.put(counts.get("wake", 0) - before)
        events["received"].wait(30)
        producer.flush(30)


def _a_sleeper_receives(monkeypatch: pytest.MonkeyPatch, sizes: list[int], hold: bool) -> int:
    """Sends `sizes` to a consumer asleep with nothing else to wake it for a minute; returns the wake-ups sent."""
    events = _asleep_consumer(monkeypatch)
    context = multiprocessing.get_context("fork")
    if hold:
        events["hold"] = context.Event()
    wakes = context.Queue()
    url = endpoint_url("shm")
    with tb.Consumer(url, spin_s=0) as consumer:
        sender = context.Process(target=_send_to_a_sleeper, args=(url, events, sizes, wakes))
        sender.start()
        try:
            assert same(consumer.recv("warm", timeout=30), np.zeros(1024, np.float32))
            events["armed"].set()
            for i, size in enumerate(sizes):
                assert same(consumer.recv(f"k{i}", timeout=10), np.full(size, i, np.float32))
            events["received"].set()
            woke = int(wakes.get(timeout=10))
        finally:
            sender.join(30)
        assert sender.exitcode == 0
    return woke


def test_a_consumer_asleep_on_its_socket_is_woken_by_the_next_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the producer's wake-up datagram, sent because the ring said the consumer sleeps, brings the frame
    within the receive's 10 s (nothing else would wake it for a minute)."""
    assert _a_sleeper_receives(monkeypatch, [1024], hold=False) == 1


def test_a_wake_up_read_before_a_segments_announcement_is_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket holds a wake-up (for k0) and then a new segment's announcement (for k1, of another size), and the
    consumer reads both notices before either datagram: the wake-up is read while it looks for the segment."""
    assert _a_sleeper_receives(monkeypatch, [1024, 4096], hold=True) == 1


def test_a_full_ring_makes_a_send_wait_and_nothing_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer whose table is full reads no notices; the producer's sends wait for room in its ring of 4, then
    go on as the application takes tensors: every one arrives, in order."""
    monkeypatch.setattr(shm_ring, "CAPACITY", 4)
    waits = []
    wait_for_room = ShmSender._wait_for_room

    def counted(self: ShmSender, done: Any, poll_s: float | None = None) -> None:
        waits.append(self._ring is not None and self._ring.free() == 0)
        wait_for_room(self, done, poll_s)

    monkeypatch.setattr(ShmSender, "_wait_for_room", counted)
    url = endpoint_url("shm")
    with tb.Consumer(url, max_buffered_bytes=4 * 4096) as consumer, tb.Producer(url) as producer:
        sending = threading.Thread(
            target=lambda: [producer.send("k", np.full(1024, i, np.float32)) for i in range(100)], daemon=True
        )
        sending.start()
        wait_for(lambda: any(waits), 30, "a send waiting for room in the ring")
        for i in range(100):
            assert same(consumer.recv("k", timeout=30), np.full(1024, i, np.float32))
        sending.join(30)
        assert not sending.is_alive()


def test_a_reconnect_resends_more_untaken_frames_than_the_ring_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_ring, "CAPACITY", 4)
    url = endpoint_url("shm")
    with tb.Producer(url, reconnect_timeout_s=30) as producer:
        with tb.Consumer(url) as first:
            for i in range(10):
                producer.send(f"k{i}", np.full(1024, i, np.float32))
            producer.flush(30)
            assert len(first.table) == 10
        with tb.Consumer(url) as second:
            producer.flush(30)  # (reconnects, and resends the ten the first left untaken)
            for i in range(10):
                assert same(second.recv(f"k{i}", timeout=30), np.full(1024, i, np.float32))


def test_resends_behind_a_full_ring_wait_their_turn_past_send_timeout_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reconnect's resends fill a ring of 4 that a slow application keeps full for longer than `send_timeout_s`:
    they wait their turn (told as the ring empties, by the flush), on the one connection, none lost or reordered."""
    monkeypatch.setattr(shm_ring, "CAPACITY", 4)
    handshakes = []
    handshake = ShmSender._handshake

    def counted(self: ShmSender) -> Any:
        handshakes.append(1)
        return handshake(self)

    monkeypatch.setattr(ShmSender, "_handshake", counted)
    url = endpoint_url("shm")
    with tb.Producer(url, send_timeout_s=0.5, reconnect_timeout_s=30) as producer:
        with tb.Consumer(url) as first:
            for i in range(10):
                producer.send(f"k{i}", np.full(1024, i, np.float32))
            producer.flush(30)
            assert len(first.table) == 10
        with tb.Consumer(url, max_buffered_bytes=3 * 4096) as second:
            sender = producer.transport.sender_side  # type: ignore[attr-defined]  # (not during the flush: its lock)
            errors: list[BaseException] = []
            flushing = threading.Thread(target=catching(errors, producer.flush, 30))
            flushing.start()
            wait_for(lambda: sender._untold, 10, "resends waiting for room in the ring")
            time.sleep(1.0)  # (the application takes nothing for twice send_timeout_s: the condition tested)
            for i in range(10):
                assert same(second.recv(f"k{i}", timeout=30), np.full(1024, i, np.float32))
            flushing.join(30)
            assert not flushing.is_alive() and errors == [] and len(handshakes) == 2


def test_a_flush_whose_consumer_goes_away_waits_for_the_next_one_which_gets_every_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flushing = threading.Event()
    wait = ShmSender._wait

    def noted(self: ShmSender, done: Any, timeout: float | None, what: str, poll_s: float | None = None) -> None:
        if what == "flush":
            flushing.set()
        wait(self, done, timeout, what, poll_s)

    monkeypatch.setattr(ShmSender, "_wait", noted)
    url = endpoint_url("shm")
    with tb.Producer(url, reconnect_timeout_s=30) as producer:
        first = tb.Consumer(url, max_buffered_bytes=3 * 4096)  # (holds: the rest stay unacknowledged)
        try:
            for i in range(10):
                producer.send(f"k{i}", np.full(1024, i, np.float32))
            errors: list[BaseException] = []
            thread = threading.Thread(target=catching(errors, producer.flush, 30))
            thread.start()
            wait_for(flushing.is_set, 10, "the flush waiting for acks")
        finally:
            first.close()
        with tb.Consumer(url) as second:
            for i in range(10):  # (none taken from the first: all sent again)
                assert same(second.recv(f"k{i}", timeout=30), np.full(1024, i, np.float32))
            thread.join(30)
            assert not thread.is_alive() and errors == []


_PYTHON_PATHS = {**os.environ, "TENSORBUS_NATIVE": "0"}


def _run_python_paths(code: str) -> subprocess.Popen[str]:
    """`code` in a process on the Python paths alone (TENSORBUS_NATIVE=0: no ring)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_PYTHON_PATHS,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )  # (used with `with`: its pipe closed and the process waited for)


def test_a_producer_on_the_python_paths_sends_datagrams_to_a_consumer_with_the_ring() -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer:
        with _run_python_paths(f"""
            import sys, numpy as np, tensorbus as tb
            with tb.Producer({url!r}) as producer:
                for i in range(50):
                    producer.send("k", np.full(1024, i, np.float32))
                producer.flush(30)
                sys.stdin.readline()  # (connected until the test looked at its connection)
            """) as child:
            for i in range(50):
                assert same(consumer.recv("k", timeout=30), np.full(1024, i, np.float32))
            assert _peer(consumer).ring is None
            assert child.stdin is not None
            child.stdin.write("done\n")
            child.stdin.flush()
            assert child.wait(30) == 0


def test_a_consumer_on_the_python_paths_is_sent_datagrams_by_a_producer_with_the_ring() -> None:
    url = endpoint_url("shm")
    with _run_python_paths(f"""
        import numpy as np, tensorbus as tb
        with tb.Consumer({url!r}) as consumer:
            print("listening", flush=True)
            for i in range(50):
                assert (consumer.recv("k", timeout=30) == np.full(1024, i, np.float32)).all()
        print("ok", flush=True)
        """) as child:
        assert child.stdout is not None and child.stdout.readline().strip() == "listening"
        with tb.Producer(url) as producer:
            for i in range(50):
                producer.send("k", np.full(1024, i, np.float32))
            producer.flush(30)
            assert producer.transport.sender_side._ring is None  # type: ignore[attr-defined]
        assert child.stdout.readline().strip() == "ok" and child.wait(30) == 0


def _attack(sock: socket.socket, attack: str) -> None:
    """Send the consumer a ring, or ring notices, that no honest producer would."""
    if attack == "unsealed ring":
        fd = os.memfd_create("hostile-ring")
        os.ftruncate(fd, shm_ring.size(4))
        control.send(sock, "ring", 4, fds=[fd])
        os.close(fd)
    elif attack == "too large":  # (more notices than a consumer takes from a producer)
        fd = os.memfd_create("hostile-ring", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, shm_ring.size(2 * shm_ring.CAPACITY))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        control.send(sock, "ring", 2 * shm_ring.CAPACITY, fds=[fd])
        os.close(fd)
    else:
        ring = shm_ring.ProducerRing(4)
        control.send(sock, "ring", 4, fds=[ring.fd])
        if attack == "two rings":
            control.send(sock, "ring", 4, fds=[ring.fd])
        elif attack == "unknown segment":
            assert ring.put(1, 99, 0, 64) >= 0
            _wake(sock)
        else:  # a tail far past the head
            ring._map[64:72] = (1000).to_bytes(8, "little")
            _wake(sock)


def _wake(sock: socket.socket) -> None:
    """Tell the consumer to look at the ring, which it may have done already: it reads the ring's notices at each
    of its steps, and one that finds them bad drops the producer before the wake comes (this send then meets a
    closed socket: BrokenPipeError)."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        control.send(sock, "wake")


@pytest.mark.parametrize(
    ("attack", "reason"),
    [
        ("unsealed ring", "not sealed"),
        ("too large", "a notification ring of"),
        ("tail out of range", "tail is out of range"),
        ("unknown segment", "unknown segment 99"),
        ("two rings", "unexpected control message 'ring'"),
    ],
)
def test_a_hostile_ring_drops_its_producer_and_the_consumer_serves_on(
    attack: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tensorbus")  # (the CLI's in-process tests leave the root at CRITICAL)
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer:
        sock, offers = raw_producer(consumer.transport.path)  # type: ignore[attr-defined]
        assert offers[1] is True  # (the ring offered)
        with contextlib.closing(sock):
            _attack(sock, attack)
            dropped_and_served_on(sock, consumer, url)
    assert reason in caplog.text, caplog.text
