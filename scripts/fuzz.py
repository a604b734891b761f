"""Fuzz the decoder, the reassembler and a live tcp:// consumer with mutated frames.

Mutations (byte flips, deletions, insertions, splices, length-field lies) of valid frames of every
kind go through `tensorbus.decode` and a `Reassembler` (with checksums off, so mutations reach the
parsers), and a share of them is sent over real sockets to a live consumer beside an honest
producer whose tensors must all arrive. Anything other than a tensorbus CodecError is a crash; a
single case over 2 s is a hang. Prints a report with peak RSS.

Two attacks follow: a captured stream of signed frames replayed (to the consumer restarted, to
another endpoint with the same key, and mutated), every one of which must be refused; and the held
bomb: connections each sending one small zstd frame that expands to `--bomb-mib` MiB while the
consumer's table is full, whose peak RSS is reported against `max_buffered_bytes`.

    python scripts/fuzz.py --cases 1000000            # the full run (about 2-4 minutes here)
    python scripts/fuzz.py --cases 20000 --live 2000  # a quick slice
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import random
import resource
import socket
import struct
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tensorbus as tb
from tensorbus.transports.stream import HELLO, proof

SIGNING_KEY = b"fuzz-key"


def seeds() -> list[bytes]:
    """Valid frames of every kind, checksum off so that mutations reach the header parser."""
    rng = np.random.default_rng(0)
    objects = [
        np.arange(64, dtype=np.float32),
        np.asfortranarray(rng.random((5, 7))),
        np.array(3, np.int8),
        np.zeros((0, 4)),
        {"w": rng.random((8, 8)).astype(np.float16), "b": np.arange(3)},
        tb.SparseTensor(np.array([[0, 1], [2, 0]]), np.array([1.5, -2.0]), (3, 3)),
        np.arange(200, dtype=">i4"),
    ]
    frames = [tb.dumps(o, key=f"k{i}", metadata={"i": i, "tag": ["x"]}, checksum=False) for i, o in enumerate(objects)]
    frames.append(tb.dumps(np.zeros(4096), compression="zstd", checksum=False))
    frames.append(tb.dumps(np.zeros(4096), compression="lz4", checksum=False))
    big = tb.encode(rng.random(3000), key="chunked", message_id=("fuzz", 1))
    frames += [b"".join(c) for c in tb.split(big, max_chunk_bytes=4096, message_id=("fuzz", 1), checksum=False)]
    return frames


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 5)):
        op = rng.random()
        at = rng.randrange(len(out)) if out else 0
        if op < 0.45 and out:
            out[at] = rng.randrange(256)
        elif op < 0.6:
            del out[at : at + rng.randint(1, 64)]
        elif op < 0.75:
            out[at:at] = rng.randbytes(rng.randint(1, 32))
        elif op < 0.85:
            other = rng.choice(pool)
            cut = rng.randrange(len(other))
            out[at:] = other[cut:]
        elif len(out) >= 24:  # lie in a length field of the prefix
            field, fmt, top = rng.choice([(8, "<I", 2**32 - 1), (12, "<Q", 2**64 - 1)])
            struct.pack_into(fmt, out, field, rng.choice([0, 1, 2**31, top, top // 3, rng.randrange(1 << 20)]))
    return bytes(out)


def raw_connection(address: str) -> socket.socket:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(proof(None, HELLO.unpack(sock.recv(HELLO.size, socket.MSG_WAITALL))[3]))
    sock.recv(1)
    return sock


def replay(rng: random.Random, count: int) -> dict[str, int]:
    """Signed frames captured on their way to a consumer, replayed to it restarted and to another
    endpoint, as they were and mutated: how many were delivered (must be none) and refused (at least
    all those replayed as they were)."""
    captured: list[bytes] = []
    with tb.Consumer("tcp://127.0.0.1:0", signing_key=SIGNING_KEY) as first:
        address = first.address
        with tb.Producer(address, signing_key=SIGNING_KEY) as producer:
            send = producer.transport.send

            def tap(frame: list, *, key: str | None) -> None:
                send(frame, key=key)
                captured.append(b"".join(bytes(memoryview(b).cast("B")) for b in frame))

            producer.transport.send = tap  # type: ignore[method-assign]
            for i in range(count):
                producer.send(f"r{i}", np.full(8, i))
            producer.flush(30)
    result = {"replayed": 0, "delivered": 0, "refused": 0}
    with (
        tb.Consumer(address, signing_key=SIGNING_KEY) as restarted,
        tb.Consumer("tcp://127.0.0.1:0", signing_key=SIGNING_KEY) as other,
    ):
        for target in (restarted, other):
            attacker = raw_connection(target.address)  # as captured: each one refused, the connection kept
            attacker.sendall(b"".join(captured))
            result["replayed"] += len(captured)
            for frame in captured:  # mutated: refused, or the connection dropped for garbage
                try:
                    attacker.sendall(mutate(rng, frame, captured))
                except OSError:
                    attacker.close()
                    attacker = raw_connection(target.address)
                result["replayed"] += 1
            attacker.close()
        with tb.Producer(address, signing_key=SIGNING_KEY) as honest:  # (after the replays, on their heels)
            honest.send("honest", np.ones(1))
            honest.flush(30)
        restarted.recv("honest", timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and min(t.stats["rejected"] for t in (restarted, other)) < count:
            time.sleep(0.05)  # (the replays as captured come first on their connections: all refused by then)
        for target in (restarted, other):
            result["delivered"] += target.stats["received"] - (target is restarted)
            result["refused"] += target.stats["rejected"]
    return result


def _bomb_consumer(max_buffered: int, addresses: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    logging.disable(logging.CRITICAL)
    with tb.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=max_buffered) as consumer:
        addresses.put(consumer.address)
        stop.wait(120)


def _peak_rss_mib(pid: int) -> float:
    """A process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def held_bomb(connections: int, bomb_mib: int, max_buffered_mib: int) -> dict[str, float]:
    """`connections` peers each sending one zstd frame that expands to `bomb_mib` MiB to a consumer
    whose table (`max_buffered_mib`) an unclaimed tensor fills: the consumer's peak RSS, MiB."""
    spawn = multiprocessing.get_context("spawn")
    addresses, stop = spawn.Queue(), spawn.Event()
    child = spawn.Process(target=_bomb_consumer, args=(max_buffered_mib << 20, addresses, stop), daemon=True)
    child.start()
    try:
        address = addresses.get(timeout=60)
        baseline = _peak_rss_mib(child.pid)  # type: ignore[arg-type]
        with tb.Producer(address) as filler:
            filler.send("filler", np.ones(max_buffered_mib << 20, np.uint8))
            filler.flush(30)
        bomb = np.zeros(bomb_mib << 20, np.uint8)
        frames = [
            tb.dumps(bomb, key=f"bomb{i}", compression="zstd", message_id=("bomb", i)) for i in range(connections)
        ]
        peers = [raw_connection(address) for _ in range(connections)]
        for peer, frame in zip(peers, frames, strict=True):
            peer.sendall(frame)
        time.sleep(2.0)
        peak = _peak_rss_mib(child.pid)  # type: ignore[arg-type]
        for peer in peers:
            peer.close()
        wire_kib = sum(len(f) for f in frames) / 1024
        return {"wire_kib": round(wire_kib), "baseline_mib": round(baseline), "peak_mib": round(peak)}
    finally:
        stop.set()
        child.join(30)


def hog(tensors: int) -> dict[str, float]:
    """One connection sends `tensors` 64 KiB tensors nobody takes, twice the consumer's table: an
    honest producer's tensors must still be taken at once (its share: `max_buffered_bytes_per_producer`)."""
    frames = [tb.dumps(np.ones(64 << 10, np.uint8), key=f"hog{i}", message_id=("hog", i)) for i in range(tensors)]
    with tb.Consumer("tcp://127.0.0.1:0", max_buffered_bytes=tensors << 15) as consumer:
        attacker = raw_connection(consumer.address)

        def send_all() -> None:
            try:
                attacker.sendall(b"".join(frames))
            except OSError:  # closed once done, while the consumer still holds it back
                pass

        flood = threading.Thread(target=send_all)
        flood.start()
        deadline = time.monotonic() + 30
        while consumer.intake._held_up < 1 and time.monotonic() < deadline:
            time.sleep(0.001)  # until the attacker is held back
        worst, taken = 0.0, 0
        with tb.Producer(consumer.address) as honest:
            for i in range(20):
                started = time.monotonic()
                honest.send(f"honest{i}", np.full(1024, i))
                try:
                    honest.flush(5)
                except tb.TransportError:
                    break
                worst = max(worst, time.monotonic() - started)
                taken += int(consumer.recv(f"honest{i}", timeout=0)[0] == i)
        attacker.close()
        flood.join(30)
    return {"honest_taken": taken, "of": 20, "worst_ms": round(worst * 1000, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1_000_000)
    parser.add_argument("--live", type=int, default=20_000, help="mutated frames sent to a live tcp:// consumer")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--replays", type=int, default=200, help="signed frames captured, then replayed")
    parser.add_argument("--bombs", type=int, default=8, help="held-bomb connections (0: skip that attack)")
    parser.add_argument("--bomb-mib", type=int, default=64, help="what each held bomb expands to")
    parser.add_argument("--max-buffered-mib", type=int, default=64, help="the held-bomb consumer's table")
    parser.add_argument("--hog", type=int, default=2000, help="unclaimed tensors one connection floods (0: skip)")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # every rejected frame logs an error; the report counts them
    rng = random.Random(args.seed)
    pool = seeds()
    limits = tb.Limits(max_payload_bytes=64 << 20)
    reassembler = tb.Reassembler(max_bytes=256 << 20, timeout_s=1.0, limits=limits)
    counts = {"accepted": 0, "rejected": 0, "crashes": 0, "hangs": 0}
    started = time.perf_counter()
    for case in range(args.cases):
        data = mutate(rng, rng.choice(pool), pool)
        t0 = time.perf_counter()
        for target in (lambda d: tb.decode(d, limits=limits), reassembler.feed):
            try:
                target(data)
                counts["accepted"] += 1
            except tb.CodecError:
                counts["rejected"] += 1
            except Exception:
                counts["crashes"] += 1
                if counts["crashes"] <= 5:
                    print(f"CRASH on case {case}: {data[:80]!r}...", file=sys.stderr)
                    traceback.print_exc()
        if time.perf_counter() - t0 > 2.0:
            counts["hangs"] += 1
        if case and case % 200_000 == 0:
            print(f"  {case:,} cases, {time.perf_counter() - started:.0f}s", flush=True)
    offline_s = time.perf_counter() - started

    live = {"sent": 0, "honest_sent": 0, "honest_received": 0}
    with tb.Consumer("tcp://127.0.0.1:0", max_payload_bytes=64 << 20) as consumer:
        honest = tb.Producer(consumer.address)
        attacker = raw_connection(consumer.address)
        for i in range(args.live):
            try:
                attacker.sendall(mutate(rng, rng.choice(pool), pool))
            except OSError:  # the consumer dropped this connection (garbage): open another
                attacker.close()
                attacker = raw_connection(consumer.address)
            live["sent"] += 1
            if i % 100 == 0:
                honest.send(f"h{i}", np.full(16, i))
                live["honest_sent"] += 1
        honest.flush(60)
        for i in range(0, args.live, 100):
            if np.array_equal(consumer.recv(f"h{i}", timeout=30), np.full(16, i)):
                live["honest_received"] += 1
        honest.close()
        attacker.close()
    replays = replay(rng, args.replays)
    bombs = held_bomb(args.bombs, args.bomb_mib, args.max_buffered_mib) if args.bombs else None
    hogged = hog(args.hog) if args.hog else None
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"offline: {args.cases:,} mutated frames x (decode, reassembler) in {offline_s:.0f}s: {counts}")
    print(f"live tcp:// consumer: {live}")
    print(f"replayed signed frames (restarted consumer, other endpoint; as captured and mutated): {replays}")
    if bombs is not None:
        print(
            f"held bomb: {args.bombs} connections x one zstd frame of {args.bomb_mib} MiB, "
            f"max_buffered_bytes={args.max_buffered_mib} MiB full: {bombs}"
        )
    if hogged is not None:
        print(f"one connection floods {args.hog} unclaimed 64 KiB tensors (twice the table): {hogged}")
    print(
        f"peak RSS {peak_mb:.0f} MB; reassembler held {reassembler.held_bytes} bytes, stats {dict(reassembler.stats)}"
    )
    ok = counts["crashes"] == 0 and counts["hangs"] == 0 and live["honest_received"] == live["honest_sent"]
    ok = ok and replays["delivered"] == 0 and replays["refused"] >= 2 * args.replays
    ok = ok and (hogged is None or hogged["honest_taken"] == hogged["of"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
