"""A fault harness: stream tensors, break something mid-stream, and account for every tensor.

The producer sends `count` tensors of mixed sizes (some large enough to be chunked) under keys
t0..t{count-1}, each stamped with the CRC32C of its bytes. Consumer processes append one line per
tensor handed to the rendezvous table (i.e. to the application) to a shared log, before the
transport acknowledges it, so a SIGKILL at any moment cannot hide a loss; the report counts what
was lost, duplicated to the application, or corrupted.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import socket
from pathlib import Path
from typing import Any

import crc32c
import numpy as np

import tensorbus as tb
from tensorbus.intake import Intake
from tests.peers import make_tensor

CONTEXT = multiprocessing.get_context("spawn")


def spec(i: int) -> dict[str, Any]:
    """Mostly small tensors, every 100th one 20 MB (chunked by the broker transports)."""
    n = 5_000_000 if i % 100 == 50 else 1_000 + (i * 7919) % 60_000
    return {"seed": i, "n": n}


def checksum(array: np.ndarray) -> int:
    return crc32c.crc32c(np.ascontiguousarray(array).view(np.uint8))


def produce(url: str, count: int, options: dict[str, Any], progress: str) -> None:
    """Send the stream, noting progress in a file, then flush (waiting for every acknowledgement)."""
    with tb.Producer(url, **options) as producer:
        for i in range(count):
            tensor = make_tensor(spec(i))
            producer.send(f"t{i}", tensor, metadata={"crc": checksum(tensor)})
            if i % 10 == 0:
                Path(progress).write_text(str(i))
        producer.flush(timeout=240)
        Path(progress).write_text(str(count))


def consume(url: str, log: str, options: dict[str, Any]) -> None:
    """Record every message the consumer hands to the application, then wait to be killed or stopped."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def record(message: tb.Message) -> None:
        os.write(fd, f"{message.key} {checksum(message.tensor)} {message.metadata['crc']} {os.getpid()}\n".encode())

    made = Intake.__init__

    def recording_intake(intake: Intake, *args: Any, **kwargs: Any) -> None:
        """An intake whose C delivery of plain frames (`FastDelivery`, which every transport that reads
        frames uses and which puts into the table in C) notes each message it delivered."""
        made(intake, *args, **kwargs)
        take = intake.fast
        if take is not None:

            def recording_take(frame: Any, crc: int | None, source: Any) -> tb.Message | None:
                message = take(frame, crc, source)
                if message is not None:  # (in the table now, or handed to a waiting recv: not yet acknowledged)
                    record(message)
                return message

            intake.fast = recording_take
            intake.take_records = None  # (kafka:// on librdkafka then takes each record through `fast`)

    Intake.__init__ = recording_intake  # type: ignore[method-assign]  # (this process is the consumer's alone)
    consumer = tb.Consumer(url, **options)
    put = consumer.table.put

    def recording_put(message: tb.Message, **options: Any) -> None:
        record(message)
        put(message, **options)

    consumer.table.put = recording_put  # type: ignore[method-assign]
    handed = os.open(f"{log}.handed", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for message in consumer:  # the application drains the table, noting each tensor it was handed
        os.write(handed, f"{message.key} {os.getpid()}\n".encode())
        del message


def lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def handed_out_twice(log: Path) -> int:
    """Tensors `consume`'s application was handed more than once, by any of the consumer processes
    (`log` counts them as they reach the consumer's table, before the application takes them)."""
    keys = collections.Counter(line.split()[0] for line in Path(f"{log}.handed").read_text().splitlines())
    return sum(count - 1 for count in keys.values())


def report(log: Path, count: int) -> dict[str, int]:
    """sent, received (distinct), lost, duplicated to the application, corrupted."""
    records = lines(log)
    seen = collections.Counter(r[0] for r in records)
    corrupted = sum(1 for r in records if r[1] != r[2])
    expected = {f"t{i}" for i in range(count)}
    return {
        "sent": count,
        "received": len(expected & set(seen)),
        "lost": len(expected - set(seen)),
        "duplicated": sum(c - 1 for c in seen.values()),
        "corrupted": corrupted,
        "consumer_processes": len({r[3] for r in records}),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(target: Any, *args: Any) -> multiprocessing.process.BaseProcess:
    process = CONTEXT.Process(target=target, args=args, daemon=True)
    process.start()
    return process


def fail_feed_once(monkeypatch: Any, consumer: tb.Consumer, error: BaseException) -> list[BaseException]:
    """Make the consumer's next `Reassembler.feed` raise `error` (a decoder bug, memory running out): the
    list it is appended to once raised, for the test to check that the fault fired."""
    feed = consumer.intake.reassembler.feed
    failures, raised = iter([error]), []

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        pending = next(failures, None)
        if pending is not None:
            raised.append(pending)
            raise pending
        return feed(*args, **kwargs)

    monkeypatch.setattr(consumer.intake.reassembler, "feed", failing_once)
    return raised
