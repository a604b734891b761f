"""At-least-once to the application: a consumer killed (SIGKILL) or closed with tensors nobody took
loses none of them; its successor on the same endpoint gets every one, CRC-checked, and with
`dedup_file` none that the first consumer handed out. A producer that sends, flushes and exits
before anything is taken still exits at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trustme

import tensorbus as tb
import tensorbus.aio as tba
from tensorbus.transports import socket_acks
from tests import faults
from tests.conftest import endpoint_url, transport_params
from tests.integration.test_kafka import committed
from tests.waiting import wait_for

SENT, TAKEN = 60, 10
#: the producer's reconnect bound, and the waits below: a successor of a killed Kafka member waits for its session
WAIT_S = 60


def tensor(i: int) -> np.ndarray:
    return (np.arange(256, dtype=np.float32) * (i + 1)) % 251


def take_some(url: str, options: dict[str, Any], directory: str) -> None:
    """The first consumer (a process of its own): take t0..t9, wait until the others reach the table, say so, and
    once the producer's flush returned, close (`options["then"] == "close"`) or wait to be killed."""
    then = options.pop("then")
    consumer = tb.Consumer(url, **options)
    Path(directory, "address").write_text(consumer.address)
    handed = Path(directory, "handed")
    for i in range(TAKEN):
        consumer.recv(f"t{i}", timeout=WAIT_S)
        with handed.open("a") as log:
            log.write(f"t{i}\n")
    deadline = time.monotonic() + WAIT_S
    while len(consumer.table) < SENT - TAKEN and time.monotonic() < deadline:  # (bounded: the parent checks it)
        time.sleep(0.01)
    Path(directory, "table.part").write_text(str(len(consumer.table)))
    os.replace(Path(directory, "table.part"), Path(directory, "table"))  # whole when the parent sees it
    deadline = time.monotonic() + WAIT_S
    while not Path(directory, "flushed").exists() and time.monotonic() < deadline:  # (bounded: the parent checks)
        time.sleep(0.01)  # the producer's flush saw every frame received: going now cannot race it
    if then == "close":
        consumer.close()
        return
    time.sleep(WAIT_S * 4)  # until killed


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(directory / "ca.pem")
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(directory / "server.pem")
    return {"ca": str(directory / "ca.pem"), "cert": str(directory / "server.pem")}


def endpoint(transport: str, tmp_path: Path, tls: dict[str, str]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """URL, consumer options, producer options of a fresh endpoint a successor can take over."""
    if transport in ("tcp", "tcps"):
        url = f"{transport}://127.0.0.1:{faults.free_port()}"
        if transport == "tcps":
            return url, {"ssl_certfile": tls["cert"]}, {"ssl_cafile": tls["ca"], "reconnect_timeout_s": WAIT_S}
        return url, {}, {"reconnect_timeout_s": WAIT_S}
    if transport == "unix":
        return f"unix://{tmp_path}/untaken.sock", {}, {"reconnect_timeout_s": WAIT_S}
    url = endpoint_url(transport)
    if transport == "shm":
        return url, {}, {"reconnect_timeout_s": WAIT_S}
    if transport == "amqp":
        return url, {}, {}  # (a quorum queue: the default queue_type)
    return url, {"session_timeout_s": 6}, {}  # kafka, both clients: a killed member's partitions move after its session


#: every scheme a successor can take over; Kafka on both clients ("kafka-confluent": client=confluent)
SUCCESSIONS = transport_params("tcp", "unix", "tcps", "shm", "amqp", "kafka", "kafka-confluent")


@pytest.mark.parametrize("then", ["kill", "close"])
@pytest.mark.parametrize("transport", SUCCESSIONS)
def test_a_consumer_gone_with_untaken_tensors_leaves_every_one_to_its_successor(
    transport: str, then: str, tmp_path: Path, tls: dict[str, str]
) -> None:
    url, consumer_options, producer_options = endpoint(transport, tmp_path, tls)
    options = {**consumer_options, "dedup_file": str(tmp_path / "ids"), "then": then}
    first = faults.start(take_some, url, options, str(tmp_path))
    try:
        wait_for(lambda: (tmp_path / "address").exists(), WAIT_S, "the first consumer to listen")
        with tb.Producer(url, **producer_options) as producer:
            for i in range(SENT):
                producer.send(f"t{i}", tensor(i), metadata={"crc": faults.checksum(tensor(i))})
            producer.flush(WAIT_S)
            (tmp_path / "flushed").write_text("")
            wait_for(lambda: (tmp_path / "table").exists(), WAIT_S, "the first consumer to take ten")
            assert int((tmp_path / "table").read_text()) == SENT - TAKEN  # all the others reached its table
            if then == "kill":
                os.kill(first.pid, signal.SIGKILL)
            first.join(WAIT_S)
            assert first.exitcode is not None
            assert (tmp_path / "handed").read_text().split() == [f"t{i}" for i in range(TAKEN)]
            successor = tb.Consumer(url, **consumer_options, dedup_file=str(tmp_path / "ids"))
            try:
                producer.flush(WAIT_S)  # (a socket producer finds the first gone and resends to the successor)
                got = {}
                for _ in range(SENT - TAKEN):
                    message = successor.next_message(timeout=WAIT_S)
                    assert faults.checksum(message.tensor) == message.metadata["crc"]
                    got[message.key] = got.get(message.key, 0) + 1
                assert got == {f"t{i}": 1 for i in range(TAKEN, SENT)}  # every one of the fifty, once
                with pytest.raises(tb.Timeout):  # and none the first one handed out
                    successor.next_message(timeout=1.0)
            finally:
                successor.close()
    finally:
        if first.is_alive():
            first.kill()


def send_flush_exit(url: str, options: dict[str, Any]) -> None:
    with tb.Producer(url, **options) as producer:
        for i in range(5):
            producer.send(f"t{i}", tensor(i))
        producer.flush(WAIT_S)


@pytest.mark.parametrize("transport", ["tcp", "unix", "shm", pytest.param("amqp", marks=pytest.mark.broker)])
def test_a_producer_that_exits_before_anything_is_taken_exits_at_once(
    transport: str, tmp_path: Path, tls: dict[str, str]
) -> None:
    url, consumer_options, producer_options = endpoint(transport, tmp_path, tls)
    with tb.Consumer(url, **consumer_options) as consumer:
        producer = faults.start(send_flush_exit, consumer.address, producer_options)
        wait_for(lambda: len(consumer.table) == 5, WAIT_S, "the five in the table, none taken")
        producer.join(8)  # (under close_timeout_s, 10 s: close does not wait for what is not taken)
        assert producer.exitcode == 0
        assert sorted(m.key for m in (consumer.next_message(timeout=1) for _ in range(5))) == [
            f"t{i}" for i in range(5)
        ]


def test_a_consumer_with_ack_arrival_acknowledges_on_arrival_and_loses_its_untaken_ones_on_close() -> None:
    with tb.Consumer("tcp://127.0.0.1:0", ack="arrival") as first:
        producer = tb.Producer(first.address, reconnect_timeout_s=1, close_timeout_s=1)
        for i in range(5):
            producer.send(f"t{i}", tensor(i))
        producer.flush(WAIT_S)
        assert first.recv("t0", timeout=WAIT_S).shape == (256,)
        wait_for(lambda: len(first.table) == 4, WAIT_S, "the other four in the table")
    producer.flush(5)  # the close acknowledged the four as taken: nothing kept, nothing to resend to anyone
    assert not producer.transport._unacked  # type: ignore[attr-defined]
    producer.close()


def test_with_ack_take_a_producer_keeps_the_untaken_ones_for_the_next_consumer() -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as first:
        producer = tb.Producer(first.address, reconnect_timeout_s=1, close_timeout_s=1)
        for i in range(5):
            producer.send(f"t{i}", tensor(i))
        producer.flush(WAIT_S)
        assert first.recv("t0", timeout=WAIT_S).shape == (256,)
        wait_for(lambda: len(first.table) == 4, WAIT_S, "the other four in the table")
    with pytest.raises(tb.TransportError, match="cannot connect"):  # kept: it looks for a consumer to give them
        producer.flush(5)
    assert len(producer.transport._unacked) == 4  # type: ignore[attr-defined]
    producer.close()


def test_past_max_untaken_bytes_the_oldest_copies_are_let_go_and_counted() -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        with tb.Producer(consumer.address, max_untaken_bytes=4 * 1024) as producer:
            for i in range(20):  # 1 KiB each, none taken: a send never waits for a recv
                producer.send(f"t{i}", tensor(i))
            producer.flush(WAIT_S)
            transport: Any = producer.transport
            assert transport._untaken_bytes <= 4 * 1024 and transport.untaken_let_go >= 14
        assert consumer.recv("t19", timeout=WAIT_S)[1] == tensor(19)[1]


@pytest.mark.parametrize("spelling", ["consumer.ack", "message.ack"])
@pytest.mark.parametrize("transport", ["memory", "tcp", pytest.param("amqp", marks=pytest.mark.broker)])
def test_with_manual_acks_what_was_taken_but_not_acknowledged_comes_again(
    transport: str, spelling: str, tmp_path: Path, tls: dict[str, str]
) -> None:
    if transport == "memory":
        url, consumer_options, producer_options = f"memory://manual-{uuid.uuid4().hex}", {}, {}
    else:
        url, consumer_options, producer_options = endpoint(transport, tmp_path, tls)
    ids = str(tmp_path / "ids")
    first = tb.Consumer(url, **consumer_options, ack="manual", dedup_file=ids)
    with tb.Producer(first.address, **producer_options) as producer:
        for i in range(20):
            producer.send(f"t{i}", tensor(i))
        producer.flush(WAIT_S)
        taken = [first.recv_message(f"t{i}", timeout=WAIT_S) for i in range(6)]
        for message in taken[:3]:  # t0..t2 done with; t3 given back: delivered again
            message.ack() if spelling == "message.ack" else first.ack(message)
        taken[3].reject() if spelling == "message.ack" else first.reject(taken[3])
        assert first.recv_message("t3", timeout=WAIT_S).message_id == taken[3].message_id
        first.close()  # t3..t5 taken, never acknowledged
        with tb.Consumer(url, **consumer_options, ack="manual", dedup_file=ids) as successor:
            producer.flush(WAIT_S)  # (a socket producer resends what was not acknowledged)
            got = sorted(str(successor.next_message(timeout=WAIT_S).key) for _ in range(17))
            assert got == sorted(f"t{i}" for i in range(3, 20))
            with pytest.raises(tb.Timeout):
                successor.next_message(timeout=0.5)  # not t0..t2


def test_messages_taken_and_not_acknowledged_count_against_max_buffered_bytes() -> None:
    url = f"memory://manual-room-{uuid.uuid4().hex}"
    with tb.Consumer(url, ack="manual", max_buffered_bytes=3 * 1024 + 100) as consumer, tb.Producer(url) as producer:
        for i in range(5):
            producer.send(f"t{i}", tensor(i))  # 1 KiB each
        held = [consumer.recv_message(f"t{i}", timeout=WAIT_S) for i in range(3)]
        assert consumer.table.buffered_bytes >= 3 * 1024  # the three, unacknowledged
        wait_for(lambda: consumer.intake._held_up or consumer.transport._reader._held, WAIT_S, "t3 held back")  # type: ignore[attr-defined]
        assert len(consumer.table) <= 1  # no room for both of the others while three are unacknowledged
        for message in held:
            consumer.ack(message)
        assert [consumer.recv(f"t{i}", timeout=WAIT_S)[1] for i in (3, 4)] == [tensor(3)[1], tensor(4)[1]]
        with pytest.raises(tb.ConfigError, match="ack='manual'"), tb.Consumer(f"memory://{uuid.uuid4().hex}") as other:
            other.ack(held[0])
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        producer.send("t", tensor(0))
        with pytest.raises(tb.ConfigError, match="ack='manual'"):
            consumer.recv_message("t", timeout=WAIT_S).ack()  # (taken already: there is nothing to acknowledge)


@pytest.mark.parametrize("api", ["blocking", "asyncio"])
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_an_array_changed_after_flush_reaches_a_successor_as_it_was_sent(
    transport: str, api: str, tmp_path: Path, tls: dict[str, str]
) -> None:
    url, consumer_options, producer_options = endpoint(transport, tmp_path, tls)
    loop = asyncio.new_event_loop()
    run: Any = loop.run_until_complete if api == "asyncio" else (lambda result: result)
    first = tb.Consumer(url, **consumer_options)
    producer: Any = (tb.Producer if api == "blocking" else tba.Producer)(first.address, **producer_options)
    try:
        if api == "asyncio":
            run(producer.open())
        arrays = [tensor(i) for i in range(3)]
        sent = [array.copy() for array in arrays]
        big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: a frame whose payload is the array's own memory
        sent.append(big.copy())
        for i, array in enumerate([*arrays, big]):
            run(producer.send(f"t{i}", array))
        run(producer.flush(WAIT_S))
        for array in [*arrays, big]:
            array[:] = -1  # the application reuses its arrays once flush returned
        wait_for(lambda: len(first.table) == 4, WAIT_S, "the four in the first consumer's table, untaken")
        first.close()
        with tb.Consumer(url, **consumer_options) as successor:
            run(producer.flush(WAIT_S))  # (resent to the successor)
            for i, expected in enumerate(sent):
                np.testing.assert_array_equal(successor.recv(f"t{i}", timeout=WAIT_S), expected)
    finally:
        first.close()
        run(producer.close())
        loop.close()


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_flush_after_the_consumer_took_a_large_tensor_asks_and_keeps_no_copy(
    transport: str, tmp_path: Path, tls: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer acknowledges a tensor's arrival just before the application takes it: a flush that
    would copy a large one asks first whether it was taken (socket_acks.py, `_flush_steps`)."""
    monkeypatch.setattr(socket_acks, "TAKEN_WAIT_MAX_S", WAIT_S)  # (the bound is not what is tested: never reach it)
    monkeypatch.setattr(socket_acks, "COPY_BYTES_PER_S", 1.0)
    url, consumer_options, _ = endpoint(transport, tmp_path, tls)
    with tb.Consumer(url, **consumer_options) as consumer, tb.Producer(consumer.address) as producer:
        kept: Any = producer.transport
        copied: list[int] = []

        def counting() -> Iterator[Any]:
            copied.append(len(kept._unacked))
            yield from ()

        monkeypatch.setattr(kept, "_own_untaken", counting)
        array = np.ones(1 << 20, dtype=np.float32)
        producer.send("big", array)
        wait_for(lambda: len(consumer.table) == 1, WAIT_S, "the tensor in the table")
        assert consumer.recv("big", timeout=WAIT_S).nbytes == array.nbytes
        producer.flush(WAIT_S)
        assert copied == [0]  # the consumer said it took the tensor: nothing left to copy
        assert kept._untaken_bytes == 0 and not kept._unacked


@pytest.mark.parametrize("case", ["many small tensors", "one large tensor"])
def test_an_asyncio_flush_copies_untaken_frames_in_slices_the_loop_runs_between(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush makes the kept copies of untaken frames the producer's own; on an event loop it copies them a
    slice at a time (socket_acks.py, `_own_untaken`: OWN_SLICE_FRAMES frames, or OWN_SLICE_BYTES of one large
    array), the loop's other tasks running between two slices."""
    monkeypatch.setattr(socket_acks, "OWN_SLICE_FRAMES", 100)
    if case == "many small tensors":
        arrays, slices = [tensor(i) for i in range(1000)], 1000 // 100
    else:
        arrays = [np.arange(4 << 20, dtype=np.float32)]  # (16 MiB)
        slices = arrays[0].nbytes // socket_acks.OWN_SLICE_BYTES
    last = arrays[-1].copy()
    loop = asyncio.new_event_loop()
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        producer = tba.Producer(consumer.address)
        try:
            loop.run_until_complete(producer.open())
            kept: Any = producer.blocking.transport
            turns, during = [0], []
            original = kept._own_untaken

            def watched() -> Iterator[Any]:
                before = turns[0]
                yield from original()
                during.append(turns[0] - before)

            monkeypatch.setattr(kept, "_own_untaken", watched)

            async def flush_beside_a_task() -> None:
                stop = asyncio.Event()

                async def other_task() -> None:
                    while not stop.is_set():
                        turns[0] += 1
                        await asyncio.sleep(0)

                beside = asyncio.create_task(other_task())
                for i, array in enumerate(arrays):
                    await producer.send(f"t{i}", array)
                wait_for(lambda: len(consumer.table) == len(arrays), WAIT_S, "every tensor in the table, untaken")
                await producer.flush(WAIT_S)
                stop.set()
                await beside
                for array in arrays:
                    array[:] = -1  # (the producer's copies are its own now)

            loop.run_until_complete(flush_beside_a_task())
            assert during and during[0] >= slices - 1  # a turn of the other task after each slice
            assert all(isinstance(part, (bytes, bytearray)) for frame, _ in kept._unacked for part in frame)
            assert len(kept._unacked) == len(arrays)
        finally:
            loop.run_until_complete(producer.close())
            loop.close()
        np.testing.assert_array_equal(consumer.recv(f"t{len(arrays) - 1}", timeout=WAIT_S), last)


@pytest.mark.broker
def test_a_channel_rabbitmq_closes_over_untaken_deliveries_loses_nothing_and_hands_out_each_once() -> None:
    # What RabbitMQ's consumer_timeout does to a consumer holding untaken tensors past it: it closes the
    # channel with 406 PRECONDITION_FAILED. RabbitMQ 3.10 (these brokers) sets consumer_timeout for the whole
    # node only (30 min; the per-queue x-consumer-timeout argument came with 3.12), so the broker is made to
    # close the channel with that error another way: an ack of a delivery tag it never sent.
    url = endpoint_url("amqp")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        for i in range(6):
            producer.send(f"t{i}", tensor(i))
        producer.flush(WAIT_S)
        np.testing.assert_array_equal(consumer.recv("t0", timeout=WAIT_S), tensor(0))
        wait_for(lambda: len(consumer.table) == 5, WAIT_S, "t1..t5 in the table, untaken (unacknowledged)")
        reader: Any = consumer.transport.consumer  # type: ignore[attr-defined]
        generation, channel = reader.generation, reader._channel
        reader._connection.add_callback_threadsafe(lambda: channel.basic_ack(1 << 40))
        wait_for(lambda: reader.generation > generation, WAIT_S, "the consumer back on a new channel")
        wait_for(lambda: consumer.stats["duplicates"] == 5, WAIT_S, "t1..t5 redelivered, dropped as duplicates")
        for i in range(1, 6):  # each handed out once, none lost
            np.testing.assert_array_equal(consumer.recv(f"t{i}", timeout=WAIT_S), tensor(i))
        with pytest.raises(tb.Timeout):
            consumer.next_message(timeout=0.5)
    with tb.Consumer(url) as successor:  # the redeliveries were acknowledged: nothing is left in the queue
        with pytest.raises(tb.Timeout):
            successor.next_message(timeout=2)


@pytest.mark.broker
@pytest.mark.parametrize("client", ["kafka", "kafka-confluent"])
def test_on_kafka_one_untaken_tensor_pins_its_partitions_commit_while_later_ones_are_taken(client: str) -> None:
    url = endpoint_url(client)
    topic = urllib.parse.urlsplit(url).path.lstrip("/")
    with tb.Consumer(url, partitions=1) as consumer, tb.Producer(url, partitions=1) as producer:
        for i in range(6):
            producer.send(f"t{i}", tensor(i))  # offsets 0..5 of the one partition
        producer.flush(WAIT_S)
        for i in range(1, 6):
            np.testing.assert_array_equal(consumer.recv(f"t{i}", timeout=WAIT_S), tensor(i))
        offsets: Any = consumer.transport._offsets  # type: ignore[attr-defined]

        def settled() -> bool:  # the consumer committed all it considers safe
            return offsets is not None and bool(offsets._committed) and not offsets.committable()

        wait_for(settled, WAIT_S, "the consumer's commit after t1..t5 were taken")
        assert committed(f"tensorbus-{topic}", topic) == {0: 0}  # t0, untaken, pins it: t1..t5 come again after a crash
        np.testing.assert_array_equal(consumer.recv("t0", timeout=WAIT_S), tensor(0))
        wait_for(
            lambda: committed(f"tensorbus-{topic}", topic) == {0: 6}, WAIT_S, "the commit past t5 once t0 is taken"
        )
