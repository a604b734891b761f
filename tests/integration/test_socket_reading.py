"""How a waiting consumer reads its connections: the poller, and the busy-poll before it sleeps."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.transports.reactor import Poller


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
        poller.unregister(a.fileno())
        assert poller.poll(0.0) == [None]
        with pytest.raises(KeyError):
            poller.unregister(a.fileno())
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
    """Record the timeout of every poll the consumer's reader makes from now on."""
    reactor = consumer.transport.reactor
    real = reactor._poller.poll
    calls: list[float] = []

    def poll(timeout_s: float) -> list[Any]:
        calls.append(timeout_s)
        return real(timeout_s)

    reactor._poller.poll = poll  # type: ignore[method-assign]
    return calls


def test_with_one_producer_a_waiting_recv_busy_polls_by_reading_the_connection() -> None:
    with tb.Consumer("tcp://127.0.0.1:0?spin_s=2.0") as consumer, tb.Producer(consumer.address) as producer:
        producer.send("warm-up", np.zeros(1))
        assert consumer.recv("warm-up", timeout=10)[0] == 0
        polls = counting_polls(consumer)
        later = threading.Timer(0.05, producer.send, ("reply", np.arange(5.0)))
        later.start()
        started = time.monotonic()
        assert np.array_equal(consumer.recv("reply", timeout=10), np.arange(5.0))
        assert time.monotonic() - started < 1.0  # found while spinning, not after it
        later.join()
        assert polls == []  # the read that found the frame was the whole wait


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
    with tb.Consumer("tcp://127.0.0.1:0?spin_s=5.0") as consumer:
        leaving = tb.Producer(consumer.address)
        leaving.send("warm-up", np.zeros(1))
        consumer.recv("warm-up", timeout=10)
        threading.Timer(0.05, leaving.close).start()
        started = time.monotonic()
        with pytest.raises(tb.Timeout):
            consumer.recv("never", timeout=0.5)
        assert time.monotonic() - started < 2.0  # not held in a 5 s spin on a closed connection
        assert consumer.transport.reactor._peers == {}
        with tb.Producer(consumer.address) as staying:
            staying.send("after", np.ones(1))
            assert consumer.recv("after", timeout=10)[0] == 1.0
