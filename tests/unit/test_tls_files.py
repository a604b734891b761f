"""A TLS file that is missing or holds no certificate is a `ConfigError` naming it, on every TLS scheme.

Raised by the constructor, or by a lazy producer's first send, before any connection: nothing listens
on the ports below, and nothing is asked to.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
import tensorbus.aio as tba

URLS = {
    "tcps": "tcps://127.0.0.1:1",
    "amqps": "amqps://127.0.0.1:1/?queue=tls-files",
    "kafkas": "kafkas://127.0.0.1:1/tls-files",
    "kafkas-confluent": "kafkas://127.0.0.1:1/tls-files?client=confluent",
}


def _blocking_producer(url: str, **options: Any) -> None:
    with tb.Producer(url, **options) as producer:
        producer.send("k", np.ones(1))


def _aio_producer(url: str, **options: Any) -> None:
    async def send() -> None:
        async with tba.Producer(url, **options) as producer:
            await producer.send("k", np.ones(1))

    asyncio.run(send())


def _aio_consumer(url: str, **options: Any) -> None:
    async def open_it() -> None:
        async with tba.Consumer(url, **options):
            pass

    asyncio.run(open_it())


ROLES: dict[str, Callable[..., Any]] = {
    "Producer": _blocking_producer,
    "Consumer": tb.Consumer,
    "Subscriber": tb.Subscriber,
    "Publisher": tb.Publisher,
    "aio.Producer": _aio_producer,
    "aio.Consumer": _aio_consumer,
}


def _listens(scheme: str, role: str) -> bool:
    """Whether this end of a socket scheme is the one that listens (it needs a certificate of its own)."""
    return scheme == "tcps" and role in ("Consumer", "Publisher", "aio.Consumer")


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("scheme", URLS)
@pytest.mark.parametrize("fault", ["missing", "not a certificate"])
def test_a_bad_tls_file_is_a_config_error_naming_it(scheme: str, role: str, fault: str, tmp_path: Path) -> None:
    if fault == "missing":
        path = str(tmp_path / "missing.pem")
    else:
        path = str(tmp_path / "notes.pem")
        Path(path).write_text("not a PEM file\n")
    option = "ssl_certfile" if _listens(scheme, role) else "ssl_cafile"
    options: dict[str, Any] = {option: path, "connect_timeout_s": 2}
    if scheme == "tcps":
        options.pop("connect_timeout_s")  # (refused at once: nothing listens on port 1)
        options["reconnect_timeout_s"] = 2
    url = URLS[scheme]
    if _listens(scheme, role):
        url = "tcps://127.0.0.1:0"
    with pytest.raises(tb.ConfigError, match=rf"cannot load the TLS files \({option}='[^']*{Path(path).name}'\)"):
        ROLES[role](url, **options)
