"""Signed frames captured and replayed: to a restarted consumer, to another endpoint, or too late.

A signature is bound to the endpoint, to the consumer's run (sockets) and to the producer's clock
(see docs/FORMAT.md, Signing): every replay below is refused and counted, and honest traffic still
goes through.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec import frame as frame_module
from tensorbus.codec.signing import frame_key
from tests.conftest import endpoint_url, require_broker
from tests.integration.test_socket import handshake_as_consumer, raw_peer
from tests.waiting import wait_for

KEY = b"team-key"
COUNT = 7


def _tap(producer: tb.Producer) -> list[bytes]:
    """Every frame `producer` sends, as it went out (what an eavesdropper captures)."""
    captured: list[bytes] = []
    send = producer.transport.send

    def recording(frame: list[Any], *, key: str | None) -> None:
        send(frame, key=key)
        captured.append(b"".join(bytes(memoryview(b).cast("B")) for b in frame))

    producer.transport.send = recording  # type: ignore[method-assign]
    return captured


def _signed_stream(address: str) -> list[bytes]:
    """COUNT signed tensors sent to `address` and taken there; returns their frames as captured."""
    with tb.Producer(address, signing_key=KEY) as producer:
        captured = _tap(producer)
        for i in range(COUNT):
            producer.send(f"k{i}", np.full(3, i))
        producer.flush(10)
    return captured


def _replayed_none(consumer: tb.Consumer, honest_address: str) -> None:
    """After the replay, an honest signed tensor arrives and no replayed one does."""
    with tb.Producer(honest_address, signing_key=KEY) as producer:
        producer.send("honest", np.ones(2))
        producer.flush(10)
    assert consumer.recv("honest", timeout=10).tolist() == [1, 1]
    wait_for(lambda: consumer.stats["rejected"] >= COUNT, 10, "every replayed frame refused")
    assert consumer.stats["rejected"] == COUNT and consumer.stats["received"] == 1
    for i in range(COUNT):
        with pytest.raises(tb.Timeout):
            consumer.recv(f"k{i}", timeout=0.01)


def _replay_on_socket(address: str, frames: list[bytes]) -> None:
    peer = raw_peer(address)
    peer.sendall(b"".join(frames))
    peer.close()


def test_a_stream_replayed_to_a_restarted_socket_consumer_is_refused() -> None:
    # replayed to a restarted consumer with the same key (no dedup_file), 7 of 7 were delivered again
    with tb.Consumer("tcp://127.0.0.1:0", signing_key=KEY) as first:
        address = first.address
        captured = _signed_stream(address)
        for i in range(COUNT):
            assert first.recv(f"k{i}", timeout=10).tolist() == [i] * 3
    assert len(captured) == COUNT
    with tb.Consumer(address, signing_key=KEY) as restarted:  # same port, same key: a new run
        _replay_on_socket(address, captured)
        _replayed_none(restarted, address)


def test_a_stream_replayed_to_another_socket_endpoint_with_the_same_key_is_refused() -> None:
    with (
        tb.Consumer("tcp://127.0.0.1:0", signing_key=KEY) as first,
        tb.Consumer("tcp://127.0.0.1:0", signing_key=KEY) as other,
    ):
        captured = _signed_stream(first.address)
        _replay_on_socket(other.address, captured)
        _replayed_none(other, other.address)


def test_a_signed_frame_older_than_max_frame_age_s_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with tb.Consumer("tcp://127.0.0.1:0", signing_key=KEY, max_frame_age_s=60) as consumer:
        bound = frame_key(KEY, "socket", consumer.transport.incarnation)  # type: ignore[attr-defined]
        now = time.time()
        frames = []
        for i, skew in enumerate((-3600, -61, 3600)):  # an hour old, just too old, an hour ahead
            monkeypatch.setattr(frame_module.time, "time", lambda s=skew: now + s)
            frames.append(tb.dumps(np.full(3, i), key=f"k{i}", signing_key=bound, message_id=("old", i)))
        monkeypatch.undo()
        peer = raw_peer(consumer.address)
        peer.sendall(b"".join(frames))
        wait_for(lambda: consumer.stats["rejected"] == 3, 10, "the three frames refused")
        peer.sendall(tb.dumps(np.ones(1), key="fresh", signing_key=bound, message_id=("old", 9)))
        assert consumer.recv("fresh", timeout=10).tolist() == [1]  # the same, signed now: taken
        peer.close()


def test_frames_left_unacknowledged_are_signed_again_for_the_consumer_run_that_gets_them() -> None:
    # the producer's resend after a consumer restart is legitimate: it must not be refused as a replay
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with tb.Producer(f"tcp://127.0.0.1:{port}", signing_key=KEY, reconnect_timeout_s=10) as producer:
        accepted: list[socket.socket] = []
        listener.settimeout(10)

        def first_run() -> None:  # a consumer run that reads the frames and dies before acknowledging them
            conn, _ = listener.accept()
            handshake_as_consumer(conn, None)
            accepted.append(conn)

        thread = threading.Thread(target=first_run)
        thread.start()
        for i in range(3):
            producer.send(f"k{i}", np.full(2, i))
        thread.join(10)
        accepted[0].recv(1 << 16)
        accepted[0].close()
        listener.close()
        with tb.Consumer(f"tcp://127.0.0.1:{port}", signing_key=KEY) as consumer:
            producer.flush(15)
            for i in range(3):
                assert consumer.recv(f"k{i}", timeout=10).tolist() == [i, i]
            assert consumer.stats["rejected"] == 0


def test_a_stream_replayed_to_another_memory_endpoint_or_too_late_is_refused() -> None:
    with tb.Consumer("memory://replay-a", signing_key=KEY) as first:
        captured = _signed_stream("memory://replay-a")
        with tb.Consumer("memory://replay-b", signing_key=KEY) as other:
            with tb.Producer("memory://replay-b") as raw:
                for frame in captured:
                    raw.transport.send([frame], key=None)
            _replayed_none(other, "memory://replay-b")
        for i in range(COUNT):
            assert first.recv(f"k{i}", timeout=10).tolist() == [i] * 3
    # memory:// has no consumer runs to tell apart: a restarted consumer is protected by the age limit
    with tb.Consumer("memory://replay-a", signing_key=KEY, max_frame_age_s=0.5) as restarted:
        time.sleep(0.6)
        with tb.Producer("memory://replay-a") as raw:
            for frame in captured:
                raw.transport.send([frame], key=None)
        _replayed_none(restarted, "memory://replay-a")


@pytest.mark.broker
def test_a_stream_replayed_to_another_rabbitmq_queue_with_the_same_key_is_refused() -> None:
    url = endpoint_url("amqp")
    require_broker(url)
    with tb.Consumer(url, signing_key=KEY) as first, tb.Consumer(endpoint_url("amqp"), signing_key=KEY) as other:
        captured = _signed_stream(first.address)
        with tb.Producer(other.address) as raw:
            for frame in captured:
                raw.transport.send([frame], key=None)
            raw.flush(30)
        _replayed_none(other, other.address)


def _send_stamped_an_hour_ago(
    monkeypatch: pytest.MonkeyPatch, producer: tb.Producer, tensors: list[np.ndarray]
) -> None:
    """Send `tensors` as keys k0, k1, ... with the frames' clock an hour back (old, as a replay's would be)."""
    now = time.time()
    monkeypatch.setattr(frame_module.time, "time", lambda: now - 3600)
    for i, tensor in enumerate(tensors):
        producer.send(f"k{i}", tensor)
    monkeypatch.undo()


def _frames(kept: Any) -> list[bytes]:
    """The frames a socket producer keeps for resending, as they would go out (what an eavesdropper captures)."""
    return [b"".join(bytes(memoryview(b).cast("B")) for b in frame) for frame, _ in kept]


def test_a_signed_tensor_resent_to_a_successor_after_max_frame_age_s_is_taken_and_a_replay_of_it_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the first consumer took nothing for an hour and closed: the producer resends to its successor,
    # signed for the successor's run and stamped with the resend's time (a redelivery, not a replay)
    first = tb.Consumer("tcp://127.0.0.1:0", signing_key=KEY, max_frame_age_s=None)
    address = first.address
    producer = tb.Producer(address, signing_key=KEY, reconnect_timeout_s=10)
    with producer:
        _send_stamped_an_hour_ago(monkeypatch, producer, [np.full(2, i) for i in range(3)])
        producer.flush(10)
        first_sent = _frames(producer.transport._unacked)  # type: ignore[attr-defined]
        first.close()
        with tb.Consumer(address, signing_key=KEY, max_frame_age_s=2) as successor:
            producer.flush(15)
            resent = _frames(producer.transport._unacked)  # type: ignore[attr-defined]
            too_old_after = time.time() + 2.1  # (each was stamped before the flush returned)
            for i in range(3):
                assert successor.recv(f"k{i}", timeout=10).tolist() == [i, i]
            assert successor.stats["rejected"] == 0
            # a third party replays what it captured: the first sends (signed for the first run) and,
            # once they are older than max_frame_age_s, the resends (signed for this run)
            _replay_on_socket(address, first_sent)
            wait_for(lambda: successor.stats["rejected signature"] == 3, 10, "the first sends refused")
            wait_for(lambda: time.time() > too_old_after, 10, "the resends older than max_frame_age_s")
            _replay_on_socket(address, resent)
            wait_for(lambda: successor.stats["rejected replay"] == 3, 10, "the resends replayed late refused")
            assert successor.stats["received"] == 3


@pytest.mark.broker
def test_a_signed_tensor_rabbitmq_redelivers_after_max_frame_age_s_is_taken_and_a_replay_of_it_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = endpoint_url("amqp")
    require_broker(url)
    first = tb.Consumer(url, signing_key=KEY, max_frame_age_s=None)
    with tb.Producer(first.address, signing_key=KEY) as producer:
        captured = _tap(producer)
        _send_stamped_an_hour_ago(monkeypatch, producer, [np.full(2, i) for i in range(3)])
        producer.flush(30)
    wait_for(lambda: len(first.table) == 3, 30, "the three in the first consumer's table, untaken")
    first.close()  # RabbitMQ redelivers them, marked as redelivered
    with tb.Consumer(first.address, signing_key=KEY, max_frame_age_s=60) as successor:
        for i in range(3):
            assert successor.recv(f"k{i}", timeout=30).tolist() == [i, i]
        assert successor.stats["rejected"] == 0
        with tb.Producer(successor.address) as raw:  # a third party publishes the captured frames again
            for frame in captured:
                raw.transport.send([frame], key=None)
            raw.flush(30)
        wait_for(lambda: successor.stats["rejected replay"] == 3, 30, "the replayed frames refused as too old")
        assert successor.stats["received"] == 3


def test_a_signed_chunked_tensor_resent_to_a_successor_after_max_frame_age_s_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # chunked by max_frame_bytes, a tensor's clock and signature are inside the message its chunks
    # carry: the producer resending it sets that clock anew and signs the message again
    tensors = [np.arange(20_000, dtype=np.float64) + i for i in range(3)]  # 160 KB each: five chunks or more
    first = tb.Consumer("tcp://127.0.0.1:0", signing_key=KEY, max_frame_age_s=None)
    address = first.address
    with tb.Producer(address, signing_key=KEY, reconnect_timeout_s=10, max_frame_bytes=32 << 10) as producer:
        _send_stamped_an_hour_ago(monkeypatch, producer, tensors)
        producer.flush(10)
        first_sent = _frames(producer.transport._unacked)  # type: ignore[attr-defined]
        assert len(first_sent) >= 15
        first.close()
        with tb.Consumer(address, signing_key=KEY, max_frame_age_s=2) as successor:
            producer.flush(15)
            for i, tensor in enumerate(tensors):
                assert np.array_equal(successor.recv(f"k{i}", timeout=10), tensor)
            assert successor.stats["rejected"] == 0
            _replay_on_socket(address, first_sent)  # a third party replays the first sends: another run's
            wait_for(lambda: successor.stats["rejected signature"] == len(first_sent), 10, "the first sends refused")
            assert successor.stats["received"] == 3


@pytest.mark.broker
@pytest.mark.parametrize("client", ["kafka", "kafka-confluent"])
def test_a_signed_tensor_kafka_reads_again_after_max_frame_age_s_is_taken_and_a_replay_of_it_refused(
    client: str,
) -> None:
    # the first consumer held them untaken past max_frame_age_s and closed: its successor in the group
    # reads the records again, aged by the broker's append time; a third party appending them again is refused.
    # A record the broker appended more than max_frame_age_s after it was signed is refused: 5 s leaves a
    # loaded machine room (with 1 s, a run beside two busy cores saw all three appended a second late)
    url, age_s = endpoint_url(client), 5.0
    first = tb.Consumer(url, signing_key=KEY, max_frame_age_s=age_s)
    with tb.Producer(url, signing_key=KEY) as producer:
        captured = _tap(producer)
        for i in range(3):
            producer.send(f"k{i}", np.full(2, i))
        producer.flush(30)
        too_old_after = time.time() + age_s + 0.1
    wait_for(lambda: len(first.table) == 3, 60, "the three in the first consumer's table, untaken")
    wait_for(lambda: time.time() > too_old_after, 10, "the tensors older than max_frame_age_s")
    first.close()  # nothing taken, nothing committed: the group's next consumer reads them again
    with tb.Consumer(url, signing_key=KEY, max_frame_age_s=age_s) as successor:
        for i in range(3):
            assert successor.recv(f"k{i}", timeout=60).tolist() == [i, i]
        assert successor.stats["rejected"] == 0
        with tb.Producer(url) as raw:  # a third party appends the captured frames again
            for frame in captured:
                raw.transport.send([frame], key=None)
            raw.flush(30)
        wait_for(lambda: successor.stats["rejected replay"] == 3, 30, "the appended-again frames refused as too old")
        assert successor.stats["received"] == 3
