"""The C take of a receive whose message is buffered already (`TableState._take_buffered`, tensorbus/_intake.c)
against `Rendezvous._wait`'s Python take it stands in for.

A message it takes must leave the table exactly as the Python take leaves it (queues, counts, the take
counted, the take's hook called); a case it leaves to Python must change nothing, so that Python decides.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pytest

from tensorbus.codec import Message
from tensorbus.errors import Aborted, ConfigError
from tensorbus.intake_state import ANY, FAST
from tensorbus.rendezvous import Rendezvous

from ..conftest import require_native
from ..waiting import held_elsewhere

require_native(FAST is not None, "the table's C take (tensorbus/_intake.c)")


def state(table: Rendezvous) -> tuple[Any, ...]:
    """Everything a take may change, comparable."""
    arrivals = [(n, m.key, m.tensor.tolist(), size, source) for n, (m, size, source) in table._arrivals.items()]
    by_key = {key: list(numbers) for key, numbers in table._by_key.items()}
    return arrivals, by_key, table.buffered_bytes, dict(table._by_source), table._counter, table._taken


def twins(**options: Any) -> tuple[Rendezvous, Rendezvous, list[Message], list[Message]]:
    """Two tables alike, the second without its C take (as with TENSORBUS_NATIVE=0), and what each handed out."""
    c_side, python_side = Rendezvous(**options), Rendezvous(**options)
    python_side._take_buffered = None  # type: ignore[misc]  # (the instance's: the type's C method is shadowed)
    handed: tuple[list[Message], list[Message]] = ([], [])
    c_side.on_delivered_to_application, python_side.on_delivered_to_application = (got.append for got in handed)
    return c_side, python_side, *handed


def _no_python_take(key: object) -> Message | None:
    raise AssertionError("taken the Python way")


def test_buffered_messages_are_taken_in_c_as_python_takes_them() -> None:
    c_side, python_side, c_handed, python_handed = twins()
    c_side._take = _no_python_take  # type: ignore[method-assign]  # (every take below is C's)
    sent = [("a", 3), (None, 1), ("b", 2), ("a", 5), ("a", 0), (None, 4)]
    for table in (c_side, python_side):
        for key, n in sent:
            table.put(Message(key, np.arange(n, dtype=np.int16), {"n": n}))
    for key, timeout in [("a", None), (None, 0.5), ("a", 0), ("b", 10**30), ("a", 2.5), (None, math.inf)]:
        c_message, python_message = c_side.recv_message(key, timeout), python_side.recv_message(key, timeout)  # type: ignore[arg-type]
        assert c_message.metadata == python_message.metadata and c_message.key == key
        assert state(c_side) == state(python_side)
    assert [m.metadata["n"] for m in c_handed] == [m.metadata["n"] for m in python_handed] == [3, 1, 5, 2, 0, 4]
    assert c_side.taken_count() == 6 and c_side.buffered_bytes == 0 and not c_side._by_key and not c_side._arrivals


def _unchanged(table: Rendezvous, key: object, timeout: object = None) -> None:
    before = state(table)
    assert table._take_buffered(key, timeout) is None  # type: ignore[misc, arg-type]
    assert state(table) == before


def test_an_event_loops_take_of_a_buffered_key_is_cs_too_and_arrival_order_pythons() -> None:
    # (`take_now`: tensorbus.aio's receive of a message there already)
    c_side, python_side, c_handed, python_handed = twins()
    python_takes = c_side._take
    c_side._take = _no_python_take  # type: ignore[method-assign]
    for table in (c_side, python_side):
        for key, n in [("a", 3), (None, 1), ("a", 5), ("b", 2)]:
            table.put(Message(key, np.arange(n, dtype=np.int16), {"n": n}))
    for key in ["a", None, "a"]:
        c_message, python_message = c_side.take_now(key), python_side.take_now(key)
        assert c_message.metadata == python_message.metadata  # type: ignore[union-attr]
        assert state(c_side) == state(python_side)
    c_side._take = python_takes  # type: ignore[method-assign]  # (none buffered, and ANY, arrival order: Python's)
    assert c_side.take_now("c") is None and python_side.take_now("c") is None
    assert c_side.take_now(ANY).metadata == python_side.take_now(ANY).metadata == {"n": 2}  # type: ignore[union-attr]
    assert [m.metadata["n"] for m in c_handed] == [m.metadata["n"] for m in python_handed] == [3, 1, 5, 2]
    assert state(c_side) == state(python_side) and c_side.taken_count() == 4


@pytest.mark.parametrize("timeout", ["1", -1, -0.5, math.nan, True, -(10**30)])
def test_a_timeout_python_would_refuse_is_left_to_it_which_says_why(timeout: object) -> None:
    table = Rendezvous()
    table.put(Message("k", np.arange(3), {}))
    _unchanged(table, "k", timeout)
    with pytest.raises(ConfigError, match="timeout"):
        table.recv_message("k", timeout)  # type: ignore[arg-type]  # (the mistake reported though a tensor is there)
    assert len(table) == 1


def test_nothing_buffered_arrival_order_and_an_aborted_table_are_left_to_python() -> None:
    table = Rendezvous()
    _unchanged(table, "k")
    table.put(Message("k", np.arange(3), {}))
    _unchanged(table, "other")
    _unchanged(table, ANY)  # (arrival order: `next_message`, Python's)
    assert table.next_message().key == "k"
    table.put(Message("k", np.arange(3), {}))
    table.abort("stop")
    _unchanged(table, "k")
    with pytest.raises(Aborted):
        table.recv_message("k", 0)


def test_a_lock_held_by_another_thread_leaves_the_take_to_python() -> None:
    table = Rendezvous()
    table.put(Message("k", np.arange(3), {}))
    with held_elsewhere(table._lock):
        _unchanged(table, "k")
    assert table._take_buffered("k", None) is not None  # type: ignore[misc]  # (and once it is free, C takes it)


def test_messages_counted_against_their_producers_are_taken_in_c_and_uncounted_as_python_does() -> None:
    c_side, python_side, c_handed, python_handed = twins(max_buffered_bytes=10_000, max_buffered_bytes_per_producer=500)
    c_side._take = _no_python_take  # type: ignore[method-assign]  # (every take below is C's)
    sent = [("a", 7, 100), ("b", 8, 50), ("a", 7, 30), ("a", None, 20), ("b", 7, 10)]
    for table in (c_side, python_side):
        for key, source, n in sent:
            table.put(Message(key, np.zeros(n, np.uint8), {"n": n}), source=source)
    assert c_side._by_source == {7: 140, 8: 50}
    for key in ["a", "b", "a", "b", "a"]:
        c_side.recv_message(key), python_side.recv_message(key)
        assert state(c_side) == state(python_side)
    assert [m.metadata["n"] for m in c_handed] == [m.metadata["n"] for m in python_handed] == [100, 50, 30, 10, 20]
    assert c_side._by_source == {} and c_side.buffered_bytes == 0


def test_a_take_that_gives_a_producer_at_its_share_room_is_left_to_python_which_wakes_what_waits() -> None:
    c_side, python_side, _, _ = twins(max_buffered_bytes=10_000, max_buffered_bytes_per_producer=500)
    opened: list[str] = []
    for name, table in (("c", c_side), ("python", python_side)):
        table.room_opened = lambda name=name: opened.append(name)
        for _ in range(3):
            table.put(Message("k", np.zeros(200, np.uint8), {}), source=7)  # (600 bytes: at its share of 500)
    _unchanged(c_side, "k")
    for table in (c_side, python_side):
        table.recv_message("k")
    assert opened == ["c", "python"] and state(c_side) == state(python_side) and c_side._by_source == {7: 400}
    assert c_side._take_buffered("k", None) is not None  # type: ignore[misc]  # (under its share already: C takes it)
    assert c_side._by_source == {7: 200}


def test_a_take_that_opens_room_in_a_full_table_is_left_to_python_which_wakes_what_waits() -> None:
    c_side, python_side, _, _ = twins(max_buffered_bytes=1000)
    opened: list[str] = []
    for name, table in (("c", c_side), ("python", python_side)):
        table.room_opened = lambda name=name: opened.append(name)
        for _ in range(3):
            table.put(Message("k", np.zeros(400, np.uint8), {}))  # (1200 bytes: full, and one take leaves 800)
    _unchanged(c_side, "k")
    for table in (c_side, python_side):
        table.recv_message("k")
    assert opened == ["c", "python"] and state(c_side) == state(python_side)
    assert c_side._take_buffered("k", None) is not None  # type: ignore[misc]  # (room open already: C takes it)


def test_a_producer_over_its_share_that_stays_there_is_taken_in_c_and_one_not_counted_is_left_to_python() -> None:
    c_side, python_side, _, _ = twins(max_buffered_bytes=10_000, max_buffered_bytes_per_producer=500)
    c_side._take = _no_python_take  # type: ignore[method-assign]  # (the first take below is C's)
    for table in (c_side, python_side):
        for _ in range(4):
            table.put(Message("k", np.zeros(200, np.uint8), {}), source=7)  # (800 bytes: one take leaves 600)
        table.recv_message("k")
    assert state(c_side) == state(python_side) and c_side._by_source == {7: 600}
    del c_side._by_source[7]  # (a count that is not there: Python's to judge, nothing changed)
    _unchanged(c_side, "k")


def test_an_error_while_uncounting_reaches_the_caller_with_nothing_changed() -> None:
    class Refusing(int):
        def __ge__(self, other: object) -> bool:
            raise ValueError("refused to compare")

        def __sub__(self, other: object) -> Refusing:
            return Refusing(int(self) - int(other))  # type: ignore[call-overload]

    table = Rendezvous(max_buffered_bytes=10_000, max_buffered_bytes_per_producer=500)
    table.put(Message("k", np.zeros(10, np.uint8), {}), source=7)
    table._by_source[7] = Refusing(10)
    before = state(table)
    with pytest.raises(ValueError, match="refused to compare"):
        table._take_buffered("k", None)  # type: ignore[misc]
    assert state(table) == before
    got: list[bool] = []
    elsewhere = threading.Thread(target=lambda: got.append(table._lock.acquire(timeout=5)))
    elsewhere.start()
    elsewhere.join()
    assert got == [True]  # (the table's lock was let go)
