"""The producer's C send of a plain ndarray (`SocketProducer._send_ndarray`) against the general path.

What it puts on the wire must be byte for byte what `encode` makes; what it does not take must go
the general way unchanged; and a send that fails in it must end as one in the general path does.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec import frame
from tensorbus.transports import socket_producer
from tests.conftest import require_native

require_native(socket_producer.NATIVE_STREAM is not None, "the C stream extension (tensorbus/transports/_stream.c)")


class Recorder:
    """Stands in for the `_stream` module in `socket.py`: records each frame the C send sent (sealed)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.sent: list[bytes] = []
        self.before: Callable[[int], None] | None = None  # called with the call's number, before it sends

    def send_frame(self, fd: int, frame: list[Any], large_from: int, crc32c: Any) -> int | None:
        if self.before is not None:
            self.before(len(self.sent))
        nbytes = self.real.send_frame(fd, frame, large_from, crc32c)
        if nbytes is not None:
            self.sent.append(b"".join(bytes(memoryview(part).cast("B")) for part in frame))
        return nbytes


def connected(producer: tb.Producer, consumer: tb.Consumer, recorder: Recorder) -> None:
    """Make the producer's connection (a first send connects, the general way); clear the recorder."""
    producer.send("connect", np.zeros(1))
    consumer.recv("connect", timeout=10)
    recorder.sent.clear()


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    spy = Recorder(socket_producer.NATIVE_STREAM)
    monkeypatch.setattr(socket_producer, "NATIVE_STREAM", spy)
    yield spy


CASES: list[tuple[str | None, np.ndarray, dict[str, Any] | None]] = [
    ("small", np.arange(1024, dtype=np.float32), {"i": 7, "tag": "x"}),
    (None, np.arange(12, dtype=np.int64).reshape(3, 4), None),
    ("scalar", np.array(3.5), None),
    ("empty", np.zeros((0, 5), np.uint8), {"empty": True}),
    ("fortran", np.asfortranarray(np.arange(20.0).reshape(4, 5)), None),
    ("big-endian", np.arange(6, dtype=">i4"), None),
    ("bool", np.array([True, False, True]), {"f": 1.5, "b": True, "n": None, "neg": -3, "s": "é"}),
]


@pytest.mark.parametrize("checksum", [True, False])
def test_the_c_send_puts_on_the_wire_what_encode_makes(recorder: Recorder, checksum: bool) -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer, tb.Producer(consumer.address, checksum=checksum) as producer:
        connected(producer, consumer, recorder)
        ids = [producer.send(key, tensor, metadata=metadata) for key, tensor, metadata in CASES]
        assert len(recorder.sent) == len(CASES)  # every one of them went out by the C send
        with pytest.MonkeyPatch.context() as python_only:
            python_only.setattr(frame, "NATIVE", None)  # the frames encode makes without C, to compare with
            for (key, tensor, metadata), message_id, wire in zip(CASES, ids, recorder.sent, strict=True):
                expected = tb.dumps(tensor, key=key, metadata=metadata, message_id=message_id, checksum=checksum)
                assert wire == bytes(expected)
        for key, tensor, metadata in CASES:
            if key is None:
                continue
            message = consumer.recv_message(key, timeout=10)
            assert message.tensor.dtype == tensor.dtype and np.array_equal(message.tensor, tensor)
            assert message.metadata == (metadata or {})
        assert np.array_equal(consumer.next_message(timeout=10).tensor, CASES[1][1])


def test_what_the_c_send_leaves_goes_the_general_way(recorder: Recorder, tmp_path: Any) -> None:
    strided = np.arange(20.0)[::2]
    with tb.Consumer("tcp://127.0.0.1:0", signing_key="k") as signed_consumer:
        with tb.Producer(signed_consumer.address, signing_key="k") as producer:
            assert producer._encoding.plain_flags is None
            producer.send("signed", np.ones(3))
        assert np.array_equal(signed_consumer.recv("signed", timeout=10), np.ones(3))
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        with tb.Producer(consumer.address) as plain:
            connected(plain, consumer, recorder)
            plain.send("strided", strided)  # the C head takes contiguous arrays only: encode copies this one
            plain.send("sparse", tb.SparseTensor(np.array([[0], [2]]), np.array([1.0, 2.0]), (4,)))
            plain.send("bundle", {"w": np.ones(2)})
            plain.send("nested", np.ones(2), metadata={"a": [1, {"b": None}]})  # the C head takes flat metadata
        with tb.Producer(consumer.address, compression="lz4") as compressed:
            assert compressed._encoding.plain_flags is None
            compressed.send("compressed", np.zeros(1000))
        with tb.Producer(consumer.address, max_frame_bytes=4096) as chunked:
            assert chunked.transport._c_head is None  # type: ignore[attr-defined]  # (chunked frames: no C send)
            chunked.send("chunked", np.arange(3000.0))
        assert recorder.sent == []  # none of them by the C send
        assert np.array_equal(consumer.recv("strided", timeout=10), strided)
        assert consumer.recv("sparse", timeout=10).to_dense().tolist() == [1.0, 0.0, 2.0, 0.0]
        assert np.array_equal(consumer.recv("bundle", timeout=10)["w"], np.ones(2))
        assert consumer.recv_message("nested", timeout=10).metadata == {"a": [1, {"b": None}]}
        assert np.array_equal(consumer.recv("compressed", timeout=10), np.zeros(1000))
        assert np.array_equal(consumer.recv("chunked", timeout=10), np.arange(3000.0))


def test_a_connection_broken_under_the_c_send_reconnects_and_every_tensor_arrives_once(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=socket_producer.log.name)
    with tb.Consumer("tcp://127.0.0.1:0") as consumer, tb.Producer(consumer.address) as producer:
        connected(producer, consumer, recorder)

        def break_the_fifth(call: int) -> None:
            if call == 4:  # the kernel refuses the send that follows: a real EPIPE in C
                assert producer.transport._sock is not None
                producer.transport._sock.shutdown(socket.SHUT_WR)

        recorder.before = break_the_fifth
        for i in range(10):
            producer.send(f"t{i}", np.full(100, float(i)))
        producer.flush(timeout=10)
        for i in range(10):
            assert consumer.recv(f"t{i}", timeout=10)[0] == float(i)
        with pytest.raises(tb.Timeout):
            consumer.next_message(timeout=0.3)  # the frames sent again were dropped as duplicates
        assert consumer.stats["duplicates"] >= 1
    assert "reconnecting" in caplog.text


def test_a_ctrl_c_in_the_c_send_drops_the_connection_and_loses_nothing_sent_before(recorder: Recorder) -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer, tb.Producer(consumer.address) as producer:
        connected(producer, consumer, recorder)

        def interrupt_the_fifth(call: int) -> None:
            if call == 4 and recorder.before is not None:
                recorder.before = None
                raise KeyboardInterrupt

        recorder.before = interrupt_the_fifth
        for i in range(4):
            producer.send(f"t{i}", np.full(10, float(i)))
        with pytest.raises(KeyboardInterrupt):
            producer.send("t4", np.full(10, 4.0))
        assert producer.transport._sock is None  # a frame may be cut off part way: the connection goes
        for i in range(5, 8):
            producer.send(f"t{i}", np.full(10, float(i)))
        producer.flush(timeout=10)
        for i in (0, 1, 2, 3, 5, 6, 7):
            assert consumer.recv(f"t{i}", timeout=10)[0] == float(i)
        with pytest.raises(tb.Timeout):
            consumer.next_message(timeout=0.3)  # t4 never went out; nothing came twice
