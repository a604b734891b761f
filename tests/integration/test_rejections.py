"""What a consumer says about the bad frames a peer sends: a few lines per peer, then a count."""

from __future__ import annotations

import logging
import struct

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec.frame import CRC_AT
from tests.integration.test_socket import raw_peer
from tests.unit.test_bad_frames import _with_reserved, craft, tensor_header
from tests.waiting import wait_for

FLOOD = 2000


def _bad_frame(i: int) -> bytes:
    """A whole frame whose CRC is wrong: read past, refused, the stream intact."""
    frame = bytearray(tb.dumps(np.full(4, i), key="bad", message_id=("flood", i)))
    struct.pack_into("<I", frame, CRC_AT, 12345)
    return bytes(frame)


def test_a_flood_of_bad_frames_logs_a_few_lines_and_a_summary_naming_the_peer_and_the_port(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # each bad frame logged one ERROR line (100,000 frames: 10.6 MB of log in 1.6 s), naming
    # tcp://127.0.0.1:0 rather than the port bound, and no peer at all
    caplog.set_level(logging.ERROR, logger="tensorbus")
    with tb.Consumer("tcp://127.0.0.1:0", reassembly_timeout_s=0.4) as consumer:
        limiter = consumer.intake._rejections
        limiter.window_s = 3600  # the flood falls in one window however slowly a loaded machine reads it
        peer = raw_peer(consumer.address)
        host, port = peer.getsockname()
        peer_address = f"{host}:{port}"
        peer.sendall(b"".join(_bad_frame(i) for i in range(FLOOD)))
        wait_for(lambda: consumer.stats["rejected"] == FLOOD, 60, f"{FLOOD} frames refused")
        limiter.window_s = 0  # (10 s in use) the window has passed: the periodic flush summarises it now
        wait_for(lambda: "more frames rejected" in caplog.text, 30, "the summary line")
        with tb.Producer(consumer.address) as producer:  # honest traffic unaffected
            producer.send("good", np.ones(2))
            assert consumer.recv("good", timeout=5).tolist() == [1, 1]
        peer.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) <= 10, f"{len(lines)} lines for {FLOOD} bad frames"
    assert all(consumer.address in line and peer_address in line for line in lines), lines
    summaries = [line for line in lines if "more frames rejected" in line]
    assert sum(int(line.split()[0]) for line in summaries) == FLOOD - (len(lines) - len(summaries))
    assert "127.0.0.1:0" not in caplog.text


def test_reserved_bytes_and_wrongly_typed_header_fields_are_refused_by_a_live_consumer() -> None:
    with tb.Consumer("tcp://127.0.0.1:0") as consumer:
        peer = raw_peer(consumer.address)
        peer.sendall(craft({**tensor_header(fortran="yes"), "key": "typed"}, bytes(16)))
        peer.sendall(craft({**tensor_header(), "key": "k" * 2000}, bytes(16)))
        wait_for(lambda: consumer.stats["rejected"] == 2, 10, "two frames refused")
        peer.sendall(_with_reserved(tb.dumps(np.ones(4), key="reserved"), 7))
        peer.settimeout(10)
        while peer.recv(1 << 10):  # (acks, then the end: dropped, as it is not a frame of this format)
            pass
        with tb.Producer(consumer.address) as producer:
            producer.send("good", np.ones(2))
            assert consumer.recv("good", timeout=5).tolist() == [1, 1]
        for key in ("typed", "reserved"):
            with pytest.raises(tb.Timeout):
                consumer.recv(key, timeout=0.05)
        peer.close()
