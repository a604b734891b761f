"""The socket baselines: what a user would write instead of tensorbus, each as plain as it can honestly be.

- `SocketLink`: bare TCP, `sendall` of a 16-byte header and of the array's memoryview; the
  receiver `recv_into`s a preallocated (and pre-touched) array.
- `ZmqLink`: pyzmq PUSH/PULL over TCP, `send_multipart([header, array], copy=False)`.
- `ZmqRecipeLink`: pyzmq's own `send_array` recipe: a JSON frame of dtype and shape, then the array.
- `ZmqFrameLink`: bare pyzmq, one frame a tensor and no metadata.
- `PickleLink`: pickle protocol 5 with out-of-band buffers over TCP, fresh receive buffers.

The raw broker clients are in `broker_baselines.py`.
"""

from __future__ import annotations

import pickle
import socket
import struct
import urllib.parse
from typing import Any

import numpy as np

from .links import Link

HEADER = struct.Struct("<QQ")  # index, payload bytes


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from a blocking socket."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _set_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO/SO_SNDTIMEO: a blocking socket that still cannot hang, at no cost per call."""
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


class _TcpLink(Link):
    """A listening socket for the inbound channel, a connected one for the outbound channel."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        self.host = urllib.parse.urlsplit(spec["url"]).hostname or "127.0.0.1"
        self.server: socket.socket | None = None
        self.rx: socket.socket | None = None
        self.tx: socket.socket | None = None

    def open(self) -> str:
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.bind((self.host, 0))
        self.server.listen(1)
        host, port = self.server.getsockname()[:2]
        return f"{host}:{port}"

    def connect(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.tx = socket.create_connection((host, int(port)), timeout=self.timeout_s)
        self.tx.settimeout(None)
        self.tx.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _set_kernel_timeouts(self.tx, self.timeout_s)

    def _accepted(self) -> socket.socket:
        if self.rx is None:
            assert self.server is not None
            self.server.settimeout(self.timeout_s)
            self.rx, _ = self.server.accept()
            self.rx.settimeout(None)
            self.rx.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _set_kernel_timeouts(self.rx, self.timeout_s)
        return self.rx

    def set_timeout(self, seconds: float) -> None:
        super().set_timeout(seconds)
        for sock in (self.rx, self.tx):
            if sock is not None:
                _set_kernel_timeouts(sock, seconds)

    def close(self) -> None:
        for sock in (self.tx, self.rx, self.server):
            if sock is not None:
                sock.close()


class SocketLink(_TcpLink):
    """Bare TCP: header + payload with two `sendall`s, `recv_into` a preallocated array."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        self.header = memoryview(bytearray(HEADER.size))
        self.buffer: memoryview | None = None

    def prepare(self, nbytes: int) -> None:
        array = np.empty(nbytes, np.uint8)
        array.fill(1)  # touch every page now, not while timing
        self.buffer = array.data

    def release(self) -> None:
        self.buffer = None

    def send(self, array: np.ndarray, index: int) -> None:
        assert self.tx is not None
        payload = array.data.cast("B")
        self.tx.sendall(HEADER.pack(index, len(payload)))
        self.tx.sendall(payload)

    def recv(self, timeout: float) -> tuple[int, Any]:
        rx = self._accepted()
        recv_exact(rx, self.header)
        index, nbytes = HEADER.unpack(self.header)
        buffer = self.buffer
        if buffer is None or len(buffer) != nbytes:
            buffer = memoryview(bytearray(nbytes))
        recv_exact(rx, buffer)
        return index, buffer


class PickleLink(_TcpLink):
    """pickle protocol 5: `{"i": index, "t": array}` pickled with the array's memory out of band."""

    LENGTHS = struct.Struct("<QI")  # pickle bytes, number of out-of-band buffers

    def send(self, array: np.ndarray, index: int) -> None:
        assert self.tx is not None
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps({"i": index, "t": array}, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        head = self.LENGTHS.pack(len(data), len(raws)) + struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
        self.tx.sendall(head)
        self.tx.sendall(data)
        for raw in raws:
            self.tx.sendall(raw)

    def recv(self, timeout: float) -> tuple[int, Any]:
        rx = self._accepted()
        head = bytearray(self.LENGTHS.size)
        recv_exact(rx, memoryview(head))
        size, count = self.LENGTHS.unpack(head)
        lengths = bytearray(8 * count)
        recv_exact(rx, memoryview(lengths))
        data = bytearray(size)
        recv_exact(rx, memoryview(data))
        buffers = []
        for (n,) in struct.iter_unpack("<Q", lengths):
            buffer = bytearray(n)
            recv_exact(rx, memoryview(buffer))
            buffers.append(buffer)
        message = pickle.loads(data, buffers=buffers)
        return message["i"], message["t"]


class ZmqLink(Link):
    """pyzmq PUSH (outbound) and PULL (inbound) over TCP, zero-copy sends."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        import zmq

        self.zmq = zmq
        self.context = zmq.Context()
        self.host = urllib.parse.urlsplit(spec["url"]).hostname or "127.0.0.1"
        self.pull: Any = None
        self.push: Any = None

    def open(self) -> str:
        self.pull = self.context.socket(self.zmq.PULL)
        self.pull.setsockopt(self.zmq.LINGER, 0)
        port = self.pull.bind_to_random_port(f"tcp://{self.host}")
        self.set_timeout(self.timeout_s)
        return f"tcp://{self.host}:{port}"

    def connect(self, address: str) -> None:
        self.push = self.context.socket(self.zmq.PUSH)
        self.push.setsockopt(self.zmq.LINGER, 0)
        self.push.connect(address)
        self.set_timeout(self.timeout_s)

    def set_timeout(self, seconds: float) -> None:
        super().set_timeout(seconds)
        if self.pull is not None:
            self.pull.setsockopt(self.zmq.RCVTIMEO, int(seconds * 1000))
        if self.push is not None:
            self.push.setsockopt(self.zmq.SNDTIMEO, int(seconds * 1000))

    def send(self, array: np.ndarray, index: int) -> None:
        self.push.send_multipart([HEADER.pack(index, array.nbytes), array], copy=False)

    def recv(self, timeout: float) -> tuple[int, Any]:
        header, payload = self.pull.recv_multipart(copy=False)
        index, _ = HEADER.unpack(header.buffer)
        return index, payload.buffer

    def close(self) -> None:
        for sock in (self.push, self.pull):
            if sock is not None:
                sock.close(linger=0)
        self.context.term()


class ZmqRecipeLink(ZmqLink):
    """pyzmq's own `send_array` recipe (its docs, "Serializing messages"): `send_json` of dtype and shape (here
    with the tensor's index) with SNDMORE, then the array with copy=False; the receiver rebuilds the array
    with `np.frombuffer` and `reshape`."""

    def send(self, array: np.ndarray, index: int) -> None:
        self.push.send_json({"dtype": str(array.dtype), "shape": array.shape, "i": index}, self.zmq.SNDMORE)
        self.push.send(array, copy=False)

    def recv(self, timeout: float) -> tuple[int, Any]:
        metadata = self.pull.recv_json()
        payload = self.pull.recv(copy=False)
        return metadata["i"], np.frombuffer(payload, dtype=metadata["dtype"]).reshape(metadata["shape"])


class ZmqFrameLink(ZmqLink):
    """Bare pyzmq: one frame a tensor, the array with copy=False, no metadata at all. PUSH/PULL over one
    connection keeps the order, so the receiver numbers the frames as they come, from the number each step
    starts at (the bench's tensors differ, so one lost or out of order fails its CRC32C check)."""

    def __init__(self, spec: dict[str, Any], role: str) -> None:
        super().__init__(spec, role)
        self.received = 0  # the next frame's number

    def expect(self, first: int) -> None:
        self.received = first

    def send(self, array: np.ndarray, index: int) -> None:
        self.push.send(array, copy=False)

    def recv(self, timeout: float) -> tuple[int, Any]:
        payload = self.pull.recv(copy=False)
        self.received += 1
        return self.received - 1, payload.buffer
