"""Chunk splitting and reassembly: any order, duplicates, expiry, bounded memory."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec import frame as frame_module
from tensorbus.codec.chunking import SPLIT_CRC_FROM, encode_chunks, frame_size
from tensorbus.codec.restamping import restamp_chunks


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chunks_of(obj: object, size: int, seq: int = 1, key: str = "k") -> list[bytes]:
    frame = tb.encode(obj, key=key, message_id=("p", seq))
    return [b"".join(c) for c in tb.split(frame, max_chunk_bytes=size, message_id=("p", seq), key=key)]


def test_small_frames_are_not_split() -> None:
    frame = tb.encode(np.zeros(10))
    assert tb.split(frame, max_chunk_bytes=1 << 20, message_id=("p", 1)) == [frame]


def test_chunks_respect_the_size_limit_and_carry_their_fields() -> None:
    array = np.arange(200_000, dtype=np.float32)
    parts = tb.split(tb.encode(array), max_chunk_bytes=65536, message_id=("p", 7), key="k")
    total = frame_size(tb.encode(array))
    stride = tb.codec.parse(b"".join(parts[0])).header["chunk"][3]
    assert len(parts) == -(-total // stride) and stride > 65536 - 512
    for index, part in enumerate(parts):
        assert frame_size(part) <= 65536
        header = tb.codec.parse(b"".join(part)).header
        assert header["kind"] == "chunk" and header["id"] == ["p", 7] and header["key"] == "k"
        assert header["chunk"][:3] == [index, len(parts), total]


def test_split_slices_without_copying_the_tensor() -> None:
    array = np.arange(100_000, dtype=np.float64)
    parts = tb.split(tb.encode(array), max_chunk_bytes=100_000, message_id=("p", 1))
    assert any(np.shares_memory(np.frombuffer(buf, np.uint8), array) for buf in parts[1][1:])


def test_reassembly_in_any_order_with_duplicates() -> None:
    array = np.random.default_rng(0).random((300, 301))
    chunks = chunks_of(array, 50_000)
    rng = random.Random(3)
    stream = chunks + rng.sample(chunks, 5)
    rng.shuffle(stream)
    reassembler = tb.Reassembler()
    messages = [m for m in (reassembler.feed(c) for c in stream) if m is not None]
    assert len(messages) == 1
    assert messages[0].key == "k" and messages[0].message_id == ("p", 1)
    np.testing.assert_array_equal(messages[0].tensor, array)
    assert reassembler.stats["duplicates"] == 5 and reassembler.held_bytes == 0 and reassembler.pending == 0


def test_interleaved_messages() -> None:
    a, b = np.arange(50_000.0), np.arange(70_000, dtype=np.int32)
    ca, cb = chunks_of(a, 40_000, seq=1), chunks_of(b, 40_000, seq=2)
    stream = [c for pair in zip(ca, cb, strict=False) for c in pair] + ca[len(cb) :] + cb[len(ca) :]
    reassembler = tb.Reassembler()
    out = {m.message_id[1]: m.tensor for m in map(reassembler.feed, stream) if m is not None}
    np.testing.assert_array_equal(out[1], a)
    np.testing.assert_array_equal(out[2], b)


def test_unchunked_frames_pass_straight_through() -> None:
    message = tb.Reassembler().feed(tb.dumps(np.ones(3), key="x"))
    assert message is not None and message.key == "x"


def test_incomplete_messages_expire_and_free_memory() -> None:
    clock = FakeClock()
    reassembler = tb.Reassembler(timeout_s=5, clock=clock)
    chunks = chunks_of(np.zeros(100_000), 30_000)
    for c in chunks[:-1]:
        assert reassembler.feed(c) is None
    assert reassembler.held_bytes > 0
    clock.now = 6
    assert reassembler.expire() == 1
    assert reassembler.held_bytes == 0 and reassembler.stats["expired"] == 1
    later = reassembler.feed(tb.dumps(np.ones(2), key="later"))
    assert later is not None and later.key == "later"


def test_the_memory_limit_gives_up_the_message_whose_chunk_would_pass_it_and_keeps_going() -> None:
    reassembler = tb.Reassembler(max_bytes=1_000_000)
    big = chunks_of(np.zeros(100_000), 100_000, seq=1)  # 800 KB in 9 chunks of ~100 KB
    other = chunks_of(np.ones(100_000), 100_000, seq=2)
    assert reassembler.feed(big[0]) is None and reassembler.feed(other[0]) is None  # both start
    assert all(reassembler.feed(c) is None for c in big[1:5])  # over half here: `big` now holds its whole 800 KB
    assert reassembler.held_bytes > 900_000
    with pytest.raises(tb.LimitExceeded, match="limit is 1000000: message given up"):
        reassembler.feed(other[1])
    assert reassembler.pending == 1 and reassembler.stats["refused"] == 1
    assert all(reassembler.feed(c) is None for c in other[2:])  # its later chunks are dropped, not started again
    assert reassembler.pending == 1 and reassembler.stats["given_up_chunks"] == len(other) - 2
    messages = [reassembler.feed(c) for c in big[5:]]
    assert messages[-1] is not None and np.array_equal(messages[-1].tensor, np.zeros(100_000))
    assert reassembler.held_bytes == 0


def test_a_tiny_chunk_claiming_the_whole_budget_reserves_nothing() -> None:
    from tensorbus.codec.frame import encode_raw

    reassembler = tb.Reassembler(max_bytes=2 << 20)
    total, stride = (2 << 20) - (32 << 10), 1024
    count = -(-total // stride)
    last = total - (count - 1) * stride  # the last chunk may be smaller than the minimum stride
    header = {"kind": "chunk", "key": None, "id": ["evil", 1], "chunk": [count - 1, count, total, stride]}
    assert reassembler.feed(b"".join(encode_raw(header, [bytes(last)], last))) is None
    assert reassembler.held_bytes < 20 << 10  # what it sent and its bookkeeping, not the 2 MB it claims
    out = [reassembler.feed(c) for c in chunks_of(np.arange(150_000.0), 100_000, seq=7)]  # 1.2 MB: fits beside it
    assert out[-1] is not None and np.array_equal(out[-1].tensor, np.arange(150_000.0))


@pytest.mark.parametrize("as_bytes", [True, False])  # bytes are immutable: kept by reference like an owned buffer
def test_a_kept_chunk_holds_its_payload_not_the_padded_frame_it_came_in(as_bytes: bool) -> None:
    """The budget counts payloads: a chunk whose header is mostly padding must not pin that padding."""
    import tracemalloc

    from tensorbus.codec.frame import encode_raw

    reassembler = tb.Reassembler(max_bytes=256 << 20)
    total, stride = 64 << 20, 1024
    count = total // stride
    tracemalloc.start()
    try:
        for index in range(100):  # far less than half the message: no buffer yet, every chunk is kept as it came
            header = {"kind": "chunk", "key": None, "id": ["p", 1], "chunk": [index, count, total, stride]}
            header["pad"] = bytes(256 << 10)  # ignored by the reader, but it is part of the frame
            frame = b"".join(encode_raw(header, [bytes(stride)], stride))
            assert reassembler.feed(frame if as_bytes else bytearray(frame), owned=not as_bytes) is None
        del frame
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reassembler.held_bytes < 200 << 10
    assert held < 4 << 20  # 25 MB of frames pinned before the fix


def test_a_chunk_in_a_view_made_in_c_is_kept_as_a_copy() -> None:
    """A memoryview made by C code has no exporting object (`.obj` is None): its buffer's size is unknown."""
    import ctypes

    from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
    from_memory.restype, from_memory.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
    chunks = chunks_of(np.arange(600.0), 1200)
    reassembler = tb.Reassembler()
    kept = [ctypes.create_string_buffer(chunk, len(chunk)) for chunk in chunks]
    views = [
        from_memory(ctypes.addressof(buffer), len(chunk), 0x200) for buffer, chunk in zip(kept, chunks, strict=True)
    ]
    assert views[0].obj is None
    *firsts, last = [reassembler.feed(view, owned=True) for view in views]
    assert firsts == [None] * len(firsts) and last is not None and np.array_equal(last.tensor, np.arange(600.0))


def test_flood_of_chunks_claiming_huge_totals_allocates_nothing_beyond_the_limit() -> None:
    from tensorbus.codec.frame import encode_raw

    reassembler = tb.Reassembler(max_bytes=10 << 20)
    refused = 0
    for seq in range(1000):
        header = {"kind": "chunk", "key": None, "id": ["evil", seq], "chunk": [0, 1 << 20, 1 << 40, 1 << 20]}
        try:
            reassembler.feed(b"".join(encode_raw(header, [b"x" * 64], 64)))
        except tb.CodecError:
            refused += 1
    assert refused == 1000 and reassembler.held_bytes == 0


def test_a_chunk_lying_about_its_own_length_sets_no_memory_aside() -> None:
    from tensorbus.codec.frame import encode_raw

    reassembler = tb.Reassembler(max_bytes=2 << 20)
    header = {"kind": "chunk", "key": None, "id": ["evil", 1], "chunk": [0, 2, 2 << 20, 1 << 20]}
    with pytest.raises(tb.MalformedHeader, match="should carry 1048576 bytes, carries 64"):
        reassembler.feed(b"".join(encode_raw(header, [b"x" * 64], 64)))
    assert reassembler.held_bytes == 0 and reassembler.pending == 0
    out = [reassembler.feed(c) for c in chunks_of(np.zeros(200_000), 300_000)]  # the whole budget is still free
    assert out[-1] is not None and out[-1].tensor.shape == (200_000,)


def test_chunks_below_the_minimum_stride_are_refused() -> None:
    from tensorbus.codec.frame import encode_raw

    header = {"kind": "chunk", "key": None, "id": ["tiny", 1], "chunk": [0, 2, 2, 1]}
    with pytest.raises(tb.MalformedHeader, match="below the 1024-byte minimum"):
        tb.Reassembler().feed(b"".join(encode_raw(header, [b"x"], 1)))


def test_expiry_drops_exactly_the_messages_past_their_time() -> None:
    clock = FakeClock()
    reassembler = tb.Reassembler(timeout_s=5, clock=clock)
    for seq in range(6):  # started at t = 0, 1, ... 5
        clock.now = seq
        assert reassembler.feed(chunks_of(np.zeros(2_000), 4_000, seq=seq)[0]) is None
    clock.now = 8.5  # older than 5 s: those started at 0, 1, 2, 3
    assert reassembler.expire() == 4 and reassembler.pending == 2
    assert reassembler.is_pending(("p", 4)) and reassembler.is_pending(("p", 5))


def test_chunk_that_disagrees_or_lies_about_its_size() -> None:
    chunks = chunks_of(np.zeros(50_000), 30_000)
    other = chunks_of(np.zeros(60_000), 30_000)  # same message id, different total
    reassembler = tb.Reassembler()
    reassembler.feed(chunks[0])
    with pytest.raises(tb.MalformedHeader, match="disagrees"):
        reassembler.feed(other[1])


def test_signed_chunks_require_the_key() -> None:
    frame = tb.encode(np.zeros(50_000), signing_key=b"s")
    parts = tb.split(frame, max_chunk_bytes=30_000, message_id=("p", 1), signing_key=b"s")
    reassembler = tb.Reassembler(signing_key=b"s")
    out = [reassembler.feed(b"".join(p)) for p in parts]
    assert out[-1] is not None
    with pytest.raises(tb.SignatureError):
        tb.Reassembler(signing_key=b"other").feed(b"".join(parts[0]))


def test_too_small_chunk_size_is_a_config_error() -> None:
    with pytest.raises(tb.ConfigError, match="no room"):
        tb.split(tb.encode(np.zeros(10_000)), max_chunk_bytes=300, message_id=("p", 1))


def test_a_large_buffer_is_reused_once_no_tensor_views_it() -> None:
    reassembler = tb.Reassembler()
    first = np.arange(600_000, dtype=np.float32)  # 2.4 MB: pooled
    (message,) = [m for m in (reassembler.feed(c) for c in chunks_of(first, 1 << 20, seq=1)) if m is not None]
    held = message.tensor
    (second,) = [m for m in (reassembler.feed(c) for c in chunks_of(first + 1, 1 << 20, seq=2)) if m is not None]
    assert not np.shares_memory(held, second.tensor)  # the first tensor is alive: its memory is not reused
    np.testing.assert_array_equal(held, first)
    del held, message, second
    (third,) = [m for m in (reassembler.feed(c) for c in chunks_of(first + 2, 1 << 20, seq=3)) if m is not None]
    np.testing.assert_array_equal(third.tensor, first + 2)
    assert reassembler._pool.reused == 1


def test_with_a_free_pooled_buffer_chunks_go_into_place_as_they_arrive_and_cost_only_their_bytes() -> None:
    reassembler = tb.Reassembler()
    first = np.arange(600_000, dtype=np.float32)  # 2.4 MB: pooled
    assert [reassembler.feed(c) for c in chunks_of(first, 1 << 18, seq=1)][-1] is not None  # (dropped at once)
    chunks = chunks_of(first + 1, 1 << 18, seq=2)
    order = [len(chunks) - 2, 3, 0, *[i for i in range(len(chunks) - 1) if i not in (len(chunks) - 2, 3, 0)]]
    for index in order[:3]:  # out of order, well under half: no copy kept aside, the pool's buffer filled in
        assert reassembler.feed(chunks[index]) is None
    partial = next(iter(reassembler._partials.values()))
    assert partial.buffer is not None and not partial.pieces and not partial.allocated
    assert reassembler.held_bytes < 3 * (1 << 18) + (20 << 10)  # the bytes received, not the 2.4 MB claimed
    for index in order[3:]:
        assert reassembler.feed(chunks[index]) is None
    (message,) = [reassembler.feed(chunks[-1])]
    assert message is not None and reassembler._pool.reused == 1 and reassembler.held_bytes == 0
    np.testing.assert_array_equal(message.tensor, first + 1)


def test_a_message_filling_a_pooled_buffer_refuses_a_corrupted_chunk_and_takes_the_next_version_whole() -> None:
    reassembler = tb.Reassembler()
    array = np.arange(600_000, dtype=np.float32)
    assert [reassembler.feed(c) for c in chunks_of(array, 1 << 18, seq=1)][-1] is not None
    bad = chunks_of(array + 1, 1 << 18, seq=2)
    assert reassembler.feed(bad[0]) is None  # into the pooled buffer
    corrupted = bytearray(bad[1])
    corrupted[-100] ^= 1
    with pytest.raises(tb.ChecksumMismatch):
        reassembler.feed(bytes(corrupted))
    for chunk in chunks_of(array + 2, 1 << 18, seq=3):  # a newer version, while the older one is incomplete
        message = reassembler.feed(chunk)
    assert message is not None
    np.testing.assert_array_equal(message.tensor, array + 2)  # none of version 2's bytes in it


def test_a_chunk_s_check_copies_it_into_place_and_a_bad_one_fills_only_a_slot_not_yet_received(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    copied: list[int] = []
    copy = frame_module.crc32c_copy

    def counted(dst: Any, src: Any, value: int = 0) -> int:
        copied.append(len(src))
        return copy(dst, src, value)

    monkeypatch.setattr(frame_module, "crc32c_copy", counted)
    reassembler = tb.Reassembler()
    array = np.arange(600_000, dtype=np.float32)
    assert [reassembler.feed(c) for c in chunks_of(array, 1 << 18, seq=1)][-1] is not None
    copied.clear()  # (the first message's later half was copied by its checks: it had its buffer from half on)
    chunks = chunks_of(array + 1, 1 << 18, seq=2)
    assert reassembler.feed(chunks[0]) is None  # the message's first chunk takes the pool's buffer
    partial = next(iter(reassembler._partials.values()))
    assert partial.buffer is not None
    slot = partial.buffer[partial.stride : 2 * partial.stride]
    corrupted = bytearray(chunks[1])
    corrupted[-100] ^= 1
    with pytest.raises(tb.ChecksumMismatch):
        reassembler.feed(bytes(corrupted))
    assert bytes(slot[-100:]) == bytes(corrupted[-100:])  # copied by its check, not received: still missing
    first = bytes(partial.buffer[: partial.stride])
    again = bytearray(chunks[0])
    again[-100] ^= 1
    with pytest.raises(tb.ChecksumMismatch):
        reassembler.feed(bytes(again))  # a bad copy of a chunk already here is not copied over it
    assert bytes(partial.buffer[: partial.stride]) == first and 1 not in partial.received
    for chunk in chunks[1:]:
        message = reassembler.feed(chunk)
    assert message is not None
    np.testing.assert_array_equal(message.tensor, array + 1)  # the good chunk 1 overwrote the bad one
    large = [c for c in chunks[1:] if len(c) >= SPLIT_CRC_FROM]  # (a small last chunk is read twice: cheaper)
    assert len(large) >= 8 and len(copied) == 1 + len(large)  # the corrupted one, then every large one but the first


def test_copy_true_gives_a_reassembled_tensor_its_own_memory() -> None:
    reassembler = tb.Reassembler()
    out = [reassembler.feed(c, copy=True) for c in chunks_of(np.arange(50_000.0), 30_000)]
    tensor = out[-1].tensor
    assert tensor.flags.owndata and tensor.flags.writeable and tensor[49_999] == 49_999.0


def test_a_message_refused_at_its_first_chunk_is_given_up_so_its_later_chunks_hold_nothing() -> None:
    reassembler = tb.Reassembler(max_bytes=300_000)
    first = chunks_of(np.ones(70_000, np.float32), 65_536, seq=1)  # ~280 KB
    second = chunks_of(np.ones(40_000, np.float32), 65_536, seq=2)
    assert all(reassembler.feed(c) is None for c in first[:-1])  # past half: its whole buffer is charged
    with pytest.raises(tb.LimitExceeded, match="message given up"):
        reassembler.feed(second[0])
    assert reassembler.feed(first[-1]) is not None
    assert all(reassembler.feed(c) is None for c in second[1:])
    assert reassembler.pending == 0 and reassembler.held_bytes == 0  # not a partial that can never be whole


def test_feed_looks_for_late_messages_only_once_the_oldest_can_be_late(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    reassembler = tb.Reassembler(timeout_s=5, clock=clock)
    looks: list[float] = []
    expire = reassembler.expire
    monkeypatch.setattr(reassembler, "expire", lambda: looks.append(clock.now) or expire())
    first, second = chunks_of(np.zeros(100_000), 30_000, seq=1), chunks_of(np.ones(100_000), 30_000, seq=2)
    reassembler.feed(first[0])
    clock.now = 3
    reassembler.feed(second[0])  # (due at 8)
    for c in first[1:-1] + second[1:-1]:
        reassembler.feed(c)
    assert looks == []  # none can be late before 5
    clock.now = 5.5
    reassembler.feed(tb.dumps(np.ones(2), key="a"))
    assert looks == [5.5] and reassembler.pending == 1 and reassembler.stats["expired"] == 1
    reassembler.feed(tb.dumps(np.ones(2), key="b"))
    assert looks == [5.5]  # the next one is due at 8
    clock.now = 8.5
    reassembler.feed(tb.dumps(np.ones(2), key="c"))
    assert looks == [5.5, 8.5] and reassembler.pending == 0 and reassembler.stats["expired"] == 2


def test_given_up_counts_every_incomplete_message_that_stops_being_pending_without_completing() -> None:
    clock = FakeClock()
    reassembler = tb.Reassembler(timeout_s=5, clock=clock, max_bytes=1_000_000)
    done = chunks_of(np.zeros(1000), 3000, seq=1)
    for c in done:
        reassembler.feed(c)
    assert reassembler.given_up == 0  # completed: not given up
    late = chunks_of(np.zeros(100_000), 100_000, seq=2)
    reassembler.feed(late[0])
    clock.now = 6
    reassembler.expire()
    assert reassembler.given_up == 1
    big, other = chunks_of(np.zeros(100_000), 100_000, seq=3), chunks_of(np.ones(100_000), 100_000, seq=4)
    reassembler.feed(other[0])
    for c in big[:5]:
        reassembler.feed(c)
    with pytest.raises(tb.LimitExceeded):
        reassembler.feed(other[1])  # over max_bytes: `other` given up part way
    assert reassembler.given_up == 2 and not reassembler.is_pending(("p", 4))


def test_a_paused_reassembler_expires_nothing_and_resumes_its_deadlines() -> None:
    clock = FakeClock()
    reassembler = tb.Reassembler(timeout_s=5, clock=clock)
    chunks = chunks_of(np.zeros(100_000), 30_000)
    reassembler.feed(chunks[0])
    clock.now = 1
    reassembler.pause()
    clock.now = 10
    reassembler.feed(chunks[1])
    assert reassembler.pending == 1  # its reader was held up: not late
    reassembler.resume()  # (9 s stood still: due at 14 now)
    clock.now = 13
    reassembler.feed(chunks[2])
    assert reassembler.pending == 1
    clock.now = 14.5
    reassembler.feed(tb.dumps(np.ones(2)))
    assert reassembler.pending == 0 and reassembler.stats["expired"] == 1


@pytest.mark.parametrize("max_chunk_bytes", [4_136, 8_229])  # (the second: the last chunk carries 17 bytes of the MAC)
def test_restamped_chunks_carry_a_message_stamped_now_and_signed_again(
    max_chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what a socket producer resends to another consumer run: the chunks of a message signed an hour ago
    whole_key, old_key, new_key = b"team", b"run-1", b"run-2"
    array = np.arange(6_000, dtype=np.float32)
    now = time.time()
    monkeypatch.setattr(frame_module.time, "time", lambda: now - 3600)
    chunks = encode_chunks(
        array,
        max_chunk_bytes=max_chunk_bytes,
        message_id=("p", 1),
        key="k",
        signing_key=whole_key,
        chunk_signing_key=old_key,
    )
    monkeypatch.undo()
    assert len(chunks) > 2
    limits = tb.Limits(max_frame_age_s=60)

    def reassembled(parts: list[list[Any]], run_key: bytes) -> Any:
        reassembler = tb.Reassembler(signing_key=run_key, whole_signing_key=whole_key, limits=limits)
        message = None
        for part in parts:
            message = reassembler.feed(b"".join(bytes(memoryview(b).cast("B")) for b in part)) or message
        return message

    with pytest.raises(tb.Replayed):  # as sent: too old
        reassembled(chunks, old_key)
    given = chunks[::-1]  # (any order)
    again = restamp_chunks(given, whole_key, new_key)
    assert again is not None and len(again) == len(chunks)
    assert frame_size(again[0]) == frame_size(given[0])
    message = reassembled(again[::-1], new_key)
    assert message is not None and np.array_equal(message.tensor, array) and message.key == "k"
    with pytest.raises(tb.SignatureError):  # signed for the new run only
        reassembled(again[::-1], old_key)
    monkeypatch.setattr(frame_module.time, "time", lambda: now + 61)  # replayed later than max_frame_age_s
    with pytest.raises(tb.Replayed):
        reassembled(again[::-1], new_key)


def test_restamp_chunks_leaves_what_is_not_every_chunk_of_one_signed_message() -> None:
    chunks = encode_chunks(
        np.zeros(4_000), max_chunk_bytes=8_192, message_id=("p", 2), signing_key=b"k", chunk_signing_key=b"r"
    )
    assert restamp_chunks(chunks[1:], b"k", b"r2") is None  # one missing
    unsigned = encode_chunks(np.zeros(4_000), max_chunk_bytes=8_192, message_id=("p", 3))
    assert restamp_chunks(unsigned, b"k", b"r2") is None
