"""How a waiting consumer reads its connections: the poller, and the busy-poll before it sleeps."""

from __future__ import annotations

import gc
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus import buffers
from tensorbus.transports import reader as reader_module
from tensorbus.transports.reactor import Poller
from tests.conftest import require_native
from tests.waiting import wait_for


@pytest.mark.parametrize("epoll", [True, False], ids=["epoll", "selectors"])
def test_the_poller_reports_what_was_registered_with_each_readable_descriptor(
    epoll: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not epoll:
        monkeypatch.delattr(select, "epoll", raising=False)  # as where there is none (not Linux)
    elif not hasattr(select, "epoll"):
        pytest.skip("no epoll on this platform")
    poller = Poller()
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        poller.register(a.fileno(), "a")
        poller.register(r, None)
        with pytest.raises((KeyError, OSError)):
            poller.register(a.fileno(), "again")
        assert poller.poll(0.0) == []
        b.sendall(b"x")
        os.write(w, b"!")
        assert sorted(poller.poll(1.0), key=str) == [None, "a"]
        with pytest.raises(KeyError):
            poller.unregister(a.fileno(), "another")  # a number now another's is left alone
        poller.unregister(a.fileno(), "a")
        assert poller.poll(0.0) == [None]
        with pytest.raises(KeyError):
            poller.unregister(a.fileno(), "a")
        started = time.monotonic()
        os.read(r, 1)
        assert poller.poll(0.05) == [] and time.monotonic() - started >= 0.04  # it waited, then saw nothing
    finally:
        poller.close()
        a.close()
        b.close()
        os.close(r)
        os.close(w)


def counting_polls(consumer: tb.Consumer) -> list[float]:
    """Record the timeout of every poll made from now on by this thread (not the background reader's)."""
    reactor = consumer.transport.reactor
    real = reactor._poller.poll
    calls: list[float] = []
    this_thread = threading.get_ident()

    def poll(timeout_s: float) -> list[Any]:
        if threading.get_ident() == this_thread:
            calls.append(timeout_s)
        return real(timeout_s)

    reactor._poller.poll = poll  # type: ignore[method-assign]
    return calls


def test_with_one_producer_a_waiting_recv_busy_polls_by_reading_the_connection() -> None:
    require_native(reader_module.NATIVE_STREAM is not None, "the C stream reader (tensorbus/transports/_stream.c)")
    # (a spin far longer than the 0.05 s the reply takes: however late the timer's thread runs, it is caught spinning)
    with tb.Consumer("tcp://127.0.0.1:0?spin_s=30.0") as consumer, tb.Producer(consumer.address) as producer:
        producer.send("warm-up", np.zeros(1))
        assert consumer.recv("warm-up", timeout=10)[0] == 0
        polls = counting_polls(consumer)
        later = threading.Timer(0.05, producer.send, ("reply", np.arange(5.0)))
        later.start()
        assert np.array_equal(consumer.recv("reply", timeout=10), np.arange(5.0))
        later.join()
        assert polls == []  # found while spinning, not by a poll after it: the read that found it was the whole wait


def test_a_second_producer_is_read_once_the_busy_poll_on_the_first_ends() -> None:
    with tb.Consumer("tcp://127.0.0.1:0?spin_s=0.3") as consumer, tb.Producer(consumer.address) as first:
        first.send("warm-up", np.zeros(1))
        consumer.recv("warm-up", timeout=10)

        def second_sends() -> None:
            time.sleep(0.05)
            with tb.Producer(consumer.address) as second:
                second.send("from-second", np.ones(3))

        sender = threading.Thread(target=second_sends)
        sender.start()
        started = time.monotonic()
        assert np.array_equal(consumer.recv("from-second", timeout=10), np.ones(3))
        assert time.monotonic() - started < 5.0
        sender.join()
        first.send("still-first", np.full(2, 7.0))
        assert consumer.recv("still-first", timeout=10)[0] == 7.0


def test_a_producer_leaving_during_the_busy_poll_ends_it_and_others_are_served() -> None:
    with tb.Consumer("tcp://127.0.0.1:0?spin_s=30") as consumer:
        leaving = tb.Producer(consumer.address)
        leaving.send("warm-up", np.zeros(1))
        consumer.recv("warm-up", timeout=10)
        threading.Timer(0.05, leaving.close).start()
        started = time.monotonic()
        with pytest.raises(tb.Timeout):
            consumer.recv("never", timeout=0.5)
        assert time.monotonic() - started < 10  # not held in a 30 s spin on a closed connection
        deadline = time.monotonic() + 10  # (the Timer thread's close may come late on a loaded machine)
        while consumer.transport.reactor.connections and time.monotonic() < deadline:
            with pytest.raises(tb.Timeout):
                consumer.recv("never", timeout=0.1)  # this thread leads, and sees the end of the stream
        assert consumer.transport.reactor.connections == 0
        with tb.Producer(consumer.address) as staying:
            staying.send("after", np.ones(1))
            assert consumer.recv("after", timeout=10)[0] == 1.0


CTRL_C_DURING_THE_SPIN = r"""
import gc, signal, threading
import numpy as np
import tensorbus as tb
# as Python sets up a program's Ctrl-C, whatever this process was started with (a SIGINT ignored or blocked
# is inherited across exec)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
with tb.Consumer("tcp://127.0.0.1:0?spin_s=0.05") as consumer, tb.Producer(consumer.address) as producer:
    producer.send("warm-up", np.zeros(1))
    consumer.recv("warm-up", timeout=10)
    reader = consumer.transport.reactor
    (peer,) = reader._peers.values()
    main = threading.main_thread().ident
    gc.collect()  # and no collection meanwhile: an interrupt that lands in a finalizer is swallowed by CPython
    gc.disable()
    for trial in range(5):
        try:
            # to the main thread itself, as a terminal's Ctrl-C reaches a single-threaded program: sent to the
            # process, the kernel may hand it to any thread, and the waiting one notices only at its next wake-up.
            # The recv's 60 s is a backstop: the interrupt ends it (at once on an idle machine)
            threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGINT)).start()
            consumer.recv("never", timeout=60)
            raise SystemExit("the recv ended without the interrupt")
        except KeyboardInterrupt:
            pass
        assert list(reader._peers.values()) == [peer]  # not dropped: the producer needs no reconnect
        producer.send(f"after-{trial}", np.full(1, float(trial)))
        assert consumer.recv(f"after-{trial}", timeout=10)[0] == float(trial)
print("kept", flush=True)
"""


def test_a_ctrl_c_during_the_busy_poll_keeps_the_idle_connection() -> None:
    """The spin spends its time reading the one connection; an interrupt there finds no frame half taken.

    In a process of its own, as a program a terminal's Ctrl-C reaches: what earlier tests left in the test
    process (signal dispositions, masks, finalizers) cannot decide where the interrupt lands."""
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_DURING_THE_SPIN], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout == "kept\n", done.stderr[-3000:]


HELD_THEN_GONE = r"""
import socket, sys
import numpy as np
import tensorbus as tb
from tensorbus.transports.stream import handshake_as_producer
path = sys.argv[1]
def frame(key, value, producer, seq):
    return bytes(tb.dumps(np.full(1000, value), key=key, message_id=(producer * 16, seq)))
def connect():
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)
    handshake_as_producer(sock, None, path)
    return sock
a = connect()
a.shutdown(socket.SHUT_RD)  # A reads nothing more: the consumer's ack after its 2nd frame fails
a.sendall(frame("a1", 1.0, "a", 1) + frame("a2", 2.0, "a", 2))  # a1 fills the table, a2 is held
print("A sent", flush=True); sys.stdin.readline()
a.close()
# (Linux gives a blocked accept its descriptor when it starts: X takes that one, B then gets A's old number)
x = connect()
b = connect()
b.sendall(frame("b0", 0.0, "b", 1))
print("B connected", flush=True); sys.stdin.readline()
b.sendall(frame("b1", 7.0, "b", 2))
print("B sent b1", flush=True); sys.stdin.readline()
"""


@pytest.fixture
def no_collection() -> Iterator[None]:
    """Earlier tests' garbage collected now, and no collection until the test ends: a socket in a cycle
    closed meanwhile frees a lower descriptor number than the one the test waits to see reused."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_producer_dropped_while_held_leaves_alone_the_one_that_got_its_descriptor_number(
    tmp_path: Any, no_collection: None
) -> None:
    path = str(tmp_path / "c.sock")
    with tb.Consumer(f"unix://{path}?ack_every_frames=2", max_buffered_bytes=4000) as consumer:
        reactor = consumer.transport.reactor
        with subprocess.Popen(
            [sys.executable, "-c", HELD_THEN_GONE, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        ) as child:
            assert child.stdin is not None and child.stdout is not None
            assert child.stdout.readline() == "A sent\n"
            # a2 is held first, then the ack after it fails and drops A: wait for both
            wait_for(lambda: reactor._held and reactor._held[0] not in reactor._peers.values(), 10, "A held, dropped")
            (held,) = reactor._held
            assert held not in reactor._peers.values()  # its ack failed: dropped while it holds a2
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline() == "B connected\n"
            assert consumer.recv("b0", timeout=5)[0] == 0
            assert held.fd in reactor._peers  # the number is another producer's now (what this test is about)
            assert consumer.recv("a1", timeout=5)[0] == 1  # room opens: a2 leaves the hold
            assert consumer.recv("a2", timeout=5)[0] == 2
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline() == "B sent b1\n"
            assert consumer.recv("b1", timeout=5)[0] == 7.0  # B is still read
            child.stdin.write("\n")


@pytest.mark.parametrize("scheme", ["tcp", "unix"])
def test_a_backlog_of_64_kb_tensors_is_received_into_the_buffers_the_last_one_left(scheme: str, tmp_path: Any) -> None:
    """A run of the reader delivers up to `ack_every_bytes` before the application takes any: the pool keeps
    that many buffers below 1 MiB, so a second backlog of 40 tensors of 64 KB needs no fresh memory."""
    url = "tcp://127.0.0.1:0" if scheme == "tcp" else f"unix://{tmp_path}/backlog.sock"
    backlog, tensor = 40, np.arange(16 << 10, dtype=np.float32)  # 40 x 64 KB: 2.5 MiB, past RECYCLED_BYTES
    with tb.Consumer(url) as consumer, tb.Producer(consumer.address) as producer:
        pool = consumer.transport._pool  # type: ignore[attr-defined]
        reused = []
        for batch in range(2):
            before = pool.reused
            for i in range(backlog):
                producer.send(f"{batch}/{i}", tensor)
            producer.flush(timeout=30)  # every one of them is in the consumer's table, none taken
            reused.append(pool.reused - before)
            for i in range(backlog):
                assert np.array_equal(consumer.recv(f"{batch}/{i}", timeout=10), tensor)
        assert reused == [0, backlog]  # the second backlog's frames all went into buffers the first one left


@pytest.mark.parametrize(
    ("ack_every_bytes", "kept"),
    [(1 << 40, buffers.RECYCLED_AT_MOST), (4 << 20, 4 << 20), (1024, buffers.RECYCLED_BYTES)],
    ids=["a huge run: at most 8 MiB", "a run's worth", "a short run: the pool's own 1 MiB"],
)
def test_the_pool_keeps_a_run_of_the_reader_within_bounds(ack_every_bytes: int, kept: int) -> None:
    with tb.Consumer("tcp://127.0.0.1:0", ack_every_bytes=ack_every_bytes) as consumer:
        assert consumer.transport._pool.recycled_bytes == kept  # type: ignore[attr-defined]
