"""The one place the tests reach into pika's private state: the transport under a connection.

Written for pika 1.4.4 (`BlockingConnection._impl` is the `SelectConnection` it drives, whose private
`_transport` holds the socket as `_sock` and reads it with `_sigint_safe_recv`). A pika that moves these
fails the tests here, in one place, rather than in each test that breaks a connection or watches its reads.
"""

from __future__ import annotations

import socket
from typing import Any


def pika_transport(connection: Any) -> Any:
    """The transport under a pika `BlockingConnection` or `SelectConnection` (pika 1.4.4's private layout)."""
    return getattr(connection, "_impl", connection)._transport


def break_connection(connection: Any) -> None:
    """Shut the connection's socket both ways under pika, as a network failure would."""
    pika_transport(connection)._sock.shutdown(socket.SHUT_RDWR)
