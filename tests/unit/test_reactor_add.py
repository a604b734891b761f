"""Connections handed to the reader from the accept thread while a leader reads the others."""

from __future__ import annotations

import socket
from typing import Any

from tensorbus.buffers import BufferPool
from tensorbus.codec.frame import Limits
from tensorbus.ledger import Ledger
from tensorbus.transports import Delivered
from tensorbus.transports.reactor import Reactor
from tensorbus.transports.socket import SocketConsumer


class Nowhere:
    """A consumer's intake that takes every frame (none comes here)."""

    fast = None

    def __init__(self) -> None:
        self.ledger = Ledger()

    def __call__(
        self, frame: Any, crc: int | None = None, *, may_hold: bool = False, source: object = None
    ) -> Delivered:
        return Delivered(None, True)


def test_a_connection_a_leader_drops_before_it_is_registered_leaves_its_descriptor_to_the_next() -> None:
    """A lone connection is read without the poller, so a leader may read it, find it closed and drop
    it before `add` registered it: the next connection given that descriptor number must be read all the same."""
    reader = Reactor(Nowhere(), Limits(), SocketConsumer.Options(linger_s=0.0), BufferPool())  # type: ignore[arg-type]
    register = reader._poller.register

    def dropped_meanwhile(fd: int, data: Any) -> None:
        """`Reactor._drop` on the leader's thread, its steps around this registration."""
        peer = reader._peers.pop(fd)  # (then unregistering finds nothing: not registered yet)
        register(fd, data)
        peer.conn.close()

    try:
        first, first_peer = socket.socketpair()
        first_peer.close()
        fd = first.fileno()
        reader._poller.register = dropped_meanwhile  # type: ignore[method-assign]
        reader.add(first, "first")
        reader._poller.register = register  # type: ignore[method-assign]
        assert fd not in reader._peers
        second, peer = socket.socketpair()
        try:
            assert second.fileno() == fd  # (the lowest free number: the one just freed)
            reader.add(second, "second")
            assert reader._peers.get(fd) is not None and second.fileno() == fd  # read, not closed
        finally:
            peer.close()
    finally:
        reader.close(1.0)
