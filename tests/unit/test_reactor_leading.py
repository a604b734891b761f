"""Who leads a socket consumer's Reactor: the fields the leader and the waiting threads share."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tensorbus.buffers import BufferPool
from tensorbus.codec.frame import Limits
from tensorbus.transports.reactor import Reactor
from tensorbus.transports.socket import SocketConsumer
from tests.unit.test_reactor_add import Nowhere


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
