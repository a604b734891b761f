"""Where a node-loss run's tensors sit in a topic's log: read for a failed case's report, so that a tensor the
consumer never had is told apart as never written, or written and not read.

Reads every partition from its first offset to its high watermark with a plain librdkafka consumer (no group),
and names each record by the node-loss index in its metadata (a whole frame) or as a chunk of a message id.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from tensorbus.codec.frame import decode, peek_chunk

#: the longest the scan waits for the brokers (it runs after the case, brokers all back)
SCAN_S = 60.0


def scan(servers: Sequence[str], topic: str) -> dict[int, list[tuple[int, str]]]:
    """Per partition, each record's offset and what it is: `i=N` (a whole frame's node-loss index), `end`, a
    `chunk` of a message, or `unreadable`."""
    consumer = Consumer(
        {"bootstrap.servers": ",".join(servers), "group.id": "tb-log-scan", "enable.auto.commit": False}
    )
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=SCAN_S).topics[topic].partitions)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=SCAN_S)[1] for p in partitions}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        found: dict[int, list[tuple[int, str]]] = collections.defaultdict(list)
        remaining = {p for p, end in ends.items() if end > 0}
        misses = 0
        while remaining and misses < 20:
            record = consumer.poll(3.0)
            if record is None:
                misses += 1
                continue
            if record.error() is not None:
                continue
            partition, offset = record.partition() or 0, record.offset() or 0
            found[partition].append((offset, _named(record.value() or b"")))
            if offset + 1 >= ends[partition]:
                remaining.discard(partition)
        return dict(found)
    finally:
        consumer.close()


def _named(value: bytes) -> str:
    view = memoryview(value)
    chunk = peek_chunk(view)
    if chunk is not None:
        return f"chunk {chunk[1]} of {chunk[0]}"
    try:
        metadata = decode(value, copy=True).metadata
    except Exception as exc:  # (reported, not raised: this is a failure's report)
        return f"unreadable ({type(exc).__name__})"
    return "end" if metadata.get("end") else f"i={metadata.get('i')}"


def report(servers: Sequence[str], topic: str, missing: Sequence[int]) -> str:
    """Where each missing index is in the log (or that it is not there), and what the log's first offsets hold."""
    try:
        found = scan(servers, topic)
    except Exception as exc:
        return f"the topic's log could not be read: {exc!r}"
    at = {name: (p, offset) for p, records in found.items() for offset, name in records}
    lines = [
        f"tensor {i}: " + (f"in the log at partition {at[f'i={i}'][0]} offset {at[f'i={i}'][1]}" if f"i={i}" in at
                           else "not in the log as a whole record")
        for i in missing
    ]  # fmt: skip
    for p, records in sorted(found.items()):
        first = ", ".join(f"{offset}: {name}" for offset, name in records[:12])
        lines.append(f"partition {p}: {len(records)} records from offset {records[0][0]}; the first: {first}")
    return "\n".join(lines)
