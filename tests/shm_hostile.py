"""A hand-made shm:// producer connection, for sending what no honest producer would, and the check that the
consumer dropped it and serves the next producer."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.transports import shm_control as control
from tensorbus.transports.stream import proof
from tests.peers import same


def raw_producer(path: str) -> tuple[socket.socket, list[Any]]:
    """A control connection past the handshake, and what the consumer's hello offered after its nonce."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(path)
    (kind, nonce, *offers), _ = control.receive(sock)
    assert kind == "hello"
    control.send(sock, "proof", proof(None, nonce))
    assert control.receive(sock)[0] == ["ok"]
    return sock, offers


def dropped_and_served_on(sock: socket.socket, consumer: tb.Consumer, url: str) -> None:
    """The consumer closed `sock`'s connection, and still takes a tensor from a new producer."""
    with pytest.raises((ConnectionError, OSError)):  # dropped: the next receive sees the end
        while control.receive(sock) is not None:
            pass
    with tb.Producer(url) as producer:
        producer.send("after", np.arange(3))
    assert same(consumer.recv("after", timeout=10), np.arange(3))
