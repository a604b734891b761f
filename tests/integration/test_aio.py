"""tensorbus.aio: receives awaited on the event loop, with the blocking API's semantics and errors.

Each test runs on the standard asyncio loop and on uvloop (the `aio` extra). The behaviour suite
(test_behaviour.py) runs through the asyncio consumer too; these are what only an event loop has:
cancellation, asyncio timeouts, sends that await room, and a loop that is never blocked.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
import tensorbus.aio as tba
from tensorbus.aio import socket_sending
from tensorbus.aio.socket_sending import Turn
from tests.conftest import IN_CI, endpoint_url, require_module, require_native, transport_params
from tests.machine_witness import MOST_WITNESSES, MachineWitness, machine_took, witness_took, witnesses_run_here
from tests.peers import Peer, make_tensor, same
from tests.waiting import until, wait_for

LOOPS = ["asyncio", "uvloop"]


@pytest.fixture(params=LOOPS)
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """Runs a coroutine to completion on a fresh loop of the kind the test is parametrized with."""
    if request.param == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        message = "uvloop is not installed (pip install 'tensorbus[aio]')"
        if IN_CI:
            pytest.fail(f"CI=true and {message}")
        pytest.skip(message)

    def on_uvloop(coroutine: Coroutine[Any, Any, Any]) -> Any:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            assert "uvloop" in type(runner.get_loop()).__module__
            return runner.run(coroutine)

    return on_uvloop


def waiting(consumer: tba.Consumer, key: object) -> bool:
    return bool(consumer.table._waiters.get(key))


@pytest.mark.parametrize("transport", ["memory", "tcp", "unix"])
def test_recv_before_and_after_send_and_arrival_order(run: Any, transport: str) -> None:
    async def main() -> None:
        async with tba.Consumer(endpoint_url(transport)) as consumer:
            early = asyncio.create_task(consumer.recv("early", timeout=30))
            await until(lambda: waiting(consumer, "early"), "the receive to wait")
            async with tba.Producer(consumer.address) as producer:
                await producer.send("early", np.arange(5))
                await producer.send("late", np.arange(3), metadata={"step": 7})
                for i in range(4):
                    await producer.send(f"job{i}", np.full(2, i))
                await producer.flush(timeout=30)
            assert same(await early, np.arange(5))
            message = await consumer.recv_message("late", timeout=30)
            assert message.metadata == {"step": 7} and same(message.tensor, np.arange(3))
            keys = []
            async for message in consumer:
                keys.append(message.key)
                if len(keys) == 4:
                    break
            assert keys == [f"job{i}" for i in range(4)]

    run(main())


@pytest.mark.parametrize("transport", ["memory", "tcp", "unix"])
def test_ends_opened_in_one_run_of_a_loop_serve_the_next(run: Any, transport: str) -> None:
    """An endpoint opened under one `asyncio.run` and used under the next (module-level ends, a test
    framework's loop per test): the consumer reads on the new loop, and the producer's sends, four tasks at
    a time waiting for a socket producer's turn (an `asyncio.Lock` serves the first loop it waited on
    only), take turns on it; nothing is lost."""
    consumer = tba.Consumer(endpoint_url(transport))
    producer: tba.Producer | None = None

    async def first() -> None:
        nonlocal producer
        await consumer.open()
        producer = await tba.Producer(consumer.address).open()
        await producer.send("first", np.arange(3))
        assert same(await consumer.recv("first", timeout=30), np.arange(3))

    async def sends(run_number: int) -> None:
        assert producer is not None

        async def stream(task: int) -> None:
            for i in range(50):
                await producer.send(f"{run_number}-{task}", np.full(5000, i))

        received = asyncio.create_task(receive(run_number))
        if transport == "memory":
            await asyncio.gather(*(stream(task) for task in range(4)))
        else:  # the turn held here while the four start: they wait for it on this loop
            turn = producer._sender._turn  # type: ignore[union-attr]
            async with turn:
                streams = [asyncio.create_task(stream(task)) for task in range(4)]
                await until(lambda: turn._tasks == 5, "the four sends to wait for the turn")
            await asyncio.gather(*streams)
        await producer.flush(timeout=30)
        await received

    async def receive(run_number: int) -> None:
        for task in range(4):
            for i in range(50):
                assert same(await consumer.recv(f"{run_number}-{task}", timeout=30), np.full(5000, i))

    async def last() -> None:
        if producer is not None:
            await producer.close()
        await consumer.close()

    try:
        run(first())
        run(sends(2))
        run(sends(3))
    finally:
        run(last())


@pytest.mark.parametrize("transport", transport_params("memory", "tcp", "unix", "amqp", "kafka"))
def test_async_and_blocking_ends_talk_to_each_other(run: Any, transport: str) -> None:
    async def main() -> None:
        with tb.Consumer(endpoint_url(transport)) as blocking_consumer:
            async with tba.Producer(blocking_consumer.address) as producer:
                await producer.send("to-blocking", make_tensor({"seed": 1}), metadata={"from": "aio"})
                await producer.flush(timeout=60)
            message = await asyncio.to_thread(blocking_consumer.recv_message, "to-blocking", 60)
            assert message.metadata == {"from": "aio"} and same(message.tensor, make_tensor({"seed": 1}))
        async with tba.Consumer(endpoint_url(transport)) as consumer:
            peer = Peer(consumer.address, [("to-aio", {"seed": 2})])  # a blocking producer (another process)
            assert same(await consumer.recv("to-aio", timeout=60), make_tensor({"seed": 2}))
            await asyncio.to_thread(peer.join)

    run(main())


#: the threads of the blocking socket ends, which tcp:// and unix:// ends of tensorbus.aio start none of
SOCKET_THREADS = ("tensorbus-reader", "tensorbus-accept", "tensorbus-aio-send", "tensorbus-expiry")


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_socket_ends_read_and_write_on_the_loop_and_start_no_thread(run: Any, transport: str) -> None:
    """tcp:// and unix:// ends read, accept, write and expire on the event loop itself: while small and
    large tensors cross, in order and whole, no reading, accepting, sending or expiring thread of theirs
    is alive (a thread would make the loop wait for the GIL whenever the kernel kept it off a CPU); its large
    receive buffers take no transparent huge pages (a fault in one zeroes 2 MiB while the loop waits)."""
    big = make_tensor({"seed": 4, "n": 3_000_000})

    async def main() -> None:
        async with tba.Consumer(endpoint_url(transport)) as consumer, tba.Producer(consumer.address) as producer:
            assert consumer.blocking.transport._pool.huge_pages is False
            for i in range(200):
                await producer.send("k", np.full(1000 + i, i))
            await producer.send("big", big)
            await producer.flush(timeout=30)
            assert [t.name for t in threading.enumerate() if t.name.startswith(SOCKET_THREADS)] == []
            for i in range(200):
                got = await consumer.recv("k", timeout=30)
                assert got.shape == (1000 + i,) and got[0] == i
            assert same(await consumer.recv("big", timeout=30), big)

    run(main())


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_loop_consumer_expires_on_the_loop_what_nobody_took(run: Any, transport: str) -> None:
    """With no expiry thread, the loop drops a tensor nobody took within `unclaimed_timeout_s` (counted)
    and keeps serving: a later tensor is received."""

    async def main() -> None:
        async with (
            tba.Consumer(endpoint_url(transport), unclaimed_timeout_s=0.2) as consumer,
            tba.Producer(consumer.address) as producer,
        ):
            await producer.send("nobody", np.arange(10))
            await producer.flush(timeout=30)
            deadline = asyncio.get_running_loop().time() + 30
            while consumer.blocking.stats["unclaimed"] == 0:
                assert asyncio.get_running_loop().time() < deadline, "never expired"
                await asyncio.sleep(0.02)
            assert consumer.blocking.stats["unclaimed"] == 1
            await producer.send("later", np.arange(3))
            assert (await consumer.recv("later", timeout=30)).tolist() == [0, 1, 2]
            with pytest.raises(tb.Timeout):
                await consumer.recv("nobody", timeout=0)

    run(main())


def test_a_loop_producer_proves_its_secret_signs_its_frames_and_resends_to_a_successor(run: Any) -> None:
    """The loop's own handshake and writes, against blocking consumers: a wrong secret is refused at
    once (AuthRefused), signed frames pass, and what a consumer left untaken goes to its successor on
    the same address, which the producer reconnects to."""
    secret, key = "s3cret", b"k" * 32

    async def main() -> None:
        with tb.Consumer("tcp://127.0.0.1:0", auth_secret=secret, signing_key=key) as first:
            address = first.address
            async with tba.Producer(address, auth_secret="wrong") as intruder:
                with pytest.raises(tb.AuthRefused):
                    await intruder.send("k", np.arange(3))
            producer = tba.Producer(address, auth_secret=secret, signing_key=key, reconnect_timeout_s=30)
            await producer.send("taken", np.arange(4))
            await producer.send("left", np.arange(5))
            await producer.flush(timeout=30)
            assert same(await asyncio.to_thread(first.recv, "taken", 30), np.arange(4))
        with tb.Consumer(address, auth_secret=secret, signing_key=key) as successor:
            await producer.flush(timeout=30)  # (the untaken one goes again, on a new connection)
            await producer.send("after", np.arange(6))
            assert same(await asyncio.to_thread(successor.recv, "left", 30), np.arange(5))
            assert same(await asyncio.to_thread(successor.recv, "after", 30), np.arange(6))
            await producer.close()

    run(main())


def test_tls_round_trip(run: Any, tmp_path: Any) -> None:
    trustme = require_module("trustme", "dev")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")

    async def main() -> None:
        async with tba.Consumer("tcps://127.0.0.1:0", ssl_certfile=str(tmp_path / "server.pem")) as consumer:
            async with tba.Producer(consumer.address, ssl_cafile=str(tmp_path / "ca.pem")) as producer:
                await producer.send("secure", make_tensor({"seed": 3, "n": 300_000}))
                assert same(await consumer.recv("secure", timeout=30), make_tensor({"seed": 3, "n": 300_000}))

    run(main())


def test_a_cancelled_recv_leaves_the_tensor_for_the_next(run: Any) -> None:
    async def main() -> None:
        async with tba.Consumer(endpoint_url("memory")) as consumer, tba.Producer(consumer.address) as producer:
            pending = asyncio.create_task(consumer.recv("k"))
            await until(lambda: waiting(consumer, "k"), "the receive to wait")
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            assert not waiting(consumer, "k")  # withdrawn: the tensor is not handed to a dead receive
            await producer.send("k", np.arange(4))
            assert same(await consumer.recv("k", timeout=30), np.arange(4))

    run(main())


@pytest.mark.parametrize("delivered_by", ["the loop", "another thread"])
def test_a_tensor_arriving_as_its_task_is_cancelled_stays_for_the_next_recv(run: Any, delivered_by: str) -> None:
    """The message is in the receive's hands (its future set, or its hand-over queued on the loop) when
    the task is cancelled: it goes back first in line, and is taken (acknowledged) only by the next recv."""

    async def main() -> None:
        async with tba.Consumer(endpoint_url("memory")) as consumer:
            table = consumer.table
            taken: list[tb.Message] = []
            record_taken = table.on_delivered_to_application  # (the ledger's: what acknowledges a tensor)
            assert record_taken is not None
            table.on_delivered_to_application = lambda message: (taken.append(message), record_taken(message))
            pending = asyncio.create_task(consumer.recv_message("k"))
            await until(lambda: waiting(consumer, "k"), "the receive to wait")
            message = tb.Message("k", np.arange(3), {"n": "raced"})
            if delivered_by == "the loop":
                table.put(message)  # served at once, on this thread: the future has its result
            else:
                putter = threading.Thread(target=table.put, args=(message,))
                putter.start()
                putter.join()  # (the hand-over is queued on the loop, not run yet)
            pending.cancel()  # before the task (or the hand-over) runs
            with pytest.raises(asyncio.CancelledError):
                await pending
            assert taken == []  # not acknowledged
            got = await consumer.recv_message("k", timeout=5)
            assert got.metadata == {"n": "raced"} and same(got.tensor, np.arange(3))
            assert taken == [got] and len(table) == 0

    run(main())


@pytest.mark.parametrize("transport", ["memory", "tcp"])
def test_timeouts_around_recv_lose_nothing_and_deliver_nothing_twice(run: Any, transport: str) -> None:
    count = 300

    async def main() -> None:
        async with tba.Consumer(endpoint_url(transport)) as consumer, tba.Producer(consumer.address) as producer:

            async def produce() -> None:
                for i in range(count):
                    await producer.send("k", np.array([i]))
                    if i % 10 == 0:
                        await asyncio.sleep(0.0005)

            sending = asyncio.create_task(produce())
            got: list[int] = []
            timeouts = 0
            while len(got) < count:
                try:
                    if len(got) % 2:
                        async with asyncio.timeout(0.0002):
                            got.append(int((await consumer.recv("k"))[0]))
                    else:
                        got.append(int((await asyncio.wait_for(consumer.recv("k"), 0.0002))[0]))
                except TimeoutError:
                    timeouts += 1
                    assert timeouts < 1_000_000
            await sending
            assert got == list(range(count))
            with pytest.raises(tb.Timeout, match="'k'"):
                await consumer.recv("k", timeout=0.05)
            assert timeouts > 0  # (the timeouts did cut receives short)

    run(main())


def test_recv_timeout_is_a_tensorbus_timeout_naming_the_key(run: Any) -> None:
    async def main() -> None:
        async with tba.Consumer(endpoint_url("memory")) as consumer:
            started = time.monotonic()
            with pytest.raises(tb.Timeout, match="'never'") as info:
                await consumer.recv("never", timeout=0.2)
            assert isinstance(info.value, TimeoutError) and time.monotonic() - started >= 0.2
            assert not waiting(consumer, "never")
            with pytest.raises(tb.ConfigError, match="timeout"):
                await consumer.recv("x", timeout="soon")  # type: ignore[arg-type]

    run(main())


def test_a_receive_timer_that_fires_early_waits_out_its_deadline(run: Any) -> None:
    # (uvloop counts timers in whole milliseconds and may fire one a fraction of a millisecond early)
    from tensorbus.aio.handoff import Deadlines, _Expired

    async def main() -> None:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        deadline = time.monotonic() + 0.05
        deadlines = Deadlines()
        deadlines.add(future, deadline)
        deadlines.fire()  # as if the timer fired 50 ms early
        assert not future.done()
        with pytest.raises(_Expired):
            await future
        assert time.monotonic() >= deadline

    run(main())


def test_receives_share_one_timer_and_each_times_out_at_its_own_deadline(run: Any) -> None:
    """A consumer's receives arm no timer of their own (`Deadlines`): one armed for the earliest deadline
    settles each receive at its own, re-armed for the next, and stays armed as receives end."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        armed: list[float] = []
        call_later = loop.call_later

        def counted(delay: float, *args: Any) -> asyncio.TimerHandle:
            armed.append(delay)
            return call_later(delay, *args)

        loop.call_later = counted  # type: ignore[method-assign]
        async with tba.Consumer(endpoint_url("tcp")) as consumer, tba.Producer(consumer.address) as producer:
            for i in range(20):  # receives that wait, one timeout each: the timer armed by the first alone
                sending = asyncio.ensure_future(producer.send("k", np.full(4, i)))
                assert (await consumer.recv("k", timeout=30))[0] == i
                await sending
            assert len([delay for delay in armed if delay > 20]) == 1, armed
            started = time.monotonic()
            late = asyncio.create_task(consumer.recv("late", timeout=0.3))
            with pytest.raises(tb.Timeout, match="'soon'"):
                await consumer.recv("soon", timeout=0.1)
            assert 0.1 <= time.monotonic() - started and not late.done()
            with pytest.raises(tb.Timeout, match="'late'"):
                await late
            assert time.monotonic() - started >= 0.3
            assert not waiting(consumer, "soon") and not waiting(consumer, "late")

    run(main())


def test_a_socket_consumers_receive_asks_asyncio_for_no_running_loop(run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tcp:// consumer's receives run on the loop that reads it: they do not look the running loop up
    (`asyncio.get_running_loop`, a `getpid` system call each on Linux)."""
    looked_up = [0]
    get_running_loop = asyncio.get_running_loop

    def counted() -> asyncio.AbstractEventLoop:
        looked_up[0] += 1
        return get_running_loop()

    async def main() -> None:
        async with tba.Consumer(endpoint_url("tcp")) as consumer:
            producer = tb.Producer(consumer.address)
            monkeypatch.setattr(asyncio, "get_running_loop", counted)
            for i in range(5):  # receives that wait (the tensor is sent once each waits)
                sending = asyncio.get_running_loop().run_in_executor(None, producer.send, "k", np.full(4, i))
                assert (await consumer.recv("k", timeout=30))[0] == i
                await sending
            monkeypatch.undo()
            await asyncio.to_thread(producer.close)
        assert looked_up[0] == 5, "run_in_executor's own, one a round"

    run(main())


def test_the_turn_clock_restarts_when_a_receive_that_waited_resumes(run: Any) -> None:
    """A receive that waited counts as its loop's ends suspending when it resumes, not when it began to
    wait (aio/turns.py): the reply sent just after one that waited longer than SLICE_S need not yield first
    (it went out a turn late, after the acks and upkeep queued meanwhile)."""
    from tensorbus.aio import turns

    async def main() -> None:
        async with tba.Consumer(endpoint_url("tcp")) as consumer:
            sent_at: list[float] = []

            def send_later() -> None:
                with tb.Producer(consumer.address) as producer:
                    wait_for(lambda: waiting(consumer, "k"), 30, "the receive to wait")
                    time.sleep(5 * turns.SLICE_S)  # (the receive waits longer than SLICE_S: the case in question)
                    sent_at.append(time.perf_counter())
                    producer.send("k", np.zeros(4))

            sending = asyncio.get_running_loop().run_in_executor(None, send_later)
            await consumer.recv("k", timeout=30)
            assert turns._clock.since > sent_at[0], "the clock counts from the receive's resumption"
            await sending

    run(main())


def test_abort_fails_pending_and_later_receives(run: Any) -> None:
    async def main() -> None:
        async with tba.Consumer(endpoint_url("tcp")) as consumer:
            pending = [asyncio.create_task(consumer.recv(f"k{i}")) for i in range(3)]
            pending.append(asyncio.create_task(consumer.next_message()))
            await until(lambda: len(consumer.table._waiters) == 4, "the receives to wait")
            consumer.abort("shutting down for maintenance")
            for task in pending:
                with pytest.raises(tb.Aborted, match="maintenance"):
                    await task
            with pytest.raises(tb.Aborted, match="maintenance"):
                await consumer.recv("later", timeout=1)
        async with tba.Consumer(endpoint_url("tcp")) as consumer:
            pending = [asyncio.create_task(consumer.recv("k"))]
            await until(lambda: waiting(consumer, "k"), "the receive to wait")
        with pytest.raises(tb.Aborted, match="consumer closed"):  # (pending as it closed)
            await pending[0]
        with pytest.raises(tb.Closed):  # (made after: as the blocking consumer's)
            await consumer.recv("after close")

    run(main())


def test_manual_acknowledgement_is_the_blocking_consumers(run: Any) -> None:
    async def main() -> None:
        async with tba.Consumer(endpoint_url("memory"), ack="manual") as consumer:
            async with tba.Producer(consumer.address) as producer:
                await producer.send("k", np.arange(3))
            message = await consumer.recv_message("k", timeout=30)
            consumer.reject(message)  # given back: the next receive gets it again
            again = await consumer.recv_message("k", timeout=30)
            assert again.message_id == message.message_id and same(again.tensor, np.arange(3))
            assert consumer.table.buffered_bytes > 0  # taken, not acknowledged: it still counts
            consumer.ack(again)
            assert consumer.table.buffered_bytes == 0
        async with tba.Consumer(endpoint_url("memory")) as consumer:
            with pytest.raises(tb.ConfigError, match="manual"):
                consumer.ack(message)

    run(main())


def test_ends_opened_by_several_tasks_at_once_are_opened_once(run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    for kind in ("Consumer", "Producer"):
        blocking_class = getattr(tb.api, kind)
        monkeypatch.setattr(tb.api, kind, lambda *a, _c=blocking_class, _k=kind, **o: made.append(_k) or _c(*a, **o))

    async def main() -> None:
        consumer, producer = tba.Consumer(endpoint_url("tcp")), tba.Producer("memory://unused")
        await asyncio.gather(*(end.open() for end in (consumer, consumer, producer, producer)))
        sender = tba.Producer(consumer.address)  # opened by its first sends, several at once
        await asyncio.gather(*(sender.send("k", np.full(2, i)) for i in range(4)))
        assert sorted([int((await consumer.recv("k", timeout=30))[0]) for _ in range(4)]) == [0, 1, 2, 3]
        for end in (sender, producer, consumer):
            await end.close()

    run(main())
    assert sorted(made) == ["Consumer", "Producer", "Producer"]


def test_an_open_cancelled_or_closed_midway_closes_the_consumer_it_made(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, made = threading.Event(), []
    blocking_class = tb.api.Consumer

    def slow_consumer(*args: Any, **options: Any) -> Any:
        gate.wait(30)  # (a slow broker handshake)
        made.append(blocking_class(*args, **options))
        return made[-1]

    monkeypatch.setattr(tb.api, "Consumer", slow_consumer)

    async def main() -> None:
        cancelled = tba.Consumer(endpoint_url("tcp"))
        opening = asyncio.ensure_future(cancelled.open())
        await asyncio.sleep(0)  # (it has started)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        closed = tba.Consumer(endpoint_url("tcp"))
        opening = asyncio.ensure_future(closed.open())
        await asyncio.sleep(0)
        await closed.close()
        gate.set()
        with pytest.raises(tb.Closed):
            await opening
        deadline = time.monotonic() + 30  # the cancelled one is closed off the loop, by its done-callback
        while not (len(made) == 2 and all(c._closed for c in made)) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    run(main())
    assert len(made) == 2 and all(c._closed for c in made), "a consumer made for a cancelled or closed open lives on"


def test_errors_are_the_blocking_apis(run: Any) -> None:
    async def main() -> None:
        with pytest.raises(tb.ConfigError, match="unknown transport scheme"):
            await tba.Consumer("tpc://127.0.0.1:0").open()
        with pytest.raises(tb.ConfigError, match="no_such_option"):
            await tba.Producer("memory://x", no_such_option=1).open()
        producer = tba.Producer("memory://x")
        await producer.close()
        with pytest.raises(tb.Closed):
            await producer.send("k", np.arange(2))
        async with tba.Consumer("memory://x") as consumer:
            with pytest.raises(tb.ConfigError):
                await consumer.recv(17)  # type: ignore[arg-type]
            with pytest.raises(tb.ConfigError, match="callable"):
                consumer.blocking.recv_async("k", "not a function")  # type: ignore[arg-type]
        for receive in (consumer.recv("k", timeout=1), consumer.next_message(timeout=1)):
            with pytest.raises(tb.Closed):  # (as the blocking consumer's, after close)
                await receive
        assert [message async for message in consumer] == []  # (iteration ends)

    run(main())


@pytest.mark.parametrize("transport", ["memory", "tcp"])
def test_send_awaits_room_without_blocking_the_loop_and_send_timeout_bounds_it(run: Any, transport: str) -> None:
    tensor_bytes, count = 256 * 1024, 24  # 6 MB against 1 MB unacknowledged and a 1 MB table

    async def main() -> None:
        options = {"max_buffered_bytes": 1 << 20}
        async with tba.Consumer(endpoint_url(transport), **options) as consumer:
            async with tba.Producer(consumer.address, max_unacked_bytes=1 << 20, send_timeout_s=60) as producer:
                sent = 0
                beats = 0

                async def produce() -> None:
                    nonlocal sent
                    for i in range(count):
                        await producer.send("k", np.full(tensor_bytes // 8, i, dtype=np.float64))
                        sent += 1

                sending = asyncio.create_task(produce())
                await until(lambda: sent > 0, "a first send")
                stalled_at = -1
                while stalled_at != sent:  # until a send awaits for long (over 100 beats of the loop)
                    stalled_at, beats = sent, 0
                    while beats < 100 and sent == stalled_at:
                        await asyncio.sleep(0.001)
                        beats += 1
                assert sent < count and not sending.done()  # held back, and the loop ran on meanwhile
                for i in range(count):
                    assert int((await consumer.recv("k", timeout=60))[0]) == i
                await sending
            quick: dict[str, Any] = {"max_unacked_bytes": 1 << 20, "send_timeout_s": 0.5}
            if transport == "tcp":  # (closed within 0.5 s: what it sent waits in a consumer aborted below, unacked)
                quick["close_timeout_s"] = 0.5
            async with tba.Producer(consumer.address, **quick) as producer:
                started = time.monotonic()
                with pytest.raises(tb.TransportError, match="max_unacked_bytes"):
                    for i in range(count):
                        await producer.send("nobody", np.full(tensor_bytes // 8, i, dtype=np.float64))
                assert time.monotonic() - started < 30
                consumer.abort("done")

    run(main())


def test_a_send_cancelled_before_its_turn_is_not_sent(run: Any) -> None:
    async def main() -> None:
        async with tba.Consumer(endpoint_url("memory")) as consumer, tba.Producer(consumer.address) as producer:
            gate = threading.Event()
            blocker = asyncio.create_task(producer._run(gate.wait, 30))  # the worker is busy
            await asyncio.sleep(0)
            queued = asyncio.create_task(producer.send("cancelled", np.arange(2)))  # (behind it: to the worker)
            await asyncio.sleep(0)
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            gate.set()
            await blocker
            await producer.send("after", np.arange(3))
            assert same(await consumer.recv("after", timeout=30), np.arange(3))
            with pytest.raises(tb.Timeout):
                await consumer.recv("cancelled", timeout=0.1)

    run(main())


def test_a_memory_producer_sends_small_tensors_on_the_loop_and_large_ones_off_it(run: Any) -> None:
    """memory:// natively on the loop: small plain tensors are sent by the loop itself (no worker thread is
    made), and an in-process consumer on the same loop gets them; a large one is copied on the worker."""
    small = [np.full(1024, i, dtype=np.float32) for i in range(200)]
    big = np.arange(1 << 19, dtype=np.float32)  # 2 MB: over MEMORY_ON_LOOP_BELOW

    async def main() -> None:
        async with tba.Consumer(endpoint_url("memory")) as consumer, tba.Producer(consumer.address) as producer:
            for half in (small[:100], small[100:]):  # (fewer than a burst ahead of the receives: memory_pacing.py)
                for tensor in half:
                    await producer.send("small", tensor)
                for tensor in half:
                    assert same(await consumer.recv("small", timeout=30), tensor)
            assert producer._worker is None  # (none made: every send went out on the loop)
            await producer.send("big", big)
            assert producer._worker is not None
            assert same(await consumer.recv("big", timeout=30), big)
            await producer.flush(timeout=30)

    run(main())


def test_a_memory_send_behind_one_on_the_worker_is_not_overtaken(run: Any) -> None:
    """A small tensor sent while a large one is still being sent on the worker thread goes behind it, not out
    on the loop ahead of it: two tasks' sends arrive in the order they were made."""
    big = np.full(4 << 20, 7, dtype=np.uint8)

    async def main() -> None:
        async with tba.Consumer(endpoint_url("memory")) as consumer, tba.Producer(consumer.address) as producer:
            for round_ in range(20):
                first = asyncio.create_task(producer.send("k", big, metadata={"i": 2 * round_}))
                await asyncio.sleep(0)  # (its call is on the worker now)
                await producer.send("k", np.arange(4), metadata={"i": 2 * round_ + 1})
                await first
            seen = [(await consumer.recv_message("k", timeout=30)).metadata["i"] for _ in range(40)]
            assert seen == list(range(40))

    run(main())


def test_a_memory_send_is_not_let_overtake_a_worker_call_by_a_later_call_cancelled(run: Any) -> None:
    """A call queued on the worker and cancelled before it ran is done at once, while the call before it may
    still run: a small send after it still goes behind that one (as for a `wait_for(flush)` that timed out)."""
    big = np.full(16 << 20, 7, dtype=np.uint8)

    async def main() -> None:
        async with tba.Consumer(endpoint_url("memory")) as consumer, tba.Producer(consumer.address) as producer:
            for round_ in range(10):
                first = asyncio.create_task(producer.send("k", big, metadata={"i": 2 * round_}))
                await asyncio.sleep(0)
                cancelled = asyncio.create_task(producer.send("k", big, metadata={"i": -1}))
                await asyncio.sleep(0)
                cancelled.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await cancelled
                await producer.send("k", np.arange(4), metadata={"i": 2 * round_ + 1})
                await first
            seen = [(await consumer.recv_message("k", timeout=30)).metadata["i"] for _ in range(20)]
            assert seen == list(range(20))
            with pytest.raises(tb.Timeout):
                await consumer.recv("k", timeout=0.1)

    run(main())


def test_a_memory_producer_on_the_loop_is_paced_to_a_consumer_thread(run: Any) -> None:
    """A producer on the loop does not pause there (its receive may be a task of that loop), but owes the pause:
    its next sends go to the worker thread, which does pause. So it does not deliver far ahead of a blocking
    consumer's thread into the table (memory_pacing.py: BURST_BYTES, 4 MiB; unpaced it got 100 MB ahead)."""
    tensor = np.ones(16 << 10, np.float32)  # 64 KB
    count = 3_000

    async def main() -> int:
        url = endpoint_url("memory")
        consumer = tb.Consumer(url)
        most = [0]

        def consume() -> None:
            for _ in range(count):
                consumer.recv("k", timeout=30)
                most[0] = max(most[0], consumer.table.buffered_bytes)

        taking = threading.Thread(target=consume)
        taking.start()
        try:
            async with tba.Producer(url) as producer:
                for _ in range(count):
                    await producer.send("k", tensor)
                    most[0] = max(most[0], consumer.table.buffered_bytes)
                await asyncio.to_thread(taking.join, 60)
        finally:
            consumer.close()
        assert not taking.is_alive()
        return most[0]

    assert run(main()) <= 16 << 20


class ThreadClock:
    """What the kernel's accounting says the calling thread did (Linux's /proc; zeros elsewhere): what a late
    beat was made of, and how much of it the machine took (a wait for a CPU, a vCPU taken away)."""

    #: what `spent` gives, in order
    FIELDS = ("on a CPU", "waiting for a CPU", "minor faults", "major faults", "steal ticks")
    #: the length of a tick of /proc/stat's steal (USER_HZ)
    TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def __init__(self) -> None:
        task = f"/proc/self/task/{threading.get_native_id()}"
        paths = (f"{task}/schedstat", f"{task}/stat", "/proc/stat")
        self._files = [open(path, "rb") for path in paths] if all(map(os.path.exists, paths)) else []

    def __call__(self) -> tuple[float, ...]:
        """Seconds on a CPU and runnable waiting for one (schedstat), minor and major faults (its stat), and each
        CPU's steal ticks (/proc/stat: time the hypervisor ran something else on that vCPU)."""
        if not self._files:
            return (0.0,) * len(self.FIELDS)
        for file in self._files:
            file.seek(0)
        schedstat = self._files[0].read().split()
        stat = self._files[1].read().rsplit(b")", 1)[1].split()  # (after the command's name, which may hold spaces)
        cpus = [line.split() for line in self._files[2].read().splitlines()[1:] if line.startswith(b"cpu")]
        return (
            int(schedstat[0]) / 1e9,
            int(schedstat[1]) / 1e9,
            float(stat[7]),
            float(stat[9]),
            *(float(cpu[8]) for cpu in cpus),
        )

    @classmethod
    def spent(cls, before: tuple[float, ...], after: tuple[float, ...]) -> list[float]:
        """What the thread did between two readings, as FIELDS: the steal of the vCPU that lost the most."""
        deltas = [then - now for then, now in zip(after, before, strict=True)]
        return [*deltas[:4], max(deltas[4:], default=0.0)]

    @classmethod
    def late(cls, lateness: float, spent: list[float], stopped: float = 0.0) -> float:
        """A beat's `lateness` less what the machine took: the waits for a CPU, and the time the thread was
        neither on a CPU nor waiting for one while a vCPU was stolen, up to that steal less a tick (/proc/stat
        counts it in whole ticks: a tick less is never more than was stolen); or, if more, the time the whole
        machine `stopped` meanwhile (what every witness lost: `machine_took`)."""
        on_cpu, waiting, stolen_ticks = spent[0], spent[1], spent[4]
        off = max(lateness - on_cpu - waiting, 0.0)
        return min(lateness - waiting - min(off, max(stolen_ticks - 1, 0.0) * cls.TICK_S), lateness - stopped)

    def close(self) -> None:
        for file in self._files:
            file.close()


def test_a_beat_is_excused_only_what_the_machine_took() -> None:
    """`ThreadClock.late`: the waits for a CPU come off; time off a CPU comes off only up to the steal less a
    tick; the thread's own CPU never does."""
    tick = ThreadClock.TICK_S
    assert ThreadClock.late(0.100, [0.090, 0.0, 0, 0, 9]) == pytest.approx(0.090)  # (on a CPU: its own doing)
    assert ThreadClock.late(0.100, [0.001, 0.030, 0, 0, 0]) == pytest.approx(0.070)  # (off a CPU, none stolen)
    assert ThreadClock.late(0.100, [0.001, 0.0, 0, 0, 5]) == pytest.approx(0.100 - 4 * tick)
    assert ThreadClock.late(0.100, [0.001, 0.0, 0, 0, 50]) == pytest.approx(0.001)  # (never more than it was off)
    assert ThreadClock.late(0.100, [0.090, 0.0, 0, 0, 0], 0.060) == pytest.approx(0.040)  # (the machine stopped)
    assert ThreadClock.late(0.100, [0.001, 0.030, 0, 0, 0], 0.010) == pytest.approx(0.070)  # (the more of the two)
    before, after = (0.0, 0.0, 0, 0, 3, 7), (0.5, 0.1, 10, 0, 4, 17)
    assert ThreadClock.spent(before, after) == [0.5, 0.1, 10, 0, 10]  # (the vCPU that lost the most)


class Collections:
    """Python's garbage collections (a `gc.callbacks` entry): when each ran, on which thread, of which generation."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}  # (by thread: a collection runs on the thread that allocated)
        self.done: list[tuple[float, float, int, str]] = []  # (start, end, generation, thread)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = time.perf_counter()
        elif thread in self._started:
            name = threading.current_thread().name
            self.done.append((self._started.pop(thread), time.perf_counter(), info["generation"], name))

    def within(self, start: float, end: float) -> str:
        """The collections of 1 ms or more that overlapped a span, as text for a late beat's account."""
        found = [c for c in self.done if c[0] < end and c[1] > start and c[1] - c[0] >= 0.001]
        return "".join(f", a collection of generation {g} on {t} {(b - a) * 1e3:.1f} ms" for a, b, g, t in found)


def test_the_witnesses_note_a_stop_of_the_machine_and_it_excuses_only_what_every_one_lost() -> None:
    """Witnesses kept from running for 200 ms (SIGSTOP, as a paused VM keeps every process) each note a stall of
    about that length, at that moment, and `machine_took` counts it where a span overlaps it for certain; a stall
    only one witness had (its vCPU taken while the other ran) excuses nothing."""
    if not witnesses_run_here():
        pytest.skip("the witnesses need Linux's /proc and CPU affinity")
    with MachineWitness() as witness:
        try:
            for pid in witness.pids:
                os.kill(pid, signal.SIGSTOP)
            stopped = time.perf_counter()
            time.sleep(0.2)
            resumed = time.perf_counter()
        finally:
            for pid in witness.pids:  # (the first beat of each after this notes the stall, before `stop` ends it)
                os.kill(pid, signal.SIGCONT)
    assert len(witness.stalls) == min(len(os.sched_getaffinity(0)), MOST_WITNESSES)
    for one in witness.stalls:
        woke, late, stall = max(one, key=lambda noted: noted[2])
        assert 0.1 <= stall <= late and woke >= resumed, one  # (less its waits for a CPU before it stopped, after)
    assert machine_took(stopped, resumed, witness.stalls) >= 0.1
    assert machine_took(stopped - 10, stopped - 9, witness.stalls) == 0.0  # (long before it: nothing)
    beat = (0.5, 0.2, 0.1)  # (woke at 0.5 s, its beat from 0.299 s; 0.1 s of it not a wait for a CPU)
    assert witness_took(0.2, 0.5, [beat]) == pytest.approx(0.1)  # (the whole beat: the whole stall)
    assert witness_took(0.35, 0.5, [beat]) == pytest.approx(0.049)  # (0.15 s of it, less its 0.101 s of rest)
    assert witness_took(0.0, 0.35, [beat]) == 0.0  # (0.051 s of it: the stall may have been elsewhere)
    assert machine_took(0.2, 0.5, [[beat], [beat]]) == pytest.approx(0.1)
    assert machine_took(0.2, 0.5, [[beat], []]) == 0.0  # (one witness only: not the machine)


#: the ends' options in `test_the_loop_is_never_blocked_while_tensors_cross`, by case (a signed or compressed
#: 256 MB frame's check or decompression would hold the loop ~0.2-0.9 s: decoded off it)
LOOP_CASE_OPTIONS: dict[str, dict[str, Any]] = {
    "tcp, signed": {"signing_key": "k"},
    "tcp, zstd": {"compression": "zstd"},
}
#: the latest beat and the 99th percentile allowed, by case: 50 and 20 ms, but through a broker a beat waits for
#: the interpreter lock while a client's thread holds it (kafka-python builds records and requests in Python,
#: 60-165 ms at a time with 1 MB records; confluent-kafka's `produce` holds it while it waits for librdkafka, up
#: to 175 ms; pika decodes frames in Python, 20-56 ms), so there the latest may be 0.5 s late and the 99th
#: percentile 50 ms (26 ms on confluent against Compose's nine brokers in a full test run; docs/ASYNC.md)
LOOP_LIMITS: dict[str, tuple[float, float]] = {
    "amqp": (0.5, 0.050),
    "kafka": (0.5, 0.050),
    "kafka-confluent": (0.5, 0.050),
}


def _loop_case_ends(case: str, tmp_path: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The consumer's URL and options and the producer's options of a case of the heartbeat test."""
    transport = case.split(",")[0]
    if transport == "tcps":
        trustme = require_module("trustme", "dev")
        ca = trustme.CA()
        ca.cert_pem.write_to_path(tmp_path / "ca.pem")
        ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
        return (
            "tcps://127.0.0.1:0",
            {"ssl_certfile": str(tmp_path / "server.pem")},
            {"ssl_cafile": str(tmp_path / "ca.pem")},
        )
    options = LOOP_CASE_OPTIONS.get(case, {})
    consumer_options = {"signing_key": options["signing_key"]} if "signing_key" in options else {}
    if transport == "kafka-confluent":  # (a consumer's address names no client: the producer's is its own choice)
        options = {**options, "client": "confluent"}
    return endpoint_url(transport), consumer_options, options


@pytest.mark.parametrize(
    "transport",
    [
        *transport_params("tcp", "tcp, signed", "tcp, zstd", "unix", "tcps", "shm", "memory"),
        "memory, the large one from a thread",
        *transport_params("amqp", "kafka", "kafka-confluent"),
    ],
)
def test_the_loop_is_never_blocked_while_tensors_cross(run: Any, transport: str, tmp_path: Any) -> None:
    """A 1 ms heartbeat in the loop while a producer and a consumer in the same loop exchange a 256 MB
    tensor and 10,000 4 KB tensors over every transport (tcp:// signed, or compressed with zstd, too; over
    memory://, the 256 MB one also in a bundle, sent by a blocking producer on another thread of the process,
    which copies it into the endpoint's queue): no beat late by 50 ms or more, the 99th percentile under 20 ms
    (through a broker, whose clients hold the interpreter lock for longer, a beat may be 0.5 s late: LOOP_LIMITS).

    A beat's lateness does not count what the machine took from the loop's thread: the time the kernel kept
    it waiting for a CPU (a loaded 2-core machine does that for tens of ms, with no tensors moving at all),
    and, while the hypervisor ran something else on a vCPU (/proc/stat's steal: with both vCPUs busy, as a
    signed 256 MB tensor's check off the loop makes them, the VM loses 15-110 ms at a time), the time the
    thread was neither on a CPU nor waiting for one, up to that steal (`ThreadClock.late`); or, if more, the
    time the whole machine stopped: what every witness, a process per CPU that only sleeps, lost at the same
    moments to something other than a wait for a CPU (tests/machine_witness.py: a VM the host paused counts
    no steal, and a thread's "on a CPU" may hold the pause). It counts everything else: the thread's own CPU
    (page faults included), waits for the GIL with no vCPU stolen
    (also those for a thread preempted while it held it: telling those apart from the process's own doing
    took away the test's power to see a blocked loop). A beat 15 ms late or more is printed with what it was
    made of, the garbage collections it overlapped among it.

    An exchange late beyond the limits is run once more, with new ends, and the test fails only if that one is
    late too: what tensorbus does on the loop it does in every exchange (the munmap and the on-loop decoding
    this test caught took 60-900 ms in every one), while a rare stall the counters leave unexplained (on the
    2-vCPU VM with brokers running, one beat in a few thousand 35-80 ms late on the loop thread's own CPU,
    with no page fault: docs/TESTING.md) has not come in two exchanges in a row.

    What the process held before the exchange (its modules, the test's 10,000 arrays) is frozen out of
    Python's garbage collector (`gc.freeze`, as a service does after it started): a full collection of
    that heap, which allocation triggers at any time, takes 20-40 ms on the loaded 2-vCPU VM, whatever
    the loop is doing. Collections of what the exchange allocates still count."""
    big = np.full(64 << 20, 1.5, dtype=np.float32)
    small = [np.full(1024, i, dtype=np.float32) for i in range(10_000)]

    async def main() -> list[tuple[float, float, list[float]]]:
        beats: list[tuple[float, float, list[float]]] = []  # (when it was due, when it ran, what the thread did)
        stop = asyncio.Event()
        clock = ThreadClock()

        async def heartbeat() -> None:
            while not stop.is_set():
                before = clock()
                due = time.perf_counter() + 0.001
                await asyncio.sleep(0.001)
                beats.append((due, time.perf_counter(), ThreadClock.spent(before, clock())))

        url, consumer_options, options = _loop_case_ends(transport, tmp_path)
        async with (
            tba.Consumer(url, **consumer_options) as consumer,
            tba.Producer(consumer.address, **options) as producer,
        ):
            beating = asyncio.create_task(heartbeat())

            def send_from_a_thread() -> None:
                with tb.Producer(consumer.address) as beside:
                    beside.send("big", {"w": big})

            async def produce() -> None:
                if transport == "memory, the large one from a thread":
                    sending = asyncio.create_task(asyncio.to_thread(send_from_a_thread))
                else:
                    await producer.send("big", big)
                for tensor in small:
                    await producer.send("small", tensor)
                await producer.flush(timeout=120)
                if transport == "memory, the large one from a thread":
                    await sending

            async def consume() -> None:
                got = await consumer.recv("big", timeout=120)
                got = got["w"] if isinstance(got, dict) else got
                assert got.shape == big.shape and got[0] == 1.5 and got[-1] == 1.5
                for i in range(len(small)):
                    assert (await consumer.recv("small", timeout=120))[0] == i

            try:
                await asyncio.wait_for(asyncio.gather(produce(), consume()), 300)
            finally:
                stop.set()
                await beating
                clock.close()
        return beats

    most, most_p99 = LOOP_LIMITS.get(transport, (0.050, 0.020))
    for attempt in (1, 2):
        collections = Collections()
        gc.freeze()
        gc.callbacks.append(collections)
        try:
            with MachineWitness() as witness:
                beats = run(main())
        finally:
            gc.callbacks.remove(collections)
            gc.unfreeze()
        raw = [ran - due for due, ran, _ in beats]
        took = [machine_took(due, ran, witness.stalls) for due, ran, _ in beats]
        late = [
            ThreadClock.late(measured, spent, machine)
            for measured, machine, (_, _, spent) in zip(raw, took, beats, strict=True)
        ]
        worst, p99 = max(late), statistics.quantiles(late, n=100)[98]
        print(
            f"heartbeat, exchange {attempt}: {len(late)} beats; late by p99 {p99 * 1e3:.2f} ms, worst "
            f"{worst * 1e3:.2f} ms (as measured: p99 {statistics.quantiles(raw, n=100)[98] * 1e3:.2f} ms, "
            f"worst {max(raw) * 1e3:.2f} ms); stalls the witnesses noted, one per CPU: "
            + ", ".join(f"{len(one)} ({sum(stall for _, _, stall in one) * 1e3:.1f} ms)" for one in witness.stalls)
        )
        made_of = [
            f"{beat * 1e3:.1f} ms ({measured * 1e3:.1f} measured): "
            + ", ".join(
                f"{name} {value * 1e3:.1f} ms" if i < 2 else f"{name} {value:.0f}"
                for i, (name, value) in enumerate(zip(ThreadClock.FIELDS, spent, strict=True))
            )
            + f", lost by every witness {machine * 1e3:.1f} ms"
            + collections.within(due, ran)
            for beat, measured, machine, (due, ran, spent) in zip(late, raw, took, beats, strict=True)
            if beat >= 0.015
        ]
        print("\n".join(["beats 15 ms late or more:", *made_of]) if made_of else "no beat 15 ms late or more")
        assert len(late) >= 20  # (the beats ran all along: memory://'s exchange lasts only ~0.1 s, ~100 beats)
        if worst < most and p99 < most_p99:
            return
    raise AssertionError(f"late in both exchanges: worst {worst:.3f} s, p99 {p99:.3f} s; {made_of}")


def _signed_stream(count: int) -> list[np.ndarray]:
    """Tensors for a signed stream: every fourth of 2 MiB (its signature checked off the loop), the rest of 4 KB."""
    return [np.full((2 << 20 if i % 4 == 0 else 4096) // 4, i, np.float32) for i in range(count)]


def _send_all(address: str, tensors: list[np.ndarray], **options: Any) -> None:
    """A blocking producer sends `tensors` under one key, and flushes."""
    with tb.Producer(address, **options) as producer:
        for tensor in tensors:
            producer.send("k", tensor)
        producer.flush(60)


def test_a_frame_decoded_off_the_loop_keeps_its_place_among_its_producers_frames(run: Any) -> None:
    """Signed tensors of 2 MiB (checked on the consumer's decoding thread) and of 4 KB (on the loop) under one
    key: received in the order sent, each whole; the decoding thread is made only once a large one comes."""
    tensors = _signed_stream(24)

    async def main() -> None:
        async with tba.Consumer("tcp://127.0.0.1:0", signing_key="k") as consumer:
            reading: Any = consumer._reading
            await asyncio.to_thread(_send_all, consumer.address, tensors[1:4], signing_key="k")
            for tensor in tensors[1:4]:
                assert same(await consumer.recv("k", timeout=30), tensor)
            assert reading._decoding is None  # (small frames only so far: decoded on the loop)
            await asyncio.to_thread(_send_all, consumer.address, tensors, signing_key="k")
            for tensor in tensors:
                assert same(await consumer.recv("k", timeout=30), tensor)
            assert reading._decoding is not None

    run(main())


def test_a_held_frame_is_decoded_off_the_loop_once_the_table_has_room(run: Any, monkeypatch: Any) -> None:
    """A consumer whose table (5 MiB) fills with signed 2 MiB tensors holds the next one back undecoded; once
    receives make room it is offered again on the decoding thread, and every tensor comes, in order."""
    from tensorbus.transports.peer_frames import PeerFrames

    releases: list[str] = []
    off_loop = PeerFrames._off_loop

    def counted(self: PeerFrames, peer: Any, delivery: Any, released: bool = False) -> None:
        if released:
            releases.append(threading.current_thread().name)
        off_loop(self, peer, delivery, released)

    monkeypatch.setattr(PeerFrames, "_off_loop", counted)
    tensors = [np.full(1 << 19, i, np.float32) for i in range(6)]  # (2 MiB each)

    async def main() -> None:
        async with tba.Consumer("tcp://127.0.0.1:0", signing_key="k", max_buffered_bytes=5 << 20) as consumer:
            sending = asyncio.create_task(asyncio.to_thread(_send_all, consumer.address, tensors, signing_key="k"))
            reactor: Any = consumer.blocking.transport.reactor
            await until(lambda: any(peer.held is not None for peer in reactor._peer_list()), "a frame held back")
            for tensor in tensors:
                assert same(await consumer.recv("k", timeout=30), tensor)
            await sending

    run(main())
    assert releases, "no held frame was offered again off the loop"


def test_other_producers_are_served_while_a_large_frame_is_decoded_off_the_loop(run: Any, monkeypatch: Any) -> None:
    """A 2 MiB signed frame's check is held at a gate on the decoding thread: meanwhile another producer's
    tensors are delivered and received (the consumer's lock is not held through a decode); once the gate
    opens, the large one comes too."""
    from tensorbus.codec import chunking

    gate, parse = threading.Event(), chunking.parse
    at_gate = threading.Event()

    def gated(view: Any, **options: Any) -> Any:
        if len(view) > 1 << 20:
            at_gate.set()
            assert gate.wait(60), "the gate never opened"
        return parse(view, **options)

    monkeypatch.setattr(chunking, "parse", gated)
    large, small = np.full(1 << 19, 7, np.float32), _signed_stream(8)[1:4]

    async def main() -> None:
        async with tba.Consumer("tcp://127.0.0.1:0", signing_key="k") as consumer:
            sending = asyncio.create_task(asyncio.to_thread(_send_all, consumer.address, [large], signing_key="k"))
            await asyncio.to_thread(at_gate.wait, 60)
            await asyncio.to_thread(_send_all, consumer.address, small, signing_key="k")
            for tensor in small:
                assert same(await consumer.recv("k", timeout=30), tensor)
            assert not gate.is_set()
            gate.set()
            assert same(await consumer.recv("k", timeout=30), large)
            await sending

    try:
        run(main())
    finally:
        gate.set()


def test_a_consumer_that_closes_while_a_large_frame_is_held_loses_nothing(run: Any) -> None:
    """An aio consumer whose full table holds a signed 2 MiB frame back closes without an error (the close reads
    and decodes on its own thread), and leaves no decoding thread; its successor gets every tensor."""
    tensors = [np.full(1 << 19, i, np.float32) for i in range(6)]  # (2 MiB each)

    async def main() -> str:
        consumer = await tba.Consumer("tcp://127.0.0.1:0", signing_key="k", max_buffered_bytes=5 << 20).open()
        producer = tb.Producer(consumer.address, signing_key="k", reconnect_timeout_s=60)
        sending = asyncio.create_task(asyncio.to_thread(lambda: [producer.send("k", t) for t in tensors]))
        reactor: Any = consumer.blocking.transport.reactor
        await until(lambda: any(peer.held is not None for peer in reactor._peer_list()), "a frame held back")
        await consumer.close()
        assert reactor._closed
        assert not [t for t in threading.enumerate() if t.name.startswith("tensorbus-aio-decode")]
        await sending
        with tb.Consumer(consumer.address, signing_key="k") as successor:
            flushing = asyncio.create_task(asyncio.to_thread(producer.flush, 60))  # (it resends as it flushes)
            for tensor in tensors:
                assert same(await asyncio.to_thread(successor.recv, "k", 60), tensor)
            await flushing
        producer.close()
        return consumer.address

    run(main())


def test_a_frame_refused_off_the_loop_costs_its_producer_alone(run: Any) -> None:
    """A 2 MiB frame signed with another key is refused on the decoding thread (counted, logged); a producer
    with the right key is served on, before and after it."""
    good = _signed_stream(8)

    async def main() -> None:
        async with tba.Consumer("tcp://127.0.0.1:0", signing_key="k") as consumer:
            await asyncio.to_thread(_send_all, consumer.address, good[:4], signing_key="k")
            forger = tb.Producer(consumer.address, signing_key="not k", send_timeout_s=30)
            await asyncio.to_thread(forger.send, "k", np.zeros(1 << 19, np.float32))
            await until(lambda: consumer.stats["rejected"] == 1, "the forged frame refused")
            await asyncio.to_thread(forger.close)  # (off the loop: its close waits for the loop's acks)
            await asyncio.to_thread(_send_all, consumer.address, good[4:], signing_key="k")
            for tensor in good:
                assert same(await consumer.recv("k", timeout=30), tensor)
            assert consumer.stats["rejected"] == 1

    run(main())


@pytest.mark.parametrize("options", [{"compression": "zstd"}, {"signing_key": "k"}])
def test_a_producer_that_compresses_or_signs_sends_off_the_loop(
    run: Callable[[Coroutine[Any, Any, Any]], Any], options: dict[str, Any]
) -> None:
    """Compressing or signing runs over a whole tensor: such a producer sends from its worker thread, not the loop."""
    array = np.arange(1 << 16, dtype=np.float32)

    async def main() -> None:
        async with tba.Consumer("tcp://127.0.0.1:0", signing_key=options.get("signing_key")) as consumer:
            async with tba.Producer(consumer.address, **options) as producer:
                for _ in range(50):
                    await producer.send("w", array)
                assert producer._sender is None and producer._worker is not None
                assert len(producer._calls) <= 1  # (the worker's calls done are let go of, not kept)
                for _ in range(50):
                    assert same(await consumer.recv("w", timeout=30), array)

    run(main())


def test_a_large_strided_array_is_made_contiguous_off_the_loop(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    strided = np.arange(1 << 21, dtype=np.float32).reshape(1024, 2048)[:, ::2]  # (4 MiB, every other column)

    async def main() -> None:
        async with tba.Consumer("tcp://127.0.0.1:0") as consumer:
            async with tba.Producer(consumer.address) as producer:
                await producer.send("w", strided)
                assert producer._sender is not None and producer._worker is not None  # (the copy's thread)
                same(await consumer.recv("w", timeout=30), np.ascontiguousarray(strided))

    run(main())


@pytest.mark.parametrize("url", ["memory://closed-flush", "tcp://127.0.0.1:0"])
def test_a_flush_after_close_says_the_producer_is_closed(
    run: Callable[[Coroutine[Any, Any, Any]], Any], url: str
) -> None:
    async def main() -> None:
        async with tba.Consumer(url) as consumer:
            producer = tba.Producer(consumer.address)
            await producer.send("w", np.arange(3))
            await producer.close()
            with pytest.raises(tb.Closed):
                await producer.flush(5)
            never_opened = tba.Producer(consumer.address)
            await never_opened.close()
            with pytest.raises(tb.Closed):
                await never_opened.flush(5)
            assert never_opened._worker is None  # (no thread made for it)

    run(main())


def test_close_wakes_a_send_waiting_for_a_consumer_that_stopped_reading(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    """The close's flush waits `close_timeout_s` at most, its wait for the stuck send's turn included; the send
    then fails with `Closed` (with no `send_timeout_s` it would have waited for ever)."""

    async def main() -> None:
        async with tba.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=2 << 20, max_untaken_bytes=1 << 20) as consumer:
            producer = tba.Producer(consumer.address, max_unacked_bytes=1 << 20, send_timeout_s=None, close_timeout_s=1)
            await producer.open()

            async def send_on() -> None:
                for _ in range(100):  # (12.5 MiB: far past what the consumer takes in without a receive)
                    await producer.send("k", np.zeros(1 << 17))

            sending = asyncio.create_task(send_on())
            sender: Any = producer._sender
            await until(  # (the send suspended inside its turn, past max_unacked_bytes: waiting for acks)
                lambda: sender._turn.locked() and producer.blocking.transport._unacked_bytes >= 1 << 20,
                "the send waiting for acks",
            )
            await asyncio.wait_for(producer.close(), 20)
            with pytest.raises(tb.Closed):
                await asyncio.wait_for(sending, 20)

    run(main())


def test_a_send_the_socket_takes_only_part_of_ends_in_its_turn_and_another_tasks_sends_wait_behind_it(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    """A plain tensor's send writes at once, without the turn (socket_sending.py `_write_at_once`); where the
    socket takes only part of it, the rest goes in the turn, and a second task's sends wait for it (and are not
    overtaken by the first's next send while woken: `Turn.free`): no frame interleaves with another, and every
    tensor arrives whole, in its task's order."""
    require_native(socket_sending.SEND_FROM is not None, "the C frame sender (tensorbus/transports/_stream.c)")
    count, size = 48, 1 << 18  # (2 x 12 MiB, far past what a consumer that stopped reading lets in)

    async def main() -> None:
        async with tba.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=1 << 20) as consumer:
            async with tba.Producer(consumer.address, max_unacked_bytes=1 << 30, send_timeout_s=60) as producer:
                sender: Any = producer._sender
                finished_in_turn: list[int] = []
                send_retrying = sender._send_retrying

                async def spied(frame: Any, written: int = 0) -> None:
                    finished_in_turn.append(written)
                    await send_retrying(frame, written)

                sender._send_retrying = spied

                async def produce(key: str) -> None:
                    for i in range(count):
                        await producer.send(key, np.full(size // 8, i, dtype=np.float64))

                sending = [asyncio.create_task(produce("a"))]
                await until(lambda: any(finished_in_turn), "a send the socket took only part of")
                sending.append(asyncio.create_task(produce("b")))  # (its sends wait for that one's turn)
                seen: dict[str, list[int]] = {"a": [], "b": []}
                for _ in range(2 * count):  # (in arrival order: the table holds four of them)
                    message = await consumer.next_message(timeout=60)
                    got = message.tensor
                    assert got.shape == (size // 8,) and bool((got == got[0]).all())
                    seen[message.key].append(int(got[0]))
                assert seen == {"a": list(range(count)), "b": list(range(count))}
                await asyncio.gather(*sending)
                assert consumer.stats["rejected"] == 0

    run(main())


def test_a_turn_just_handed_to_a_waiting_task_is_not_free(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    """Between a release and the woken task's run the lock is not locked; the turn is not free all the same (a send
    that wrote then would put its frame between that task's and the connection's)."""

    async def main() -> None:
        turn, release, order = Turn(), asyncio.Event(), []

        async def hold() -> None:
            async with turn:
                await release.wait()
            order.append("first")

        async def wait_for_it() -> None:
            async with turn:
                order.append("second")

        tasks = [asyncio.create_task(hold())]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(wait_for_it()))
        await asyncio.sleep(0)
        assert turn.locked() and not turn.free()
        release.set()
        await asyncio.sleep(0)  # (the first ran, and released: the second is woken, not yet run)
        assert order == ["first"] and not turn.locked() and not turn.free()
        await asyncio.gather(*tasks)
        assert order == ["first", "second"] and turn.free()

    run(main())
