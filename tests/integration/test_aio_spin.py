"""A socket consumer of tensorbus.aio keeps its loop awake for `spin_s` while a receive waits
(aio/socket_reading.py, `LoopReading.spin`): bounded, over as soon as the frame came, with the loop's
other tasks, timers and I/O running throughout, and backing off after spins that ran out.

Each test runs on the standard asyncio loop and on uvloop (the `run` fixture of test_aio.py).
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import numpy as np
import pytest

import tensorbus.aio as tba
from tensorbus.aio import socket_reading, turns
from tensorbus.aio.socket_reading import NEAR_MISS, SPIN_BACKOFF, STRETCH, LoopReading
from tests.conftest import endpoint_url
from tests.integration.test_aio import run, waiting  # noqa: F401  (`run`: the fixture)
from tests.waiting import until


def _reading(consumer: tba.Consumer) -> LoopReading:
    reading = consumer._reading
    assert reading is not None, "a tcp:// consumer of tensorbus.aio reads on its loop"
    return reading


def _count_steps(reading: LoopReading) -> list[int]:
    """A one-item list counting the spin's steps from now on."""
    steps = [0]
    step = reading._spin_step

    def counted() -> None:
        steps[0] += 1
        step()

    reading._spin_step = counted  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_waiting_receive_spins_for_spin_s_and_then_lets_the_loop_sleep(run: Any, transport: str) -> None:  # noqa: F811
    """With no frame coming, the spin takes steps for `spin_s` (not less: it ends by its bound, the
    receive still waiting), and none after it: the loop sleeps until the receive's own end."""
    spin_s = 0.05

    async def main() -> None:
        async with tba.Consumer(endpoint_url(transport), spin_s=spin_s) as c:
            reading = _reading(c)
            steps = _count_steps(reading)
            started = time.monotonic()
            receive = asyncio.create_task(c.recv("k", timeout=30))
            await until(lambda: waiting(c, "k") and reading._spinning is None, "the spin to end", timeout=10)
            spun_s = time.monotonic() - started
            assert not receive.done(), "the spin ended by its bound, with the receive still waiting"
            assert spun_s >= spin_s, f"the spin ended after {spun_s:.4f}s, before its bound of {spin_s}s"
            assert steps[0] > 1, "a receive that waits spins"
            seen = steps[0]
            await asyncio.sleep(2 * spin_s)
            assert steps[0] == seen, "no step after the spin ran out: the loop may sleep"
            receive.cancel()
            with pytest.raises(asyncio.CancelledError):
                await receive

    run(main())


def test_the_loop_runs_its_other_tasks_timers_and_io_while_a_receive_spins(run: Any) -> None:  # noqa: F811
    """A spin of 30 s: meanwhile a second task's timers fire again and again, a socket it awaits is read,
    and a producer on the same loop connects and sends; the receive gets that tensor, and the spin is
    over as soon as it came (well before its 30 s)."""

    async def main() -> None:
        async with tba.Consumer("tcp://127.0.0.1:0", spin_s=30) as consumer:
            reading = _reading(consumer)
            receive = asyncio.create_task(consumer.recv("k", timeout=60))
            await until(lambda: waiting(consumer, "k"), "the receive to wait")
            assert reading._spinning is not None
            ticks, spinning_throughout = 0, True
            loop = asyncio.get_running_loop()
            left, right = socket.socketpair()
            left.setblocking(False)
            with left, right:
                for _ in range(20):
                    await asyncio.sleep(0.001)  # (a timer)
                    ticks += 1
                    right.send(b"x")
                    assert await asyncio.wait_for(loop.sock_recv(left, 1), 10) == b"x"  # (I/O)
                    spinning_throughout = spinning_throughout and reading._spinning is not None
            assert ticks == 20 and spinning_throughout, "the other task ran while the receive spun"
            async with tba.Producer(consumer.address) as producer:
                await producer.send("k", np.arange(1024, dtype=np.float32))
                got = await asyncio.wait_for(receive, 30)
                assert got[-1] == 1023
                await until(lambda: reading._spinning is None, "the spin to end with its frame", timeout=10)
                assert reading._backoff == 0 and reading._skip == 0, "a spin that found its frame backs off nothing"

    run(main())


def test_a_spin_goes_on_while_bytes_come_and_ends_spin_s_after_the_last(run: Any) -> None:  # noqa: F811
    """A spin of 1 s: frames of another key every 10 ms for 1.5 s keep it going (a large frame comes in
    many reads, each a reason to go on); once they stop it ends by its bound, the receive still waiting."""

    async def main() -> None:
        async with tba.Consumer("tcp://127.0.0.1:0", spin_s=1.0) as consumer:
            reading = _reading(consumer)
            async with tba.Producer(consumer.address) as producer:
                await producer.send("other", np.zeros(4))  # (connected before the receive waits)
                await consumer.recv("other", timeout=30)
                turns.replying()  # (a stream's receive: no send since the last wait, however that one went)
                receive = asyncio.create_task(consumer.recv("k", timeout=60))
                await until(lambda: waiting(consumer, "k"), "the receive to wait")
                started = time.monotonic()
                while time.monotonic() - started < 1.5:
                    await producer.send("other", np.zeros(4))
                    await asyncio.sleep(0.01)
                assert reading._spinning is not None and reading._backoff == 0, "the spin went on past spin_s"
                await until(lambda: reading._spinning is None, "the spin to end", timeout=10)
                assert not receive.done() and reading._backoff == 1, "it ended by its bound"
                receive.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await receive

    run(main())


def test_spins_that_run_out_back_off_and_one_that_finds_its_frame_ends_that(run: Any) -> None:  # noqa: F811
    """After a spin that ran out the next receive sleeps at once, after two in a row the next two, and so
    on up to SPIN_BACKOFF; a spin that finds its frame starts it over. spin_s=0 spins never. (These receives
    follow no send on their thread: a stream's.)"""

    async def wait_once(consumer: tba.Consumer, reading: LoopReading) -> bool:
        """Whether a receive that waits (and is then cancelled) spins; its spin is left to run out."""
        steps = _count_steps(reading)
        receive = asyncio.create_task(consumer.recv("k", timeout=30))
        await until(lambda: waiting(consumer, "k") and reading._spinning is None, "the spin to end", timeout=10)
        receive.cancel()
        with pytest.raises(asyncio.CancelledError):
            await receive
        del reading._spin_step  # (the instance's counting wrapper: the class's step again)
        return steps[0] > 0

    async def main() -> None:
        async with tba.Consumer("tcp://127.0.0.1:0", spin_s=0.005) as consumer:
            reading = _reading(consumer)
            spun = [await wait_once(consumer, reading) for _ in range(8)]
            assert spun == [True, False, True, False, False, True, False, False]
            assert reading._backoff == 4 and reading._skip == 2
            reading._backoff, reading._skip = SPIN_BACKOFF, 0  # (as if many had run out in a row)
            assert await wait_once(consumer, reading)
            assert reading._backoff == SPIN_BACKOFF and reading._skip == SPIN_BACKOFF, "it backs off no further"
            reading._skip = 0
            assert reading._consumer is not None and reading._consumer.reactor is not None
            reading._consumer.reactor.spin_s = 30  # (the frame comes within this spin, however loaded)
            async with tba.Producer(consumer.address) as producer:
                receive = asyncio.create_task(consumer.recv("k", timeout=30))
                await until(lambda: waiting(consumer, "k"), "the receive to wait")
                assert reading._spinning is not None
                await producer.send("k", np.zeros(4))
                await asyncio.wait_for(receive, 30)
                await until(lambda: reading._spinning is None, "the spin to end with its frame", timeout=10)
            assert reading._backoff == 0 and reading._skip == 0
        async with tba.Consumer("tcp://127.0.0.1:0", spin_s=0) as consumer:
            assert not await wait_once(consumer, _reading(consumer))

    run(main())


class _Clock:
    """A `time.monotonic` that moves only when told (`socket_reading`'s: the spin's bounds and its judging)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_near_miss_of_a_reply_makes_the_next_spin_longer(run: Any, monkeypatch: Any) -> None:  # noqa: F811
    """A receive that waits after a send on its thread (for a reply) and whose spin ran out is judged by when
    bytes came next. Within NEAR_MISS spins after, the peer answered, late by its own wake-up: the next reply's
    receive spins STRETCH times as long, without backing off (two ends of a quiet ping-pong that both slept
    once otherwise keep each other asleep, each making the other's spins run out). A longer spin that runs
    out, or bytes that come later, back off as before; a near miss keeps the back-off built up, for when the
    longer spin runs out too. A receive with no send before it (a stream's) backs off as soon as its spin ran
    out."""
    clock = _Clock()
    monkeypatch.setattr(socket_reading, "time", clock)
    spin_s = 0.05

    async def main() -> None:
        async with (
            tba.Consumer("tcp://127.0.0.1:0", spin_s=spin_s) as consumer,
            tba.Consumer("tcp://127.0.0.1:0") as peer,
        ):
            reading = _reading(consumer)

            async def spin_for(spun_s: float, reply: bool = True) -> asyncio.Task[Any]:
                """A receive of "k" that waits (after a send to the peer: `reply`), its spin run out on the clock
                after `spun_s`; it goes on spinning until then, however many turns the loop takes (a second)."""
                if reply:
                    await to_peer.send("ping", np.zeros(4))
                receive = asyncio.create_task(consumer.recv("k", timeout=30))
                await until(lambda: waiting(consumer, "k") and reading._spinning is not None, "the receive to spin")
                clock.now += 0.99 * spun_s
                await asyncio.sleep(1.0)
                assert reading._spinning is not None, f"the spin ended before {spun_s}s"
                clock.now += 0.02 * spun_s
                await until(lambda: reading._spinning is None, "the spin to run out", timeout=10)
                assert not receive.done()
                return receive

            async def answer(receive: asyncio.Task[Any], after_s: float) -> None:
                """The frame comes `after_s` after the spin ran out (on the clock)."""
                clock.now += after_s
                await producer.send("k", np.zeros(4))
                await asyncio.wait_for(receive, 30)

            async with tba.Producer(consumer.address) as producer, tba.Producer(peer.address) as to_peer:
                await producer.send("other", np.zeros(4))  # (connected before the receives wait)
                await consumer.recv("other", timeout=30)
                turns.replying()  # (that receive may have found its tensor there, not waiting: the send forgotten)

                await answer(await spin_for(spin_s, reply=False), 0.5 * NEAR_MISS * spin_s)
                assert (reading._backoff, reading._skip, reading._stretch) == (1, 1, False), "a stream's"
                reading._backoff = reading._skip = 0

                receive = await spin_for(spin_s)
                assert reading._ran_out is not None and reading._skip == 0, "judged when bytes come"
                await answer(receive, 0.5 * NEAR_MISS * spin_s)
                assert (reading._backoff, reading._skip, reading._stretch) == (0, 0, True), "a near miss"

                await answer(await spin_for(STRETCH * spin_s), 0.0)
                assert (reading._backoff, reading._skip) == (1, 1), "a longer spin that ran out backs off"
                receive = asyncio.create_task(consumer.recv("k", timeout=30))
                await until(lambda: waiting(consumer, "k"), "the receive to wait")
                assert reading._spinning is None and reading._skip == 0, "the next receive sleeps at once"
                await answer(receive, 0.0)

                await answer(await spin_for(spin_s), 1.5 * NEAR_MISS * spin_s)
                assert (reading._backoff, reading._skip, reading._stretch) == (2, 2, False), "a late answer"
                reading._backoff, reading._skip = 8, 0
                await answer(await spin_for(spin_s), 0.5 * NEAR_MISS * spin_s)
                assert (reading._backoff, reading._skip, reading._stretch) == (8, 0, True), "kept"
                await answer(await spin_for(STRETCH * spin_s), 0.0)
                assert (reading._backoff, reading._skip) == (16, 16), "and doubled when the longer spin runs out"

    run(main())
