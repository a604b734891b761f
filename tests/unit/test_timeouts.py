"""Timeout arguments are checked where they are given: an error naming the argument, not one deep in a wait."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tensorbus as tb

NUMBER = "must be a number of seconds or None"
BAD = [
    ("1", NUMBER + r", got '1' \(str\)"), (True, NUMBER), ([1], NUMBER),
    (-1, "must be 0 seconds or more"), (-0.5, "must be 0 seconds or more"), (math.nan, "cannot be NaN"),
]  # fmt: skip


def _calls(consumer: tb.Consumer, producer: tb.Producer) -> dict[str, Callable[[Any], object]]:
    """Every public method that takes a timeout, with that timeout as its one argument left."""
    table = tb.Rendezvous()
    return {
        "Consumer.recv": lambda t: consumer.recv("x", timeout=t),
        "Consumer.recv_message": lambda t: consumer.recv_message("x", timeout=t),
        "Consumer.next_message": lambda t: consumer.next_message(timeout=t),
        "Producer.flush": lambda t: producer.flush(timeout=t),
        "Rendezvous.recv": lambda t: table.recv("x", timeout=t),
        "Rendezvous.next_message": lambda t: table.next_message(timeout=t),
        "Rendezvous.wait_for_room": lambda t: table.wait_for_room(timeout=t),
    }


@pytest.mark.parametrize(("timeout", "needle"), BAD)
def test_a_bad_timeout_is_a_config_error_naming_the_argument(timeout: object, needle: str) -> None:
    with tb.Consumer("memory://timeouts") as consumer, tb.Producer("memory://timeouts") as producer:
        for name, call in _calls(consumer, producer).items():
            with pytest.raises(tb.ConfigError, match=f"^timeout {needle}") as caught:
                call(timeout)
            assert isinstance(caught.value, ValueError), name
        producer.send("x", np.arange(3))  # nothing was lost or left waiting by the refused calls
        assert consumer.recv("x", timeout=5).tolist() == [0, 1, 2]


@pytest.mark.parametrize("timeout", [0, 0.0, 0.01, np.float64(0.01), np.int64(0), None])
def test_numbers_of_seconds_and_none_are_taken(timeout: Any) -> None:
    with tb.Consumer("memory://timeouts-ok") as consumer, tb.Producer("memory://timeouts-ok") as producer:
        producer.send("x", np.arange(2))
        try:
            producer.flush(timeout)
        except tb.TransportError:  # a flush of 0 seconds, before the consumer took it: as on tcp://, not a refusal
            assert timeout == 0
        assert consumer.recv_message("x", timeout=5).tensor.tolist() == [0, 1]
        producer.send("y", np.arange(1))
        assert consumer.next_message(timeout=None if timeout is None else 5).key == "y"
        if timeout is not None:
            with pytest.raises(tb.Timeout, match=r"no tensor for key 'x' within"):
                consumer.recv("x", timeout=timeout)


def test_a_duration_option_of_inf_is_as_long_as_a_wait_takes_and_a_connect_of_no_time_is_refused() -> None:
    """`connect_timeout_s=math.inf` (or 1e10 s) became an OverflowError at the first connect (a socket's timeout
    refuses it); it is taken as the longest wait this platform has. A connect of 0 s never completes: refused."""
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        for forever in (math.inf, 1e10):
            with tb.Producer(consumer.address, connect_timeout_s=forever, send_timeout_s=forever) as producer:
                producer.send("k", np.arange(3))
                producer.flush(30)
                assert consumer.recv("k", timeout=30).tolist() == [0, 1, 2]
    with pytest.raises(tb.ConfigError, match="connect_timeout_s must be more than 0"):
        tb.Producer("tcp://127.0.0.1:1?connect_timeout_s=0")
