"""shm:// beyond the behaviour suite: zero-copy views, memory handed back, empty(), pinning, cleanup, auth."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import logging
import mmap
import multiprocessing
import os
import select
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec import frame
from tensorbus.codec.frame import encode_raw
from tensorbus.transports import leading, shm_consumer
from tensorbus.transports import shm_control as control
from tensorbus.transports.shm_consumer import BATCH
from tensorbus.transports.shm_producer import ShmSender
from tensorbus.transports.shm_segments import (
    F_SEAL_FUTURE_WRITE,
    FUTURE_WRITE_SEALS,
    SEALS,
    sealed_memfd,
    touch_pages,
)
from tests.conftest import endpoint_url, require_native, require_torch
from tests.peers import make_tensor, same
from tests.shm_hostile import dropped_and_served_on, raw_producer
from tests.waiting import wait_for

MIB = 1 << 20


def shm_files() -> set[str]:
    """The files of /dev/shm that tensorbus could have made (other processes of the machine make theirs)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {name for name in names if "tensorbus" in name or name.startswith("tb-")}


def mapped_segments(pid: int | str = "self") -> list[tuple[int, int]]:
    """The address ranges of shm:// segments mapped by process `pid` (a closed endpoint leaves none, whatever
    it was sent: earlier tests in this process included)."""
    ranges = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if "memfd:tensorbus-shm" in line:
                start, end = line.split()[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def in_shared_memory(array: np.ndarray) -> bool:
    address = array.__array_interface__["data"][0]
    return any(start <= address < end for start, end in mapped_segments())


def test_received_arrays_are_read_only_views_of_shared_memory() -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        producer.send("a", np.arange(100_000, dtype=np.float32))
        got = consumer.recv("a", timeout=10)
        assert same(got, np.arange(100_000, dtype=np.float32))
        assert in_shared_memory(got) and not got.flags.writeable
        with pytest.raises(ValueError):
            got[0] = 1


def test_a_kept_array_is_unchanged_while_more_are_sent_and_memory_comes_back_on_release() -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        first = np.full(64 * 1024, 1.0, np.float32)
        producer.send("k", first)
        kept = consumer.recv("k", timeout=10)
        sender = producer.transport.sender_side
        for i in range(200):  # many more than one segment's slots of this size: free slots are reused
            producer.send("k", np.full(64 * 1024, float(i + 2), np.float32))
            assert (consumer.recv("k", timeout=10) == i + 2).all()
        assert (kept == 1.0).all()  # its slot was never written again
        slot_of_kept = min(sender._inflight)  # the oldest position still in flight: the kept array's
        assert sender._inflight[slot_of_kept].pinned
        del kept
        gc.collect()
        producer.send("k", np.zeros(4, np.float32))  # (the producer reads the consumer's "free" as it sends)
        consumer.recv("k", timeout=10)
        wait_for(lambda: sender.poll() or slot_of_kept not in sender._inflight, 10, "the kept array's slot freed")
        large = [s for s in sender.slots.segments.values() if s.slot >= 256 * 1024]
        assert len(large) <= 2  # 8 slots each: reused, not a segment per tensor (200 were sent)


@pytest.mark.parametrize("ack", ["take", "manual", "arrival"])
def test_the_producer_learns_what_was_taken_without_more_traffic(ack: str) -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url, ack=ack) as consumer, tb.Producer(url) as producer:
        for i in range(5):
            producer.send(f"t{i}", np.arange(10) * i)
        producer.flush(10)
        message = consumer.recv_message("t0", timeout=10)
        if ack == "manual":
            consumer.ack(message)
        sender = producer.transport.sender_side
        expected = 0 if ack == "arrival" else 4  # (the four in the table are untaken: sent again to a successor)
        wait_for(lambda: sender.poll() or sum(s.untaken for s in sender._inflight.values()) == expected, 10, "taken")


def test_empty_is_sent_in_place_without_copying_its_bytes() -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        array = producer.empty((512, 256), np.float32)
        array[...] = np.arange(512 * 256, dtype=np.float32).reshape(512, 256)
        producer.send("e", array)
        zeros = producer.zeros((3, 5), np.int64)
        producer.send("z", zeros)
        sender = producer.transport.sender_side
        assert sender.stats["in_place"] == 2 and sender.stats["copied"] == 0
        got = consumer.recv("e", timeout=10)
        assert same(got, np.arange(512 * 256, dtype=np.float32).reshape(512, 256))
        assert same(consumer.recv("z", timeout=10), np.zeros((3, 5), np.int64))
        producer.send("e", array)  # the consumer still views the first send: this one is a copy
        assert sender.stats["copied"] == 1
        assert same(consumer.recv("e", timeout=10), got)
    with tb.Producer("tcp://127.0.0.1:1") as other, pytest.raises(tb.ConfigError, match="shm://"):
        other.empty((2,), np.float32)


def test_empty_refuses_what_numpy_or_a_frame_would_refuse_and_keeps_no_slot_for_it() -> None:
    url = endpoint_url("shm")
    with tb.Producer(url) as producer:
        slots = producer.transport.sender_side.slots
        with pytest.raises(ValueError, match="negative"):
            producer.empty((-5, 3), np.float32)
        for dtype in (object, "U5"):
            with pytest.raises(tb.UnsupportedDtype):
                producer.empty((4,), dtype)
        assert sum(segment.in_use for segment in slots.segments.values()) == 0
        assert producer.empty(3, np.int16).shape == (3,)
        assert producer.empty(np.array([2, 3]), np.int16).shape == (2, 3)  # (any shape numpy takes)


def test_a_segment_passed_to_a_consumer_can_be_mapped_to_read_only() -> None:
    """A segment's memfd is sealed against writable mappings made after the producer's own: a consumer cannot
    write into the producer's memory (its `empty()` arrays, frames kept to be sent again)."""
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        producer.send("k", np.arange(1000))
        assert same(consumer.recv("k", timeout=30), np.arange(1000))
        segment = next(iter(producer.transport.sender_side.slots.segments.values()))
        fd = os.dup(segment.fd)  # (as the consumer holds it: the same open file)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, segment.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            mmap.mmap(fd, segment.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ).close()
        finally:
            os.close(fd)


def let_go(listener: Any) -> bool:
    """True once no array views a frame and the consumer sent its frees (an array dies on whichever thread held
    the last reference: the consumer's own may still hold the message it just delivered)."""
    for peer in listener._peers.values():
        with peer.acks._lock:  # (a view's end adds to "free" and takes from the pinned bytes in one step)
            if peer.acks.pinned.total or peer.acks.owed():
                return False
    return True


def test_a_drop_the_socket_has_no_room_for_is_told_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment the producer lets go of is dropped by the consumer too (its mapping keeps its memory): a "drop"
    the socket has no room for at first (a consumer behind) is sent again at the next look, not forgotten."""
    monkeypatch.setattr("tensorbus.transports.shm_producer.POOLED_BYTES", 0)  # (an idle segment goes at once)
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        sender, listener = producer.transport.sender_side, consumer.transport._listener
        producer.send("big", np.ones(8 << 20, np.uint8))
        got = consumer.recv("big", timeout=30)
        big = max(sender.slots.segments)
        producer.send("small", np.arange(4))  # (the class last taken keeps its segment for a stream: now small's)
        assert same(consumer.recv("small", timeout=30), np.arange(4))
        peer = next(iter(listener._peers.values()))
        assert big in peer.maps
        refused: list[Any] = []
        send = control.send

        def no_room_for_the_first_drop(sock: Any, *message: Any, **options: Any) -> None:
            if message[0] == "drop" and not refused:
                refused.append(message)
                raise BlockingIOError("no room")
            send(sock, *message, **options)

        monkeypatch.setattr(control, "send", no_room_for_the_first_drop)
        del got
        gc.collect()
        wait_for(lambda: let_go(listener), 10, "the consumer's free sent")
        unmapped = lambda: refused and big not in peer.maps and refused[0][1] not in peer.maps  # noqa: E731
        wait_for(lambda: sender.poll() or unmapped(), 10, "the segments unmapped, the refused drop's too")


@pytest.mark.parametrize("answer", ["prompt", "slow"])
def test_an_empty_array_sent_again_once_its_last_send_was_let_go_goes_in_place(
    answer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer reads the consumer's "free" before it decides: an `empty()` array whose last send no array
    views any more is sent in place again, not copied, whether or not the producer had read that yet. A "slow"
    consumer thread takes 50 ms between gathering its acks and sending them: they are owed until sent."""
    if answer == "slow":
        send = control.send

        def slow_ack(sock: Any, *message: Any, **options: Any) -> None:
            if message[0] == "ack":
                time.sleep(0.05)
            send(sock, *message, **options)

        monkeypatch.setattr(control, "send", slow_ack)
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        array = producer.empty((MIB // 4,), np.float32)
        listener = consumer.transport._listener
        for i in range(3):
            array[:] = i  # (written again only once it came back)
            producer.send("e", array)
            got = consumer.recv("e", timeout=10)
            assert (got == i).all() and in_shared_memory(got)
            del got
            gc.collect()
            wait_for(lambda: let_go(listener), 10, "the consumer's free sent")
        assert producer.transport.sender_side.stats == {"in_place": 3}


def test_past_max_pinned_bytes_frames_are_copied_out_and_freed_at_once() -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url, max_pinned_bytes=3 * MIB) as consumer, tb.Producer(url) as producer:
        kept = []
        for i in range(6):
            producer.send(f"t{i}", np.full(MIB // 4, i, np.float32))  # 1 MiB each
            kept.append(consumer.recv(f"t{i}", timeout=10))
        views = [in_shared_memory(a) for a in kept]
        assert views[:2] == [True, True] and views[3:] == [False, False, False]
        assert all((a == i).all() and not a.flags.writeable for i, a in enumerate(kept))
        producer.flush(10)
        sender = producer.transport.sender_side
        wait_for(lambda: sender.poll() or len(sender._inflight) <= 3, 10, "copied-out frames freed")


def test_frames_not_taken_yet_view_shared_memory_whatever_max_pinned_bytes_says() -> None:
    """`max_pinned_bytes` bounds what taken arrays keep viewing; frames in the table are `max_buffered_bytes`'s:
    six frames waiting in the table stay views past a 3 MiB bound, and only once the application keeps them all
    is a new frame copied out."""
    url = endpoint_url("shm")
    with tb.Consumer(url, max_pinned_bytes=3 * MIB) as consumer, tb.Producer(url) as producer:
        for i in range(6):
            producer.send(f"t{i}", np.full(MIB // 4, i, np.float32))  # 1 MiB each, none taken yet
        producer.flush(10)
        kept = [consumer.recv(f"t{i}", timeout=10) for i in range(6)]
        assert all(in_shared_memory(a) and (a == i).all() for i, a in enumerate(kept))
        producer.send("past", np.full(MIB // 4, 9, np.float32))
        past = consumer.recv("past", timeout=10)
        assert not in_shared_memory(past) and (past == 9).all()
        del kept
        gc.collect()
        producer.send("again", np.full(MIB // 4, 7, np.float32))
        again = consumer.recv("again", timeout=10)
        assert in_shared_memory(again) and (again == 7).all()


def test_frames_of_a_producer_gone_count_once_taken_and_acknowledged_ones_under_manual_acks() -> None:
    """The ledger releases nothing of a closed connection: its viewed frames count from its end. Under ack="manual"
    a frame counts once acknowledged (until then the table's `max_buffered_bytes` counts it)."""
    url = endpoint_url("shm")
    with tb.Consumer(url, max_pinned_bytes=3 * MIB) as consumer:
        with tb.Producer(url) as first:
            for i in range(4):
                first.send(f"t{i}", np.full(MIB // 4, i, np.float32))  # 1 MiB each
            first.flush(10)
        kept = [consumer.recv(f"t{i}", timeout=10) for i in range(4)]  # (the producer's end may come before or after)
        assert all(in_shared_memory(a) and (a == i).all() for i, a in enumerate(kept))
        with tb.Producer(url) as second:
            second.send("past", np.full(MIB // 4, 9, np.float32))
            assert not in_shared_memory(consumer.recv("past", timeout=10))
    url = endpoint_url("shm")
    with tb.Consumer(url, max_pinned_bytes=3 * MIB, ack="manual") as consumer, tb.Producer(url) as producer:
        for i in range(4):
            producer.send(f"m{i}", np.full(MIB // 4, i, np.float32))
        messages = [consumer.recv_message(f"m{i}", timeout=10) for i in range(4)]
        producer.send("unacked", np.full(MIB // 4, 5, np.float32))  # none acknowledged: none counts yet
        assert in_shared_memory(consumer.recv("unacked", timeout=10))
        for message in messages:
            consumer.ack(message)
        producer.send("acked", np.full(MIB // 4, 6, np.float32))  # four kept and acknowledged: past the bound
        assert not in_shared_memory(consumer.recv("acked", timeout=10))
        assert all(in_shared_memory(m.tensor) and (m.tensor == i).all() for i, m in enumerate(messages))


PLAIN = [
    ("small", np.arange(1024, dtype=np.float32), {"i": 7, "tag": "x"}),
    ("scalar", np.array(3.5), None),
    ("empty", np.zeros((0, 5), np.uint8), {"empty": True}),
    ("fortran", np.asfortranarray(np.arange(20.0).reshape(4, 5)), None),
    ("big-endian", np.arange(6, dtype=">i4"), None),
    ("large", np.arange(MIB, dtype=np.float32), None),
]


def test_a_plain_arrays_frame_made_in_c_is_the_frame_encode_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain ndarray's send writes its C-made head and its bytes into the slot (`send_plain`): byte for byte the
    frame the Python encoder makes, and received as sent."""
    require_native(frame.NATIVE is not None, "the C codec extension (tensorbus/codec/_native.c)")
    written: list[bytes] = []
    send_plain = ShmSender.send_plain
    monkeypatch.setattr(
        ShmSender,
        "send_plain",
        lambda self, head, payload: (written.append(bytes(head) + bytes(payload)), send_plain(self, head, payload)),
    )
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        ids = [producer.send(key, tensor, metadata=metadata) for key, tensor, metadata in PLAIN]
        assert len(written) == len(PLAIN)  # every one of them went the C head's way
        with monkeypatch.context() as python_only:
            python_only.setattr(frame, "NATIVE", None)
            for (key, tensor, metadata), message_id, sent in zip(PLAIN, ids, written, strict=True):
                expected = tb.dumps(tensor, key=key, metadata=metadata, message_id=message_id, checksum=False)
                assert sent == bytes(expected)
        for key, tensor, metadata in PLAIN:
            message = consumer.recv_message(key, timeout=10)
            assert message.tensor.dtype == tensor.dtype and np.array_equal(message.tensor, tensor)
            assert message.metadata == (metadata or {})


def test_max_pinned_bytes_bounds_the_arrays_of_every_producer_together_even_one_gone() -> None:
    """One bound for the consumer, not one per producer: arrays kept from a producer that closed still view its
    memory, and count."""
    url = endpoint_url("shm")
    with tb.Consumer(url, max_pinned_bytes=3 * MIB) as consumer:
        with tb.Producer(url) as first:
            first.send("a", np.full(MIB // 2, 1, np.float32))  # 2 MiB
            a = consumer.recv("a", timeout=10)
        with tb.Producer(url) as second:
            second.send("b", np.full(MIB // 2, 2, np.float32))  # 2 MiB more: past the bound, copied out
            b = consumer.recv("b", timeout=10)
            del a
            gc.collect()
            second.send("c", np.full(MIB // 2, 3, np.float32))  # "a" released: within the bound again
            c = consumer.recv("c", timeout=10)
        assert not in_shared_memory(b) and in_shared_memory(c)
        assert (b == 2).all() and (c == 3).all()


def test_backpressure_a_send_waits_for_acks_and_times_out_naming_the_endpoint() -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url, max_buffered_bytes=2 * MIB) as consumer:  # takes nothing: holds after 1 MiB
        with tb.Producer(url, max_unacked_bytes=2 * MIB, send_timeout_s=0.5, close_timeout_s=0.1) as producer:
            with pytest.raises(tb.Timeout, match="shm://"):
                for _ in range(20):
                    producer.send("x", np.zeros(MIB // 4, np.float32))
            assert len(consumer.table) >= 1


def test_a_flush_asks_a_sleeping_consumer_for_its_acks_and_gets_them_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer owes acks only for what it received (nothing taken, nothing urgent) and sleeps for a minute
    (its LINGER_S and IDLE_S): the producer's flush asks, and the answer comes within the flush's 10 s."""
    for name in ("IDLE_S", "LINGER_S"):
        monkeypatch.setattr(control, name, 60.0)
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        for i in range(3):
            producer.send(f"k{i}", np.full(1024, i, np.float32))
        wait_for(lambda: len(consumer.table) == 3, 10, "three tensors in the table")
        producer.flush(10)
        assert producer.transport.sender_side.unacked_bytes == 0  # type: ignore[attr-defined]


def test_auth_secret_guards_the_control_socket() -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url, auth_secret="s3cret") as consumer:
        with pytest.raises(tb.AuthRefused, match="auth_secret"), tb.Producer(url) as producer:
            producer.send("a", np.arange(3))
        with tb.Producer(url, auth_secret="wrong", reconnect_timeout_s=1) as producer:
            with pytest.raises(tb.AuthRefused, match="auth_secret"):
                producer.send("a", np.arange(3))
        with tb.Producer(url, auth_secret="s3cret") as producer:
            producer.send("a", np.arange(3))
        assert same(consumer.recv("a", timeout=10), np.arange(3))


def test_a_second_consumer_of_a_name_is_refused_and_the_socket_is_private() -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer:
        with pytest.raises(tb.TransportError, match="already has a consumer"):
            tb.Consumer(url)
        path = consumer.transport.path
        folder = os.stat(os.path.dirname(path))
        assert folder.st_uid == os.getuid() and folder.st_mode & 0o077 == 0
    assert not os.path.exists(path)  # removed on close


def test_without_memfd_a_clear_transport_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "memfd_create")
    with pytest.raises(tb.TransportError, match="memfd_create"):
        tb.Consumer(endpoint_url("shm"))
    with pytest.raises(tb.TransportError, match="memfd_create"):
        tb.Producer(endpoint_url("shm"))


def test_torch_tensors_come_back_as_views() -> None:
    torch = require_torch()
    url = endpoint_url("shm")
    with tb.Consumer(url, like="torch") as consumer, tb.Producer(url) as producer:
        producer.send("t", torch.arange(10, dtype=torch.float32))
        got = consumer.recv("t", timeout=10)
        assert isinstance(got, torch.Tensor) and torch.equal(got, torch.arange(10, dtype=torch.float32))


def test_after_a_clean_close_nothing_is_left() -> None:
    before = shm_files()
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        for i in range(20):
            producer.send("a", make_tensor({"n": 300_000, "seed": i}))
        got = [consumer.recv("a", timeout=10) for _ in range(20)]
        path = consumer.transport.path
    assert same(got[7], make_tensor({"n": 300_000, "seed": 7}))  # kept arrays outlive both ends
    del got
    gc.collect()
    assert mapped_segments() == [] and shm_files() == before and not os.path.exists(path)


def test_a_chunk_of_a_never_completed_tensor_is_unmapped_when_the_consumer_closes() -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url, close_timeout_s=0.5) as producer:  # (never acked: no flush)
        stride, count = 4096, 4  # one chunk of four: the reassembler keeps it (a view of the segment)
        header = {"kind": "chunk", "key": "part", "id": ["gone", 1], "chunk": [0, count, count * stride, stride]}
        producer.transport.send(encode_raw(header, [bytes(stride)], stride), key="part")
        wait_for(lambda: consumer.intake.reassembler.pending == 1, 10, "the chunk to reach the reassembler")
    gc.collect()
    assert mapped_segments() == []  # (consumer, its intake and reassembler are still referenced here)
    assert consumer.intake.reassembler.pending == 0


# -- SIGKILL of either side ------------------------------------------------------------------------


def _produce_forever(url: str, sent: Any) -> None:
    with tb.Producer(url) as producer:
        for i in range(100_000):
            producer.send("s", make_tensor({"n": 256 * 1024, "seed": i % 7}), metadata={"i": i})
            sent.value = i + 1


def _consume(url: str, received: Any) -> None:
    with tb.Consumer(url) as consumer:
        kept = []
        for message in consumer:
            kept.append(message.tensor)  # keeps every array: pins the producer's memory
            received.value = message.metadata["i"] + 1


def test_producer_killed_mid_stream_kept_arrays_stay_and_memory_is_reclaimed() -> None:
    before = shm_files()
    url = endpoint_url("shm")
    ctx = multiprocessing.get_context("spawn")
    sent = ctx.Value("i", 0)
    with tb.Consumer(url) as consumer:
        peer = ctx.Process(target=_produce_forever, args=(url, sent))
        peer.start()
        kept = [consumer.recv_message("s", timeout=60) for _ in range(10)]
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        for message in kept:  # still there, bit for bit, after their producer died
            assert same(message.tensor, make_tensor({"n": 256 * 1024, "seed": message.metadata["i"] % 7}))
        while len(consumer.table):  # what it had sent before dying is still delivered
            consumer.next_message(timeout=5)
        del kept, message
        gc.collect()
        wait_for(lambda: mapped_segments() == [], 10, "no segment mapped")  # gone with the last view
        with tb.Producer(url) as producer:  # the consumer serves on
            producer.send("after", np.arange(5))
        assert same(consumer.recv("after", timeout=10), np.arange(5))
    assert shm_files() == before


@pytest.mark.parametrize("notices", ["ring", "datagrams"])
def test_a_send_to_a_consumer_that_reads_no_more_times_out_after_send_timeout_s(
    notices: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer whose table is full holds its producer back and reads none of its notices: a notice the
    socket has no room for waits in the producer (never inside a blocking send, which no timeout bounded),
    and the next send raises `Timeout` after `send_timeout_s`."""
    if notices == "datagrams":
        monkeypatch.setattr("tensorbus.transports.shm_producer.shm_ring.available", lambda: False)
    url = endpoint_url("shm")
    tensor = np.ones(1024, np.float32)
    with tb.Consumer(url, max_buffered_bytes=1 << 20) as consumer:
        with tb.Producer(url, send_timeout_s=2, close_timeout_s=0.5) as producer:
            started = time.monotonic()
            with pytest.raises(tb.Timeout):
                for _ in range(1_000_000):
                    producer.send("k", tensor)
            assert time.monotonic() - started < 60
            consumer.abort("done")


@pytest.mark.parametrize("notices", ["ring", "datagrams"])
def test_a_send_returns_once_its_consumer_was_told_of_it(notices: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer whose full table holds its producer back reads no notices for a while; a send that finds no
    room for its notice waits for room (`send_timeout_s`) rather than return with it untold: a producer that
    sends its last tensor and goes idle (waiting for an answer) must not leave it where nothing would send it."""
    if notices == "datagrams":
        monkeypatch.setattr("tensorbus.transports.shm_producer.shm_ring.available", lambda: False)
    url = endpoint_url("shm")
    tensor = np.ones(1024, np.float32)
    count = 3_000
    with tb.Consumer(url, max_buffered_bytes=256 << 10) as consumer:
        got = []

        def receive() -> None:
            with contextlib.suppress(tb.Timeout):
                for _ in range(count):
                    got.append(consumer.recv("k", timeout=30))

        receiving = threading.Thread(target=receive)
        receiving.start()
        with tb.Producer(url, send_timeout_s=60) as producer:
            for _ in range(count):
                producer.send("k", tensor)
                assert not producer.transport.sender_side._untold
            receiving.join(60)  # (no flush: every notice was in the socket or the ring when its send returned)
            assert len(got) == count


def test_a_producer_whose_consumer_left_tensors_untaken_closes_within_close_timeout_s() -> None:
    """Its close flushes: the untaken tensors wait for a successor, dialled for `close_timeout_s` (the flush's
    deadline), not for the longer `reconnect_timeout_s`; a flush's timeout bounds the dialling the same way."""
    url = endpoint_url("shm")
    producer = tb.Producer(url, close_timeout_s=1, reconnect_timeout_s=60)
    with tb.Consumer(url):
        for i in range(5):
            producer.send("k", np.full(4, i, np.int32))
        producer.flush(30)  # (in its table, untaken)
    started = time.monotonic()
    with pytest.raises(tb.TransportError, match="flush's timeout"):
        producer.flush(1)
    producer.close()
    assert time.monotonic() - started < 20  # (60 s each, had they waited for reconnect_timeout_s)


def test_a_consumer_holding_a_producer_back_does_not_spin_while_its_table_is_full() -> None:
    """A full table holds a producer's next message back, and its socket is not read meanwhile: nor is it
    watched, or every wait would return at once (its messages wait in it) and the reading thread spin a core
    while the application is behind. The selector's waits in one second are counted: ~20 waiting idly, tens of
    thousands spinning."""
    url = endpoint_url("shm")
    tensor = np.ones(1024, np.float32)
    with tb.Consumer(url, max_buffered_bytes=256 << 10) as consumer:
        producer = tb.Producer(url, send_timeout_s=60, close_timeout_s=0.5)
        stopped = threading.Event()

        def send_until_stopped() -> None:
            with contextlib.suppress(tb.TensorBusError):
                while not stopped.is_set():
                    producer.send("k", tensor)

        sending = threading.Thread(target=send_until_stopped)
        sending.start()
        try:
            listener = consumer.transport._listener
            wait_for(lambda: any(peer.held is not None for peer in listener._peers.values()), 30, "a producer held")
            waits = [0]
            select = listener._selector.select

            def counted(timeout: float | None = None) -> Any:
                waits[0] += 1
                return select(timeout)

            listener._selector.select = counted
            time.sleep(1.0)  # (a window to count in, not a wait for an event)
            assert waits[0] < 500, waits[0]
            assert consumer.recv("k", timeout=30) is not None  # (and it still serves)
        finally:
            stopped.set()
            consumer.abort("done")
            sending.join(30)
            producer.close()


@pytest.mark.parametrize("notices", ["ring", "datagrams"])
def test_what_a_consumer_took_before_it_closed_does_not_go_to_its_successor(
    notices: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer's close sends its last acks (the tensors it took); the producer's next send finds it gone
    (EPIPE) and reads those acks before it lets go of the connection: its successor gets only the new tensor.
    On both kinds of notices (the ring, or a datagram a frame where the ring is not built)."""
    if notices == "datagrams":
        monkeypatch.setattr("tensorbus.transports.shm_producer.shm_ring.available", lambda: False)
    url = endpoint_url("shm")
    with tb.Producer(url) as producer:
        with tb.Consumer(url) as first:
            for i in range(10):
                producer.send("k", np.full(4, i, np.int32))
            assert [int(first.recv("k", timeout=30)[0]) for _ in range(10)] == list(range(10))
        with tb.Consumer(url) as successor:
            producer.send("k", np.full(4, 99, np.int32))
            producer.flush(30)
            assert int(successor.recv("k", timeout=30)[0]) == 99
            assert len(successor.table) == 0  # (none of the first's again)


def test_consumer_killed_mid_stream_the_producer_reclaims_and_resends_to_the_next() -> None:
    before = shm_files()
    url = endpoint_url("shm")
    ctx = multiprocessing.get_context("spawn")
    received = ctx.Value("i", 0)
    peer = ctx.Process(target=_consume, args=(url, received))
    peer.start()
    with tb.Producer(url, reconnect_timeout_s=30) as producer:
        sender = producer.transport.sender_side
        for i in range(10):
            producer.send("s", make_tensor({"n": 256 * 1024, "seed": i}), metadata={"i": i})
        wait_for(lambda: received.value >= 5, 30, "5 tensors received")
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        segments_before = len(sender.slots.segments)
        with tb.Consumer(url) as consumer:  # takes over the dead one's socket
            for i in range(10, 20):
                producer.send("s", make_tensor({"n": 256 * 1024, "seed": i}), metadata={"i": i})
            producer.flush(30)
            got = {}
            while len(consumer.table):
                message = consumer.next_message(timeout=5)
                got[message.metadata["i"]] = message.tensor
            # all sent after, and every one the dead one's application had not taken (the one it was
            # taking when killed may have been handed out)
            assert set(range(received.value + 1, 20)) <= set(got)
            assert all(same(t, make_tensor({"n": 256 * 1024, "seed": i})) for i, t in got.items())
            del got, message
            gc.collect()
            # the dead consumer's segments were retired and dropped: not one kept per tensor
            wait_for(lambda: sender.poll() or len(sender.slots.segments) <= segments_before, 10, "segments dropped")
    gc.collect()
    assert mapped_segments() == [] and shm_files() == before


def test_close_from_another_thread_while_a_recv_waits() -> None:
    url = endpoint_url("shm")
    consumer = tb.Consumer(url)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            consumer.recv("never", timeout=30)
        except tb.TensorBusError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_for(lambda: consumer.table._waiters.get("never"), 30, "the recv waiting in the table")
    consumer.close()
    waiter.join(10)
    assert isinstance(errors[0], tb.Aborted)


@pytest.mark.parametrize(
    ("attack", "reason"),
    [
        ("unknown segment", "a frame in an unknown segment 99"),
        ("outside its segment", "a frame outside its segment"),
        ("unsealed segment", "not sealed at its size"),
        ("unreserved segment", "did not reserve"),
        ("reserved past its end", "did not reserve"),
        ("garbage", ""),
        ("short drop", "unexpected control message 'drop'"),
        ("empty", ""),
    ],
)
def test_a_hostile_producer_is_dropped_and_the_consumer_serves_on(
    attack: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tensorbus")  # (the CLI's in-process tests leave the root at CRITICAL)
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, contextlib.closing(raw_producer(consumer.transport.path)[0]) as sock:
        if attack == "unknown segment":
            control.send(sock, "frame", 1, 99, 0, 64)
        elif attack == "garbage":
            sock.send(b"\xc1not msgpack")
        elif attack in ("short drop", "empty"):  # well-formed msgpack, too short for its kind
            control.send(sock, *(["drop"] if attack == "short drop" else []))
        elif attack == "outside its segment":  # a segment made as a producer makes one, then a frame past its end
            size = 4096
            fd, mapped = sealed_memfd("hostile", size, "a hostile segment", ours_to_write=True)
            touch_pages(mapped, write=True)
            control.send(sock, "seg", 1, size, fds=[fd])
            os.close(fd)
            control.send(sock, "frame", 1, 1, 4000, 200)
            mapped.close()
        else:  # a segment not sealed, or with no memory behind it (64 MiB of holes): refused at once, so nothing
            sealed = attack != "unsealed segment"  # is sent after it (it could meet a closed socket)
            size = 64 << 20 if attack in ("unreserved segment", "reserved past its end") else 4096
            fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING if sealed else 0)
            os.ftruncate(fd, size)
            if attack == "reserved past its end":  # (its memory counts as much as its size, all of it holes)
                libc = ctypes.CDLL(None, use_errno=True)
                keep_size = 1  # FALLOC_FL_KEEP_SIZE
                fallocate = libc.fallocate
                fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
                assert fallocate(fd, keep_size, size, size) == 0, os.strerror(ctypes.get_errno())
            if sealed:  # (as a producer seals one: the holes are what refuses it, not a seal it lacks)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | (F_SEAL_FUTURE_WRITE if FUTURE_WRITE_SEALS else 0))
            control.send(sock, "seg", 1, size, fds=[fd])
            os.close(fd)
        dropped_and_served_on(sock, consumer, url)
        wait_for(lambda: "memfd:hostile" not in Path("/proc/self/maps").read_text(), 10, "its segment unmapped")
    drops = [r.getMessage() for r in caplog.records if "dropped a producer" in r.getMessage()]
    assert len(drops) == 1 and reason in drops[0], drops  # (dropped for what it did, not for something else)


def test_two_threads_sending_on_one_producer() -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:

        def send(prefix: str) -> None:
            for i in range(200):
                producer.send(prefix, np.full(1000 + i, i, np.int32))

        senders = [threading.Thread(target=send, args=(p,)) for p in ("a", "b")]
        for thread in senders:
            thread.start()
        for thread in senders:
            thread.join(60)
        for prefix in ("a", "b"):  # in order per key, every one intact
            for i in range(200):
                assert same(consumer.recv(prefix, timeout=10), np.full(1000 + i, i, np.int32))


class _SelectSpy:
    """Calls through to a listener's selector, noting on the thread `ident` each poll (timeout 0) and each
    wait that may sleep (any other timeout)."""

    def __init__(self, listener: Any, ident: int) -> None:
        self.select, self.ident = listener._selector.select, ident
        self.polled = multiprocessing.get_context("fork").Event()  # (a forked producer may wait for it)
        #: set as a wait of a second or more begins: a receive's, toward its deadline (not the few ms acks owed leave)
        self.slept = multiprocessing.get_context("fork").Event()
        self.sleeps: list[float | None] = []
        listener._selector.select = self

    def __call__(self, timeout: float | None = None) -> Any:
        if threading.get_ident() == self.ident:
            if timeout == 0:
                self.polled.set()
            else:
                self.sleeps.append(timeout)
                if timeout is None or timeout >= 1.0:
                    self.slept.set()
        return self.select(timeout)


def test_a_waiting_recv_polls_and_takes_a_frame_that_comes_meanwhile_without_sleeping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (a step's wait bounds its poll, and a recv leads in slices: here the recv's deadline bounds both)
    monkeypatch.setattr(control, "IDLE_S", 60.0)
    monkeypatch.setattr(leading, "POLL_S", 60.0)
    url = endpoint_url("shm")
    with tb.Consumer(url, spin_s=60.0) as consumer, tb.Producer(url) as producer:
        producer.send("warm", np.zeros(4, np.float32))  # (connected, and its segment mapped)
        warm = consumer.recv("warm", timeout=10)
        listener = consumer.transport._listener
        spy = _SelectSpy(listener, threading.get_ident())
        before = listener.spins.copy()
        # the frame is sent once the recv polls (from another process: a thread would wait for the poller's GIL)
        sent = multiprocessing.get_context("fork").Process(target=_send_when, args=(url, spy.polled))
        sent.start()
        try:
            got = consumer.recv("k", timeout=30)
        finally:
            sent.join(30)
        assert same(got, np.arange(1024, dtype=np.float32)) and same(warm, np.zeros(4, np.float32))
        assert spy.sleeps == []  # (the receive never waited in the selector: it polled until the frame came)
        assert listener.spins["found"] > before["found"] and listener.spins["out"] == before["out"]


def _send_when(url: str, polled: Any) -> None:
    polled.wait(10)  # (sent anyway after that: the receive then slept, and the test says so)
    with tb.Producer(url) as producer:
        producer.send("k", np.arange(1024, dtype=np.float32))


def _send_late(url: str, starts: list[Any], late_s: list[float]) -> None:
    """A producer: "warm" at once, then each tensor `late_s` after its event in `starts` (set by the receive)."""
    with tb.Producer(url) as producer:
        producer.send("warm", np.zeros(4, np.float32))
        for i, (started, late) in enumerate(zip(starts, late_s, strict=True)):
            started.wait(10)
            time.sleep(late)  # (the lateness itself, not a wait for something)
            producer.send(f"k{i}", np.full(256, i, np.float32))
        producer.flush(30)


def test_a_near_miss_makes_the_next_spin_longer_and_it_catches_a_reply_as_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame that comes soon after a receive's spin ran out (within NEAR_MISS spins: a peer answering late by
    its own wake-up) makes the next spin last STRETCH spins, which then takes a frame as late without sleeping:
    two ends of a ping-pong do not sleep in turn round after round (transports/spinning.py)."""
    monkeypatch.setattr(control, "IDLE_S", 60.0)
    monkeypatch.setattr(leading, "POLL_S", 60.0)
    # the windows widened, the rule kept: a near miss within 20 s of a spin that ran out, a longer spin of 10 s
    # (with 0.8 s and 1.2 s, a process kept off the CPU that long by a busy machine would miss them)
    monkeypatch.setattr(shm_consumer, "NEAR_MISS", 50.0)
    monkeypatch.setattr(shm_consumer, "STRETCH", 25.0)
    spin_s = 0.4
    url = endpoint_url("shm")
    context = multiprocessing.get_context("fork")
    starts = [context.Event(), context.Event()]
    # the first frame as soon as its receive's spin ran out and it sleeps toward its deadline (a near miss:
    # timed from the sleep, not from the receive's start, a receive the machine kept off the CPU cannot find it
    # still spinning), the second 1.5 spins after its receive began to poll (past a spin of spin_s, within one
    # of STRETCH spins; the first frame's ack, owed meanwhile, cuts the step's spin to LINGER_S, and the next
    # step's spin is the longer one)
    with tb.Consumer(url, spin_s=spin_s) as consumer:
        sender = context.Process(target=_send_late, args=(url, starts, [0.0, 1.5 * spin_s]))
        sender.start()
        try:
            assert same(consumer.recv("warm", timeout=30), np.zeros(4, np.float32))
            listener = consumer.transport._listener
            spy = _SelectSpy(listener, threading.get_ident())
            before = listener.spins.copy()
            spy.slept = starts[0]
            assert same(consumer.recv("k0", timeout=30), np.full(256, 0, np.float32))
            assert listener.spins["near"] == before["near"] + 1, listener.spins
            spy.sleeps.clear()
            out = listener.spins["out"]
            spy.polled = starts[1]
            assert same(consumer.recv("k1", timeout=30), np.full(256, 1, np.float32))
            assert spy.sleeps == [] and listener.spins["out"] == out  # (the longer spin took it)
        finally:
            sender.join(30)
        assert sender.exitcode == 0


@pytest.mark.parametrize("spin_s", [0.002, 0.0])
def test_polls_that_find_nothing_make_the_next_waits_sleep_at_once(spin_s: float) -> None:
    url = endpoint_url("shm")
    with tb.Consumer(url, spin_s=spin_s) as consumer, tb.Producer(url) as producer:
        producer.send("warm", np.zeros(4, np.float32))  # (a producer connected: the idle waits are short)
        consumer.recv("warm", timeout=10)
        listener = consumer.transport._listener
        spy = _SelectSpy(listener, threading.get_ident())
        before = listener.spins["out"]
        for _ in range(20):
            with pytest.raises(tb.Timeout):
                consumer.recv("never", timeout=0.01)
        polls, sleeps = listener.spins["out"] - before, len(spy.sleeps)
        assert sleeps >= 5  # (every step slept in the end: one or more a recv, if the machine lets it lead)
        if spin_s:  # 1, 2, 4, 8... steps sleep at once after each poll that ran out (without: a poll each)
            assert 1 <= polls <= 2 + sleeps // 2, (polls, sleeps)
        else:
            assert polls == 0 and not spy.polled.is_set()


def _echo(fwd: str, bwd: str, count: int) -> None:
    with tb.Consumer(fwd, spin_s=60.0) as consumer, tb.Producer(bwd) as producer:
        for _ in range(count):
            producer.send("pong", consumer.recv("ping", timeout=30))
        consumer.recv("stop", timeout=30)  # (its flush's request would meet the last receive's read on)
        producer.flush(30)


def _ping_pong(monkeypatch: pytest.MonkeyPatch, count: int) -> tuple[Any, list[int]]:
    """`count` round trips against an echo process, every bound on a poll but the receive's own deadline lifted (each
    reply is found polling, no receive sleeps): the receiving consumer's listener, and the acks it sent."""
    for module, name in ((control, "IDLE_S"), (control, "LINGER_S"), (leading, "POLL_S")):
        monkeypatch.setattr(module, name, 60.0)
    acks: list[int] = []
    send = control.send
    monkeypatch.setattr(
        control, "send", lambda sock, *m, **kw: (acks.append(1) if m[0] == "ack" else None, send(sock, *m, **kw))
    )
    fwd, bwd = endpoint_url("shm"), endpoint_url("shm")
    with tb.Consumer(bwd, spin_s=60.0) as consumer:
        listener = consumer.transport._listener  # type: ignore[attr-defined]
        echo = multiprocessing.get_context("fork").Process(target=_echo, args=(fwd, bwd, count))
        echo.start()
        try:
            with tb.Producer(fwd) as producer:
                for i in range(count):
                    producer.send("ping", np.full(1024, i, np.float32))
                    assert (consumer.recv("pong", timeout=30) == i).all()
                producer.send("stop", np.zeros(1))
        finally:
            echo.join(30)
        assert echo.exitcode == 0
    return listener, acks


def test_a_ping_pong_whose_receives_find_each_frame_polling_sends_one_ack_for_many(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, acks = _ping_pong(monkeypatch, 200)
    # (without the batching: an ack per frame, 200; with it, one per URGENT_COUNT frees or taken, and one
    # each time a receive returned before the frame came and the background read it, then slept)
    assert 1 <= len(acks) <= 200 // 4, len(acks)


def _lead_and_step(consumer: tb.Consumer, send: Any, served: Any, look: Any) -> Any:
    """Lead the consumer's reading on this thread, so its background thread steps aside and reads nothing: `send()`,
    then step as a waiting receive does until `served()`, its read on included; what `look()` saw then."""
    listener = consumer.transport._listener  # type: ignore[attr-defined]
    done = threading.Lock()
    done.acquire()
    seen: list[Any] = []

    def step(deadline: float | None, stop: Any) -> bool:
        send()  # (each "frame" message is in the consumer's socket once its send returns)
        listener._read_on_skip = 0  # (an earlier read on that found nothing would make this receive skip its own)
        while not served():
            listener._step(deadline, served)
        seen.append(look())
        done.release()
        return True

    assert listener.leadership.wait(done, time.monotonic() + 10, step)
    return seen[0]


def test_a_receive_reads_on_what_the_producer_sent_already_into_the_table() -> None:
    """A stream: the receive that leads delivers the frames waiting behind its own, so the receives after it take
    theirs from the table without leading, each lead costing several times a frame's delivery."""
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as producer:
        producer.send("warm", np.zeros(4, np.float32))  # (connected)
        consumer.recv("warm", timeout=10)
        listener = consumer.transport._listener  # type: ignore[attr-defined]
        before = listener.spins["read on"]
        reads_on, keys = _lead_and_step(
            consumer,
            lambda: [producer.send(f"k{i}", np.full(1024, i, np.float32)) for i in range(10)],
            lambda: "k0" in consumer.table.buffered_keys(),
            lambda: (listener.spins["read on"] - before, sorted(consumer.table.buffered_keys())),
        )
        assert (reads_on, keys) == (1, [f"k{i}" for i in range(10)])  # (one read on took k1 to k9 in)
        for i in range(10):
            assert (consumer.recv(f"k{i}", timeout=10) == i).all()


def test_a_read_on_takes_batch_messages_in_all_from_every_producer_in_turn() -> None:
    """A read on is bounded (the served receive returns soon, however many producers are connected), and does not
    leave one producer's frames behind another's."""
    url = endpoint_url("shm")
    with tb.Consumer(url) as consumer, tb.Producer(url) as a, tb.Producer(url) as b:
        for name, producer in (("a", a), ("b", b)):
            producer.send(f"warm-{name}", np.zeros(4, np.float32))
            consumer.recv(f"warm-{name}", timeout=10)

        def send() -> None:
            for i in range(40):
                a.send(f"a{i}", np.full(1024, i, np.float32))
                b.send(f"b{i}", np.full(1024, i, np.float32))

        keys = _lead_and_step(consumer, send, lambda: len(consumer.table) > 0, consumer.table.buffered_keys)
        # one frame served, then BATCH messages read on: frames, and the other producer's segment announcement
        assert BATCH - 1 <= len(keys) - 1 <= BATCH, len(keys)
        assert {key[0] for key in keys} == {"a", "b"}
        for i in range(40):
            assert (consumer.recv(f"a{i}", timeout=10) == i).all() and (consumer.recv(f"b{i}", timeout=10) == i).all()


def test_a_ping_pong_reads_on_rarely_after_reads_on_that_found_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ping-pong's reply never waits behind the receive's frame: the first reads on find nothing, and the next
    1, 2, 4... up to READ_ON_BACKOFF receives then return without a look."""
    listener, _ = _ping_pong(monkeypatch, 200)
    # (1, 2, 4, ..., 64 receives skipped after each: 200 receives look 8 times; without the back-off, 200)
    assert listener.spins["read on"] == 0 and 1 <= listener.spins["read on, none"] <= 10, listener.spins


def test_a_poke_while_the_leader_empties_its_wake_up_pipe_still_wakes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A poke that lands between the leader's reading of the wake-up pipe and its noting that it was woken is
    not lost: either it waits until the leader is done, or its byte stays in the pipe. (Lost, every later poke
    wrote nothing: a consumer's close then waited 10 s for its thread, now and then.)"""
    consumer = tb.Consumer(endpoint_url("shm"))
    listener = consumer.transport._listener  # type: ignore[attr-defined]
    me, read = threading.get_ident(), os.read
    poked: list[threading.Thread] = []
    kept: list[bool] = []
    done = threading.Lock()
    done.acquire()

    def read_and_be_poked_meanwhile(fd: int, n: int) -> bytes:
        if threading.get_ident() == me and fd == listener._wake_r and not poked:
            poked.append(threading.Thread(target=listener.poke))  # (another thread: the leader's own poke is none)
            poked[0].start()
            poked[0].join(0.5)  # (done at once where the pipe's emptying does not keep pokes out)
        return read(fd, n)

    def step(deadline: float | None, stop: Any) -> bool:
        """This test's thread leads (the background thread steps aside): it wakes as the leader does, poked."""
        if not kept:
            with monkeypatch.context() as patched:
                patched.setattr(os, "read", read_and_be_poked_meanwhile)
                listener._woken()
            poked[0].join(5)
            pending = bool(select.select([listener._wake_r], [], [], 0)[0])
            kept.append(pending or not listener._poked)
            done.release()
        return True

    assert listener.leadership.wait(done, time.monotonic() + 10, step)
    assert kept == [True], "a poke is noted as pending, but nothing is left in the pipe to wake the leader"
    started = time.monotonic()
    consumer.close()
    assert time.monotonic() - started < 5
