"""Held messages under a flood of compression bombs: the consumer's memory stays within its table's limit.

While the table is full, each connection's next message is held back as it came (undecoded), so K
connections each sending one small zstd frame that expands to many MiB cost K small frames, not K
decoded tensors. The consumer runs in a process of its own, so its peak resident memory is its own.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from pathlib import Path
from typing import Any

import numpy as np

import tensorbus as tb
from tests.integration.test_socket import raw_peer

MIB = 1 << 20
TABLE_MIB = 64
BOMB_MIB = 64
BOMBS = 6
#: what the consumer may grow by over its table's limit (the interpreter's own churn, a frame or two)
MARGIN_MIB = 48


def _peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _consumer(requests: Any, replies: Any) -> None:
    """A consumer that reports on request: ("status",) -> (held back, received, peak RSS MiB);
    ("recv", key) -> the sum of the tensor received under key."""
    logging.disable(logging.CRITICAL)
    with tb.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=TABLE_MIB * MIB) as consumer:
        replies.put((consumer.address, _peak_rss_mib()))
        while (request := requests.get(timeout=120))[0] != "stop":
            if request[0] == "status":
                replies.put((consumer.intake._held_up, consumer.stats["received"], _peak_rss_mib()))
            else:
                replies.put(int(consumer.recv(request[1], timeout=30).sum()))


def test_compression_bombs_held_while_the_table_is_full_cost_their_size_on_the_wire() -> None:
    spawn = multiprocessing.get_context("spawn")
    requests, replies = spawn.Queue(), spawn.Queue()
    child = spawn.Process(target=_consumer, args=(requests, replies), daemon=True)
    child.start()
    peers = []
    try:
        address, baseline = replies.get(timeout=60)
        with tb.Producer(address) as filler:  # a tensor nobody asks for fills the table
            filler.send("filler", np.ones(TABLE_MIB * MIB, np.uint8))
            filler.flush(30)
        bomb = np.zeros(BOMB_MIB * MIB, np.uint8)
        frames = [tb.dumps(bomb, key=f"bomb{i}", compression="zstd", message_id=("bomb", i)) for i in range(BOMBS)]
        del bomb
        assert sum(len(frame) for frame in frames) < BOMBS * MIB // 8  # (small on the wire)
        for frame in frames:
            peer = raw_peer(address)
            peer.sendall(frame)
            peers.append(peer)
        deadline = time.monotonic() + 30
        while True:  # until every bomb is held back (each on its own connection)
            requests.put(("status",))
            held, received, peak = replies.get(timeout=30)
            if held >= BOMBS or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert held == BOMBS and received == 1
        assert peak - baseline < TABLE_MIB + MARGIN_MIB, (baseline, peak)
        with tb.Producer(address) as honest:  # someone waiting for a key makes room for it
            requests.put(("recv", "honest"))
            honest.send("honest", np.full(1000, 3, np.int64))
            assert replies.get(timeout=60) == 3000
    finally:
        for peer in peers:
            peer.close()
        requests.put(("stop",))
        child.join(30)
        if child.is_alive():
            child.kill()


#: a flood of bombs: as many connections, each with one bomb as large as the table and the decompression limit
FLOOD_BOMBS = 8
FLOOD_MIB = 128
#: what the bound allows over the table and the held frames' wire bytes: the interpreter's own churn
SMALL_CONSTANT_MIB = 32


def _flood_consumer(requests: Any, replies: Any) -> None:
    """A consumer whose table and decompression limit are both FLOOD_MIB; reports as `_consumer` does."""
    logging.disable(logging.CRITICAL)
    limit = FLOOD_MIB * MIB
    with tb.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=limit, max_decompressed_bytes=limit) as consumer:
        replies.put((consumer.address, _peak_rss_mib()))
        while requests.get(timeout=120)[0] != "stop":
            replies.put((consumer.intake._held_up, consumer.stats["received"], _peak_rss_mib()))


def test_eight_bombs_as_large_as_the_table_cost_the_table_plus_their_wire_bytes() -> None:
    """docs/SECURITY.md's bound: peak = the table + the held frames' size on the wire + a small constant,
    measured as the consumer process's VmHWM (a zstd payload is decompressed straight into its aligned
    buffer: before, a second whole copy of the tensor made it 2 x the table)."""
    spawn = multiprocessing.get_context("spawn")
    requests, replies = spawn.Queue(), spawn.Queue()
    child = spawn.Process(target=_flood_consumer, args=(requests, replies), daemon=True)
    child.start()
    peers = []
    try:
        address, baseline = replies.get(timeout=60)
        bomb = np.zeros(FLOOD_MIB * MIB, np.uint8)
        frames = [tb.dumps(bomb, key=f"b{i}", compression="zstd", message_id=("b", i)) for i in range(FLOOD_BOMBS)]
        del bomb
        wire_mib = sum(len(f) for f in frames) / MIB
        assert wire_mib < 1  # ~4 KB each
        for data in frames:
            peer = raw_peer(address)
            peer.sendall(data)
            peers.append(peer)
        deadline = time.monotonic() + 60
        while True:  # until every bomb is in the table or held back
            requests.put(("status",))
            held, received, peak = replies.get(timeout=30)
            if held + received >= FLOOD_BOMBS or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert held + received == FLOOD_BOMBS and received <= 1, (held, received)
        assert peak - baseline < FLOOD_MIB + wire_mib + SMALL_CONSTANT_MIB, (baseline, peak)
    finally:
        for peer in peers:
            peer.close()
        requests.put(("stop",))
        child.join(30)
        if child.is_alive():
            child.kill()
