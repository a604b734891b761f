"""kafka-python 3.0 drops the socket of a failed connection attempt unclosed; tests/kafka_sockets.py closes it."""

from __future__ import annotations

import socket
import time
import warnings
from collections.abc import Iterator

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.errors import KafkaConnectionError
    from kafka.net.inet import KafkaNetSocket, create_connection
    from kafka.net.selector import NetworkSelector


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[socket.socket]]:
    """Every socket kafka-python's connection attempts make (closed after the test, whatever it found)."""
    sockets: list[socket.socket] = []
    factory = KafkaNetSocket.socket

    def recording(self: KafkaNetSocket, *args: int) -> socket.socket:
        sockets.append(factory(self, *args))
        return sockets[-1]

    monkeypatch.setattr(KafkaNetSocket, "socket", recording)
    yield sockets
    for sock in sockets:
        sock.close()


@pytest.fixture
def net() -> Iterator[NetworkSelector]:
    selector = NetworkSelector()
    yield selector
    selector.close()


def _attempt(net: NetworkSelector, port: int, timeout_at: float) -> None:
    with pytest.raises(KafkaConnectionError):
        net.run(create_connection, net, "127.0.0.1", port, (), None, timeout_at)


def test_a_connection_attempt_that_times_out_closes_its_socket(made: list[socket.socket], net: NetworkSelector) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        _attempt(net, listener.getsockname()[1], time.monotonic())  # its deadline has passed already
    assert len(made) == 1
    assert made[0].fileno() == -1, "kafka-python left the timed-out attempt's socket open"


def test_a_refused_connection_attempt_closes_its_socket(made: list[socket.socket], net: NetworkSelector) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]  # (closed: nothing listens there now)
    _attempt(net, port, time.monotonic() + 10)
    assert len(made) == 1
    assert made[0].fileno() == -1, "kafka-python left the refused attempt's socket open"
