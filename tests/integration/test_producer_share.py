"""One producer cannot occupy the whole table: past its share (`max_buffered_bytes_per_producer`) its
next tensor is held back, unread, while the other producers' tensors go on being taken.

On sockets a producer is a connection, in memory:// a `Producer`. Each socket test runs with the
intake's C delivery of plain frames and without it (the Python intake), which must count the same
bytes against the same producer.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

import tensorbus as tb
from tensorbus import intake
from tests.conftest import require_native
from tests.integration.test_socket import raw_peer
from tests.waiting import wait_for

KIB = 1 << 10
TABLE = 1024 * KIB
SHARE = 256 * KIB
TENSOR = 64 * KIB
#: how long an honest producer's tensors may take to be in the table while another producer floods it
#: (they take milliseconds; the rest is room for a loaded machine: held behind the flood, they would wait
#: for ever, or for the 30 s a receive allows)
HONEST_BOUND_S = 5.0


@pytest.fixture(params=["c", "python"])
def delivery(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The consumers made in the test deliver plain frames in C (where built) or the Python way."""
    if request.param == "python":
        monkeypatch.setattr(intake, "FAST", None)
    else:
        require_native(intake.FAST is not None, "the intake's C delivery (tensorbus/_intake.c)")
    yield request.param


def tensor(i: int) -> np.ndarray:
    return np.full(TENSOR, i % 251, np.uint8)


def test_a_producer_past_its_share_waits_while_another_is_still_served(delivery: str) -> None:
    consumer = _one_producer_past_its_share("tcp://127.0.0.1:0")
    fast = consumer.intake.fast_delivery
    assert (fast is not None and fast.taken > 0) if delivery == "c" else fast is None


def test_a_producer_past_its_share_waits_while_another_is_still_served_in_memory() -> None:
    _one_producer_past_its_share(f"memory://share-{uuid.uuid4().hex}")


def _one_producer_past_its_share(url: str) -> tb.Consumer:
    """A producer sends twice the table, nobody takes its tensors: past its share its next one is held
    back, while another producer's are taken at once. Then the first one's come, none lost."""
    with tb.Consumer(url, max_buffered_bytes=TABLE, max_buffered_bytes_per_producer=SHARE) as consumer:
        many = 2 * TABLE // TENSOR
        with tb.Producer(consumer.address) as greedy, tb.Producer(consumer.address) as honest:
            for i in range(many):
                greedy.send(f"a{i}", tensor(i))
            admitted = SHARE // TENSOR  # (each also counts its header: the last of these reaches the share)
            wait_for(lambda: consumer.intake._held_up == 1 and len(consumer.table) == admitted, 30, "the table full")
            assert sorted(consumer.table.buffered_keys()) == sorted(f"a{i}" for i in range(admitted))
            started = time.monotonic()
            for i in range(4):
                honest.send(f"b{i}", tensor(100 + i))
            for i in reversed(range(4)):  # (the last first: all of them were read)
                assert consumer.recv(f"b{i}", timeout=HONEST_BOUND_S).tolist() == tensor(100 + i).tolist()
            took = time.monotonic() - started
            assert took < HONEST_BOUND_S, took
            assert consumer.intake._held_up == 1  # the greedy producer still waits, and lost nothing:
            for i in range(many):  # taking its tensors makes room for the next ones
                assert consumer.recv(f"a{i}", timeout=30).tolist() == tensor(i).tolist()
            greedy.flush(30)
        assert consumer.stats["received"] == many + 4 and consumer.stats["duplicates"] == 0
        assert len(consumer.table) == 0 and not consumer.table._by_source
    return consumer


def test_tensors_dropped_unclaimed_give_their_producer_room_again(delivery: str) -> None:
    with tb.Consumer(
        "tcp://127.0.0.1:0", max_buffered_bytes=TABLE, max_buffered_bytes_per_producer=SHARE, unclaimed_timeout_s=0.2
    ) as consumer:
        with tb.Producer(consumer.address) as producer:
            for i in range(8):
                producer.send(f"a{i}", tensor(i))
            assert consumer.recv("a7", timeout=30).tolist() == tensor(7).tolist()  # the first ones were dropped
            producer.flush(30)
        assert consumer.stats["unclaimed"] > 0
        wait_for(lambda: len(consumer.table) == 0, 30, "the table emptied")
        assert not consumer.table._by_source


def test_one_hostile_connection_flooding_unclaimed_tensors_cannot_delay_an_honest_producer(delivery: str) -> None:
    frames = [tb.dumps(np.full(4 * KIB, 1, np.uint8), key=f"junk{i}", message_id=("hostile0", i)) for i in range(2000)]
    with tb.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=4 * TABLE) as consumer:  # (a share: half of it)
        hostile = raw_peer(consumer.address)
        flood = threading.Thread(target=_send_all, args=(hostile, frames), daemon=True)
        flood.start()  # 8 MiB of tensors nobody asks for, at a 4 MiB table: it fills its share, then waits
        try:
            wait_for(lambda: consumer.intake._held_up == 1, 30, "a delivery held up")
            assert consumer.table.buffered_bytes >= 2 * TABLE  # (its share: half the table)
            with tb.Producer(consumer.address) as honest:
                for round_ in range(5):
                    started = time.monotonic()
                    for i in range(20):
                        honest.send(f"h{round_}.{i}", np.full(16 * KIB, i, np.uint8))
                    honest.flush(10)
                    took = time.monotonic() - started
                    assert took < HONEST_BOUND_S, took
                    for i in range(20):
                        assert int(consumer.recv(f"h{round_}.{i}", timeout=0)[0]) == i
            assert consumer.intake._held_up == 1  # still held back, not read: its share is what it costs
            assert consumer.table.buffered_bytes < consumer.table.max_buffered_bytes
        finally:
            hostile.close()
            flood.join(30)


def _send_all(peer: socket.socket, frames: list[bytes]) -> None:
    """Send the frames until the consumer stops reading them (or the connection is closed)."""
    try:
        for frame in frames:
            peer.sendall(frame)
    except OSError:
        pass


@pytest.mark.parametrize("share", [None, 2 * TABLE], ids=["default-share", "explicit-share"])
def test_one_tensor_as_large_as_the_table_cannot_keep_another_producers_tensors_out(
    delivery: str, share: int | None
) -> None:
    """A connection's one tensor as large as the whole table, which nobody asks for, enters (its connection had
    nothing buffered) and fills the table; an honest producer then sends nine tensors nobody waits for yet and
    a tenth a `recv` waits for. The large tensor is over its producer's share: it is dropped to make room
    (logged, counted in stats["evicted"]), and the honest producer's tensors are all taken."""
    big = tb.dumps(np.ones(4 * TABLE, np.uint8), key="big", message_id=("hostile1", 1))
    with tb.Consumer(
        "tcp://127.0.0.1:0", max_buffered_bytes=4 * TABLE, max_buffered_bytes_per_producer=share
    ) as consumer:
        hostile = raw_peer(consumer.address)
        try:
            hostile.sendall(big)
            wait_for(lambda: consumer.table.buffered_bytes >= 4 * TABLE, 30, "the large tensor in the table")
            with tb.Producer(consumer.address) as honest:
                for i in range(9):
                    honest.send(f"unawaited{i}", tensor(i))
                honest.send("awaited", tensor(99))
                started = time.monotonic()
                assert int(consumer.recv("awaited", timeout=30)[0]) == 99
                assert time.monotonic() - started < HONEST_BOUND_S
                for i in range(9):
                    assert int(consumer.recv(f"unawaited{i}", timeout=5)[0]) == i % 251
            assert consumer.stats["evicted"] == 1 and "big" not in consumer.table.buffered_keys()
        finally:
            hostile.close()


def test_an_awaited_tensor_behind_its_own_producers_held_ones_waits_no_longer_than_unclaimed_timeout_s(
    delivery: str,
) -> None:
    """A producer past its share has its next tensor held back, unread, and the one a `recv` waits for is
    behind it on the same connection: with `unclaimed_timeout_s` the producer's oldest are dropped once
    that old, and the awaited one arrives within about that (docs/SECURITY.md)."""
    unclaimed_s = 1.0
    with tb.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=TABLE, unclaimed_timeout_s=unclaimed_s) as consumer:
        with tb.Producer(consumer.address) as producer:
            for i in range(2 * TABLE // TENSOR):  # twice the table: past its share, the rest waits unread
                producer.send(f"unawaited{i}", tensor(i))
            producer.send("awaited", tensor(99))
            started = time.monotonic()
            assert int(consumer.recv("awaited", timeout=30)[0]) == 99
            took = time.monotonic() - started
        assert took < 3 * unclaimed_s + HONEST_BOUND_S, took  # (dropped in rounds, each unclaimed_timeout_s old)
        assert consumer.stats["unclaimed"] >= 1
