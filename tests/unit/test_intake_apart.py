"""`Intake.deliver_decoded_apart`: a whole frame decoded outside the intake's lock (tensorbus.aio's decoding
thread) comes to the same as `Intake.__call__`, and a frame whose admission was interrupted is taken as decoded."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec import encode


def signed_frame(to: tb.Consumer, value: float, seq: int) -> memoryview:
    """A received frame of one tensor signed for `to` (a buffer of its own, as a transport hands it over)."""
    key = to.intake.reassembler.signing_key  # (the consumer's key, bound to its endpoint)
    parts = encode(np.full(1 << 10, value, np.float32), key="k", message_id=("p" * 16, seq), signing_key=key)
    return memoryview(bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts)))


def consumer() -> tb.Consumer:
    return tb.Consumer(f"memory://apart-{uuid.uuid4().hex[:8]}", signing_key=b"s")


def test_a_frame_decoded_apart_comes_to_what_the_intake_makes_of_it() -> None:
    with consumer() as apart, consumer() as locked:
        for seq, value in enumerate([1.0, 2.0, 2.0], start=1):  # (the third: a duplicate of the second's id)
            seq = min(seq, 2)
            results = [
                apart.intake.deliver_decoded_apart(signed_frame(apart, value, seq), may_hold=True, source=1),
                locked.intake(signed_frame(locked, value, seq), may_hold=True, source=1),
            ]
            assert results[0] == results[1]
        forged = [bytearray(signed_frame(end, 3.0, 9)) for end in (apart, locked)]
        for frame in forged:
            frame[-1] ^= 1  # (its signature's last byte)
        refusals = [apart.intake.deliver_decoded_apart(memoryview(forged[0])), locked.intake(memoryview(forged[1]))]
        assert refusals[0] == refusals[1] and refusals[0].refused is not None
        assert apart.stats == locked.stats and apart.stats["duplicates"] == 1 and apart.stats["rejected"] == 1
        assert [apart.recv("k", 5)[0], apart.recv("k", 5)[0]] == [1.0, 2.0]


def test_a_frame_decoded_apart_whose_admission_was_interrupted_is_taken_as_it_was_decoded(monkeypatch: Any) -> None:
    """The table refused the first admission (no memory): the frame is kept decoded (`state.interrupted`), and
    offered again it is taken as such, leaving nothing kept (a kept one would turn the C delivery off)."""
    with consumer() as c:
        frame, put = signed_frame(c, 5.0, 1), c.table.put
        failing = [True]

        def put_once(message: Any, **options: Any) -> None:
            if failing.pop() if failing else False:
                raise MemoryError("no room for it this time")
            put(message, **options)

        monkeypatch.setattr(c.table, "put", put_once)
        with pytest.raises(MemoryError):
            c.intake.deliver_decoded_apart(frame, may_hold=True, source=1)
        assert c.intake.state.interrupted is not None and c.intake.state.interrupted[0] is frame
        assert c.intake.deliver_decoded_apart(frame, may_hold=True, source=1).admitted
        assert c.intake.state.interrupted is None
        assert c.recv("k", 5)[0] == 5.0
