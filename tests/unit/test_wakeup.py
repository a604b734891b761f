"""memory://'s wait for a ring (transports/wakeup.py): the C `Wakeup` and its Python twin `PyWakeup`, one suite.

Both must return True for a ring (one made before the wait included, and two rings are one), False once the
timeout passed, and let other threads run while they wait: the C one spins without the interpreter lock, so
a thread that needs it (the ringer) runs meanwhile. Bounds are loose: these check what a wait returns, not
how fast.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tensorbus.codec.native import load
from tensorbus.transports import wakeup

from ..conftest import require_native


def _c_wakeup() -> Any:
    module = load("tensorbus._intake")
    require_native(module is not None, "the intake's C extension (tensorbus/_intake.c)")
    assert module is not None
    return module.Wakeup


@pytest.fixture(params=["python", "c"])
def make(request: pytest.FixtureRequest) -> Any:
    return wakeup.PyWakeup if request.param == "python" else _c_wakeup()


def test_the_wait_in_use_is_the_c_one_where_it_is_built() -> None:
    assert wakeup.Wakeup is _c_wakeup()


@pytest.mark.parametrize("spin_s", [0.0, 0.0001])
def test_a_ring_made_before_the_wait_is_not_lost_and_two_rings_are_one(make: Any, spin_s: float) -> None:
    bell = make()
    assert bell.wait(0, spin_s) is False  # not rung: a wait of no time says so at once
    bell.ring()
    bell.ring()
    assert bell.wait(30, spin_s) is True
    assert bell.wait(0, spin_s) is False  # the ring was taken once


@pytest.mark.parametrize("spin_s", [0.0, 0.005])
def test_an_unrung_wait_ends_at_its_timeout(make: Any, spin_s: float) -> None:
    bell = make()
    started = time.monotonic()
    assert bell.wait(0.05, spin_s) is False
    assert time.monotonic() - started >= 0.04


@pytest.mark.parametrize("spin_s", [0.0, 30.0])
def test_a_ring_from_another_thread_wakes_a_wait_with_no_timeout(make: Any, spin_s: float) -> None:
    bell, results = make(), []
    waiter = threading.Thread(target=lambda: results.append(bell.wait(None, spin_s)), daemon=True)
    waiter.start()
    waiter.join(0.05)  # (whether it waits yet or not: a ring before the wait is not lost either)
    bell.ring()
    waiter.join(10)
    assert results == [True]


def test_a_spinning_wait_lets_the_ringer_run(make: Any) -> None:
    """A wait spinning for its whole timeout must not hold the interpreter lock: the ringing thread runs
    Python meanwhile and rings, and the wait returns True. Were the spin to hold the lock, the ringer could
    run only once the wait had ended, False."""
    bell, results, entering = make(), [], threading.Event()

    def wait() -> None:
        entering.set()
        results.append(bell.wait(5.0, 5.0))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    assert entering.wait(10)  # (returns once the waiter let go of the interpreter lock: in its wait, at the latest)
    sum(range(100_000))  # Python work on this thread while the waiter waits
    bell.ring()
    waiter.join(10)
    assert results == [True]


def test_a_nan_timeout_is_refused(make: Any) -> None:
    with pytest.raises(ValueError, match="NaN"):
        make().wait(float("nan"))


def test_a_c_wait_whose_spins_ran_out_sleeps_at_once() -> None:
    """A spin that ran out halves the next one, down to none: where the ring comes late, a wait stops taking
    a CPU for nothing. A fresh wait spins (its spin, run out, counts one halving), one after six spins that ran
    out sleeps at once: next to no CPU for the waiting thread. (Not the fresh spin's own CPU: a spin yields its
    CPU at every turn, and on a busy machine another thread may take most of the 0.2 s.)"""
    make = _c_wakeup()
    fresh, spent = make(), make()
    for done in range(6):
        assert spent.halvings == done
        assert spent.wait(0.001, 0.001) is False
    assert fresh.halvings == 0 and spent.halvings == 6
    cpu = []
    for bell in (fresh, spent):
        started = time.thread_time()
        assert bell.wait(0.2, 0.2) is False
        cpu.append(time.thread_time() - started)
    assert fresh.halvings == 1 and spent.halvings == 6  # (the fresh wait spun; the spent one did not)
    assert cpu[1] < 0.005, cpu
    spent.ring()
    assert spent.wait(0, 0.2) is True and spent.halvings == 6  # (rung before the wait: no spin, nothing counted)
    assert spent.wait(0.01, 0.01) is False and spent.halvings == 6
    fresh.ring()
    assert fresh.wait(0.2, 0.2) is True and fresh.halvings == 0  # (a spin that was rung: the next spins in full)


class _Recorder:
    """A `Wakeup` that records the spin each wait was given and returns at once, unrung."""

    def __init__(self) -> None:
        self.spins: list[float] = []

    def ring(self) -> None:
        pass

    def wait(self, timeout_s: float | None = None, spin_s: float = 0.0) -> bool:
        self.spins.append(spin_s)
        return False


def test_only_a_receive_whose_thread_sent_since_it_last_waited_spins() -> None:
    """A round trip's receive (its thread sent, and waits for the reply) spins; a stream's receive (it only
    receives: its producer sends on, holding the interpreter lock) and the background thread sleep at once."""
    from tensorbus.transports.memory_frames import Frames

    frames, elsewhere, stop = Frames(), Frames(), threading.Event()
    frames._ready = _Recorder()  # type: ignore[assignment]
    spins = frames._ready.spins  # type: ignore[attr-defined]

    def get(receiving: bool) -> None:
        assert frames.get(stop, time.monotonic() + 30, receiving=receiving, spin_s=0.5) is None

    def on_a_thread(*steps: Any) -> None:
        thread = threading.Thread(target=lambda: [step() for step in steps])
        thread.start()
        thread.join(30)
        assert not thread.is_alive()

    on_a_thread(lambda: get(True))  # received only
    on_a_thread(lambda: elsewhere.put(b"request", source="me"), lambda: get(True), lambda: get(True))
    on_a_thread(lambda: elsewhere.put(b"request", source="me"), lambda: get(False))  # the background thread
    assert spins == [0.0, 0.5, 0.0, 0.0]


def test_a_memory_consumers_spin_is_its_option() -> None:
    import tensorbus as tb

    with tb.Consumer("memory://wakeup-spin?spin_s=0.002") as consumer:
        assert consumer.transport._reader._spin_s == 0.002  # type: ignore[attr-defined]
