"""A receiver waiting for a key whose frame names a stale incarnation fails at once, on every delivery path."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.transports import reader as reader_module
from tests.conftest import require_native
from tests.waiting import once, wait_for

#: what a fenced receive may take at most (it used to wait out its whole timeout, WAIT_S)
PROMPTLY_S = 10.0
WAIT_S = 60.0


@pytest.fixture(params=["memory", "tcp-c-reader", "tcp-python-reader", "unix-python-reader"])
def url(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> Iterator[str]:
    """A consumer URL, read by the C stream reader (and the C delivery) or by the Python one."""
    if request.param.endswith("c-reader"):
        require_native(reader_module.NATIVE_STREAM is not None, "the C stream reader (tensorbus/transports/_stream.c)")
    elif request.param.endswith("python-reader"):
        monkeypatch.setattr(reader_module, "NATIVE_STREAM", None)
    scheme = request.param.split("-")[0]
    yield {"memory": "memory://fencing", "tcp": "tcp://127.0.0.1:0", "unix": f"unix://{tmp_path}/fencing.sock"}[scheme]


def test_a_waiting_table_receive_fails_when_its_key_arrives_stale() -> None:
    table = tb.Rendezvous()
    table.send(tb.make_key("w", 2, "ps", "x"), np.ones(1))
    stale = tb.make_key("w", 1, "ps", "g")
    errors: list[BaseException | None] = []
    table.recv_async(stale, lambda message, error: errors.append(error))
    waiting = threading.Thread(target=lambda: errors.append(_failure(lambda: table.recv(stale, timeout=WAIT_S))))
    waiting.start()
    wait_for(lambda: len(table._waiters.get(stale, ())) == 2, 10, "two receivers waiting")
    for _ in range(2):
        with pytest.raises(tb.StaleIncarnation):
            table.send(stale, np.ones(1))  # the sender hears of it, and so does the receiver it was for
    waiting.join(PROMPTLY_S)
    assert not waiting.is_alive()
    assert [type(e) for e in errors] == [tb.StaleIncarnation, tb.StaleIncarnation]
    assert "incarnation 1 of 'w'" in str(errors[1])
    table.send(tb.make_key("w", 2, "ps", "g"), np.zeros(1))  # other receivers and keys are untouched
    assert table.next_message(timeout=1).key == tb.make_key("w", 2, "ps", "x")


def test_a_recv_fails_at_once_when_its_key_arrives_with_a_stale_incarnation(url: str) -> None:
    with tb.Consumer(url) as consumer, tb.Producer(consumer.address) as producer:
        producer.send(tb.make_key("worker", 7, "ps", "grad"), np.arange(3))  # the worker restarted: incarnation 7
        assert consumer.recv(tb.make_key("worker", 7, "ps", "grad"), timeout=WAIT_S).tolist() == [0, 1, 2]
        stale = tb.make_key("worker", 6, "ps", "grad")
        # the old incarnation's late frame, once the receive waits (before it, it is turned away unseen)
        once(lambda: stale in consumer.table._waiters, lambda: producer.send(stale, np.arange(3)), "the receive")
        started = time.monotonic()
        with pytest.raises(tb.StaleIncarnation, match=r"incarnation 6 of 'worker'.*incarnation 7"):
            consumer.recv(stale, timeout=WAIT_S)
        assert time.monotonic() - started < PROMPTLY_S
        try:
            producer.send("after", np.ones(2))  # the connection and the table go on
        except tb.Rejected as exc:  # (a producer told of the refusal already, as memory://'s is: raised once)
            assert exc.key == stale
            producer.send("after", np.ones(2))
        assert consumer.recv("after", timeout=WAIT_S).tolist() == [1.0, 1.0]
        assert consumer.table.stats["stale"] == 1


def _failure(call: Callable[[], object]) -> BaseException | None:
    """What `call` raised, or None."""
    try:
        call()
    except BaseException as exc:
        return exc
    return None
