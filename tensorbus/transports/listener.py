"""The listening side of the stream sockets: bind, accept producers, check their handshake, hand them on.

A unix socket file belongs to the consumer that bound it: a live consumer's path is refused, a
dead one's stale file is replaced, and closing removes only the file this listener bound.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import ssl
import stat
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import TransportError
from ..logs import LogLimiter
from .base import backoff_s
from .greeter import Greeter
from .stream import SocketOptions

log = logging.getLogger(__name__)
#: the accept thread looks up this often (e.g. for close, or handshakes past their deadline)
POLL_S = 0.1


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of a file, or None if there is none: tells this consumer's socket file from a successor's."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def connection_cap(asked: int) -> int:
    """`max_connections`, lowered to half the process's descriptor limit: past that, accepting would
    fail for want of descriptors (and every other file this process opens with it)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or asked <= soft // 2:
        return asked
    log.info("max_connections=%d lowered to %d: half this process's descriptor limit (ulimit -n)", asked, soft // 2)
    return max(1, soft // 2)


class Admits(Protocol):
    """What a listener hands accepted connections to: the consumer's `Reactor`, or a fan-out publisher."""

    @property
    def connections(self) -> int: ...

    def add(self, conn: socket.socket, name: Any) -> None: ...
    def close(self, timeout: float) -> None: ...


class Listener:
    """A bound server socket whose accept thread greets producers (`Greeter`) and hands them to a `Reactor`."""

    def __init__(
        self, family: int, target: str | tuple[str, int], options: SocketOptions, secret: bytes | None,
        address: Callable[[], str], incarnation: bytes,
    ) -> None:  # fmt: skip
        self.family, self.target, self.options, self.secret = family, target, options, secret
        self._address = address  # the endpoint URL, for messages (it learns its port only once bound)
        self._server: socket.socket | None = None
        self._socket_file: tuple[int, int] | None = None  # (device, inode) of the unix socket file bound
        self._reactor: Admits | None = None
        self._greeter: Greeter | None = None
        self._closed = threading.Event()
        self.incarnation = incarnation  # (sent in each hello: signed frames are bound to it)
        self._pause_s = 0.0
        self._paused_until: float | None = None  # accepting failed (e.g. out of descriptors): retry then
        self._on_server: Callable[[], None] | None = None  # accepts what waits on the server socket
        self._threaded = True  # accepting on a thread of its own (else an event loop calls `turn`)
        self._failures = backoff_s(0.01, 1.0)
        self._errors = LogLimiter(log)
        self.max_connections = connection_cap(options.max_connections)

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

    def start(self, reactor: Admits, context: ssl.SSLContext | None, thread: bool = True) -> None:
        """Accept producers on a background thread (`thread`), or whenever an event loop calls `turn`
        (tensorbus/aio: at `selector`'s readiness, and now and then); those that pass the handshake go to `reactor`."""
        self._reactor, self._threaded = reactor, thread
        self._greeter = Greeter(self.secret, self.incarnation, self.options.connect_timeout_s, self._room, self._admit)
        server = self._server
        assert server is not None
        self._on_server = lambda: self._accept(server, context)
        if thread:
            threading.Thread(target=self._serve, daemon=True, name=f"tensorbus-accept-{self._address()}").start()
        else:
            server.setblocking(False)
            self._greeter.watch(server, self._on_server)

    @property
    def selector(self) -> int:
        """The descriptor that is readable when `turn` has something to do (an event loop's to watch)."""
        assert self._greeter is not None
        return self._greeter.selector.fileno()

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

    def _serve(self) -> None:
        """Accept producers and run their handshakes (`Greeter`) until closed."""
        server, greeter = self._server, self._greeter
        assert server is not None and greeter is not None and self._on_server is not None
        try:
            server.setblocking(False)
            greeter.watch(server, self._on_server)
        except (OSError, ValueError):  # closed before this thread began: nothing to accept
            if self._closed.is_set():
                greeter.close()
                return
            raise
        while not self._closed.is_set():
            try:
                self.turn(POLL_S)
            except Exception:
                if self._closed.is_set() or server.fileno() < 0:
                    break
                log.exception("the handshakes on %s failed; going on", self._address())  # (a bug: never stop accepting)
                time.sleep(POLL_S)
        greeter.close()

    def turn(self, wait_s: float = 0.0) -> None:
        """Accept, and advance the handshakes, as far as can be done within `wait_s` (an event loop's: 0)."""
        server, greeter = self._server, self._greeter
        assert server is not None and greeter is not None
        if self._paused_until is None and self._pause_s:
            greeter.watch(server, None)
            self._paused_until = time.monotonic() + self._pause_s
        elif self._paused_until is not None and time.monotonic() >= self._paused_until:
            greeter.watch(server, self._on_server)
            self._paused_until, self._pause_s = None, 0.0
        greeter.run_once(wait_s)

    def _accept(self, server: socket.socket, context: ssl.SSLContext | None) -> None:
        """Accept every connection waiting and start its handshake."""
        assert self._greeter is not None
        while True:
            try:
                conn, peer = server.accept()
            except BlockingIOError:
                self._failures = backoff_s(0.01, 1.0)
                return
            except OSError as exc:
                if self._closed.is_set() or server.fileno() < 0:
                    return
                self._pause_s = next(self._failures)  # e.g. EMFILE: out of descriptors for now; keep listening
                self._errors.error(
                    "accepting a producer on %s failed (%s); retrying in %.2fs", self._address(), exc, self._pause_s
                )
                return
            self._greeter.start(conn, peer, context)

    def _admit(self, conn: socket.socket, peer: Any) -> None:
        """A producer passed the handshake: its frames are read from now on."""
        assert self._reactor is not None
        if self._closed.is_set():
            conn.close()
            return
        self._reactor.add(conn, peer)

    def _room(self) -> str | None:
        """None while another producer may connect; else why not (sent to the one refused)."""
        assert self._reactor is not None
        if self._reactor.connections >= self.max_connections:
            return f"it has max_connections={self.max_connections} producers connected"
        return None

    def close(self) -> None:
        """Stop accepting, drop every producer (see `Reactor.close`), remove the unix socket file this bound."""
        self._closed.set()
        if self._server is None:
            return
        if not self._threaded and self._greeter is not None:  # (an accept thread closes its own)
            self._greeter.close()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        if self._reactor is not None:
            self._reactor.close(self.options.close_timeout_s)
        if self.family == socket.AF_UNIX and _identity(self.target) == self._socket_file:  # type: ignore[arg-type]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.target)  # type: ignore[arg-type]  # (a successor's file is left alone)
        self._server = None
