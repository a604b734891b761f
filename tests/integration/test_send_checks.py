"""What no consumer would take is refused at `send`, naming the problem, and nothing is sent: on
the C path of a plain ndarray (tcp://, unix://) as on the Python path (memory://, TENSORBUS_NATIVE=0)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec.frame import DEFAULT_LIMITS, FLAG_CHECKSUM, NATIVE
from tests.conftest import endpoint_url, require_native

HUGE = "x" * (DEFAULT_LIMITS.max_header_bytes + 1)


def sparse_written_to_after_it_was_made() -> tb.SparseTensor:
    sparse = tb.SparseTensor([[0, 1]], [1.0], (2, 2))
    sparse.indices[0, 0] = 5  # (its arrays are the caller's: nothing stops this)
    return sparse


CASES: list[tuple[str, dict[str, Any], type, str]] = [
    ("str metadata", {"metadata": "str"}, tb.InvalidTensor, "metadata must be a dict.*got a str"),
    ("list metadata", {"metadata": [1, 2]}, tb.InvalidTensor, "metadata must be a dict.*got a list"),
    ("huge metadata", {"metadata": {"notes": HUGE}}, tb.LimitExceeded, "header.*exceed|max_header_bytes=1048576"),
    ("long key", {"key": "k" * 1025}, tb.ConfigError, "key of 1025 characters; the limit is 1024"),
    ("sparse out of shape", {"tensor": sparse_written_to_after_it_was_made()}, tb.InvalidTensor, "outside dense"),
    ("masked array", {"tensor": np.ma.array([1, 2], mask=[0, 1])}, tb.InvalidTensor, "masked array"),
]


@pytest.mark.parametrize("transport", ["memory", "tcp", "unix"])
def test_a_frame_every_consumer_would_drop_is_refused_at_send_and_nothing_is_sent(transport: str) -> None:
    with tb.Consumer(endpoint_url(transport)) as consumer, tb.Producer(consumer.address) as producer:
        for what, case, error, needle in CASES:
            try:
                producer.send(case.get("key", "bad"), case.get("tensor", np.ones(4)), metadata=case.get("metadata"))
            except error as exc:
                assert re.search(needle, str(exc)), f"{what}: {exc}"
            else:
                pytest.fail(f"{what}: sent, not refused")
        producer.send("ok", np.arange(3), metadata={"fine": True})
        message = consumer.recv_message("ok", timeout=30)
        assert message.tensor.tolist() == [0, 1, 2]
        assert len(consumer.table) == 0 and consumer.stats["rejected"] == 0
        assert consumer.stats["received"] == 1  # only the good one came


def test_the_c_head_leaves_what_python_refuses_to_python() -> None:
    require_native(NATIVE is not None, "the C codec (tensorbus/codec/_native.c)")
    array = np.ones(4)
    assert NATIVE.ndarray_head(array, "k", {"a": 1}, ("p", 1), FLAG_CHECKSUM) is not None
    for key, metadata in [(HUGE, None), ("k", {"notes": HUGE}), ("k", "str"), ("k", [1, 2])]:
        assert NATIVE.ndarray_head(array, key, metadata, ("p", 1), FLAG_CHECKSUM) is None


@pytest.mark.parametrize("transport", ["memory", "tcp", "unix"])
def test_a_producer_checks_headers_against_its_own_max_header_bytes(transport: str) -> None:
    raised = 4 * DEFAULT_LIMITS.max_header_bytes
    notes = "x" * (2 * DEFAULT_LIMITS.max_header_bytes)  # between the default limit and the raised one
    array = np.arange(6.0)
    with tb.Consumer(endpoint_url(transport), max_header_bytes=raised) as consumer:
        with tb.Producer(consumer.address) as default:
            with pytest.raises(tb.LimitExceeded, match=f"max_header_bytes={DEFAULT_LIMITS.max_header_bytes}"):
                default.send("big", array, metadata={"notes": notes})
        with tb.Producer(f"{consumer.address}?max_header_bytes={raised}") as producer:  # (as a URL query too)
            producer.send("big", array, metadata={"notes": notes})
            with pytest.raises(tb.LimitExceeded, match=f"max_header_bytes={raised}"):
                producer.send("bigger", array, metadata={"notes": notes * 3})
        message = consumer.recv_message("big", timeout=30)
        assert message.metadata["notes"] == notes and message.tensor.tolist() == array.tolist()
        assert consumer.stats["received"] == 1 and consumer.stats["rejected"] == 0


@pytest.mark.parametrize("tensor", [np.ones(4), {"a": np.ones(4)}], ids=["ndarray", "bundle"])
def test_a_producer_whose_consumers_take_less_refuses_a_header_under_the_default(tensor: Any) -> None:
    with tb.Consumer(endpoint_url("memory")) as consumer, tb.Producer(consumer.address, max_header_bytes=4096) as p:
        with pytest.raises(tb.LimitExceeded, match="max_header_bytes=4096"):
            p.send("k", tensor, metadata={"notes": "x" * 8192})  # (the C head of an ndarray knows only the default)
        p.send("k", tensor, metadata={"notes": "x" * 100})
        assert consumer.recv_message("k", timeout=10).metadata["notes"] == "x" * 100
