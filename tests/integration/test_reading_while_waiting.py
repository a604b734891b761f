"""memory:// and shm:// deliver on the thread of a waiting `recv` (leading.py), and on their own thread
while no `recv` waits. (memory:// delivers a plain tensor on the producer's thread while nothing is queued,
tests/unit/test_memory_delivery.py; so there these send bundles, which it queues.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tests.conftest import endpoint_url, require_native
from tests.waiting import once_leading, wait_for

TRANSPORTS = ["memory", "shm"]


def delivering_threads(consumer: tb.Consumer) -> list[str]:
    """The name of the thread that delivers each frame from now on."""
    transport: Any = consumer.transport
    owner = transport._reader if transport.url.scheme == "memory" else transport._listener
    attribute = "_deliver" if transport.url.scheme == "memory" else "deliver"
    real = getattr(owner, attribute)
    names: list[str] = []

    class Recording:
        def __init__(self) -> None:
            self.ledger, self.release = real.ledger, real.release
            self.fast = None if real.fast is None else self.taking(real.fast)

        def taking(self, fast: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                taken = fast(*args, **kwargs)
                if taken is not None:  # (each frame once: the C delivery took it, or left it to the Python one)
                    names.append(threading.current_thread().name)
                return taken

            return call

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            names.append(threading.current_thread().name)
            return real(*args, **kwargs)

    setattr(owner, attribute, Recording())
    return names


def tensor(consumer: tb.Consumer, value: np.ndarray) -> Any:
    """What the tests send: `value`, or on memory:// a bundle of it (never delivered on the producer's thread)."""
    return {"x": value} if consumer.transport.url.scheme == "memory" else value


def first(received: Any) -> float:
    """The first element of what `tensor` sent."""
    return float((received["x"] if isinstance(received, dict) else received)[0])


@pytest.fixture(params=TRANSPORTS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[tb.Consumer, tb.Producer]]:
    url = endpoint_url(request.param)
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        producer.send("warm-up", np.zeros(1))
        assert consumer.recv("warm-up", timeout=10)[0] == 0
        yield consumer, producer


def test_a_waiting_recv_delivers_its_tensor_on_its_own_thread(pair: tuple[tb.Consumer, tb.Producer]) -> None:
    consumer, producer = pair
    names = delivering_threads(consumer)
    for i in range(5):
        reply = tensor(consumer, np.full(3, float(i)))
        later = once_leading(consumer, lambda reply=reply: producer.send("reply", reply))
        assert first(consumer.recv("reply", timeout=10)) == i
        later.join()
    assert names == [threading.current_thread().name] * 5


def test_while_no_recv_waits_the_background_thread_delivers(pair: tuple[tb.Consumer, tb.Producer]) -> None:
    consumer, producer = pair
    names = delivering_threads(consumer)
    producer.send("unasked", tensor(consumer, np.ones(2)))
    wait_for(lambda: len(consumer.table) == 1, 10, "the tensor delivered with no recv waiting")
    assert names and names[0].startswith(f"tensorbus-{consumer.transport.url.scheme}-")
    assert first(consumer.recv("unasked", timeout=10)) == 1.0


def test_two_threads_waiting_each_get_their_tensor(pair: tuple[tb.Consumer, tb.Producer]) -> None:
    consumer, producer = pair
    got: dict[str, float] = {}

    def receive(key: str) -> None:
        got[key] = float(consumer.recv(key, timeout=20)[0])

    threads = [threading.Thread(target=receive, args=(key,)) for key in ("a", "b")]
    for thread in threads:
        thread.start()
    for value, key in enumerate(("b", "a")):
        producer.send(key, np.full(1, float(value)))
    for thread in threads:
        thread.join(30)
    assert got == {"b": 0.0, "a": 1.0}


def test_an_abort_ends_a_leading_recv(pair: tuple[tb.Consumer, tb.Producer]) -> None:
    consumer, _ = pair
    aborting = once_leading(consumer, lambda: consumer.abort("stop"))
    started = time.monotonic()
    with pytest.raises(tb.Aborted):
        consumer.recv("never", timeout=30)
    assert time.monotonic() - started < 10
    aborting.join(10)


def test_a_callback_may_close_the_consumer_on_the_leading_thread(pair: tuple[tb.Consumer, tb.Producer]) -> None:
    consumer, producer = pair
    closed = threading.Event()

    def close_in_callback(message: Any, error: BaseException | None) -> None:
        consumer.close()
        closed.set()

    consumer.recv_async("cb", close_in_callback)
    later = once_leading(consumer, lambda: producer.send("cb", np.ones(1)))
    with pytest.raises(tb.Aborted):  # this recv leads, runs the callback, and sees its consumer closed
        consumer.recv("never", timeout=30)
    later.join()
    assert closed.wait(10)


def test_plain_tensors_take_the_c_delivery_and_a_damaged_frame_is_refused(
    pair: tuple[tb.Consumer, tb.Producer],
) -> None:
    consumer, producer = pair
    require_native(consumer.intake.fast_delivery is not None, "the C delivery (tensorbus/_intake.c)")
    before = consumer.intake.fast_delivery.taken
    for i in range(3):
        producer.send("plain", np.full(4, float(i)))
    assert [consumer.recv("plain", timeout=10)[0] for _ in range(3)] == [0.0, 1.0, 2.0]
    assert consumer.intake.fast_delivery.taken == before + 3
    producer.transport.send([b"TBUF" + bytes(60)], key=None)  # not a frame: the intake refuses it
    producer.send("after", np.ones(2))
    assert consumer.recv("after", timeout=10)[0] == 1.0
    assert consumer.stats["rejected"] == 1
