"""The fan-out's `Reader` (fanout/kafka.py) on confluent-kafka (librdkafka), for kafka:// with `client="confluent"`.

librdkafka needs a `group.id` even for a consumer that only assigns itself partitions: it gets one of its
own, never joined (no `subscribe`) and never committed to. Records come in `consume` batches.
"""

from __future__ import annotations

import time
import uuid

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException
from confluent_kafka import TopicPartition as RdTopicPartition

from ..errors import TransportError
from ..transports.kafka import KafkaTransport
from ..transports.kafka_rdkafka import batch, client_config, translate_error

#: records handed over per `poll` at most
BATCH = 64


class ConfluentReader:
    """Every partition of the transport's topic, read from its start; nothing committed."""

    def __init__(self, transport: KafkaTransport) -> None:
        o, self._shown, self._topic = transport.options, transport._shown, transport.topic
        self._timeout = o.connect_timeout_s
        config = {
            **client_config(transport),
            "group.id": f"tensorbus-fanout-{uuid.uuid4().hex}",  # (required; no member ever joins it)
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "fetch.max.bytes": o.fetch_max_bytes,
            "max.partition.fetch.bytes": o.partition_fetch_bytes,
            "receive.message.max.bytes": min(o.fetch_max_bytes + (1 << 20), 2**31 - 1),
        }
        try:
            self._consumer = Consumer(config)
        except KafkaException as exc:
            raise translate_error(exc.args[0], self._shown) from None
        try:
            partitions = self._partitions(time.monotonic() + self._timeout)
            #: the next offset to read in each partition (librdkafka's position is unknown until a record came)
            self._next = {p: 0 for p in partitions}
            self._consumer.assign([RdTopicPartition(self._topic, p, OFFSET_BEGINNING) for p in partitions])
        except BaseException:  # (its threads and connections are not left behind)
            self._consumer.close()
            raise

    def _partitions(self, deadline: float) -> list[int]:
        """The topic's partitions, asked again until `deadline` while the cluster does not know them yet."""
        while True:
            try:
                topic = self._consumer.list_topics(self._topic, timeout=max(0.1, deadline - time.monotonic()))
                topic_metadata = topic.topics[self._topic]
                if topic_metadata.error is None and topic_metadata.partitions:
                    return sorted(topic_metadata.partitions)
            except KafkaException as exc:
                if time.monotonic() > deadline:
                    raise translate_error(exc.args[0], self._shown) from None
            if time.monotonic() > deadline:
                raise TransportError(f"{self._shown}: the topic's partitions unknown after {self._timeout}s")
            time.sleep(0.1)

    def ends(self) -> dict[int, int]:
        ends = {}
        try:
            for partition in self._next:
                tp = RdTopicPartition(self._topic, partition)
                marks = self._consumer.get_watermark_offsets(tp, timeout=self._timeout)
                if marks is None:
                    raise TransportError(
                        f"{self._shown}: the end of partition {partition} unknown after {self._timeout}s"
                    )
                low, ends[partition] = marks
                self._next[partition] = max(self._next[partition], low)  # (what retention removed)
        except KafkaException as exc:
            raise translate_error(exc.args[0], self._shown) from None
        return ends

    def position(self, partition: int) -> int:
        """The next offset: after the last record handed over, or further where librdkafka skipped offsets that
        hold no record (a compacted batch left empty)."""
        try:
            [known] = self._consumer.position([RdTopicPartition(self._topic, partition)])
        except KafkaException as exc:
            raise translate_error(exc.args[0], self._shown) from None
        return max(self._next[partition], known.offset)  # (negative while librdkafka knows none)

    def poll(self, timeout: float) -> list[bytes]:
        try:
            records = batch(self._consumer, BATCH, timeout)
        except KafkaException as exc:
            raise translate_error(exc.args[0], self._shown) from None
        values = []
        for record in records:
            if (error := record.error()) is not None:
                raise translate_error(error, self._shown)
            self._next[record.partition() or 0] = (record.offset() or 0) + 1
            if (value := record.value()) is not None:
                values.append(value)
        return values

    def close(self) -> None:
        self._consumer.close()
