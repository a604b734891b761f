"""A socket consumer read on the event loop (tensorbus/aio/socket_reading.py): what it owes its producers
when the loop stops between two turns, and how reading ahead of the receives stops and starts again.

These drive the loop as an application between two `run_until_complete` calls does (the benchmark's
workers do): the loop runs only while a receive is awaited, so nothing may be left for "the next turn".
FAIR_SHARE (frames per turn) is made 1, so a handful of small frames spans as many turns.
"""

from __future__ import annotations

import asyncio
import fcntl
import termios
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
import tensorbus.aio as tba
from tensorbus.aio import socket_reading
from tensorbus.transports import peer_frames
from tensorbus.transports import reader as reader_module
from tensorbus.transports.peer_frames import PeerFrames
from tensorbus.transports.stream import SocketOptions
from tests.conftest import require_native
from tests.waiting import until, wait_for

FRAMES = 20


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _queued(sock: Any) -> int:
    """Bytes in the socket's receive queue."""
    count = bytearray(4)
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    return int.from_bytes(count, "little")


def _connected(loop: asyncio.AbstractEventLoop, **options: Any) -> tuple[tba.Consumer, tb.Producer]:
    """An asyncio consumer on `loop` (with `options`) and a blocking producer connected to it (one tensor across)."""
    consumer = loop.run_until_complete(tba.Consumer("tcp://127.0.0.1:0", **options).open())
    producer = tb.Producer(consumer.address)
    loop.run_until_complete(asyncio.to_thread(producer.send, "k", np.zeros(4, np.float32)))
    assert loop.run_until_complete(consumer.recv("k", timeout=30)).shape == (4,)
    wait_for(lambda: _acks_read(producer) == 1, 30, "the producer to read the first tensor's ack")
    return consumer, producer


def _acks_read(producer: tb.Producer) -> int:
    """The frames the producer has read acks for (it reads what came within a moment)."""
    transport = producer.transport
    with transport._lock:
        transport._read_acks(0.05)
        return transport._acked


def _send_while_the_loop_stands(consumer: tba.Consumer, producer: tb.Producer) -> None:
    """Send FRAMES small tensors and wait until they are all in the consumer's socket (its loop is stopped)."""
    for i in range(FRAMES):
        producer.send("k", np.full(512, i, np.float32))
    transport, (peer,) = producer.transport, consumer.blocking.transport.reactor._peer_list()
    wait_for(lambda: _queued(peer.conn) >= transport._unacked_bytes, 30, "the frames to reach the consumer's socket")


async def _receive(consumer: tba.Consumer, count: int) -> list[int]:
    """The numbers of the next `count` tensors."""
    return [int((await consumer.recv("k", timeout=10))[0]) for _ in range(count)]


def _close(loop: asyncio.AbstractEventLoop, consumer: tba.Consumer, producer: tb.Producer) -> None:
    producer.close()
    loop.run_until_complete(consumer.close())


def test_the_turn_that_reads_a_connection_dry_acks_every_frame_before_the_loop_stops(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer's `flush` waits for acks, which a stopped loop never sends: the turn that leaves a connection
    with no bytes read ahead acks every frame delivered from it, those of the turns before it included, while
    the turns that leave bytes read ahead send none (an ack per turn of a stream: a system call each, waking
    the producer). The loop here stops after that turn, and `flush` returns without it."""
    monkeypatch.setattr(peer_frames, "FAIR_SHARE", 1)  # (a turn per frame, each leaving the next read ahead)
    consumer, producer = _connected(loop)
    reactor = consumer.blocking.transport.reactor
    acks: list[int] = []
    ack_now = reactor._ack_now

    def counted(peer: Any) -> None:
        acks.append(peer.frames)
        ack_now(peer)

    monkeypatch.setattr(reactor, "_ack_now", counted)
    try:
        _send_while_the_loop_stands(consumer, producer)
        assert loop.run_until_complete(_receive(consumer, FRAMES)) == list(range(FRAMES))
        wait_for(lambda: _acks_read(producer) == 1 + FRAMES, 10, "the producer to see every frame acknowledged")
        producer.flush(timeout=10)  # (the loop stands: nothing would answer an ack request)
        assert 1 <= len(acks) <= 3, acks  # (not one per turn: FRAMES turns read them)
    finally:
        _close(loop, consumer, producer)


def test_a_loop_that_stops_with_bytes_read_ahead_acks_them_once_it_reads_on(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop stopped with bytes read ahead (a frame not delivered yet, which `flush` waits for anyway) acks
    the frames it delivered before them once it runs again and reads on, with no receive to ask for it."""
    monkeypatch.setattr(peer_frames, "FAIR_SHARE", 1)
    consumer, producer = _connected(loop)
    try:
        _send_while_the_loop_stands(consumer, producer)
        assert int(loop.run_until_complete(consumer.recv("k", timeout=30))[0]) == 0  # a few turns, then it stops
        delivered = 1 + consumer.table.buffered_keys().get("k", 0)
        assert 1 < delivered < FRAMES, delivered  # (stopped with frames read ahead: the case under test)
        # no receive: the loop's turns read the rest ahead, the last of them the connection dry
        buffered = lambda: consumer.table.buffered_keys().get("k", 0) == FRAMES - 1  # noqa: E731
        loop.run_until_complete(until(buffered, "the rest read ahead"))
        wait_for(lambda: _acks_read(producer) == 1 + FRAMES, 10, "the producer to see every frame acknowledged")
        assert loop.run_until_complete(_receive(consumer, FRAMES - 1)) == list(range(1, FRAMES))
    finally:
        _close(loop, consumer, producer)


def test_reading_stopped_ahead_of_the_receives_goes_on_when_a_receive_takes(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past READ_AHEAD the loop stops reading, bytes read ahead waiting; the next receive starts it again
    (not the upkeep timer, put out of reach here, nor new bytes on the socket: none come)."""
    monkeypatch.setattr(peer_frames, "FAIR_SHARE", 1)
    monkeypatch.setattr(socket_reading, "READ_AHEAD", 1)  # (one tensor in the table is enough)
    monkeypatch.setattr(socket_reading, "TAKEN_EVERY_S", 3600.0)
    consumer, producer = _connected(loop)
    try:
        _send_while_the_loop_stands(consumer, producer)
        assert loop.run_until_complete(_receive(consumer, FRAMES)) == list(range(FRAMES))
    finally:
        _close(loop, consumer, producer)


def test_a_turn_reads_no_further_ahead_than_read_ahead_allows(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn stops between two frames once READ_AHEAD bytes wait in the table, not after FAIR_SHARE frames:
    a TCP receive buffer grown to megabytes would otherwise be read whole, while a receive waits."""
    monkeypatch.setattr(socket_reading, "READ_AHEAD", 1)  # (one tensor in the table is enough)
    assert peer_frames.FAIR_SHARE > 2
    consumer, producer = _connected(loop)
    try:
        _send_while_the_loop_stands(consumer, producer)
        assert int(loop.run_until_complete(consumer.recv("k", timeout=30))[0]) == 0
        assert consumer.table.buffered_keys().get("k", 0) == 1  # the frame after the one received, no more
        assert loop.run_until_complete(_receive(consumer, FRAMES - 1)) == list(range(1, FRAMES))
    finally:
        _close(loop, consumer, producer)


def _watched(loop: asyncio.AbstractEventLoop, peer: Any) -> bool:
    """Whether the loop's selector watches the connection's socket for reading."""
    key = loop._selector.get_map().get(peer.conn.fileno())  # type: ignore[attr-defined]
    return key is not None and key.data[0] is not None  # (the reader's handle; writers aside)


def test_a_pause_stops_watching_only_once_the_connection_is_readable_again_and_reads_nothing(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past READ_AHEAD reading pauses, lazily: the loop watches the connection on (a receive that takes soon
    costs no `remove_reader`/`add_reader`), reads none of the bytes it finds there, and stops watching after
    PAUSED_LOOKS readinesses; the next receive watches and reads again, every tensor in order."""
    monkeypatch.setattr(socket_reading, "READ_AHEAD", 1)  # (one tensor in the table is enough)
    monkeypatch.setattr(socket_reading, "TAKEN_EVERY_S", 3600.0)
    consumer, producer = _connected(loop)
    reading, (peer,) = consumer._reading, consumer.blocking.transport.reactor._peer_list()
    assert reading is not None and reading.poller is not None
    try:
        _send_while_the_loop_stands(consumer, producer)
        assert int(loop.run_until_complete(consumer.recv("k", timeout=30))[0]) == 0
        assert reading.poller.paused and _watched(loop, peer)  # paused with one tensor ahead, watched still
        producer.send("k", np.full(512, FRAMES, np.float32))  # (bytes to find: the turn read the socket dry)
        wait_for(lambda: _queued(peer.conn) > 0, 30, "the tensor to reach the consumer's socket")
        queued = _queued(peer.conn)
        for look in range(1, socket_reading.PAUSED_LOOKS + 1):
            reading._ready(peer)  # (what the loop calls when the socket is readable)
            assert _queued(peer.conn) == queued and consumer.table.buffered_keys() == {"k": 1}  # nothing read
            assert _watched(loop, peer) is (look < socket_reading.PAUSED_LOOKS)
        assert loop.run_until_complete(_receive(consumer, FRAMES)) == list(range(1, FRAMES + 1))
        assert _watched(loop, peer)
    finally:
        _close(loop, consumer, producer)


def test_reading_paused_goes_free_once_no_receive_came_for_linger_s_even_after_one_took_too_little(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading paused ahead of the receives, a receive that takes too little to resume it, then none: after
    `linger_s` without one reading goes free (a send never waits for a receive). The receive used to cancel
    the pause's timer for good, and with no bytes read ahead nothing armed it again."""
    monkeypatch.setattr(socket_reading, "READ_AHEAD", 1)  # (one tensor in the table is enough)
    monkeypatch.setattr(socket_reading, "TAKEN_EVERY_S", 3600.0)
    consumer, producer = _connected(loop, linger_s=0.2)
    reading = consumer._reading
    assert reading is not None and reading.poller is not None
    try:
        producer.send("k", np.full(512, 1, np.float32))
        loop.run_until_complete(until(lambda: consumer.table.buffered_keys() == {"k": 1}, "the tensor read"))
        reading._stop_reading()  # (as a turn past READ_AHEAD does: the pause's timer armed)
        reading.taken()  # a receive took a tensor: the table holds one still, too much to resume
        assert reading.poller.paused
        loop.run_until_complete(until(lambda: not reading.poller.paused, "reading to go free"))
        assert reading._free
    finally:
        _close(loop, consumer, producer)


def test_a_consumer_moved_to_another_loop_while_its_connections_are_unwatched_watches_none_until_it_resumes(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer whose loop closed while its pause stopped watching the connections, moved to a new loop
    by its next receive (`LoopReading.move_to`), leaves them unwatched there too (watched, each readiness
    would find reading paused and return: the loop would spin), and reads them again once it resumes."""
    monkeypatch.setattr(socket_reading, "READ_AHEAD", 1)  # (one tensor in the table is enough)
    monkeypatch.setattr(socket_reading, "TAKEN_EVERY_S", 3600.0)
    consumer, producer = _connected(loop)
    reading, (peer,) = consumer._reading, consumer.blocking.transport.reactor._peer_list()
    assert reading is not None and reading.poller is not None
    _send_while_the_loop_stands(consumer, producer)
    assert int(loop.run_until_complete(consumer.recv("k", timeout=30))[0]) == 0
    producer.send("k", np.full(512, FRAMES, np.float32))
    wait_for(lambda: _queued(peer.conn) > 0, 30, "the tensor to reach the consumer's socket")
    for _ in range(socket_reading.PAUSED_LOOKS):
        reading._ready(peer)  # (what the loop calls when the socket is readable)
    assert reading.poller.unwatched
    loop.close()
    second = asyncio.new_event_loop()
    try:
        reading.move_to(second)
        assert not _watched(second, peer)
        assert second.run_until_complete(_receive(consumer, FRAMES)) == list(range(1, FRAMES + 1))
        assert _watched(second, peer)
    finally:
        _close(second, consumer, producer)
        second.close()


def _ping_pong(loop: asyncio.AbstractEventLoop, consumer: Any, producer: Any, rounds: int) -> None:
    """`rounds` tensors, each sent (from a thread) once the receive of the one before was served, and each
    received by a receive that waits for it."""

    async def ping_pong() -> None:
        for i in range(rounds):
            asyncio.get_running_loop().run_in_executor(None, producer.send, "k", np.full(4, i, np.float32))
            assert int((await consumer.recv("k", timeout=30))[0]) == i

    loop.run_until_complete(ping_pong())


def test_a_receiving_loop_acks_as_a_reading_thread_does_not_once_per_tensor(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receive that waits again as soon as the last one was served (a ping-pong) keeps the loop running:
    the frames it delivered are acked every `ack_every_frames` and when the producer asks, not one ack
    (a system call on both ends) per tensor; the last receive served with none waiting after it acks them."""
    consumer, producer = _connected(loop)
    acks: list[int] = []
    reactor: Any = consumer.blocking.transport.reactor
    sending = reactor._ack
    monkeypatch.setattr(reactor, "_ack", lambda peer: (acks.append(peer.frames), sending(peer)))
    rounds = 100
    try:
        _ping_pong(loop, consumer, producer, rounds)
        assert len(acks) < rounds // 4, acks  # (one per round before)
        wait_for(lambda: _acks_read(producer) == 1 + rounds, 10, "every frame acknowledged after the last receive")
    finally:
        _close(loop, consumer, producer)


def test_a_served_turn_looks_up_no_connection_while_a_receive_waits_again_and_no_ack_is_owed(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The acks of a turn that served a receive (`LoopReading._ack`) take the reading's lead only when there
    is something to send: none while the next receive waits already and no ack is owed (a ping-pong), and
    all of them after the last receive served, with none waiting after it."""
    consumer, producer = _connected(loop)
    calls: list[bool] = []
    reactor: Any = consumer.blocking.transport.reactor
    ack_read = reactor.ack_read
    monkeypatch.setattr(reactor, "ack_read", lambda owed_only=False: (calls.append(owed_only), ack_read(owed_only)))
    rounds = 50
    try:
        _ping_pong(loop, consumer, producer, rounds)  # (the next receive waits before the acks)
        assert True not in calls, calls  # (one call per round, owed_only, before)
        assert calls[-1:] == [False]  # the last receive: none waits after it, everything is acked
        wait_for(lambda: _acks_read(producer) == 1 + rounds, 10, "every frame acknowledged after the last receive")
    finally:
        _close(loop, consumer, producer)


def test_a_consumer_read_by_the_loop_keeps_buffers_for_the_frames_it_reads_ahead(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """The loop reads up to READ_AHEAD ahead of the receives, more 1 MiB frames at once than `pooled_buffers`
    (four of them in the table, one read, one in the application's hands: six): the pool keeps READ_AHEAD's
    1 MiB more of them, each of up to half of it (`BufferPool.keep_more`, tested in test_buffer_pool.py),
    lest they land in fresh memory (docs/PERFORMANCE.md: 4-14 faults a 1 MiB tensor, then 0.2)."""
    consumer = loop.run_until_complete(tba.Consumer("tcp://127.0.0.1:0").open())
    try:
        pool = consumer.blocking.transport._pool  # type: ignore[attr-defined]
        assert pool.max_buffers == SocketOptions().pooled_buffers
        assert (pool._more, pool._more_up_to) == (socket_reading.READ_AHEAD >> 20, socket_reading.READ_AHEAD // 2)
    finally:
        loop.run_until_complete(consumer.close())
    blocking = tb.Consumer("tcp://127.0.0.1:0")  # (read by its own threads, no further ahead than its table)
    try:
        assert blocking.transport._pool._more == 0  # type: ignore[attr-defined]
    finally:
        blocking.close()


def test_a_turn_delivers_plain_frames_in_runs_read_in_c(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's turns read plain frames in runs of the C reader (`read_taken`), as a reading thread does,
    not a Python step each; each run stops with the frame that uses up READ_AHEAD, so a turn reads no
    further ahead than it did a frame at a time (`test_a_turn_reads_no_further_ahead_than_read_ahead_allows`)."""
    require_native(reader_module.NATIVE_STREAM is not None, "the C stream reader (tensorbus/transports/_stream.c)")
    consumer, producer = _connected(loop)
    stepped, runs = [], []
    step, run = PeerFrames._step, PeerFrames._run
    monkeypatch.setattr(PeerFrames, "_step", lambda self, peer: stepped.append(peer) or step(self, peer))
    monkeypatch.setattr(PeerFrames, "_run", lambda self, *args: runs.append(run(self, *args)) or runs[-1])
    try:
        _send_while_the_loop_stands(consumer, producer)
        assert loop.run_until_complete(_receive(consumer, FRAMES)) == list(range(FRAMES))
        assert stepped == []
        assert sum(taken for taken, _ in runs) >= FRAMES and len(runs) < FRAMES  # (runs of several frames)
    finally:
        _close(loop, consumer, producer)
