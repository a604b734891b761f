"""Close the sockets of kafka-python 3.0's failed connection attempts, which it drops unclosed.

kafka-python 3.0.12, kafka/net/inet.py: `KafkaNetSocket.connect` makes a non-blocking socket and awaits
`sock_connect`; when that raises (its `timeout_at` passes, the I/O wait times out, or the broker refuses)
nobody closes the socket. It lives on in the exception's traceback until the garbage collector finds it,
in whatever test is running then, and its ResourceWarning (an error under pyproject's filterwarnings)
fails that test. Under load a connection attempt can outlast its timeout, so any Kafka test may hit it.
The wrapper below closes exactly those sockets, and only when `sock_connect` failed: every other socket
(tensorbus's own included) still warns when leaked. tests/unit/test_kafka_sockets.py shows the leak.
"""

from __future__ import annotations

import socket
import warnings
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.net.inet import KafkaNetSocket

_sock_connect = KafkaNetSocket.sock_connect


async def _sock_connect_closing(self: KafkaNetSocket, net: Any, sock: socket.socket, sockaddr: Any, **kw: Any) -> Any:
    """kafka-python's `sock_connect`, closing the socket when the attempt fails (or is cancelled)."""
    try:
        return await _sock_connect(self, net, sock, sockaddr, **kw)
    except BaseException:
        sock.close()
        raise


def close_failed_attempts() -> None:
    """Install the wrapper (once)."""
    if KafkaNetSocket.sock_connect is _sock_connect:
        KafkaNetSocket.sock_connect = _sock_connect_closing  # type: ignore[method-assign]
