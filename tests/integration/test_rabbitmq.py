"""RabbitMQ-specific behaviour against a real broker: chunking past its limit, redelivery, errors, layout."""

from __future__ import annotations

import collections
import threading
import time
import urllib.parse

import numpy as np
import pika
import pytest

import tensorbus as tb
from tensorbus.transports.rabbitmq_consumer import RECV_BYTES, read_in_large_pieces
from tests.conftest import AMQP_URL, endpoint_url
from tests.peers import same
from tests.pika_internals import break_connection, pika_transport
from tests.waiting import wait_for

pytestmark = pytest.mark.broker


@pytest.fixture
def url() -> str:
    return endpoint_url("amqp")


def queue_of(url: str) -> str:
    return urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["queue"][0]


def test_300_mb_tensor_is_chunked_under_the_default_limit(url: str) -> None:
    big = np.random.default_rng(0).standard_normal(300 * 2**20 // 8)
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        producer.send("big", big)
        producer.flush(timeout=120)
        received = consumer.recv("big", timeout=120)
        assert same(received, big)
        assert consumer.stats["chunks"] >= 18  # 300 MB in chunks of at most 16 MiB


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_tensors_of_many_more_chunks_than_the_prefetch_window_all_arrive(url: str, queue_type: str) -> None:
    # chunks are acked only once their tensor is whole: a fresh consumer takes over each time the held ones
    # fill the window (quorum queues have no channel-wide prefetch that could grow instead)
    url = f"{url}&queue_type={queue_type}"
    tensors = [np.random.default_rng(i).standard_normal(40_000) for i in range(3)]
    with (
        tb.Consumer(f"{url}&prefetch_count=4") as consumer,
        tb.Producer(url, max_frame_bytes=10_000) as producer,
    ):
        for i, tensor in enumerate(tensors):
            producer.send(f"t{i}", tensor)  # 320 kB each: 33 chunks, against a window of 4
        producer.flush(timeout=60)
        for i, tensor in enumerate(tensors):
            assert same(consumer.recv(f"t{i}", timeout=60), tensor)
        assert consumer.stats["chunks"] >= 3 * 32
        reader = consumer.transport.consumer
        assert reader.rolls >= 3 * 32 // 4 - 3  # a consumer delivers at most a window (4) of held chunks
        # the last acks run on the connection's thread: then nothing is held, by any consumer
        wait_for(lambda: sum(reader.held.values()) == 0, 10, "the held chunks to be acked")
        assert len(reader.held) <= 1


def test_broker_side_size_error_is_a_tensorbus_error(url: str) -> None:
    with tb.Producer(url, max_frame_bytes=200 * 2**20) as producer:
        producer.send("too-big", np.zeros(150 * 2**20, np.uint8))  # one 150 MB message > 128 MiB broker max
        producer.send("fine", np.arange(10.0))  # published behind it, before any confirm: must not be lost
        with pytest.raises(tb.TransportError, match="max size"):
            producer.flush(timeout=60)
        producer.flush(timeout=30)  # the producer keeps working
        producer.send("after", np.arange(3.0))
        producer.flush(timeout=30)
    with tb.Consumer(url) as consumer:
        assert same(consumer.recv("fine", timeout=30), np.arange(10.0))
        assert same(consumer.recv("after", timeout=30), np.arange(3.0))
        with pytest.raises(tb.Timeout):
            consumer.recv("too-big", timeout=0.5)


def test_publishing_does_not_wait_for_each_confirm(url: str) -> None:
    with tb.Producer(url) as producer:
        for i in range(200):
            producer.send("small", np.full(1000, i, np.float32))
        producer.flush(timeout=30)
        publisher = producer.transport._publisher
        assert publisher is not None and publisher.peak_in_flight > 1
    with tb.Consumer(url) as consumer:
        assert [int(consumer.recv("small", timeout=30)[0]) for _ in range(200)] == list(range(200))


def test_the_consumer_reads_its_socket_two_frames_at_a_time_not_pikas_4_kib(url: str) -> None:
    arr = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: some 32 full body frames
    asked: list[int] = []
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        transport = pika_transport(consumer.transport.consumer._connection)
        recv = transport._sigint_safe_recv
        transport._sigint_safe_recv = lambda sock, n: (asked.append(n), recv(sock, n))[1]
        producer.send("big", arr)
        assert same(consumer.recv("big", timeout=30), arr)
    assert asked and set(asked) == {RECV_BYTES}
    assert not read_in_large_pieces(object())  # a pika without the setting is left as it is


def test_a_queue_that_exists_is_used_as_it_is(url: str) -> None:
    # a classic queue with arguments of its own: declaring it as a quorum queue would be refused (406)
    queue = queue_of(url)
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        connection.channel().queue_declare(queue, durable=True, arguments={"x-max-length": 1000})
        with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
            producer.send("k", np.arange(3.0))
            assert same(consumer.recv("k", timeout=30), np.arange(3.0))
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="inequivalent arg"):
            connection.channel().queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
    finally:
        connection.close()


def test_a_new_queue_is_a_quorum_queue_unless_asked_otherwise(url: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        for queue_type in ("quorum", "classic", "stream", None):
            name = f"{queue_of(url)}-{queue_type}"
            chosen = "" if queue_type is None else f"&queue_type={queue_type}"
            with tb.Producer(f"{AMQP_URL}?queue={name}{chosen}") as producer:
                producer.send("k", np.arange(3.0))
                producer.flush(30)
            made = queue_type or "quorum"
            other = "quorum" if made == "classic" else "classic"
            with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="inequivalent arg 'x-queue-type'"):
                connection.channel().queue_declare(name, durable=True, arguments={"x-queue-type": other})
            connection.channel().queue_declare(name, durable=True, arguments={"x-queue-type": made})  # its type
            connection.channel().queue_delete(name)
    finally:
        connection.close()


def test_a_queue_deleted_mid_stream_is_declared_again(url: str) -> None:
    queue = queue_of(url)
    with tb.Producer(url) as producer:
        producer.send("a", np.arange(3.0))
        producer.flush(30)
        connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
        connection.channel().queue_delete(queue)
        connection.close()
        producer.send("b", np.arange(3.0))  # unroutable: reported, not silently dropped
        with pytest.raises(tb.TransportError, match="could not route"):
            producer.flush(30)
        producer.send("c", np.arange(4.0))
        producer.flush(30)
    with tb.Consumer(url) as consumer:
        assert same(consumer.recv("c", timeout=30), np.arange(4.0))


def test_a_lost_connection_is_replaced_and_a_stale_wake_up_stalls_nothing(url: str) -> None:
    with tb.Producer(url) as producer:
        producer.send("a", np.arange(3.0))
        producer.flush(30)
        publisher = producer.transport._publisher
        old = publisher._connection
        break_connection(old)  # the connection breaks under the publisher
        replaced = lambda: publisher._connection is not old and publisher._channel is not None  # noqa: E731
        wait_for(replaced, 20, "a new connection and channel")  # (the old channel, still set, proves nothing)
        # an application thread that read the old connection just before the swap posts its wake-up there
        publisher._wake_posted = old
        old.ioloop.add_callback_threadsafe(publisher._publish)
        producer.send("b", np.arange(5.0))
        producer.flush(10)
    with tb.Consumer(url) as consumer:
        assert same(consumer.recv("b", timeout=30), np.arange(5.0))


def test_a_plain_pika_consumer_can_read_tensorbus_messages(url: str) -> None:
    queue = queue_of(url)
    with tb.Producer(url) as producer:
        producer.send("weights", np.arange(12.0).reshape(3, 4), metadata={"step": 3})
        producer.flush(30)
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        channel = connection.channel()
        method, properties, body = channel.basic_get(queue, auto_ack=True)
        assert method is not None
        assert properties.content_type == "application/vnd.tensorbus.frame"
        assert properties.headers["tensorbus-key"] == "weights" and properties.delivery_mode == 2  # (quorum queues
        # add x-delivery-count)
        message = tb.decode(body)
        assert message.key == "weights" and message.metadata == {"step": 3}
        assert same(message.tensor, np.arange(12.0).reshape(3, 4))
    finally:
        connection.close()


def test_wrong_password_fails_fast_with_a_tensorbus_error() -> None:
    parts = urllib.parse.urlsplit(endpoint_url("amqp"))
    wrong = parts._replace(netloc=f"guest:wrong@{parts.hostname}:{parts.port}")
    started = time.monotonic()
    with pytest.raises(tb.TransportError, match="refused the credentials"):
        tb.Consumer(urllib.parse.urlunsplit(wrong))
    assert time.monotonic() - started < 30


def test_a_connection_lost_mid_tensor_leaves_the_held_counts_consistent(url: str) -> None:
    # the chunks held before the drop are released again after it: counted against the old channel,
    # they must not drive the new channel's counts negative (nor stop the consumer's I/O thread)
    arr = np.arange(40 * 1500, dtype=np.float32)
    chunks = tb.codec.encode_chunks(arr, max_chunk_bytes=2048, message_id=("manual", 1), key="big")
    first = len(chunks) - 10
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        transport = consumer.transport
        for chunk in chunks[:first]:
            producer.transport.send(chunk, key="big")
        producer.flush(30)
        wait_for(lambda: consumer.stats["chunks"] >= first, 20, "the first chunks")
        reader = transport.consumer
        break_connection(reader._connection)
        wait_for(lambda: reader.generation >= 2 and consumer.stats["chunks"] >= 2 * first, 30, "redelivery")
        for chunk in chunks[first:]:
            producer.transport.send(chunk, key="big")
        producer.flush(30)
        assert same(consumer.recv("big", timeout=30), arr)
        wait_for(lambda: sum(reader.held.values()) == 0, 10, "the held chunks released")
        assert min(reader.held.values(), default=0) >= 0 and reader.thread.is_alive()
        for i in range(3):
            producer.send(f"after{i}", np.full(3, i))
        for i in range(3):
            assert same(consumer.recv(f"after{i}", timeout=30), np.full(3, i))


@pytest.mark.parametrize("ack", ["arrival", "take"])
def test_deliveries_acked_as_soon_as_recorded_leave_no_bookkeeping_behind(url: str, ack: str) -> None:
    # released at once (ack="arrival", or taken by a waiting recv before the worker recorded it): the
    # delivery's ack runs before its hold, and the hold must still clear what that ack noted
    with tb.Consumer(url, ack=ack) as consumer, tb.Producer(url) as producer:
        reader = consumer.transport.consumer
        for i in range(50):
            producer.send(f"k{i}", np.full(2, i))
        for i in range(50):
            assert same(consumer.recv(f"k{i}", timeout=30), np.full(2, i))
        wait_for(lambda: not reader._acked_early and sum(reader.held.values()) == 0, 10, "every delivery settled")


def test_close_acks_everything_delivered_so_the_next_consumer_gets_no_duplicates(url: str) -> None:
    with tb.Producer(url) as producer:
        for i in range(200):
            producer.send(f"k{i}", np.full(2, i))
        producer.flush(30)
    with tb.Consumer(url) as consumer:
        for i in range(200):
            consumer.recv(f"k{i}", timeout=30)
    with tb.Consumer(url) as successor:
        with pytest.raises(tb.Timeout):
            message = successor.next_message(timeout=2)
            pytest.fail(f"the successor got {message.key} again")


def test_a_consumer_whose_queue_is_deleted_declares_it_again_and_goes_on(url: str) -> None:
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        producer.send("a", np.arange(3.0))
        assert same(consumer.recv("a", timeout=30), np.arange(3.0))
        connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
        connection.channel().queue_delete(queue_of(url))
        connection.close()
        wait_for(lambda: consumer.transport.consumer.generation >= 2, 20, "the consumer to reconnect")
        producer.send("c", np.arange(4.0))
        assert same(consumer.recv("c", timeout=30), np.arange(4.0))


def test_every_consumer_of_a_stream_gets_every_tensor_from_where_it_starts(url: str) -> None:
    url = f"{url}&queue_type=stream"
    big = np.random.default_rng(0).standard_normal(50_000)  # 400 kB: chunked below
    with tb.Producer(url, max_frame_bytes=64_000) as producer:
        for i in range(5):
            producer.send(f"k{i}", np.full(3, i))
        producer.send("big", big)
        producer.flush(30)
        with (
            tb.Consumer(f"{url}&offset=first") as one,
            tb.Consumer(f"{url}&offset=first") as two,  # a second reader of the same stream: fan-out
            tb.Consumer(f"{url}&offset=3") as from_3,
            tb.Consumer(f"{url}&offset=next") as later,
        ):
            for consumer in (one, two):
                assert [int(consumer.recv(f"k{i}", timeout=30)[0]) for i in range(5)] == list(range(5))
                assert same(consumer.recv("big", timeout=30), big)
            assert int(from_3.next_message(timeout=30).tensor[0]) == 3  # offsets count messages from 0
            producer.send("after", np.arange(4.0))
            producer.flush(30)
            assert later.next_message(timeout=30).key == "after"  # `next`: nothing sent before it started
            for consumer in (one, two):
                assert same(consumer.recv("after", timeout=30), np.arange(4.0))


def test_a_stream_consumer_that_loses_its_connection_goes_on_from_its_position(url: str) -> None:
    url = f"{url}&queue_type=stream"
    with (
        tb.Consumer(f"{url}&offset=first&prefetch_count=4") as consumer,
        tb.Producer(url, max_frame_bytes=10_000) as producer,
    ):
        reader = consumer.transport.consumer
        for i in range(20):
            producer.send(f"k{i}", np.full(5_000, i, np.float32))  # 20 kB: 3 chunks each
        producer.flush(30)
        assert [int(consumer.recv(f"k{i}", timeout=30)[0]) for i in range(10)] == list(range(10))
        # (the worker moves the position on just after it handed the tensor over)
        wait_for(lambda: isinstance(reader.position, int) and reader.position >= 10 * 3, 10, "the position")
        break_connection(reader._connection)
        wait_for(lambda: reader.generation >= 2, 20, "the consumer to reconnect")
        assert [int(consumer.recv(f"k{i}", timeout=30)[0]) for i in range(10, 20)] == list(range(10, 20))
        with pytest.raises(tb.Timeout):  # the frames read again after the reconnect were dropped as duplicates
            message = consumer.next_message(timeout=1)
            pytest.fail(f"{message.key} came twice")
        # read again: about a window's worth, not the 30 chunks before the position (as from `first`)
        assert consumer.stats["duplicates"] + consumer.intake.reassembler.stats["duplicates"] < 15


def test_a_url_of_several_nodes_connects_to_the_first_that_answers(url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    several = urllib.parse.urlunsplit(parts._replace(netloc=f"guest:guest@127.0.0.1:1,{parts.hostname}:{parts.port}"))
    with tb.Consumer(several) as consumer, tb.Producer(several) as producer:
        producer.send("k", np.arange(3.0))
        assert same(consumer.recv("k", timeout=30), np.arange(3.0))
        assert producer.transport.params.port == consumer.transport.params.port == parts.port
    with pytest.raises(tb.ConfigError, match=r"bad host:port '127\.0\.0\.1:99999'"):
        tb.Producer(urllib.parse.urlunsplit(parts._replace(netloc="127.0.0.1:5672,127.0.0.1:99999")))


def test_a_stream_longer_than_confirm_timeout_s_is_not_taken_for_a_stalled_one(url: str) -> None:
    # the producer runs ahead of the broker, so frames stay unconfirmed all along: every confirm is progress
    with tb.Consumer(url) as consumer, tb.Producer(url, confirm_timeout_s=2, max_pending_bytes=32 << 20) as producer:
        # taken as they come (iterating ends when the consumer closes)
        threading.Thread(target=lambda: collections.deque(consumer, maxlen=0), daemon=True).start()
        started, sent = time.monotonic(), 0
        while time.monotonic() - started < 2.5 * 2 and sent < 5000:
            producer.send("k", np.zeros(1 << 18, np.float32))  # 1 MB
            sent += 1
        producer.flush(60)
        assert producer.transport._publisher.peak_in_flight > 4


@pytest.mark.parametrize("take_it", [False, True])
def test_deliveries_taken_after_an_untaken_one_are_acked_without_it(url: str, take_it: bool) -> None:
    # released deliveries go as one `multiple` ack only up to the oldest one not released: a tensor
    # left untaken before taken ones stays unacked and comes to the next consumer, alone; once taken
    # too, the whole run is acked and nothing comes again
    with tb.Producer(url) as producer:
        producer.send("untaken", np.arange(3.0))
        for i in range(20):
            producer.send(f"k{i}", np.full(2, i))
        producer.flush(30)
    with tb.Consumer(url) as consumer:
        reader = consumer.transport.consumer
        for i in range(20):
            assert same(consumer.recv(f"k{i}", timeout=30), np.full(2, i))
        wait_for(lambda: len(reader._outstanding) == 1, 10, "every delivery but the untaken one acked")
        if take_it:
            assert same(consumer.recv("untaken", timeout=30), np.arange(3.0))
            wait_for(lambda: not reader._outstanding, 10, "the untaken one acked once taken")
    with tb.Consumer(url) as successor:
        if not take_it:
            assert same(successor.recv("untaken", timeout=30), np.arange(3.0))
        with pytest.raises(tb.Timeout):
            message = successor.next_message(timeout=2)
            pytest.fail(f"the successor got {message.key} again")


@pytest.mark.parametrize("queue_type", ["quorum", "stream"])
def test_running_out_of_memory_for_a_message_reconnects_and_the_message_comes_again(
    url: str, queue_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delivering thread lives on: the consumer reconnects, and RabbitMQ delivers again what it had not acked
    (a stream: read again from that message, not past it, though the one after it was delivered meanwhile)."""
    from tests.faults import fail_feed_once

    url = f"{url}&queue_type={queue_type}"
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        raised = fail_feed_once(monkeypatch, consumer, MemoryError())
        producer.send("k", np.arange(3))
        producer.send("after", np.arange(2))
        producer.flush(timeout=30)
        assert consumer.recv("k", timeout=60).tolist() == [0, 1, 2]
        assert consumer.recv("after", timeout=60).tolist() == [0, 1]
        assert len(raised) == 1 and consumer.transport.consumer.worker.is_alive()  # type: ignore[attr-defined]
