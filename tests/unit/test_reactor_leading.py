"""Who leads a socket consumer's Reactor: the fields the leader and the waiting threads share."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tensorbus.buffers import BufferPool
from tensorbus.codec.frame import Limits
from tensorbus.transports.leading import Leadership
from tensorbus.transports.reactor import Reactor
from tensorbus.transports.socket import SocketConsumer
from tests.unit.test_reactor_add import Nowhere
from tests.waiting import wait_for


@pytest.fixture
def reactor() -> Any:
    reader = Reactor(Nowhere(), Limits(), SocketConsumer.Options(linger_s=0.0), BufferPool())  # type: ignore[arg-type]
    yield reader
    reader.close(1.0)


@pytest.mark.parametrize("taken", [True, False], ids=["just-after-taking-the-lead", "before-taking-it"])
def test_a_ctrl_c_while_taking_the_lead_leaves_it_free(reactor: Any, taken: bool, monkeypatch: Any) -> None:
    take_lead = reactor._take_lead

    def interrupted(wait_s: float) -> bool:
        if taken:  # (the real way in: a background leader steps aside)
            assert take_lead(30)
        raise KeyboardInterrupt  # (the Ctrl-C, not a RuntimeError of a release by a thread that does not own it)

    monkeypatch.setattr(reactor, "_take_lead", interrupted)
    done = threading.Lock()
    done.acquire()
    with pytest.raises(KeyboardInterrupt):
        reactor.read_while_waiting(done, None)
    with pytest.raises(RuntimeError):  # not this thread's: given back (an RLock refuses a release by a non-owner)
        reactor._leader.release()


def test_whether_someone_wants_to_lead_is_read_under_its_lock(reactor: Any) -> None:
    answers: list[bool] = []
    with reactor._wanted_lock:  # (what a thread changing `_wanted` holds)
        reader = threading.Thread(target=lambda: answers.append(reactor._someone_wants_to_lead()))
        reader.start()
        reader.join(0.2)
        assert reader.is_alive() and not answers  # it waits for the lock rather than read a count being changed
    reader.join(5)
    assert answers == [False]


def test_who_leads_is_read_under_the_lock_it_is_written_under(reactor: Any) -> None:
    answers: list[int | None] = []
    with reactor._wanted_lock:  # (what a leader holds while it says it leads, or no longer does)
        reader = threading.Thread(target=lambda: answers.append(reactor.leading_thread()))
        reader.start()
        reader.join(0.2)
        assert reader.is_alive() and not answers  # it waits for the lock rather than read a leader being changed
    reader.join(5)
    assert len(answers) == 1


def test_a_thread_taking_the_lead_says_so_under_the_lock(reactor: Any) -> None:
    seen: list[tuple[bool, int | None]] = []

    def take() -> None:
        took = reactor._take_lead(5)
        seen.append((took, reactor.leading_thread()))
        reactor._lead_as(None)
        reactor._leader.release()

    with reactor._wanted_lock:  # a thread deciding whether to wait holds it: the taker cannot lead half-said
        taker = threading.Thread(target=take)
        taker.start()
        taker.join(0.2)
        assert taker.is_alive() and not seen
    taker.join(10)
    assert seen == [(True, taker.ident)]
    assert reactor.leading_thread() != taker.ident


def test_a_thread_deciding_whether_to_wait_sees_an_application_leader(reactor: Any) -> None:
    done = threading.Lock()
    done.acquire()
    leader = threading.Thread(target=lambda: reactor.read_while_waiting(done, None))
    leader.start()
    try:
        wait_for(lambda: reactor.leading_thread() == leader.ident, 10, "the first thread to lead")
        assert not reactor._take_lead(0.5)  # it waits for its tensor: the leader delivers it too
        assert reactor.leading_thread() == leader.ident
    finally:
        done.release()
        leader.join(10)
    assert not leader.is_alive()


def _leadership() -> Leadership:
    return Leadership(linger_s=0.0, interrupt=lambda: None)


def test_a_leadership_says_who_leads_under_its_lock() -> None:
    leadership = _leadership()
    answers: list[bool] = []
    with leadership._state:
        readers = [
            threading.Thread(target=lambda: answers.append(leadership.is_leading())),
            threading.Thread(target=lambda: answers.append(leadership._waits_for_another())),
            threading.Thread(target=lambda: answers.append(leadership._wants())),
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(0.2)
            assert reader.is_alive()
        assert not answers  # each waits for the lock rather than read fields being changed
    for reader in readers:
        reader.join(5)
    assert answers == [False, False, False]


def test_a_leadership_leader_is_seen_by_another_thread_deciding_whether_to_wait() -> None:
    leadership = _leadership()
    first, second = threading.Lock(), threading.Lock()
    first.acquire()
    second.acquire()
    stepping, finished = threading.Event(), threading.Event()

    def step(deadline: float | None, stop: Any) -> bool:  # (a read that waits for a frame until `deadline`)
        stepping.set()
        finished.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return True

    leader = threading.Thread(target=lambda: leadership.wait(first, time.monotonic() + 30, step))
    leader.start()
    try:
        assert stepping.wait(10)
        assert leadership._waits_for_another()  # another thread leads: this one would wait, not lead
        steps: list[int] = []
        assert not leadership.wait(second, time.monotonic() + 0.2, lambda d, s: steps.append(1) or True)
        assert not steps  # it never led
    finally:
        first.release()
        finished.set()
        leader.join(10)
    assert not leader.is_alive() and not leadership._waits_for_another()
