"""Producer/Consumer plumbing on memory://: URL schemes, options, config files, lifecycle."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tensorbus as tb
import tensorbus.options
import tensorbus.transports
from tensorbus.options import defaults
from tensorbus.transports.base import Delivered
from tests.faults import fail_feed_once
from tests.waiting import wait_for


def test_unknown_scheme_names_the_known_ones_and_suggests() -> None:
    with pytest.raises(tb.ConfigError, match=r"'tpc'.*did you mean 'tcp'.*Known: amqp://, amqps://, kafka://"):
        tb.Producer("tpc://127.0.0.1:1")


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("127.0.0.1:5603", "names no transport.*e.g. tcp://"),
        ("memory://", "needs a name after memory://"),
        ("tcp://127.0.0.1:5697/path", "takes no path"),
    ],
)
def test_urls_a_user_might_mistype_are_explained(url: str, needle: str) -> None:
    with pytest.raises(tb.ConfigError, match=needle):
        tb.Consumer(url)


def test_a_unix_path_that_is_not_a_socket_is_named_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(tb.TransportError, match="exists and is not a socket"):
        tb.Consumer(f"unix://{path}")
    assert path.read_text() == "keep me"


@pytest.mark.parametrize("key", [123, b"k", ("a", "b")])
def test_a_key_that_is_not_a_str_is_refused_at_the_sender_not_dropped_by_the_consumer(key: object) -> None:
    with pytest.raises(tb.ConfigError, match="key must be a str"):
        tb.dumps(np.ones(1), key=key)  # type: ignore[arg-type]
    with tb.Consumer("memory://keys") as consumer, tb.Producer("memory://keys") as producer:
        with pytest.raises(tb.ConfigError, match="key must be a str"):
            producer.send(key, np.ones(1))  # type: ignore[arg-type]
        with pytest.raises(tb.ConfigError, match="key must be a str"):
            consumer.recv(key, timeout=1)  # type: ignore[arg-type]  # (it would wait for ever)
        with pytest.raises(tb.ConfigError, match="key must be a str"):
            consumer.recv_async(key, lambda message, error: None)  # type: ignore[arg-type]
        producer.send(None, np.ones(1))  # no key at all is fine: iteration receives it, and so does recv(None)
        producer.send(None, np.zeros(1))
        assert next(iter(consumer)).key is None
        assert consumer.recv(None, timeout=1).tolist() == [0.0]


def test_an_unknown_compression_is_refused_when_the_producer_is_made() -> None:
    for options in ({"compression": "gzip"}, {}):
        with pytest.raises(tb.ConfigError, match="unknown compression 'gzip'"):
            tb.Producer("memory://comp" + ("" if options else "?compression=gzip"), **options)


def test_unknown_options_are_errors_from_kwargs_and_query() -> None:
    with pytest.raises(tb.ConfigError, match=r"unknown option.*compresion"):
        tb.Producer("memory://x", compresion="lz4")
    with pytest.raises(tb.ConfigError, match=r"unknown option.*bogus.*URL query"):
        tb.Consumer("memory://x?bogus=1")
    with pytest.raises(tb.ConfigError, match="not a valid float"):
        tb.Producer("tcp://127.0.0.1:9?send_timeout_s=soon")


def test_url_query_options_are_typed() -> None:
    producer = tb.Producer("tcp://127.0.0.1:9?send_timeout_s=2.5&max_frame_bytes=65536")
    assert producer.transport.options.send_timeout_s == 2.5 and producer.transport.max_frame_bytes == 65536
    producer.close()


def test_from_config_reads_url_and_role_tables(tmp_path: Path) -> None:
    config = tmp_path / "bus.toml"
    config.write_text(
        'url = "memory://cfg"\ncompression = "zstd"\nmax_frame_bytes = 4096\n'
        "[consumer]\nmax_buffered_bytes = 1000000\n[producer]\nchecksum = false\n"
    )
    with pytest.raises(tb.ConfigError, match="compression"):
        tb.Consumer.from_config(config)  # compression is a producer option, and the file is shared
    config.write_text(
        'url = "memory://cfg"\nmax_frame_bytes = 4096\n[consumer]\nmax_buffered_bytes = 1000000\n'
        '[producer]\nchecksum = false\ncompression = "zstd"\n'
    )
    with tb.Consumer.from_config(config) as consumer, tb.Producer.from_config(config) as producer:
        assert consumer.table.max_buffered_bytes == 1_000_000
        assert producer.checksum is False and producer.compression == "zstd"
        producer.send("k", np.arange(10_000))
        assert np.array_equal(consumer.recv("k", timeout=5), np.arange(10_000))
    (tmp_path / "bad.toml").write_text('url = "memory://x"\nmystery = 1\n')
    with pytest.raises(tb.ConfigError, match="mystery"):
        tb.Producer.from_config(tmp_path / "bad.toml")


def test_shipped_config_files_name_only_known_options() -> None:
    configs = [p for p in sorted(Path(__file__).parents[2].joinpath("config").glob("*.toml")) if p.name != "bench.toml"]
    assert configs, "config/ ships example files"
    for path in configs:
        _, options = tb.options.load_config(path, "producer")
        url, _ = tb.options.load_config(path, "consumer")
        assert url, f"{path} names a url"
        cls, _ = tb.transports.resolve_transport(url)
        known = (
            set(defaults(cls.Options)) | set(defaults(tb.api.ProducerOptions)) | set(defaults(tb.api.ConsumerOptions))
        )
        assert set(options) <= known, f"{path}: {set(options) - known}"


def test_send_after_close_is_an_error_and_close_is_idempotent() -> None:
    producer = tb.Producer("memory://closed")
    producer.close()
    producer.close()
    with pytest.raises(tb.Closed):
        producer.send("k", np.ones(1))


def test_closing_a_consumer_ends_iteration_and_fails_waiters() -> None:
    consumer = tb.Consumer("memory://iter")
    with tb.Producer("memory://iter") as producer:
        producer.send("a", np.ones(1))
    seen = []
    for message in consumer:
        seen.append(message.key)
        consumer.close()
    assert seen == ["a"]
    with pytest.raises(tb.Closed, match="recv on a closed Consumer"):  # use after close(), as documented
        consumer.recv("b", timeout=1)


def test_every_receive_on_a_closed_consumer_raises_closed_and_pending_ones_are_aborted() -> None:
    consumer = tb.Consumer("memory://closed-consumer")
    handle_errors: list[BaseException | None] = []
    consumer.recv_async("pending", lambda message, error: handle_errors.append(error))
    consumer.close()
    assert len(handle_errors) == 1 and isinstance(handle_errors[0], tb.Aborted)  # pending at close(): Aborted
    for call in (
        lambda: consumer.recv("k", timeout=0),
        lambda: consumer.recv_message("k", timeout=0),
        lambda: consumer.next_message(timeout=0),
        lambda: consumer.recv_async("k", lambda message, error: None),
    ):
        with pytest.raises(tb.Closed):
            call()


def test_auth_refused_is_exported_and_documented_in_the_error_tree() -> None:
    from tensorbus.transports.stream import AuthRefused

    assert tb.AuthRefused is AuthRefused and issubclass(tb.AuthRefused, tb.TransportError)
    assert "AuthRefused" in tb.__all__
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    tree = readme[readme.index("Errors form one tree") :].split("\n\n")[0]
    assert "`AuthRefused`" in tree


@pytest.mark.parametrize(
    ("url", "form"),
    [
        ("memory:/x", "memory://NAME"),
        ("memory:///x", "memory://NAME"),
        ("shm:/x", "shm://NAME"),
        ("tcp:/127.0.0.1:5555", "tcp://HOST:PORT"),
        ("unix:tmp/x.sock", "unix:///path/to.sock"),
        ("kafka:127.0.0.1:9092/t", "kafka://HOST:9092/TOPIC"),
        ("amqp:/127.0.0.1", "amqp://USER:PASSWORD@HOST:5672/VHOST"),
    ],
)
def test_a_malformed_url_is_refused_with_the_form_expected(url: str, form: str) -> None:
    for end in (tb.Producer, tb.Consumer):
        with pytest.raises(tb.ConfigError, match=f"malformed URL.*write it as {re.escape(form)}"):
            end(url)


def test_a_memory_flush_with_no_consumer_fails_naming_the_option_that_bounds_it() -> None:
    with tb.Producer("memory://nobody-flush", reconnect_timeout_s=0.5) as producer:
        producer.send("k", np.ones(4))
        started = time.monotonic()
        with pytest.raises(tb.TransportError, match=r"no consumer.*reconnect_timeout_s=0\.5 bounds it"):
            producer.flush(timeout=30)
        assert time.monotonic() - started < 20
        with pytest.raises(tb.TransportError, match="flush's timeout"):
            producer.flush(timeout=0.2)  # (a flush shorter than the bound: named as such)
        with tb.Consumer("memory://nobody-flush") as consumer:
            producer.flush(timeout=30)  # a consumer came: everything is taken into its table
            assert consumer.recv("k", timeout=5).tolist() == [1.0] * 4


def test_a_memory_flush_waits_for_a_consumer_that_comes_within_the_bound() -> None:
    with tb.Producer("memory://late-consumer") as producer:
        producer.send("k", np.ones(2))
        consumer: list[tb.Consumer] = []
        starter = threading.Thread(target=lambda: consumer.append(tb.Consumer("memory://late-consumer")))
        starter.start()
        producer.flush(timeout=30)
        starter.join(30)
        with consumer[0]:
            assert consumer[0].recv("k", timeout=5).tolist() == [1.0, 1.0]


def test_a_memory_flush_waits_for_a_tensor_held_back_by_a_full_table_to_enter_it() -> None:
    """A flush means every tensor is in a consumer's table, as on tcp://: not merely read by its consumer.
    With room for one 1 MiB tensor per producer, the second is held back until the first is taken."""
    one = np.zeros(1 << 20, np.uint8)
    with tb.Consumer("memory://held-flush", max_buffered_bytes=2 << 20) as consumer:
        with tb.Producer("memory://held-flush") as producer:
            producer.send("a", one)
            producer.send("b", one + 1)
            frames = producer.transport._frames  # type: ignore[attr-defined]
            source = producer.transport._source  # type: ignore[attr-defined]
            # (without the C delivery a reading thread takes "a" in, not the send: until then both count as untaken)
            wait_for(lambda: frames.unreceived(source) < 2 * one.nbytes, 30, '"a" taken into the table')
            with pytest.raises(tb.TransportError, match=r"1048\d{3} bytes sent were not taken into .* table"):
                producer.flush(timeout=0.5)
            assert consumer.stats["received"] == 1  # "b" is held back, not in the table
            assert consumer.recv("a", timeout=5).sum() == 0  # room: "b" enters the table
            producer.flush(timeout=30)
            assert consumer.stats["received"] == 2
            assert consumer.recv("b", timeout=5).min() == 1


def test_producer_sends_before_the_consumer_exists() -> None:
    with tb.Producer("memory://early") as producer:
        producer.send("early", np.arange(3))
    with tb.Consumer("memory://early") as consumer:
        assert np.array_equal(consumer.recv("early", timeout=5), np.arange(3))


def test_signed_endpoint_rejects_unsigned_frames_and_counts_them() -> None:
    with tb.Consumer("memory://signed", signing_key="k1") as consumer:
        with tb.Producer("memory://signed") as unsigned, tb.Producer("memory://signed", signing_key="k2") as wrong:
            unsigned.send("x", np.ones(1))
            wrong.send("x", np.ones(1))
        with tb.Producer("memory://signed", signing_key="k1") as good:
            good.send("x", np.full(1, 7.0))
        assert consumer.recv("x", timeout=5)[0] == 7.0
        assert consumer.stats["rejected"] == 2


def test_stale_incarnation_from_a_transport_is_refused_and_counted() -> None:
    with tb.Consumer("memory://fence") as consumer, tb.Producer("memory://fence") as producer:
        producer.send(tb.make_key("w", 5, "ps", "g"), np.ones(1))
        producer.send(tb.make_key("w", 4, "ps", "g"), np.ones(1))
        producer.send("after", np.ones(1))
        consumer.recv("after", timeout=5)  # (counted just after it is handed over: wait for the count)
        wait_for(lambda: consumer.stats["received"] == 2, 5, "the counts")
        assert consumer.stats["refused"] == 1 and consumer.stats["received"] == 2


def test_a_frame_the_decoder_fails_on_costs_that_frame_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with tb.Consumer("memory://decoder-bug") as consumer, tb.Producer("memory://decoder-bug") as producer:
        monkeypatch.setattr(consumer.intake, "fast", None)  # (the Python delivery, whose decoder fails)
        raised = fail_feed_once(monkeypatch, consumer, RuntimeError("a decoder bug"))
        producer.send("k", np.array([1]))
        producer.send("k", np.array([2]))
        assert consumer.recv("k", timeout=5)[0] == 2 and len(raised) == 1
        assert consumer.stats["rejected"] == 1
        assert "decoder failed on" in caplog.text


def test_frames_a_closing_memory_consumer_never_delivered_wait_for_the_next_one() -> None:
    first = tb.Consumer("memory://handover", max_buffered_bytes=1000)
    with tb.Producer("memory://handover") as producer:
        for i in range(10):
            producer.send(f"k{i}", np.full(1000, i, np.uint8))  # the first fills the table: delivery then waits
    wait_for(lambda: len(first.table) >= 1, 30, "k0 in the table")
    first.close()  # k0 sat in its table unreceived and goes with it; k1..k9 were never delivered
    with tb.Consumer("memory://handover") as second:
        assert [second.recv(f"k{i}", timeout=5)[0] for i in range(1, 10)] == list(range(1, 10))


def test_the_buffer_limit_counts_metadata_too() -> None:
    with tb.Consumer(
        "memory://metadata", max_buffered_bytes=1 << 20, max_buffered_bytes_per_producer=1 << 20
    ) as consumer:
        with tb.Producer("memory://metadata") as producer:
            for i in range(40):  # empty tensors, 100 KB of metadata each
                producer.send(f"k{i}", np.zeros(0), metadata={"blob": "x" * 100_000})
            wait_for(lambda: consumer.table.buffered_bytes >= 1 << 20, 30, "the table filled to its limit")
            time.sleep(0.2)  # delivery has stopped at the limit
            assert consumer.table.buffered_bytes >= 1 << 20 and len(consumer.table) < 40
            assert [consumer.recv(f"k{i}", timeout=5).size for i in range(40)] == [0] * 40


def test_a_closing_memory_consumer_hands_a_half_received_chunked_tensor_over_whole() -> None:
    from tensorbus.transports.memory import HUB

    with tb.Producer("memory://chunked-handover", max_frame_bytes=4096) as producer:  # queued before anyone reads
        producer.send("k0", np.zeros(1000, np.uint8))  # fills the table: delivery then waits for room
        producer.send("k1", np.arange(5000, dtype=np.float32))  # 20 KB: several chunks
        producer.send("k2", np.ones(10, np.uint8))
    queue = HUB.endpoint("chunked-handover")
    sent = len(queue)
    first = tb.Consumer("memory://chunked-handover", max_buffered_bytes=1000)
    wait_for(lambda: len(first.table) >= 1 and len(queue) <= 1, 30, "k0 delivered and k1 read")
    assert sent > 3 and len(first.table) == 1 and len(queue) == 1  # k0 delivered; k1 read whole, waits for room
    first.close()  # its delivery thread then hands k1 to an aborted table: every chunk of it goes back
    with tb.Consumer("memory://chunked-handover") as second:
        assert (second.recv("k1", timeout=5) == np.arange(5000, dtype=np.float32)).all()
        assert second.recv("k2", timeout=5).tolist() == [1] * 10
        assert second.intake.reassembler.pending == 0


def test_a_tensor_an_aborted_consumer_turned_away_is_turned_away_again_when_read_again() -> None:
    """A broker may hand a turned-away tensor to the same consumer again (kafka:// after a rebalance).

    It was never taken, so it must not count as a duplicate, which the transport would acknowledge:
    every frame of it, whole or chunked, is turned away each time.
    """
    whole = b"".join(tb.encode(np.ones(3), key="k", message_id=("p", 1)))
    chunked = tb.codec.encode_chunks(np.arange(2000.0), max_chunk_bytes=4096, message_id=("p", 2), key="c")
    chunks = [b"".join(c) for c in chunked]
    assert len(chunks) > 2
    with tb.Consumer("memory://turned-away") as consumer:
        consumer.abort("step failed")
        for _ in range(2):
            assert consumer.intake(whole) == Delivered(("p", 1), False, turned_away=True)
            assert [consumer.intake(c) for c in chunks] == [Delivered(("p", 2), False, turned_away=True)] * len(chunks)
        assert consumer.stats["duplicates"] == 0


def _joined(parts: list) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def test_a_delivery_held_up_by_a_full_table_goes_to_a_receiver_that_waits_for_its_key() -> None:
    with tb.Consumer("memory://held-up-waiter", max_buffered_bytes=1000) as consumer:
        consumer.intake(tb.dumps(np.zeros(1000, np.uint8), key="a", message_id=("p", 1)))  # the table is full
        delivering = threading.Thread(
            target=consumer.intake, args=(tb.dumps(np.arange(4.0), key="b", message_id=("p", 2)),)
        )
        delivering.start()
        time.sleep(0.2)
        assert delivering.is_alive(), "a full table must hold up a delivery nobody waits for"
        assert consumer.recv("b", timeout=5).tolist() == [0, 1, 2, 3]  # it needs no room: it is handed over
        delivering.join(5)
        assert not delivering.is_alive() and consumer.table.buffered_bytes >= 1000


def test_partly_received_tensors_do_not_expire_while_a_full_table_holds_up_delivery() -> None:
    # a broker delivered every chunk; the consumer just stopped reading them: expiring the tensor
    # meanwhile lost it (and its chunks were acknowledged as given up on)
    options = {"max_buffered_bytes": 1000, "reassembly_timeout_s": 1.0}
    with tb.Consumer("memory://held-up-chunks", **options) as consumer:
        # the reassembler's clock is the test's: it moves only while the delivery is held up (on the real one, a
        # thread the machine is slow to start would let the tensor expire before the hold began)
        now = [0.0]
        reassembler = consumer.intake.reassembler
        reassembler.clock = lambda: now[0]
        big = np.arange(3000, dtype=np.float64)
        chunks = tb.codec.encode_chunks(big, max_chunk_bytes=8192, message_id=("p", 1), key="big")
        assert len(chunks) > 2
        consumer.intake(_joined(chunks[0]))
        consumer.intake(tb.dumps(np.zeros(1000, np.uint8), key="a", message_id=("p", 2)))  # full now
        delivering = threading.Thread(
            target=consumer.intake, args=(tb.dumps(np.zeros(8, np.uint8), key="c", message_id=("p", 3)),)
        )
        delivering.start()
        wait_for(lambda: consumer.intake._held_up == 1, 30, "the delivery held up by the full table")
        now[0] += 3.0  # three reassembly timeouts with delivery held up
        consumer.intake.expire()  # (as the intake's expiry thread does, every quarter of the timeout)
        consumer.recv("a", timeout=5)
        delivering.join(5)
        for chunk in chunks[1:]:
            consumer.intake(_joined(chunk))
        assert np.array_equal(consumer.recv("big", timeout=5), big)
        assert consumer.intake.reassembler.stats["expired"] == 0


def test_keyword_and_file_options_of_the_wrong_type_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(tb.ConfigError, match=r"send_timeout_s must be int or float, got '30'"):
        tb.Producer("tcp://127.0.0.1:9", send_timeout_s="30")
    with pytest.raises(tb.ConfigError, match="checksum must be bool"):
        tb.Producer("memory://typed", checksum="false")  # a non-empty string would have meant True
    with pytest.raises(tb.ConfigError, match="max_buffered_bytes must be int"):
        tb.Consumer("memory://typed", max_buffered_bytes=1e9)
    config = tmp_path / "c.toml"
    config.write_text('[producer]\nurl = "tcp://127.0.0.1:9"\nsend_timeout_s = "30"\n')
    with pytest.raises(tb.ConfigError, match="send_timeout_s"):
        tb.Producer.from_config(config)
    tb.Producer("tcp://127.0.0.1:9", send_timeout_s=None, connect_timeout_s=2).close()  # None and ints pass


def test_logged_urls_hide_passwords_and_secrets() -> None:
    shown = tensorbus.options.redact("amqp://u:pw@h:5672/%2F?queue=q&signing_key=abc&auth_secret=s&prefetch_count=3")
    assert shown == "amqp://u:***@h:5672/%2F?queue=q&signing_key=***&auth_secret=***&prefetch_count=3"
    assert tensorbus.options.redact("tcp://127.0.0.1:5") == "tcp://127.0.0.1:5"
    assert tensorbus.options.redact("unix:///tmp/a.sock") == "unix:///tmp/a.sock"  # as written, not unix:/tmp
    assert tensorbus.options.redact("guest:pw@h:5672") == "***@h:5672"  # no scheme: urlsplit finds no password


def test_a_url_without_a_scheme_is_refused_without_showing_its_password() -> None:
    with pytest.raises(tb.ConfigError, match="names no transport") as caught:
        tb.Producer("guest:s3cret@127.0.0.1:5672")
    assert "s3cret" not in str(caught.value) and "guest" not in str(caught.value)


def test_a_callback_raising_system_exit_costs_nothing_but_its_own_call(caplog: pytest.LogCaptureFixture) -> None:
    with tb.Consumer("memory://exit-callback") as consumer, tb.Producer("memory://exit-callback") as producer:

        def leave(message: object, error: object) -> None:
            raise SystemExit("from a callback")

        consumer.recv_async("a", leave)
        producer.send("a", np.arange(3))
        producer.send("b", np.arange(4))
        assert consumer.recv("b", timeout=5).tolist() == [0, 1, 2, 3]  # the delivering thread lives on
    assert "recv_async callback for 'a' raised" in caplog.text


def test_closing_a_memory_consumer_from_its_own_callback_frees_the_name() -> None:
    consumer = tb.Consumer("memory://close-in-callback")
    closed = threading.Event()

    def close(message: object, error: object) -> None:
        consumer.close()
        closed.set()

    consumer.recv_async("a", close)
    with tb.Producer("memory://close-in-callback") as producer:
        producer.send("a", np.arange(3))
        assert closed.wait(5)
        for _ in range(100):  # the delivering thread frees the name once the callback returned
            try:
                successor = tb.Consumer("memory://close-in-callback")
                break
            except tb.TransportError:
                time.sleep(0.05)
        producer.send("b", np.arange(2))
        assert successor.recv("b", timeout=5).tolist() == [0, 1]
        successor.close()


@pytest.mark.parametrize("url", ["memory://nan", "tcp://127.0.0.1:0"])
def test_a_nan_timeout_is_a_config_error_not_a_wait_forever(url: str) -> None:
    with tb.Consumer(url) as consumer:
        with pytest.raises(tb.ConfigError, match="NaN"):
            consumer.recv("k", timeout=float("nan"))


@pytest.mark.parametrize(
    "option", [{"connect_timeout_s": -5}, {"send_timeout_s": float("nan")}, {"max_unacked_bytes": -1}]
)
def test_durations_below_zero_and_sizes_below_one_are_config_errors(option: dict) -> None:
    with pytest.raises(tb.ConfigError, match=next(iter(option))):
        tb.Producer("tcp://127.0.0.1:5555", **option)
    name, value = next(iter(option.items()))
    with pytest.raises(tb.ConfigError, match=name):
        tb.Producer(f"tcp://127.0.0.1:5555?{name}={value}")


def test_every_scheme_has_the_form_its_malformed_urls_are_told() -> None:
    assert set(tensorbus.transports.FORMS) == set(tensorbus.transports.TRANSPORTS)


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("shape", [(10, 100), (100, 300)], ids=["small", "pooled"])
def test_a_memory_producer_queues_a_plain_tensor_as_the_codec_encodes_it_aligned(
    checksum: bool, shape: tuple[int, int]
) -> None:
    """memory:// builds a plain ndarray's frame straight into its queued copy (its own short path: a small
    one whole in C, a larger one in a pooled buffer): the same bytes as the codec's frame, checksum
    included, in a 64-byte aligned buffer."""
    from tensorbus.transports.memory import HUB, SMALL_FRAME

    tensor = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)
    assert (tensor.nbytes < SMALL_FRAME) == (shape == (10, 100))
    with tb.Producer("memory://plain-frames", checksum=checksum) as producer:
        message_id = producer.send("k", tensor, metadata={"i": 7})
    queued = HUB.endpoint("plain-frames").get(threading.Event(), deadline=time.monotonic())
    assert queued is not None
    frame = queued[2]  # (position, source, frame)
    expected = tb.encode(tensor, key="k", metadata={"i": 7}, message_id=message_id, checksum=checksum)
    assert bytes(frame) == b"".join(bytes(memoryview(part).cast("B")) for part in expected)
    assert tb.buffers.address(frame) % 64 == 0
    assert (tb.loads(frame) == tensor).all()


def test_with_on_a_closed_producer_or_consumer_is_refused() -> None:
    producer, consumer = tb.Producer("memory://closed-with"), tb.Consumer("memory://closed-with")
    producer.close()
    consumer.close()
    for closed in (producer, consumer):
        with pytest.raises(tb.Closed, match="closed"), closed:
            pass
