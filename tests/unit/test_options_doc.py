"""docs/OPTIONS.md names every option, in the section of the producer, consumer or transport that has it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tensorbus.api import ConsumerOptions, ProducerOptions
from tensorbus.fanout import PublisherOptions, SubscriberOptions
from tensorbus.transports.kafka import KafkaOptions
from tensorbus.transports.memory import MemoryOptions
from tensorbus.transports.rabbitmq import RabbitMQOptions
from tensorbus.transports.shm import ShmOptions
from tensorbus.transports.stream import SocketOptions

OPTIONS_MD = Path(__file__).resolve().parents[2] / "docs" / "OPTIONS.md"
SECTIONS = {
    "Producer": ProducerOptions,
    "Consumer": ConsumerOptions,
    "`tcp://`, `tcps://`, `unix://`": SocketOptions,
    "`memory://`": MemoryOptions,
    "`shm://`": ShmOptions,
    "`amqp://`, `amqps://` (RabbitMQ)": RabbitMQOptions,
    "`kafka://`, `kafkas://`": KafkaOptions,
    "Publisher": PublisherOptions,
    "Subscriber": SubscriberOptions,
}


def documented(section: str) -> set[str]:
    """The option names in the first column of the section's table."""
    parts = re.split(r"^## (.+)$", OPTIONS_MD.read_text(), flags=re.MULTILINE)
    bodies = dict(zip(parts[1::2], parts[2::2], strict=True))
    assert section in bodies, f"docs/OPTIONS.md has no section {section!r}"
    names: set[str] = set()
    for line in bodies[section].splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    return names


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_option_is_documented_in_its_section_and_nothing_else_is(section: str) -> None:
    fields = {f.name for f in dataclasses.fields(SECTIONS[section])}
    if section not in ("Producer", "Consumer", "Publisher", "Subscriber"):
        fields -= {"max_frame_bytes"} if SECTIONS[section].max_frame_bytes is None else set()
    assert documented(section) == fields
