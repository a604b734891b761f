"""memory:// delivers a plain tensor on the producer's thread while nothing is queued, and queues the rest.

`Frames.put` hands a frame to the listening consumer's C delivery (`deliver_now`) only while no frame of
any producer is queued, being delivered or held back, so none is overtaken; every other frame is
queued and delivered on a reading thread as before (recv_async callbacks never run on a producer's).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.intake_state import FAST
from tensorbus.transports import memory_pacing
from tensorbus.transports.memory import HUB
from tensorbus.transports.memory_frames import Frames
from tensorbus.transports.memory_pacing import BURST

from ..conftest import require_native
from ..waiting import wait_for


def _plain_consumer(name: str, **options: Any) -> tb.Consumer:
    """A consumer on memory://NAME whose intake has the C delivery (else the test is skipped, or fails in CI)."""
    require_native(FAST is not None, "the intake's C delivery (tensorbus/_intake.c)")
    consumer = tb.Consumer(f"memory://{name}", **options)
    assert consumer.intake.fast is not None
    return consumer


def test_a_plain_tensor_is_in_the_consumers_table_when_send_returns_and_is_acknowledged_on_take() -> None:
    with _plain_consumer("direct") as consumer, tb.Producer("memory://direct") as producer:
        taken_before = consumer.intake.fast_delivery.taken
        producer.send("k", np.arange(10, dtype=np.float32), metadata={"i": 1})
        # on the producer's thread, before send returned: nothing queued, nothing for a reading thread to do
        assert len(consumer.table) == 1 and len(HUB.endpoint("direct")) == 0
        assert consumer.intake.fast_delivery.taken == taken_before + 1
        reader = consumer.transport._reader  # type: ignore[attr-defined]
        assert reader is not None and len(reader._stream.unreleased()) == 1  # kept until taken
        message = consumer.recv_message("k", timeout=30)
        assert message.metadata == {"i": 1} and (message.tensor == np.arange(10, dtype=np.float32)).all()
        assert reader._stream.unreleased() == []  # released by the take (ack="take")
        producer.flush(timeout=30)  # nothing of it waits anywhere


def test_a_frame_is_delivered_on_the_producers_thread_only_while_nothing_is_queued_or_being_delivered() -> None:
    frames = Frames()
    delivered: list[tuple[object, int, int | None]] = []

    def deliver_now(frame: Any, source: object, position: int, crc: int | None) -> bool:
        delivered.append((source, position, crc))
        return True

    frames.put(b"queued-1", source="a")  # before a consumer listens: queued
    frames.deliver_with(deliver_now)
    frames.put(b"behind-1", source="b", crc=7)  # another producer's frame is queued: not ahead of it
    assert delivered == [] and len(frames) == 2
    stop = threading.Event()
    taken = frames.get(stop, deadline=0)
    assert taken is not None and taken[1:] == ("a", b"queued-1") and taken[0] == 1
    taken = frames.get(stop, deadline=0)
    assert taken is not None and taken[1:] == ("b", b"behind-1") and taken[0] == 2
    frames.put(b"behind-2", source="b")  # its predecessors are being delivered: queued
    assert delivered == [] and len(frames) == 1
    frames.received("a")
    frames.received("b")
    taken = frames.get(stop, deadline=0)
    assert taken is not None and taken[:2] == (3, "b")
    frames.received("b")
    frames.put(b"now", source="c", crc=5)  # nothing queued nor being delivered: delivered now, numbered next
    assert delivered == [("c", 4, 5)] and len(frames) == 0
    frames.put(b"back", source="c", front=True)  # a frame given back on close is never delivered by put
    assert len(frames) == 1 and len(delivered) == 1
    frames.get(stop, deadline=0)
    frames.received("c")
    frames.deliver_with(None)  # the consumer stopped: queued again
    frames.put(b"later", source="c")
    assert len(frames) == 1 and len(delivered) == 1


def test_a_frame_the_c_delivery_declines_is_queued_and_later_ones_wait_behind_it_in_order() -> None:
    frames = Frames()
    answers = [False, True]

    def deliver_now(frame: Any, source: object, position: int, crc: int | None) -> bool:
        return answers.pop(0)

    frames.deliver_with(deliver_now)
    frames.put(b"declined", source="a")
    frames.put(b"after", source="a")  # not offered: it would overtake the one queued
    assert len(frames) == 2 and answers == [True]


def test_a_producer_that_woke_a_waiting_receive_pauses_a_burst_later_until_the_receive_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Producer and receive share one interpreter lock: the woken receive runs before the producer delivers
    more than a burst further frames (else it would find hundreds waiting, out of the caches)."""
    monkeypatch.setattr(memory_pacing, "BURST_WAIT_S", 60.0)  # (here never given up on, however loaded the machine)
    frames = Frames()
    waits_then: list[int] = []  # how many times the receive had waited as each frame was delivered

    def deliver_now(frame: Any, source: object, position: int, crc: int | None) -> bool:
        waits_then.append(frames.pace._waits)
        return True

    frames.deliver_with(deliver_now)
    got: list[Any] = []
    stop = threading.Event()
    # (woken by the first frame, it returns to look for its tensor, then waits for more: the pause ends)
    receive = threading.Thread(target=lambda: got.extend(frames.get(stop, None, receiving=True) for _ in range(2)))
    receive.start()
    wait_for(lambda: frames._getting == 1, 30, "the receive to wait")
    count = BURST + BURST // 8 + 1  # (it looks every eighth of a burst)
    for _ in range(count):
        frames.put(b"frame", source="p")
    receive.join(30)
    assert got == [None, None]
    assert waits_then[0] == 1 and len(waits_then) == count
    assert waits_then[-1] == 2  # a burst on, the producer had let the receive run


def test_recv_async_callbacks_run_on_a_reading_thread_never_on_the_producers() -> None:
    with tb.Consumer("memory://callbacks") as consumer, tb.Producer("memory://callbacks") as producer:
        called = threading.Event()
        threads: list[threading.Thread] = []

        def callback(message: tb.Message | None, error: BaseException | None) -> None:
            threads.append(threading.current_thread())
            called.set()

        consumer.recv_async("k", callback)
        producer.send("k", np.zeros(4, np.float32))
        assert called.wait(30)
        assert threads and threads[0] is not threading.current_thread()


def test_a_waiting_receive_gets_its_tensor_whichever_thread_delivers_it() -> None:
    with tb.Consumer("memory://waiting") as consumer, tb.Producer("memory://waiting") as producer:
        got: list[Any] = []
        receiving = threading.Thread(target=lambda: got.append(consumer.recv("k", timeout=30)))
        receiving.start()
        frames = HUB.endpoint("waiting")
        # (once it waits, the tensor goes to it straight away; before, into the table, where it finds it)
        for i in range(20):
            producer.send("k", np.full(4, i, np.float32))
            if got:
                break
        receiving.join(30)
        assert got and (got[0] == 0).all()
        wait_for(lambda: len(frames) == 0, 30, "the queue to be empty")


def test_tensors_delivered_on_the_producers_thread_and_not_taken_go_to_the_next_consumer_in_order() -> None:
    with tb.Producer("memory://handed-on") as producer:
        with tb.Consumer("memory://handed-on") as first:
            for i in range(5):
                producer.send("k", np.full(3, i, np.int64), metadata={"i": i})
            # (at once with the C delivery, on the producer's thread; else once the reading thread delivered them)
            wait_for(lambda: len(first.table) == 5, 30, "five tensors in the table")
            assert len(HUB.endpoint("handed-on")) == 0
            assert first.recv_message("k", timeout=30).metadata == {"i": 0}
        assert len(HUB.endpoint("handed-on")) == 4  # the untaken ones, back in the queue, first in line
        producer.send("k", np.full(3, 5, np.int64), metadata={"i": 5})  # queued behind them
        with tb.Consumer("memory://handed-on") as second:
            assert [second.recv_message("k", timeout=30).metadata["i"] for _ in range(5)] == [1, 2, 3, 4, 5]


def test_a_tensor_over_the_producers_share_is_queued_and_held_back_as_before() -> None:
    tensor = np.zeros(1 << 16, np.uint8)
    share = 1 << 17
    options = {"max_buffered_bytes": 2 * share, "max_buffered_bytes_per_producer": share}
    with tb.Consumer("memory://shared", **options) as consumer:
        with tb.Producer("memory://shared") as producer:
            for _ in range(4):  # two fit its share (in the table); the third is held back, the fourth queued
                producer.send("k", tensor)
            wait_for(lambda: len(consumer.table) == 2, 30, "two tensors in the table")
            assert len(consumer.table) == 2  # (its share is full from the second: the rest wait)
            assert HUB.endpoint("shared").unreceived(producer.transport._source) > 0  # type: ignore[attr-defined]
            for _ in range(4):
                assert consumer.recv("k", timeout=30).nbytes == tensor.nbytes
            producer.flush(timeout=30)


@pytest.mark.parametrize("nbytes", [1 << 16, 1 << 20], ids=["copied-then-checksummed", "checksummed-while-copied"])
def test_a_queued_frame_carries_the_crc_of_its_bytes_whichever_way_the_producer_computed_it(nbytes: int) -> None:
    """Under 1 MiB the producer copies, then checksums, holding the interpreter lock; from 1 MiB it does both in
    one pass without it. Queued before a consumer listens, the frames are checked by the consumer's own CRC."""
    require_native(FAST is not None, "the intake's C delivery (tensorbus/_intake.c)")
    tensors = [np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8) for seed in range(3)]
    with tb.Producer("memory://checked") as producer:
        for tensor in tensors:
            producer.send("k", tensor)
        assert len(HUB.endpoint("checked")) == 3  # (queued: no consumer took them on the producer's thread)
        with tb.Consumer("memory://checked") as consumer:
            for tensor in tensors:
                assert np.array_equal(consumer.recv("k", timeout=30), tensor)
