"""The listening side of the stream sockets: bind, accept producers, check their handshake, hand them on.

A unix socket file belongs to the consumer that bound it: a live consumer's path is refused, a
dead one's stale file is replaced, and closing removes only the file this listener bound.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import TransportError
from .base import backoff_s
from .reactor import Reactor
from .stream import SocketOptions, handshake_as_consumer

log = logging.getLogger(__name__)
#: the accept thread looks up this often (e.g. for close) while the handshake limit is reached
POLL_S = 0.1


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of a file, or None if there is none: tells this consumer's socket file from a successor's."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Listener:
    """A bound server socket whose accept thread greets each producer on a thread of its own."""

    def __init__(
        self, family: int, target: str | tuple[str, int], options: SocketOptions, secret: bytes | None,
        address: Callable[[], str],
    ) -> None:  # fmt: skip
        self.family, self.target, self.options, self.secret = family, target, options, secret
        self._address = address  # the endpoint URL, for messages (it learns its port only once bound)
        self._server: socket.socket | None = None
        self._socket_file: tuple[int, int] | None = None  # (device, inode) of the unix socket file bound
        self._reactor: Reactor | None = None
        self._closed = threading.Event()

    def bind(self) -> Any:
        """Bind and listen; return the bound address. A clear `TransportError` when that is not possible."""
        server = socket.socket(self.family, socket.SOCK_STREAM)
        try:
            if self.family == socket.AF_UNIX:
                self._remove_stale_socket_file()
            else:
                server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(self.target)
            server.listen(self.options.backlog)
            if self.family == socket.AF_UNIX:
                self._socket_file = _identity(self.target)  # type: ignore[arg-type]
        except OSError as exc:
            server.close()
            raise TransportError(f"cannot listen on {self._address()}: {exc}") from None
        except BaseException:
            server.close()
            raise
        self._server = server
        return server.getsockname()

    def start(self, reactor: Reactor, context: ssl.SSLContext | None) -> None:
        """Accept producers on a background thread; the ones that pass the handshake go to `reactor`."""
        self._reactor = reactor
        threading.Thread(
            target=self._accept, args=(context,), daemon=True, name=f"tensorbus-accept-{self._address()}"
        ).start()

    def _remove_stale_socket_file(self) -> None:
        """Remove a socket file a dead consumer left behind; a live consumer's is an error, not replaced."""
        path = self.target
        assert isinstance(path, str)
        try:
            if not stat.S_ISSOCK(os.stat(path).st_mode):  # never removed: it is not a consumer's
                raise TransportError(f"cannot listen on {self._address()}: {path} exists and is not a socket")
        except FileNotFoundError:
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # nobody listens there any more
            return
        except OSError:
            pass  # bind reports what is wrong with the path
        else:
            raise TransportError(f"cannot listen on {self._address()}: another consumer is listening there")
        finally:
            probe.close()

    def _accept(self, context: ssl.SSLContext | None) -> None:
        """Accept producers until closed; at most `backlog` handshakes at once (more wait in the kernel's queue)."""
        server = self._server
        assert server is not None
        handshakes = threading.BoundedSemaphore(max(1, self.options.backlog))
        failures = backoff_s(0.01, 1.0)
        while not self._closed.is_set():
            if not handshakes.acquire(timeout=POLL_S):
                continue
            try:
                conn, peer = server.accept()
            except OSError as exc:
                handshakes.release()
                if self._closed.is_set() or server.fileno() < 0:
                    return
                delay = next(failures)  # e.g. EMFILE: out of file descriptors for now; keep the listener alive
                log.error("accepting a producer on %s failed (%s); retrying in %.2fs", self._address(), exc, delay)
                time.sleep(delay)
                continue
            failures = backoff_s(0.01, 1.0)
            threading.Thread(
                target=self._handshake,
                args=(conn, peer, context, handshakes),
                daemon=True,
                name=f"tensorbus-hello-{peer}",
            ).start()

    def _handshake(
        self, conn: socket.socket, peer: Any, ctx: ssl.SSLContext | None, handshakes: threading.BoundedSemaphore
    ) -> None:
        """TLS and the shared-secret check (blocking, with a timeout), then hand the connection to the reactor.

        The whole handshake gets `connect_timeout_s`, not each read: a peer trickling a byte now and
        then would otherwise hold its handshake slot (of `backlog`) for as long as it likes.
        """
        current = [conn]
        deadline = threading.Timer(self.options.connect_timeout_s, _cut, args=(current,))
        deadline.daemon = True
        deadline.start()
        try:
            conn.settimeout(self.options.connect_timeout_s)
            if ctx is not None:
                conn = current[0] = ctx.wrap_socket(conn, server_side=True)
            if not handshake_as_consumer(conn, self.secret):
                log.error("refused producer %s: no valid proof of the shared secret", peer)
                conn.close()
                return
        except (OSError, ssl.SSLError) as exc:
            if not self._closed.is_set():  # one that left without a word was probably probing (see bind)
                left = isinstance(exc, (BrokenPipeError, ConnectionResetError, EOFError))
                log.log(logging.INFO if left else logging.ERROR, "handshake with %s failed: %s", peer, exc)
            conn.close()
            return
        finally:
            deadline.cancel()
            handshakes.release()
        assert self._reactor is not None
        if self._closed.is_set():
            conn.close()
            return
        self._reactor.add(conn, peer)

    def close(self) -> None:
        """Stop accepting, drop every producer (see `Reactor.close`), remove the unix socket file this bound."""
        self._closed.set()
        if self._server is None:
            return
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        if self._reactor is not None:
            self._reactor.close(self.options.close_timeout_s)
        if self.family == socket.AF_UNIX and _identity(self.target) == self._socket_file:  # type: ignore[arg-type]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.target)  # type: ignore[arg-type]  # (a successor's file is left alone)
        self._server = None


def _cut(current: list[socket.socket]) -> None:
    """End a handshake that ran out of time: its blocked read returns at once."""
    with contextlib.suppress(OSError):
        current[0].shutdown(socket.SHUT_RDWR)
