"""Consumer CPU per tensor: a tensorbus socket Consumer against the least a Python reader of the same frames does.

What it measures
    A real `tb.Producer` in another process streams float32 tensors over tcp:// to one of two readers in
    this process, and the reader's CPU time per received tensor is reported (median of rounds; the two
    readers alternate round by round, as the machine is noisy):
      - tensorbus: `tb.Consumer(...).recv_message(key)`, with everything it does per frame (acks, dedup,
        fencing, reassembly checks, backpressure, the rendezvous table, Ctrl-C safety).
      - minimal: the socket handshake, then per frame only the prefix, the CRC32C check, the msgpack
        header, the payload copied out of the read buffer into an array of its own, a per-key FIFO, and
        an ack every 32 frames. No dedup, fencing, limits or error handling.
    The difference is what the consumer's guarantees cost per tensor (plain frames are delivered in C,
    by the intake's `_intake.FastDelivery`; docs/PERFORMANCE.md has the measured ratios).

Run
    python -m benchmarks.consumer_floor [--sizes 4KB,64KB,1MB] [--tensors 5000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import socket
import statistics
import time

import msgpack
import numpy as np

import tensorbus as tb
from tensorbus.codec.frame import PREFIX, checksum_of
from tensorbus.codec.tensors import align
from tensorbus.transports.stream import (
    ACK,
    ACK_REQUEST_MARKER,
    HELLO,
    HELLO_EVERY_CONSUMER,
    HELLO_MAGIC,
    PROOF_BYTES,
    PROTOCOL_VERSION,
    REFUSALS_WANTED,
    TRAILING_CRC,
)

from .common import parse_sizes

WARMUP = 200
READ_BYTES = 8 << 20  # more than any frame it takes (payloads under 4 MiB)


def produce(address: str, size: int, count: int) -> None:
    """Send `count` tensors of `size` bytes under one key, then flush."""
    with tb.Producer(address) as producer:
        array = np.ones(size // 4, np.float32)
        for i in range(count):
            producer.send("bench", array, metadata={"i": i})
        producer.flush(60)


def tensorbus_reader(size: int, count: int) -> float:
    """CPU seconds per tensor of a tb.Consumer receiving `count` tensors (after a warm-up)."""
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        peer = _start_producer(consumer.address, size, count)
        for _ in range(WARMUP):
            consumer.recv_message("bench", timeout=30)
        started = time.process_time()
        for _ in range(count):
            consumer.recv_message("bench", timeout=30)
        spent = time.process_time() - started
        peer.join(60)
    return spent / count


def _greet(conn: socket.socket) -> None:
    """The consumer's side of the handshake, the least way (no auth): hello, proof, verdict, then the
    producer's request to be told of refusals (this reader refuses nothing: it checks CRCs, and raises)."""
    conn.sendall(HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, HELLO_EVERY_CONSUMER, os.urandom(32)))
    conn.recv(PROOF_BYTES, socket.MSG_WAITALL)
    conn.sendall(b"\x01")
    assert conn.recv(len(REFUSALS_WANTED), socket.MSG_WAITALL) == REFUSALS_WANTED


def minimal_reader(size: int, count: int) -> float:
    """CPU seconds per tensor of the least a Python reader of the same stream does (see the docstring)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    peer = _start_producer(f"tcp://127.0.0.1:{listener.getsockname()[1]}", size, count)
    conn, _ = listener.accept()
    listener.close()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _greet(conn)
        buffer = memoryview(bytearray(READ_BYTES))
        state = {"lo": 0, "hi": 0, "frames": 0}
        table: dict[str, collections.deque] = collections.defaultdict(collections.deque)

        def read(want: int) -> None:
            lo, hi = state["lo"], state["hi"]
            if lo:
                buffer[: hi - lo] = buffer[lo:hi]
                state["lo"], state["hi"] = 0, hi - lo
            while state["hi"] < want:
                n = conn.recv_into(buffer[state["hi"] :])
                if n == 0:
                    raise EOFError
                state["hi"] += n

        def receive(n: int | None) -> None:
            """Take `n` tensors (None: until the producer leaves), answering ack requests on the way."""
            got = 0
            while n is None or got < n:
                if state["hi"] - state["lo"] < PREFIX.size:
                    read(PREFIX.size)
                lo = state["lo"]
                if buffer[lo : lo + PREFIX.size] == ACK_REQUEST_MARKER:
                    state["lo"] += PREFIX.size
                    conn.sendall(ACK.pack(state["frames"]))
                    continue
                _, _, flags, _, header_len, payload_len, stored = PREFIX.unpack_from(buffer, lo)
                assert not flags & TRAILING_CRC, "sizes from 4 MiB up carry their CRC after them: not handled here"
                start = align(PREFIX.size + header_len)
                total = start + payload_len
                if state["hi"] - lo < total:
                    read(total)
                    lo = state["lo"]
                frame = buffer[lo : lo + total]
                if checksum_of(frame) != stored:
                    raise ValueError("CRC32C mismatch")
                header = msgpack.unpackb(frame[PREFIX.size : PREFIX.size + header_len])
                entry = header["tensors"][0]
                array = np.frombuffer(bytearray(frame[start:total]), dtype=entry["dtype"]).reshape(entry["shape"])
                table[header["key"]].append((array, header["meta"]))
                table[header["key"]].popleft()
                state["lo"] += total
                state["frames"] += 1
                got += 1
                if state["frames"] % 32 == 0:
                    conn.sendall(ACK.pack(state["frames"]))

        receive(WARMUP)
        started = time.process_time()
        receive(count)
        spent = time.process_time() - started
        conn.settimeout(60)
        try:
            receive(None)  # the flush's ack requests
        except (EOFError, ConnectionError):  # it left, however that shows: closed (EOF), closed with acks
            pass  # unread (a reset), or closed before an answer to a request it sent reached it (a broken pipe)
        peer.join(60)
    return spent / count


def _start_producer(address: str, size: int, count: int) -> multiprocessing.process.BaseProcess:
    peer = multiprocessing.get_context("spawn").Process(target=produce, args=(address, size, WARMUP + count))
    peer.start()
    return peer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4KB,64KB,1MB")
    parser.add_argument("--tensors", type=int, default=5000, help="timed tensors per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("size     tensorbus µs CPU/tensor   minimal µs CPU/tensor   ratio")
    for size in parse_sizes(args.sizes):
        ours, floor, ratios = [], [], []
        for _ in range(args.rounds):
            ours.append(tensorbus_reader(size, args.tensors) * 1e6)
            floor.append(minimal_reader(size, args.tensors) * 1e6)
            ratios.append(ours[-1] / floor[-1])
        print(
            f"{size:>9,d}  {statistics.median(ours):16.1f}   {statistics.median(floor):20.1f}"
            f"   {statistics.median(ratios):5.2f}x"
        )


if __name__ == "__main__":
    main()
