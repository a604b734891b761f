"""kafka:// on librdkafka read by the receiving thread (kafka_reading.py): a waiting `recv` reads its own records,
a record the full table cannot take is held back rather than waited for, and a receive interrupted while it read
loses nothing."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.intake_state import FAST
from tensorbus.transports import kafka_reading
from tensorbus.transports.kafka_reading import RecordReading
from tests.conftest import endpoint_url, require_native
from tests.integration.test_kafka import committed
from tests.waiting import wait_for

pytestmark = pytest.mark.broker


def sending_once_the_receive_leads(
    consumer: tb.Consumer, producer: tb.Producer, tensors: list[Any]
) -> threading.Thread:
    """A thread that sends `tensors` under key "k" once a receive leads the consumer's reading (not before: the
    background thread would read them)."""
    leadership = consumer.transport._reading.leadership  # type: ignore[attr-defined]

    def send() -> None:
        wait_for(lambda: leadership._app_leads, 30, "the receive to lead the reading")
        for tensor in tensors:
            producer.send("k", tensor)
        producer.flush(30)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_a_waiting_receive_reads_and_delivers_its_record_on_its_own_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    deliverers: list[int] = []
    original = RecordReading._deliver_backlog

    def noted(self: RecordReading, stop: Any) -> bool:
        if self._backlog:
            deliverers.append(threading.get_ident())
        return original(self, stop)

    monkeypatch.setattr(RecordReading, "_deliver_backlog", noted)
    url = endpoint_url("kafka-confluent")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        for i in range(5):
            sending = sending_once_the_receive_leads(consumer, producer, [np.full(100, i, np.int32)])
            assert consumer.recv("k", timeout=30)[0] == i
            sending.join(30)
    assert len(deliverers) >= 5 and set(deliverers) == {threading.get_ident()}  # none through another thread


def test_a_record_the_full_table_cannot_take_is_held_and_later_records_wait_behind_it() -> None:
    url = endpoint_url("kafka-confluent")
    tensor_bytes = 4000
    with tb.Producer(url) as producer:
        for i in range(8):
            producer.send("a", np.full(tensor_bytes // 4, i, np.int32))
        producer.send("b", np.full(3, 9, np.int32))
        producer.flush(30)
    with tb.Consumer(url, max_buffered_bytes=3 * tensor_bytes) as consumer:
        with pytest.raises(tb.Timeout):  # "b" is behind "a"s the table has no room for: no wait for room here
            consumer.recv("b", timeout=2)
        assert [int(consumer.recv("a", timeout=30)[0]) for _ in range(8)] == list(range(8))  # in order, none lost
        assert consumer.recv("b", timeout=30).tolist() == [9, 9, 9]
        group, topic = consumer.transport.group, consumer.transport.topic  # type: ignore[attr-defined]
    assert committed(group, topic) == {0: 9}  # every record taken, and committed on close


def test_records_a_receive_took_from_librdkafka_when_interrupted_are_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    interrupted: list[int] = []
    original = kafka_reading.batch

    def interrupting(consumer: Any, most: int, timeout: float) -> list[Any]:
        records = original(consumer, most, timeout)
        if records and not interrupted and threading.current_thread() is threading.main_thread():
            interrupted.append(len(records))  # (as a Ctrl-C just after librdkafka handed the records over)
            raise KeyboardInterrupt
        return records

    monkeypatch.setattr(kafka_reading, "batch", interrupting)
    url = endpoint_url("kafka-confluent")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        sending = sending_once_the_receive_leads(consumer, producer, [np.full(10, i, np.int32) for i in range(6)])
        with pytest.raises(KeyboardInterrupt):
            consumer.recv("k", timeout=30)
        sending.join(30)
        got = [int(consumer.recv("k", timeout=30)[0]) for _ in range(6)]
        with pytest.raises(tb.Timeout):
            consumer.recv("k", timeout=0.5)  # nothing twice
    assert interrupted and got == list(range(6))


@pytest.mark.parametrize("runs", [True, False], ids=["in runs", "one by one"])
def test_records_the_c_delivery_takes_are_delivered_in_order_and_committed_in_runs_or_one_by_one(runs: bool) -> None:
    """`FastDelivery.take_records` takes runs of records (a Python `take_record` per record where it is None, as
    with a recording intake): either way every record is received once, in order, and committed."""
    require_native(FAST is not None, "the intake's C delivery (tensorbus/_intake.c)")
    url = endpoint_url("kafka-confluent")
    count, took = 300, []
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        intake: Any = consumer.intake
        take_records = intake.take_records

        def noted(records: Any, partition: int, offset: int) -> list[Any]:
            ids = take_records(records, partition, offset)
            took.append(len(ids))
            return ids

        intake.take_records = noted if runs else None  # (before any record came: the topic is new)
        for i in range(count):
            producer.send("k", np.full(256, i, np.float32))
        producer.flush(30)
        assert [int(consumer.recv("k", timeout=30)[0]) for _ in range(count)] == list(range(count))
        assert intake.fast_delivery.taken == count  # every record by the C delivery, whichever way it was called
        if runs:
            assert sum(took) == count and max(took) > 1
        else:
            assert took == []
        group, topic = consumer.transport.group, consumer.transport.topic  # type: ignore[attr-defined]
    assert committed(group, topic) == {0: count}


def test_a_waiting_receive_hands_librdkafka_waits_it_can_keep(monkeypatch: pytest.MonkeyPatch) -> None:
    """librdkafka waits in whole milliseconds (confluent-kafka drops the rest): a receive near the end of its
    slice must not hand it less, or it spins, calling `poll` again and again until the slice ends."""
    waits: list[float] = []
    original = kafka_reading.batch

    def noted(consumer: Any, most: int, timeout: float) -> list[Any]:
        if threading.current_thread() is threading.main_thread():
            waits.append(timeout)
        return original(consumer, most, timeout)

    monkeypatch.setattr(kafka_reading, "batch", noted)
    with tb.Consumer(endpoint_url("kafka-confluent")) as consumer:
        with pytest.raises(tb.Timeout):
            consumer.recv("k", timeout=0.5)  # (ten slices of kafka_reading.WAIT_S, nothing to read)
    assert waits and min(waits) >= kafka_reading.LEAST_WAIT_S
    assert len(waits) <= 0.5 / kafka_reading.LEAST_WAIT_S / 5  # (spinning: hundreds of calls)
