"""The rendezvous table on its own: keys, fencing, FIFO under threads, backpressure."""

from __future__ import annotations

import threading
import time
import tracemalloc

import numpy as np
import pytest

import tensorbus as tb


def test_make_key_and_parse_key_round_trip() -> None:
    key = tb.make_key("/job:worker/task:0", 0x1F, "/job:ps/task:1", "grad/w", (2, 7))
    assert key == "/job:worker/task:0;1f;/job:ps/task:1;grad/w;2:7"
    assert tb.parse_key(key) == ("/job:worker/task:0", 31, "/job:ps/task:1", "grad/w", (2, 7))


@pytest.mark.parametrize(
    "bad",
    [
        *("a;1;b;c", "a;1;b;c;0:0;x", "a;zz;b;c;0:0", "a;1;b;c;0", ";1;b;c;0:0", "a;1;b;c;x:0"),
        *("a;0x1f;b;c;0:0", "a; 1f;b;c;0:0", "a;+1f;b;c;0:0", "a;1_f;b;c;0:0", "a;1F;b;c;0:0", "a;1;b;c; 1:+2"),
        "a;1;b;c;\u0661:0",  # an Arabic-Indic one: int() would take it
    ],
)
def test_parse_key_rejects_anything_but_five_good_parts(bad: str) -> None:
    with pytest.raises(tb.ConfigError):
        tb.parse_key(bad)


def test_make_key_rejects_separators_in_parts() -> None:
    with pytest.raises(tb.ConfigError, match="without ';'"):
        tb.make_key("a;b", 1, "c", "d")


@pytest.mark.parametrize(
    ("incarnation", "frame_iter"),
    [(1.5, (0, 0)), (True, (0, 0)), (-1, (0, 0)), (1 << 64, (0, 0)), (1, ("0", "1:2")), (1, (0,)), (1, 5)],
)
def test_make_key_refuses_what_parse_key_would_refuse(incarnation: object, frame_iter: object) -> None:
    # such a key would not parse, so it would also slip past incarnation fencing
    with pytest.raises(tb.ConfigError):
        tb.make_key("w", incarnation, "ps", "g", frame_iter)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [float("inf"), 1e10])
def test_a_timeout_too_long_for_the_platform_waits_forever(timeout: float) -> None:
    table = tb.Rendezvous(max_buffered_bytes=8)
    threading.Timer(0.2, table.send, ("k", np.ones(4, np.uint8))).start()
    assert table.recv("k", timeout=timeout)[0] == 1  # not OverflowError from the lock's wait
    table.send("full", np.ones(8, np.uint8))
    threading.Timer(0.2, table.recv, ("full",)).start()
    assert table.wait_for_room(timeout=timeout) is True
    with tb.Consumer("memory://inf") as consumer, tb.Producer("memory://inf") as producer:
        producer.send("k", np.ones(1))
        producer.flush(timeout)
        assert consumer.recv("k", timeout=timeout)[0] == 1


def test_the_byte_count_comes_back_to_zero_when_a_sent_bundle_changes_afterwards() -> None:
    table = tb.Rendezvous(max_buffered_bytes=1000)
    grown, shrunk = {"a": np.zeros(100, np.uint8)}, {"a": np.zeros(100, np.uint8), "b": np.zeros(500, np.uint8)}
    table.send("g", grown)
    table.send("s", shrunk)
    assert table.buffered_bytes == 700
    grown["b"] = np.zeros(5000, np.uint8)  # in-process sends hand over the caller's dict itself
    del shrunk["b"]
    table.recv("g")
    table.recv("s")
    assert table.buffered_bytes == 0 and table.wait_for_room(timeout=0.1)


def test_every_waiting_thread_gets_its_own_aborted_error_with_the_reason() -> None:
    table = tb.Rendezvous()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            table.recv("never")
        except tb.Aborted as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(4)]
    for thread in threads:
        thread.start()
    while table.awaited_keys().get("never", 0) < 4:
        time.sleep(0.01)
    table.abort("bye")
    for thread in threads:
        thread.join(5)
    later: list[BaseException] = []
    table.recv_async("k", lambda _message, error: later.append(error))
    errors += later
    assert len(errors) == 5 and all(str(e) == "bye" for e in errors)
    assert len({id(e) for e in errors}) == 5  # one shared object would collect every thread's traceback


def test_older_incarnation_is_fenced_off() -> None:
    table = tb.Rendezvous()
    table.send(tb.make_key("w", 2, "ps", "x"), np.ones(1))
    with pytest.raises(tb.StaleIncarnation, match="incarnation 1 of 'w'"):
        table.send(tb.make_key("w", 1, "ps", "x"), np.ones(1))
    table.send(tb.make_key("w", 3, "ps", "x"), np.ones(1))  # a newer restart is fine
    table.send("plain-key", np.ones(1))  # keys that are not rendezvous keys are never fenced
    assert table.stats["stale"] == 1 and len(table) == 3


def test_keys_are_compared_in_full() -> None:
    table = tb.Rendezvous()
    table.send("layer1", np.ones(1))
    with pytest.raises(tb.Timeout):
        table.recv("layer", timeout=0.05)
    assert table.recv("layer1", timeout=1)[0] == 1


def test_many_threads_send_and_receive_every_tensor_once_in_fifo_order() -> None:
    table = tb.Rendezvous()
    keys, per_key = 8, 200
    received: dict[str, list[int]] = {f"k{k}": [] for k in range(keys)}

    def consume(key: str) -> None:
        for _ in range(per_key):
            received[key].append(int(table.recv(key, timeout=30)[0]))

    def produce(key: str) -> None:
        for i in range(per_key):
            table.send(key, np.array([i]))

    threads = [threading.Thread(target=consume, args=(f"k{k}",)) for k in range(keys)]
    threads += [threading.Thread(target=produce, args=(f"k{k}",)) for k in range(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(values == list(range(per_key)) for values in received.values())
    assert len(table) == 0 and table.buffered_bytes == 0


def test_buffer_limit_makes_wait_for_room_block_until_a_receive() -> None:
    table = tb.Rendezvous(max_buffered_bytes=1000)
    table.send("a", np.zeros(200))  # 1600 bytes: over the limit, but send never blocks
    assert table.buffered_bytes == 1600
    assert table.wait_for_room(timeout=0.05) is False
    started = time.monotonic()  # (before the Timer: taken after it, a preempted thread may take it late)
    threading.Timer(0.1, lambda: table.recv("a")).start()
    assert table.wait_for_room(timeout=30) is True
    assert time.monotonic() - started >= 0.09 and table.buffered_bytes == 0


def test_recv_async_is_served_from_the_buffer_immediately() -> None:
    table = tb.Rendezvous()
    table.send("a", np.ones(2), metadata={"m": 1})
    got: list[tb.Message] = []
    table.recv_async("a", lambda m, e: got.append(m))
    assert got[0].metadata == {"m": 1}


def test_callback_errors_do_not_break_the_table(caplog: pytest.LogCaptureFixture) -> None:
    table = tb.Rendezvous()
    table.recv_async("a", lambda m, e: 1 / 0)
    table.send("a", np.ones(1))
    table.send("b", np.ones(1))
    assert table.recv("b", timeout=1)[0] == 1
    assert "callback for 'a' raised" in caplog.text


def test_arrival_order_and_keyed_receives_share_one_queue() -> None:
    table = tb.Rendezvous()
    for i, key in enumerate(["a", "b", "a", "c"]):
        table.send(key, np.array([i]))
    assert table.recv("a", timeout=1)[0] == 0
    assert [int(table.next_message(timeout=1).tensor[0]) for _ in range(3)] == [1, 2, 3]
    with pytest.raises(tb.Timeout, match="no message"):
        table.next_message(timeout=0.01)


def test_an_interrupted_recv_leaves_no_waiter_behind() -> None:
    table = tb.Rendezvous()

    def interrupted(done: threading.Lock, deadline: float | None) -> bool:
        raise KeyboardInterrupt

    table.read_while_waiting = interrupted
    with pytest.raises(KeyboardInterrupt):
        table.recv("k")
    table.read_while_waiting = None
    table.send("k", np.arange(3))
    assert table.recv("k", timeout=1).tolist() == [0, 1, 2]  # not swallowed by a stale waiter


def test_a_recv_interrupted_just_as_it_was_served_puts_its_tensor_back_first() -> None:
    table = tb.Rendezvous()

    def served_then_interrupted(done: threading.Lock, deadline: float | None) -> bool:
        table.send("k", np.array([1]))  # hands the tensor to this very waiter
        raise KeyboardInterrupt

    table.send("other", np.array([0]))
    table.read_while_waiting = served_then_interrupted
    with pytest.raises(KeyboardInterrupt):
        table.recv("k")
    table.read_while_waiting = None
    table.send("k", np.array([2]))
    assert [table.recv("k", timeout=1)[0] for _ in range(2)] == [1, 2]  # per-key order kept
    assert table.next_message(timeout=1).key == "other" and len(table) == 0


def test_a_ctrl_c_in_a_callback_on_the_main_thread_is_raised_as_callback_interrupted() -> None:
    table, got = tb.Rendezvous(), []

    def interrupted(message: tb.Message | None, error: BaseException | None) -> None:
        got.append(message)
        raise KeyboardInterrupt("in the callback")

    table.recv_async("k", interrupted)
    with pytest.raises(tb.CallbackInterrupted, match="in the callback") as caught:
        table.send("k", np.arange(3))  # delivered on this (the main) thread: the Ctrl-C is the application's
    assert isinstance(caught.value, KeyboardInterrupt) and isinstance(caught.value.__cause__, KeyboardInterrupt)
    assert len(got) == 1 and len(table) == 0  # handed to the callback, not kept for another receiver


def test_fencing_remembers_a_bounded_number_of_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorbus.rendezvous

    monkeypatch.setattr(tensorbus.rendezvous, "MAX_SOURCES", 3)
    table = tb.Rendezvous()
    table.send(tb.make_key("kept", 5, "ps", "g"), np.ones(1))
    for i in range(10):  # peers naming ever new sources
        table.send(tb.make_key(f"src{i}", 1, "ps", "g"), np.ones(1))
        table.send(tb.make_key("kept", 5, "ps", "g"), np.ones(1))  # seen again: stays remembered
    assert len(table._incarnations) == 3
    with pytest.raises(tb.StaleIncarnation):
        table.send(tb.make_key("kept", 4, "ps", "g"), np.ones(1))


def test_an_incarnation_is_at_most_64_bits_and_a_long_source_name_is_not_kept() -> None:
    with pytest.raises(tb.ConfigError, match="malformed"):
        tb.parse_key("w;" + "f" * 17 + ";ps;g;0:0")  # one hex digit too many
    assert tb.parse_key("w;" + "f" * 16 + ";ps;g;0:0").src_incarnation == (1 << 64) - 1
    table = tb.Rendezvous()
    tracemalloc.start()
    try:
        for i in range(1000):  # peers naming sources as long as a key may be: fencing remembers each at a fixed cost
            key = tb.make_key(f"{i:04}" + "s" * 1000, 1, "ps", "g")
            table.send(key, np.ones(1))
            table.recv(key, timeout=1)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 256 << 10, held  # not the 1 MB of names
    with pytest.raises(tb.StaleIncarnation):
        table.send(tb.make_key("0007" + "s" * 1000, 0, "ps", "g"), np.ones(1))  # still fenced


def test_drop_unclaimed_drops_what_waited_longer_than_the_timeout_and_opens_room() -> None:
    table = tb.Rendezvous(max_buffered_bytes=100)
    opened = []
    table.room_opened = lambda: opened.append(True)
    table.send("old", np.zeros(100, np.uint8))  # fills the table
    assert table.drop_unclaimed(10, now=0.0) == []  # (the first look: it has come by now)
    table.send("new", np.zeros(1, np.uint8))
    assert table.drop_unclaimed(10, now=5.0) == []
    dropped = table.drop_unclaimed(10, now=10.0)
    assert [m.key for m in dropped] == ["old"] and table.stats["unclaimed"] == 1 and opened
    assert table.buffered_keys() == {"new": 1} and table.buffered_bytes == 1
    assert [m.key for m in table.drop_unclaimed(10, now=15.0)] == ["new"]
    assert len(table) == 0 and table.buffered_bytes == 0 and table.buffered_keys() == {}


# -- one producer's share of the table (max_buffered_bytes_per_producer) ------------------------------


def _message(key: str, nbytes: int) -> tb.Message:
    return tb.Message(key, np.zeros(nbytes, np.uint8), {})


def test_a_source_at_its_share_has_no_room_while_the_others_do() -> None:
    table = tb.Rendezvous(max_buffered_bytes=1000, max_buffered_bytes_per_producer=300)
    table.put(_message("a", 2000), source="A")  # larger than both limits: still taken into an empty share
    assert table.source_bytes("A") == 2000 and table.at_share("A")
    assert not table.has_room_for("a", "A")  # (the table is full too: nobody has room now)
    table.recv("a")
    assert table.source_bytes("A") == 0 and not table._by_source
    table.put(_message("a", 300), source="A")
    assert not table.has_room_for("x", "A") and table.has_room_for("x", "B") and table.has_room_for("x")
    handle = table.recv_async("x", lambda message, error: None)
    assert table.has_room_for("x", "A")  # someone waits for its key: handed over, it needs no room
    assert handle.cancel() and not table.has_room_for("x", "A")


def test_a_source_s_bytes_are_released_on_every_way_out_of_the_table() -> None:
    opened: list[int] = []
    table = tb.Rendezvous(max_buffered_bytes=10_000, max_buffered_bytes_per_producer=100)
    table.room_opened = lambda: opened.append(1)
    table.put(_message("a", 150), source="A")
    assert table.next_message().key == "a" and not table._by_source and opened  # taken in arrival order
    table.put(_message("a", 150), source="A")
    table.put(_message("b", 10), source="B")
    opened.clear()
    assert len(table.drop_unclaimed(1.0, now=0.0)) == 0
    assert len(table.drop_unclaimed(1.0, now=2.0)) == 2 and not table._by_source and opened  # unclaimed
    table.put(_message("a", 150), source="A")
    with pytest.raises(tb.StaleIncarnation):  # fenced: never counted
        table.put(_message("w;2;s;k;0:0", 1), source="A")
        table.put(_message("w;1;s;k;0:0", 1), source="A")
    assert table._by_source == {"A": table.buffered_bytes} and len(table) == 2
    table.abort("stop")  # aborted: all dropped
    assert not table._by_source and table.has_room_for("a", "A")


@pytest.mark.parametrize(
    ("options", "share"),
    [({}, 1 << 29), ({"max_buffered_bytes": 1000}, 500), ({"max_buffered_bytes_per_producer": 7}, 7)],
)
def test_a_producer_s_share_defaults_to_half_the_table(options: dict[str, int], share: int) -> None:
    with tb.Consumer("memory://share-default", **options) as consumer:
        assert consumer.table.max_source_bytes == share


@pytest.mark.parametrize(
    "options",
    [
        {"max_buffered_bytes_per_producer": 0},
        {"max_buffered_bytes_per_producer": -5},
        {"max_buffered_bytes_per_producer": 2.5},
        {"max_buffered_bytes_per_producer": "100"},
        {"max_buffered_bytes": 1000, "max_buffered_bytes_per_producer": 1001},
    ],
)
def test_a_bad_share_is_refused_at_construction(options: dict[str, object]) -> None:
    with pytest.raises(tb.ConfigError, match="max_buffered_bytes_per_producer"):
        tb.Consumer("memory://share-bad", **options)


def test_a_share_is_read_from_the_url_query() -> None:
    with tb.Consumer("memory://share-url?max_buffered_bytes=4096&max_buffered_bytes_per_producer=1024") as consumer:
        assert consumer.table.max_source_bytes == 1024
    with pytest.raises(tb.ConfigError, match="max_buffered_bytes_per_producer"):
        tb.Consumer("memory://share-url?max_buffered_bytes_per_producer=lots")
    with pytest.raises(tb.ConfigError, match="max_buffered_bytes_per_producer"):
        tb.Consumer("memory://share-url?max_buffered_bytes=4096&max_buffered_bytes_per_producer=4097")


def test_take_now_takes_the_oldest_buffered_message_of_its_key_and_never_waits() -> None:
    """What an asyncio receive takes when its tensor is there already: the oldest of the key, handed out
    (recorded as taken); None for a key with nothing buffered, and after an abort (a wait says why)."""
    table = tb.Rendezvous()
    handed: list[str] = []
    table.on_delivered_to_application = lambda message: handed.append(message.metadata["n"])
    for n in ("a1", "a2"):
        table.send("a", np.zeros(2), metadata={"n": n})
    table.send("b", np.zeros(2), metadata={"n": "b1"})
    assert table.take_now("c") is None
    first = table.take_now("a")
    assert first is not None and first.metadata["n"] == "a1" and handed == ["a1"]
    assert table.buffered_keys() == {"a": 1, "b": 1}
    table.abort("gone")
    assert table.take_now("a") is None and handed == ["a1"]
