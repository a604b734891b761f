"""The stream sockets' C reader and sender (`_stream.c`) against the Python ones.

The reader tests run against both readers (reader.py: `_stream.StreamReader` and `PyStreamReader`). The
reader, through the real Reactor: the same byte streams (frames of every kind, ack requests,
CRCs after their frames, frames over the limits, garbage, a cut-off end) go through a socket pair
in random pieces, once read in C and once in Python, and what reaches the consumer and why the
connection ends must be the same. The sender: the same bytes on the wire.
"""

from __future__ import annotations

import contextlib
import logging
import random
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import crc32c
import numpy as np
import pytest

from tensorbus.buffers import BufferPool
from tensorbus.codec import frame, native
from tensorbus.codec.frame import CRC_AT, PREFIX, Limits, Message, encode
from tensorbus.ledger import Ledger
from tensorbus.transports import reactor
from tensorbus.transports import reader as reader_module
from tensorbus.transports import stream as stream_module
from tensorbus.transports.base import Delivered
from tensorbus.transports.socket import SocketConsumer
from tensorbus.transports.stream import ACK_REQUEST_MARKER, TAKEN, TRAILING_CRC

from ..conftest import require_native

require_native(reader_module.NATIVE_STREAM is not None, "the C reader and sender (tensorbus/transports/_stream.c)")

LIMITS = Limits(max_payload_bytes=6 << 20)
NATIVE_STREAM = reader_module.NATIVE_STREAM  # (the tests below turn it off now and then)


@pytest.fixture(params=["c", "python"])
def make_reader(request: pytest.FixtureRequest) -> Any:
    """Each reader's class: the tests that take this run against both."""
    return reader_module.NATIVE_STREAM.StreamReader if request.param == "c" else reader_module.PyStreamReader


class Recorder:
    """A consumer that keeps what it is handed."""

    fast = None  # (no C delivery: every frame comes to `__call__`)

    def __init__(self) -> None:
        self.frames: list[tuple[bytes, int | None]] = []
        self.ledger = Ledger()

    def __call__(
        self, data: Any, crc: int | None = None, *, may_hold: bool = False, source: object = None
    ) -> Delivered:
        self.frames.append((bytes(data), crc))
        return Delivered(None, True)

    def release(self, message: Message) -> Delivered | None:
        return Delivered(None, True)


class Reasons(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(record.getMessage().split(": ", 1)[1])


def crc_after(whole: bytes) -> bytes:
    """A checksummed, unsigned frame as `stream.send_frame` sends a large one: its CRC after it."""
    wire = bytearray(whole)
    crc = wire[CRC_AT : PREFIX.size]
    wire[CRC_AT : PREFIX.size] = bytes(4)
    wire[5] |= TRAILING_CRC
    return bytes(wire) + bytes(crc)


def stream(seed: int) -> bytes:
    """Frames, ack requests and frames to skip, then an ending: clean, cut off, or garbage."""
    rng = random.Random(seed)
    parts = []
    for i in range(rng.randrange(5, 40)):
        choice = rng.random()
        size = rng.choice((0, 4, 1000, 70_000, 300_000))
        array = np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8)
        whole = b"".join(bytes(b) for b in encode(array, key=f"k{i}", checksum=rng.random() < 0.8))
        if choice < 0.1:
            parts.append(ACK_REQUEST_MARKER)
        elif choice < 0.2:
            parts.append(crc_after(b"".join(bytes(b) for b in encode(array, key="after"))))
        elif choice < 0.25:
            parts.append(b"".join(bytes(b) for b in encode(array, signing_key=b"secret")))
        elif choice < 0.3:
            parts.append(b"".join(bytes(b) for b in encode(np.zeros(7 << 20, np.uint8))))  # over the limit
        else:
            parts.append(whole)
    if rng.random() < 0.3:  # one large checksummed frame: its CRC is computed while it is received
        big = b"".join(bytes(b) for b in encode(np.ones(5 << 20, np.uint8), key="big"))
        parts.append(crc_after(big) if rng.random() < 0.5 else big)
    ending = rng.choice(("clean", "cut", "cut prefix", "garbage"))
    if ending == "cut":
        parts.append(parts[0][: rng.randrange(PREFIX.size, max(PREFIX.size + 1, len(parts[0])))])
    elif ending == "cut prefix":
        parts.append(parts[0][: rng.randrange(1, PREFIX.size)])
    elif ending == "garbage":
        parts.append(b"GET / HTTP/1.1\r\n\r\n" + bytes(100))
    return b"".join(parts)


class TakingRecorder(Recorder):
    """A consumer with a C delivery stand-in (`fast`) that takes every frame of an even length, recording it
    as `__call__` does: the frames then come in runs (`read_taken`), the others one at a time."""

    def fast(self, data: memoryview, crc: int | None, source: object) -> Any:
        if len(data) % 2:
            return None
        self.frames.append((bytes(data), crc))
        return Taken(None)


def read_through_reactor(
    data: bytes, seed: int, use_c: bool, monkeypatch: pytest.MonkeyPatch, taking: bool = False
) -> tuple[Any, ...]:
    monkeypatch.setattr(reader_module, "NATIVE_STREAM", NATIVE_STREAM if use_c else None)
    recorder, reasons, acks = TakingRecorder() if taking else Recorder(), Reasons(), bytearray()
    logger = logging.getLogger(reactor.__name__)
    logger.addHandler(reasons)
    level = logger.level
    logger.setLevel(logging.INFO)  # ("went away" is INFO; setLevel, not the attribute: it clears the logger's cache
    # of isEnabledFor answers, which an earlier test may have filled while INFO was off)
    options = SocketConsumer.Options(linger_s=0.0, ack_every_frames=3)  # (acks between frames of one run, too)
    reader = reactor.Reactor(recorder, LIMITS, options, BufferPool())  # type: ignore[arg-type]
    ours, theirs = socket.socketpair()
    try:
        reader.add(ours, "peer")
        assert (not isinstance(reader._peers[ours.fileno()].reader, reader_module.PyStreamReader)) == use_c

        def write() -> None:
            rng = random.Random(seed)
            at = 0
            while at < len(data):
                piece = rng.choice((1, 7, 23, 24, 25, 1000, 65536, 262144, 300_000))
                theirs.sendall(data[at : at + piece])
                at += piece
                if rng.random() < 0.05:
                    time.sleep(0.001)  # let the reader run dry mid-frame
            theirs.shutdown(socket.SHUT_WR)

        writer = threading.Thread(target=write)
        writer.start()
        deadline = time.monotonic() + 60
        while reader._peers and time.monotonic() < deadline:
            time.sleep(0.005)
        writer.join(10)
        assert not reader._peers, "the connection did not end"
        theirs.settimeout(10)
        acks.extend(b"".join(iter(lambda: theirs.recv(4096), b"")))  # what the consumer acknowledged, and when
    finally:
        reader.close(5)
        theirs.close()
        logger.removeHandler(reasons)
        logger.setLevel(level)
    received = [ack for ack in struct.iter_unpack("<Q", acks) if not ack[0] & TAKEN]  # (TAKEN: sent as time goes)
    return recorder.frames, reasons.reasons, received


@pytest.mark.parametrize("seed", range(12))
def test_the_c_reader_hands_over_what_the_python_reader_does(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    data = stream(seed)
    in_c = read_through_reactor(data, seed, True, monkeypatch)
    in_python = read_through_reactor(data, seed, False, monkeypatch)
    assert in_c == in_python
    # frames taken in runs (`read_taken`, C and Python) reach the consumer as one at a time do, acked alike
    assert read_through_reactor(data, seed, True, monkeypatch, taking=True) == in_c
    assert read_through_reactor(data, seed, False, monkeypatch, taking=True) == in_c
    frames, reasons, acks = in_c
    assert len(reasons) == 1  # why the connection ended
    assert acks == sorted(acks) and (not acks or acks[-1][0] <= len(frames))
    for whole, crc in frames:  # and what was handed over is whole frames, CRCs where sent after them
        if len(whole) > PREFIX.size:
            assert not whole[5] & TRAILING_CRC
            assert len(whole) == frame.frame_length(whole, frame.Limits())
        if crc is not None:
            view = memoryview(whole)
            assert crc == crc32c.crc32c(view[PREFIX.size :], crc32c.crc32c(view[:CRC_AT])) or whole[5] & 2


def test_a_frame_over_the_limits_is_skipped_and_the_next_one_read(make_reader: Any) -> None:
    over = b"".join(bytes(b) for b in encode(np.zeros(7 << 20, np.uint8)))
    good = b"".join(bytes(b) for b in encode(np.arange(3), key="k"))
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        reader = make_reader(
            ours,
            1 << 20,
            LIMITS.max_payload_bytes,
            BufferPool().take,
            crc32c.crc32c,
            1 << 20,
            4 << 20,
            1 << 20,
        )
        theirs.sendall(over[:100])
        assert reader.read() == reader_module.CHECK_PREFIX
        assert reader.prefix == over[: PREFIX.size]
        reader.skip(len(over) - PREFIX.size)
        assert reader.read() is None and reader.mid_frame  # the rest is not there yet
        sender = threading.Thread(target=theirs.sendall, args=(over[100:] + good + struct.pack("<4s20x", b"TBAK"),))
        sender.start()
        events = []
        while len(events) < 3:
            event = reader.read()
            if event is not None:
                events.append((event, reader.last_total))
        sender.join()
        assert events[0] == (reader_module.SKIPPED, PREFIX.size)
        (frame_view, crc), total = events[1]
        assert bytes(frame_view) == good and crc is None and total == len(good)
        assert events[2][0] == reader_module.ACK_REQUEST
        theirs.close()
        while (event := reader.read()) is None:
            pass
        assert event == reader_module.END and not reader.mid_frame


def received(sender: Any, frames: list[list[Any]]) -> bytes:
    """What a peer reads when `sender` sends `frames` (from another thread: a socket buffer is small)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # many partial sends
        chunks: list[bytes] = []
        reading = threading.Thread(target=lambda: chunks.extend(iter(lambda: theirs.recv(1 << 16), b"")))
        reading.start()
        for buffers in frames:
            sender(ours, buffers)
        ours.shutdown(socket.SHUT_WR)
        reading.join(30)
    return b"".join(chunks)


def test_the_c_sender_puts_on_the_wire_what_the_python_sender_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frame.time, "time", lambda: 1.0e9)  # (a signed message carries the clock)

    def frames() -> list[list[Any]]:
        rng = np.random.default_rng(3)
        out = [
            encode(rng.integers(0, 255, n, dtype=np.uint8), key="k", deferred_checksum=True)
            for n in (0, 1, 4096, 300_000)
        ]
        out.append(encode({f"p{i}": np.full(10, i) for i in range(700)}, deferred_checksum=True))  # > 512 buffers
        out.append(encode(np.arange(5), checksum=False))
        out.append(encode(np.arange(5), signing_key=b"secret"))
        return out

    sent_in_c = received(lambda sock, buffers: stream_module.send_frame(sock, buffers, True), frames())
    monkeypatch.setattr(stream_module, "NATIVE_STREAM", None)
    sent_in_python = received(lambda sock, buffers: stream_module.send_frame(sock, buffers, True), frames())
    assert sent_in_c == sent_in_python
    sealed = [
        b"".join(bytes(b) for b in frame.seal(f[0], f[1:], True, None))
        if isinstance(f[0], bytearray)
        else b"".join(bytes(b) for b in f)
        for f in frames()
    ]
    assert sent_in_c == b"".join(sealed)  # each sealed (its CRC written) on the way out


def test_the_c_sender_leaves_a_large_unsealed_frame_to_python_and_counts_what_it_sends() -> None:
    large = encode(np.zeros(5 << 20, np.uint8), deferred_checksum=True)
    small = encode(np.zeros(10, np.uint8), deferred_checksum=True)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        assert reader_module.NATIVE_STREAM.send_frame(ours.fileno(), large, 4 << 20, crc32c.crc32c) is None
        assert large[0][CRC_AT : PREFIX.size] == bytes(4)  # untouched: Python checksums it as it sends it
        assert reader_module.NATIVE_STREAM.send_frame(ours.fileno(), small, 4 << 20, crc32c.crc32c) == sum(
            len(b) for b in small
        )
        assert frame.decode(theirs.recv(1 << 16)).tensor.tolist() == [0] * 10
        theirs.close()
        with pytest.raises(BrokenPipeError):
            reader_module.NATIVE_STREAM.send_frame(ours.fileno(), encode(np.zeros(10)), 4 << 20, crc32c.crc32c)


def test_the_c_sender_seals_a_small_frame_with_the_crc_in_c_and_a_large_one_through_the_python_call() -> None:
    """Configured with `_crc`'s CRC32C_C capsule, `send_frame` seals a frame under 32 KiB without calling the
    `crc32c` it is given (three calls and three memoryviews were a ninth of a 4 KB tensor's producer CPU);
    a larger payload (here sealed whole: no CRC after it) still goes through that call, which lets go of the
    GIL while it reads. Either way the CRC is right."""
    c_api = native.crc32c_c()
    if c_api is None:
        pytest.skip("the folding CRC32C is not in use here (a CPU without VPCLMULQDQ, or TENSORBUS_NATIVE=0)")
    calls: list[int] = []

    def counting_crc32c(data: Any, value: int = 0) -> int:
        calls.append(len(data))
        return int(crc32c.crc32c(data, value))

    ours, theirs = socket.socketpair()
    with ours, theirs:
        for n, by_call in ((4096, False), (1 << 16, True)):
            sent = encode(np.arange(n, dtype=np.uint8), key="k", deferred_checksum=True)
            calls.clear()
            size = NATIVE_STREAM.send_frame(ours.fileno(), sent, stream_module.c_sends_below(False), counting_crc32c)
            assert calls == ([n] if by_call else [])  # (the head's pieces are small: in C either way)
            received = bytearray()
            while len(received) < size:
                received += theirs.recv(size - len(received))
            assert frame.checksum_of(received) == struct.unpack_from("<I", received, CRC_AT)[0]
            assert frame.decode(received).tensor.tolist() == list(np.arange(n, dtype=np.uint8))
        NATIVE_STREAM.configure(None)  # (what the Python path's readers and senders see: every buffer by the call)
        try:
            calls.clear()
            small = encode(np.zeros(10), deferred_checksum=True)
            NATIVE_STREAM.send_frame(ours.fileno(), small, 1 << 20, counting_crc32c)
            assert calls
        finally:
            NATIVE_STREAM.configure(c_api)


def test_the_c_sender_on_a_full_non_blocking_socket_says_how_far_it_got_and_goes_on_from_there() -> None:
    """`send_frame_from` (the event loop producer's): what a partial send wrote is never lost nor written twice,
    and the frame is sealed once, before its first byte."""
    send_from = reader_module.NATIVE_STREAM.send_frame_from
    rng = np.random.default_rng(5)
    frames = [encode(rng.integers(0, 255, n, dtype=np.uint8), key="k", deferred_checksum=True) for n in (3 << 20, 10)]
    frames.append(encode({f"p{i}": np.full(10, i) for i in range(700)}, deferred_checksum=True))  # > 512 buffers
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        chunks: list[bytes] = []
        partial = 0
        for buffers in frames:
            sent, total = send_from(ours.fileno(), buffers, 0, 4 << 20, crc32c.crc32c)
            assert total == sum(memoryview(b).nbytes for b in buffers) and 0 < sent <= total
            while sent < total:  # the socket is full: read some, then send on
                partial += 1
                chunks.append(theirs.recv(1 << 20))
                sent = send_from(ours.fileno(), buffers, sent, 4 << 20, crc32c.crc32c)[0]
            assert send_from(ours.fileno(), buffers, total, 4 << 20, crc32c.crc32c) == (total, total)  # (nothing left)
        ours.shutdown(socket.SHUT_WR)
        theirs.setblocking(True)
        chunks.extend(iter(lambda: theirs.recv(1 << 20), b""))
        assert partial > 0  # (the 3 MiB frame filled the socket: the case under test)
        sealed = [b"".join(bytes(b) for b in frame.seal(f[0], f[1:], True, None)) for f in frames]
        assert b"".join(chunks) == b"".join(sealed)
        with pytest.raises(ValueError, match="bytes done"):
            send_from(ours.fileno(), frames[1], 10**6, 4 << 20, crc32c.crc32c)
        with pytest.raises(ValueError, match="negative"):
            send_from(ours.fileno(), frames[1], -1, 4 << 20, crc32c.crc32c)
    large = encode(np.zeros(5 << 20, np.uint8), deferred_checksum=True)
    assert send_from(ours.fileno(), large, 0, 4 << 20, crc32c.crc32c) is None  # (left to Python, as send_frame does)


def test_a_frame_claiming_2_to_the_64_bytes_is_skipped_not_raised_into_recv() -> None:
    """Past what the C reader can count: it skips "forever", as the Python reader would, and others go on."""
    import tensorbus as tb

    with tb.Consumer("tcp://127.0.0.1:0", max_payload_bytes=1 << 20) as consumer:
        host, port = consumer.address.removeprefix("tcp://").rsplit(":", 1)
        hostile = socket.create_connection((host, int(port)), timeout=5)
        with hostile:
            hello = hostile.recv(stream_module.HELLO.size, socket.MSG_WAITALL)
            hostile.sendall(stream_module.proof(None, stream_module.HELLO.unpack(hello)[3]))
            assert hostile.recv(1) == b"\x01"
            hostile.sendall(PREFIX.pack(frame.MAGIC, frame.VERSION, 0, 0, 0, (1 << 64) - 1, 0) + bytes(1000))
            with tb.Producer(consumer.address) as producer:
                producer.send("k", np.arange(3))
                assert consumer.recv("k", timeout=20).tolist() == [0, 1, 2]


def test_the_reader_refuses_misuse_rather_than_reading_the_wrong_file() -> None:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    make = reader_module.NATIVE_STREAM.StreamReader
    args = (BufferPool().take, crc32c.crc32c, 1 << 20, 4 << 20, 1 << 20)
    for header_limit, payload_limit in ((-1, 1 << 20), (1 << 20, 1 << 64), (1 << 20, (1 << 62) + 1)):
        with pytest.raises(ValueError, match="out of range"):
            make(ours, header_limit, payload_limit, *args)
    with pytest.raises(RuntimeError, match="not initialised"):
        make.__new__(make).read()
    reader = make(ours, 1 << 20, 1 << 20, *args)
    with pytest.raises(RuntimeError, match="initialised already"):
        reader.__init__(ours, 1 << 20, 1 << 20, *args)
    theirs.sendall(bytes(10))
    assert reader.read() is None and reader.mid_frame  # 10 bytes of a prefix
    ours.close()
    other, spare = socket.socketpair()  # (may get the closed socket's descriptor number)
    with other, spare, theirs:
        spare.sendall(b"not for that reader")
        with pytest.raises(OSError):
            reader.read()


def test_a_stale_or_disagreeing_build_of_the_stream_paths_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    built = reader_module.NATIVE_STREAM
    assert native.agrees(built, stream_module.NATIVE_CONSTANTS) is built
    monkeypatch.setattr(built, "CRC_TRAILER", 8)
    with pytest.warns(RuntimeWarning, match="constants"):
        assert native.agrees(built, stream_module.NATIVE_CONSTANTS) is None
    monkeypatch.setattr(built, "SOURCE_HASH", "built from another _stream.c")
    with pytest.warns(RuntimeWarning, match="rebuild"):
        assert native.load(built.__name__) is None


def test_a_consumer_with_limits_the_c_reader_cannot_take_reads_in_python() -> None:
    import tensorbus as tb

    with tb.Consumer("tcp://127.0.0.1:0", max_payload_bytes=1 << 63) as consumer:
        with tb.Producer(consumer.address) as producer:
            producer.send("k", np.arange(3))
            assert consumer.recv("k", timeout=20).tolist() == [0, 1, 2]
        assert consumer.transport.reactor is not None
        peers = consumer.transport.reactor._peers.values()
        assert all(isinstance(peer.reader, reader_module.PyStreamReader) for peer in peers)


def test_a_frame_without_memory_leaves_the_reader_refusing_to_go_on(make_reader: Any) -> None:
    """No buffer for a frame: MemoryError (the reactor drops the connection), and no half-read stream after it."""

    def no_memory(n: int) -> memoryview:
        raise MemoryError(f"no buffer of {n} bytes")

    big = b"".join(bytes(b) for b in encode(np.zeros(2 << 20, np.uint8)))
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        reader = make_reader(ours, 1 << 20, 1 << 30, no_memory, crc32c.crc32c, 1 << 20, 4 << 20, 1 << 20)
        theirs.sendall(big[:4096])
        with pytest.raises(MemoryError):
            reader.read()
        with pytest.raises(RuntimeError, match="failed earlier"):
            reader.read()


def test_idle_timer_behaves_like_the_python_one() -> None:
    from .test_idle import check_timer

    check_timer(reader_module.NATIVE_STREAM.IdleTimer)


@pytest.mark.parametrize("bad", [float("nan"), "1", None])
def test_idle_timer_refuses_what_is_not_a_number_of_seconds(bad: Any) -> None:
    timer = reader_module.NATIVE_STREAM.IdleTimer()
    with pytest.raises((ValueError, TypeError)):
        timer.touch(bad)
    with pytest.raises((ValueError, TypeError)):
        timer.wait(bad)


def test_idle_timer_takes_huge_and_negative_seconds() -> None:
    timer = reader_module.NATIVE_STREAM.IdleTimer()
    timer.touch(1e300)  # a linger of "forever"
    assert timer.wait(-1) is False  # a timeout already past: one look, not idle
    timer.touch(-5)
    assert timer.wait(0) is True


def _reader(sock: socket.socket, recv_lowat: int, make: Any = None) -> Any:
    """A reader of `sock` (C unless `make` says): 1 MiB headers, 1 GiB payloads, pooled from 1 MiB, checksummed
    while received from 4 MiB."""
    take = BufferPool(2).take
    return (make or reader_module.NATIVE_STREAM.StreamReader)(
        sock, 1 << 20, 1 << 30, take, crc32c.crc32c, 1 << 20, 4 << 20, 1 << 20, recv_lowat=recv_lowat
    )


@contextlib.contextmanager
def _socketpair_reader(make_reader: Any) -> Iterator[tuple[Any, socket.socket]]:
    """A reader (`make_reader`'s) of a non-blocking end of a socket pair, and the pair's other end to write to;
    both ends closed after."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    try:
        yield _reader(ours, recv_lowat=0, make=make_reader), theirs
    finally:
        ours.close()
        theirs.close()


def test_fill_says_whether_read_has_anything_and_reads_ahead_between_frames(make_reader: Any) -> None:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    reader = _reader(ours, recv_lowat=0, make=make_reader)
    try:
        assert reader.fill() is False and not reader.inbox_held  # nothing there: no buffer kept either
        small = bytes(frame.dumps(np.arange(3.0), key="k"))
        theirs.sendall(small)
        assert reader.fill() is True and reader.buffered == len(small)  # read ahead: read() needs no system call
        event = reader.read()
        assert type(event) is tuple and bytes(event[0]) == small
        assert reader.fill() is False
        large = bytes(frame.dumps(np.zeros(200_000), key="big"))
        theirs.sendall(large[:50_000])
        assert reader.fill() is True and reader.read() is None and reader.mid_frame
        assert reader.fill() is False  # part way, nothing more yet: only looked (MSG_PEEK), nothing taken
        rest = threading.Thread(target=theirs.sendall, args=(large[50_000:],))  # (more than the socket holds)
        rest.start()
        deadline = time.monotonic() + 10
        while not reader.fill() and time.monotonic() < deadline:
            pass
        while (event := reader.read()) is None and time.monotonic() < deadline:
            pass
        rest.join()
        assert event is not None and bytes(event[0]) == large
        theirs.close()
        assert reader.fill() is True and reader.read() == reader_module.END  # the end is something to look at
    finally:
        ours.close()


def _read_one(reader: Any) -> Any:
    """The next event, waiting (10 s at most) for its bytes."""
    deadline = time.monotonic() + 10
    while (event := reader.read()) is None and time.monotonic() < deadline:
        pass
    return event


def test_after_a_large_frame_the_reader_reads_ahead_only_a_little(make_reader: Any) -> None:
    """A reader behind its producer finds whole frames waiting: past a large frame it reads ahead only
    SHORT_READ_AHEAD bytes (its prefix and header), and the rest of the next frame goes straight into
    place, not read ahead and copied; after a small frame it reads ahead all there is again."""
    with _socketpair_reader(make_reader) as (reader, theirs):
        large = bytes(frame.dumps(np.zeros(20_000), key="big"))  # (160 KB: over LARGE_FRAME)
        small = bytes(frame.dumps(np.arange(3.0), key="k"))
        assert len(large) >= reader_module.LARGE_FRAME > len(small)
        theirs.sendall(small + large)
        assert reader.fill() is True and reader.buffered == len(small + large)  # (after nothing large: all of it)
        assert bytes(_read_one(reader)[0]) == small and bytes(_read_one(reader)[0]) == large
        theirs.sendall(large + small + small)
        assert reader.fill() is True and reader.buffered == reader_module.SHORT_READ_AHEAD
        assert bytes(_read_one(reader)[0]) == large
        assert reader.fill() is True and reader.buffered == 2 * len(small)  # (a short read ahead: all there is)
        assert bytes(_read_one(reader)[0]) == small and bytes(_read_one(reader)[0]) == small
        theirs.sendall(large + small)
        assert reader.fill() is True and reader.buffered == len(large + small)  # (after a small frame: all again)
        assert bytes(_read_one(reader)[0]) == large and bytes(_read_one(reader)[0]) == small


def test_the_read_that_ends_a_large_frame_reads_the_start_of_the_next_too(make_reader: Any) -> None:
    """The rest of a large frame goes straight into place, and the same system call (a scatter read) reads on
    into the read-ahead buffer: the frames after it are there with no read of their own, and no byte of the
    large frame is copied out of the read-ahead buffer. A frame of SCATTER_BELOW bytes or more is received to
    its last byte alone."""
    with _socketpair_reader(make_reader) as (reader, theirs):
        large = bytes(frame.dumps(np.arange(8_000.0), key="big"))  # (64 KB: over LARGE_FRAME)
        small = bytes(frame.dumps(np.arange(3.0), key="k"))
        assert len(large) >= reader_module.LARGE_FRAME > reader_module.SHORT_READ_AHEAD > 2 * len(small)
        theirs.sendall(large)
        assert bytes(_read_one(reader)[0]) == large
        theirs.sendall(large + small + small)
        assert reader.fill() is True and reader.buffered == reader_module.SHORT_READ_AHEAD  # (its head)
        assert bytes(_read_one(reader)[0]) == large
        assert reader.buffered == 2 * len(small)  # (read with the large frame's rest)
        assert reader.drained  # (it asked for more than there was)
        assert bytes(reader.read()[0]) == small and bytes(reader.read()[0]) == small and not reader.buffered
        larger = bytes(frame.dumps(np.zeros(20_000), key="big"))  # (160 KB: received to its last byte alone)
        assert len(larger) >= reader_module.SCATTER_BELOW
        theirs.sendall(larger)
        assert bytes(_read_one(reader)[0]) == larger
        theirs.sendall(larger + small)
        assert bytes(_read_one(reader)[0]) == larger and not reader.buffered
        assert bytes(_read_one(reader)[0]) == small


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A loopback TCP connection: (ours, the consumer's non-blocking end; theirs, the producer's)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname())
        ours, _ = server.accept()
    ours.setblocking(False)
    theirs.settimeout(20)
    return ours, theirs


def _lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


LOWAT = 256 << 10
#: 5 MiB with its header: a frame large enough for the reader to wait for LOWAT bytes at a time
LARGE = bytes(frame.dumps(np.arange(5 << 17, dtype=np.float64), key="big"))


def test_in_a_large_frame_the_reader_waits_for_recv_lowat_bytes_and_for_any_byte_in_its_tail() -> None:
    ours, theirs = _tcp_pair()
    with ours, theirs:
        reader, readable = _reader(ours, LOWAT), select.poll()
        readable.register(ours, select.POLLIN)
        theirs.sendall(LARGE[:100_000])
        readable.poll(5000)
        assert reader.read() is None and reader.mid_frame
        assert _lowat(ours) == LOWAT  # in the frame's body, with more than LOWAT bytes still owed
        body = threading.Thread(target=theirs.sendall, args=(LARGE[100_000:-1000],))  # (more than the buffers hold)
        body.start()
        deadline = time.monotonic() + 10
        while (body.is_alive() or _lowat(ours) != 1) and time.monotonic() < deadline:
            readable.poll(100)
            assert reader.read() is None
        body.join()
        assert _lowat(ours) == 1  # 1000 bytes owed, fewer than LOWAT: any byte wakes the reader
        theirs.sendall(LARGE[-1000:])
        assert readable.poll(5000), "the frame's last bytes did not make the socket readable"
        event = reader.read()
        assert type(event) is tuple and bytes(event[0]) == LARGE
        small = bytes(frame.dumps(np.arange(3.0), key="k"))
        theirs.sendall(small)
        assert readable.poll(5000), "a small frame after a large one did not make the socket readable"
        event = reader.read()
        assert type(event) is tuple and bytes(event[0]) == small


def _drain(reader: Any, ours: socket.socket, sender: threading.Thread) -> None:
    """Read (nothing whole comes out) until `sender` is done and the socket has stayed empty a while."""
    quiet, deadline = 0, time.monotonic() + 20
    while quiet < 3 and time.monotonic() < deadline:
        assert reader.read() is None
        time.sleep(0.02)
        try:
            ours.recv(1, socket.MSG_PEEK)
            quiet = 0
        except BlockingIOError:
            quiet = 0 if sender.is_alive() else quiet + 1
    assert quiet == 3, "the sender's bytes never stopped coming"


@pytest.mark.parametrize("recv_lowat", [LOWAT, 0])
def test_a_large_frame_ending_in_one_read_leaves_the_socket_waking_for_any_byte(recv_lowat: int) -> None:
    ours, theirs = _tcp_pair()
    with ours, theirs:
        reader, readable = _reader(ours, recv_lowat), select.poll()
        readable.register(ours, select.POLLIN)
        last = LOWAT + 1000  # owed when the reader last waits: more than LOWAT, so it waits for LOWAT
        body = threading.Thread(target=theirs.sendall, args=(LARGE[:-last],))
        body.start()
        _drain(reader, ours, body)
        body.join()
        assert _lowat(ours) == (recv_lowat or 1)  # (0: the reader never sets it)
        theirs.sendall(LARGE[-last:])  # (the kernel grew the receive buffer to hold LOWAT and more)
        assert readable.poll(5000), "the frame's last bytes did not make the socket readable"
        deadline = time.monotonic() + 10
        while (event := reader.read()) is None and time.monotonic() < deadline:
            readable.poll(100)
        assert type(event) is tuple and bytes(event[0]) == LARGE
        assert _lowat(ours) == 1  # at the frame's end, whatever it was set to in its middle


@pytest.mark.parametrize(
    ("system", "release", "safe"),
    [
        ("linux", "6.18.44-fc-v669", True),
        ("linux", "5.8.0", True),
        ("linux", "5.4.0-150-generic", False),
        ("linux", "4.18.0-553.el8_10.x86_64", False),
        ("darwin", "23.1.0", False),
    ],
)
def test_recv_lowat_is_used_only_on_kernels_that_cannot_hang_on_it(system: str, release: str, safe: bool) -> None:
    assert reactor._lowat_is_safe(system, release) is safe


@pytest.mark.parametrize("budget", [256 << 10, 0])
@pytest.mark.parametrize(
    "checksum_from, crc_slice",
    [(1 << 20, 64 << 10), (1 << 20, 8 << 20), (1 << 30, 64 << 10)],
    ids=["checksummed in 64 KB slices", "checksummed in 8 MB slices", "not checksummed while received"],
)
def test_a_budget_bounds_the_bytes_of_a_frame_one_read_takes(
    make_reader: Any, budget: int, checksum_from: int, crc_slice: int
) -> None:
    """An event loop's reader takes a large frame in turns (`budget` bytes each), even with all of it there, and
    however much one receive could take (slices of the CRC larger than the budget, or none: a signed frame's)."""
    tensor = np.arange(2 << 20, dtype=np.uint8)
    data = b"".join(bytes(b) for b in encode(tensor))
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        theirs.sendall(data)  # (all of it waits in the socket)
        ours.setblocking(False)
        pool = BufferPool()
        reader = make_reader(ours, 1 << 20, 1 << 30, pool.take, crc32c.crc32c, 1 << 20, checksum_from, crc_slice)
        reader.budget = budget
        turns = 0
        event = reader.read()
        while event is None:
            turns += 1
            assert turns < 100
            event = reader.read()
        frame_view, crc = event
        assert bytes(frame_view) == data
        if checksum_from <= len(data):
            assert crc == native.crc32c(frame_view[PREFIX.size :], native.crc32c(frame_view[:CRC_AT]))
        else:
            assert crc is None
        assert turns == 0 if budget == 0 else len(data) // budget - 1 <= turns <= len(data) // budget
        with pytest.raises(ValueError):
            reader.budget = -1


class Taken:
    """What a delivery that took a frame returns: its Message, of which `read_taken` reads only the id."""

    def __init__(self, message_id: Any) -> None:
        self.message_id = message_id


def test_read_taken_hands_over_frames_while_taken_within_its_limits_and_returns_what_ended_it(
    make_reader: Any,
) -> None:
    """One call: frames to `take` until a limit (frames, bytes), nothing read ahead, a frame declined, another
    event, or the end; the ids of those taken, in order, and their bytes as `last_total` counts them."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    reader = _reader(ours, recv_lowat=0, make=make_reader)
    frames = [bytes(frame.dumps(np.arange(n, dtype=np.float32), key=f"k{n}")) for n in range(1, 8)]
    handed: list[tuple[bytes, Any]] = []

    def take(data: memoryview, crc: Any, source: Any) -> Any:
        handed.append((bytes(data), source))
        return None if len(handed) == 6 else Taken(len(handed))  # (declines the sixth)

    try:
        theirs.sendall(b"".join(frames[:5]))
        assert reader.fill()
        ids, event, nbytes, largest = reader.read_taken(take, "src", 2, 1 << 30)  # at most 2 frames
        assert (ids, event, nbytes, largest) == (
            [1, 2],
            reader_module.MORE,
            len(frames[0]) + len(frames[1]),
            len(frames[1]),
        )
        ids, event, nbytes, _ = reader.read_taken(take, "src", 16, len(frames[2]) + 1)  # the bytes reached in 2
        assert (ids, event, nbytes) == ([3, 4], reader_module.MORE, len(frames[2]) + len(frames[3]))
        ids, event, _, _ = reader.read_taken(take, "src", 16, 1 << 30)  # nothing read ahead after the fifth
        assert (ids, event) == ([5], reader_module.MORE) and reader.buffered == 0
        theirs.sendall(frames[5] + frames[6] + ACK_REQUEST_MARKER)
        assert reader.fill()
        ids, event, nbytes, _ = reader.read_taken(take, "src", 16, 1 << 30)  # the sixth declined: it is returned
        assert ids == [] and nbytes == 0 and type(event) is tuple and bytes(event[0]) == frames[5]
        ids, event, _, _ = reader.read_taken(take, "src", 16, 1 << 30)  # then the ack request ends the run
        assert (ids, event) == ([7], reader_module.ACK_REQUEST)
        assert reader.read_taken(take, "src", 16, 1 << 30) == ([], None, 0, 0)  # no more bytes
        assert [data for data, _ in handed] == frames and {source for _, source in handed} == {"src"}
        theirs.close()
        assert reader.read_taken(take, "src", 16, 1 << 30)[1] == reader_module.END
    finally:
        ours.close()
        theirs.close()


def test_read_taken_gives_an_error_after_frames_taken_to_its_caller_and_raises_one_before_any(make_reader: Any) -> None:
    """Frames taken before an error are the caller's to book first: the error comes back in their place.
    With none taken yet it is raised, and the frame it came with is gone, as after `read()` and a failed take."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    reader = _reader(ours, recv_lowat=0, make=make_reader)
    frames = [bytes(frame.dumps(np.arange(n, dtype=np.float32), key=f"k{n}")) for n in range(1, 5)]
    calls = []

    def take(data: memoryview, crc: Any, source: Any) -> Any:
        calls.append(bytes(data))
        if len(calls) in (2, 3):
            raise KeyboardInterrupt  # (a Ctrl-C, say, in a delivery that runs Python)
        return Taken(len(calls))

    try:
        theirs.sendall(b"".join(frames))
        assert reader.fill()
        ids, event, _, _ = reader.read_taken(take, None, 16, 1 << 30)
        assert ids == [1] and isinstance(event, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            reader.read_taken(take, None, 16, 1 << 30)
        assert reader.read_taken(take, None, 16, 1 << 30)[:2] == ([4], reader_module.MORE)
        assert calls == frames
    finally:
        ours.close()
        theirs.close()


def test_a_reader_says_when_its_last_read_found_the_socket_empty(make_reader: Any) -> None:
    """`drained`: the read that took one small frame took less than it asked for (the socket had no more),
    so a consumer stops there, with no read that finds nothing; with two frames in one read-ahead, the
    second is taken without a read, and a read-ahead filled to the brim says the socket may have more."""
    small = b"".join(bytes(b) for b in encode(np.arange(3), key="k"))
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        reader = make_reader(
            ours, 1 << 20, LIMITS.max_payload_bytes, BufferPool().take, crc32c.crc32c, 1 << 20, 4 << 20, 1 << 20
        )
        assert reader.read() is None and reader.drained  # (nothing there: EAGAIN)
        theirs.sendall(small)
        select.select([ours], [], [], 5)
        assert bytes(reader.read()[0]) == small
        assert reader.drained and not reader.buffered
        theirs.sendall(small * 2)
        select.select([ours], [], [], 5)
        assert bytes(reader.read()[0]) == small and reader.drained and reader.buffered == len(small)
        assert bytes(reader.read()[0]) == small and not reader.buffered
        # more than either reader reads ahead at once (the C one 1 MiB, the Python one READ_AHEAD)
        many = small * ((2 << 20) // len(small))
        sender = threading.Thread(target=theirs.sendall, args=(many,))
        sender.start()
        select.select([ours], [], [], 5)
        assert bytes(reader.read()[0]) == small
        took = reader.buffered + len(small)
        full = reader_module.READ_AHEAD if make_reader is reader_module.PyStreamReader else 1 << 20
        assert reader.drained == (took < full)  # (a read-ahead filled to the brim: perhaps more is there)
        got = 1
        while got < len(many) // len(small):
            event = reader.read()
            if event is not None:
                got += 1
        sender.join()
