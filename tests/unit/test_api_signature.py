"""What IDEs, help() and type checkers see of Producer and Consumer: keyword-only parameters that are the options
dataclasses' fields, the transports' options listed, a "did you mean" for a misspelled option, a repr without
credentials, and the py.typed marker."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import tomllib

import tensorbus as tb
from tensorbus.api import TRANSPORT_OPTIONS, ConsumerOptions, ProducerOptions
from tensorbus.options import UNSET
from tensorbus.transports.base import TransportOptions
from tensorbus.transports.kafka import KafkaOptions
from tensorbus.transports.memory import MemoryOptions
from tensorbus.transports.rabbitmq import RabbitMQOptions
from tensorbus.transports.shm import ShmOptions
from tensorbus.transports.stream import SocketOptions

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("cls", "own"), [(tb.Producer, ProducerOptions), (tb.Consumer, ConsumerOptions)])
def test_the_keyword_only_parameters_are_the_options_dataclass(cls: type, own: type) -> None:
    parameters = inspect.signature(cls).parameters
    keywords = {name: p for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    fields = {field.name for field in dataclasses.fields(own)}
    assert set(keywords) == fields  # same names: neither can drift from the other
    assert {field.name for field in dataclasses.fields(TransportOptions)} <= fields  # what every transport shares
    hints, field_hints = typing.get_type_hints(cls.__init__), typing.get_type_hints(own)
    for name in fields:
        assert hints[name] == field_hints[name], name  # the same type a checker sees
        assert keywords[name].default is UNSET, name  # (a URL query value holds unless the keyword is given)
    assert list(parameters)[-1] == "transport_options"  # the transport's, by scheme, at run time


def test_help_lists_every_transports_options() -> None:
    for options, heading in (
        (SocketOptions, "tcp://, tcps://, unix://"),
        (MemoryOptions, "memory://"),
        (ShmOptions, "shm://"),
        (RabbitMQOptions, "amqp://, amqps://"),
        (KafkaOptions, "kafka://, kafkas://"),
    ):
        line = TRANSPORT_OPTIONS.split(f"- {heading}:")[1].split("\n    -")[0]
        listed = {name.strip() for name in line.replace("\n", " ").split(",")}
        assert listed == {f.name for f in dataclasses.fields(options)} - {"max_frame_bytes"}, heading
    for cls in (tb.Producer, tb.Consumer):
        assert TRANSPORT_OPTIONS in (cls.__doc__ or "")


def test_a_keyword_overrides_the_url_and_one_left_out_keeps_it() -> None:
    with tb.Producer("memory://sig?max_header_bytes=4096") as producer:
        assert producer._encoding.max_header_bytes == 4096
    with tb.Producer("memory://sig?max_header_bytes=4096", max_header_bytes=8192) as producer:
        assert producer._encoding.max_header_bytes == 8192


@pytest.mark.parametrize(
    ("make", "hint"),
    [
        (lambda: tb.Producer("memory://typo", compresion="lz4"), "did you mean 'compression'"),
        (lambda: tb.Consumer("memory://typo", max_buffered_byte=1), "did you mean 'max_buffered_bytes'"),
        (lambda: tb.Producer("tcp://127.0.0.1:1", reconect_timeout_s=1), "did you mean 'reconnect_timeout_s'"),
        (lambda: tb.Producer("memory://typo?send_timeout=1"), "did you mean 'send_timeout_s'"),
    ],
)
def test_a_misspelled_option_gets_did_you_mean(make: typing.Callable[[], object], hint: str) -> None:
    with pytest.raises(tb.ConfigError, match=hint):
        make()


def test_repr_shows_the_url_without_credentials_and_the_state() -> None:
    producer = tb.Producer("tcp://127.0.0.1:1?auth_secret=hunter2")  # (connects at its first send)
    assert repr(producer) == "<Producer tcp://127.0.0.1:1?auth_secret=*** open>"
    producer.close()
    assert repr(producer).endswith(" closed>") and "hunter2" not in repr(producer)
    consumer = tb.Consumer("memory://shown")
    assert repr(consumer) == "<Consumer memory://shown open>"
    consumer.close()
    assert repr(consumer) == "<Consumer memory://shown closed>"


def test_the_package_ships_py_typed() -> None:
    assert (ROOT / "tensorbus" / "py.typed").is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["tensorbus"]


def test_mypy_sees_the_option_types(tmp_path: Path) -> None:
    """A checker refuses an option of the wrong type at the call, before anything runs."""
    script = tmp_path / "use.py"
    script.write_text(
        'import tensorbus as tb\ntb.Producer("memory://x", checksum="yes")\ntb.Consumer("memory://x", max_ndim=3)\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", str(script)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert 'Argument "checksum" to "Producer" has incompatible type "str"; expected "bool"' in result.stdout, (
        result.stdout
    )
    assert result.stdout.count("error:") == 1, result.stdout
