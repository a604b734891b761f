"""A consumer tells a producer which of its tensors it refused: its next send or flush raises `Rejected`.

On the stream sockets (read by the C reader and the Python one), memory:// and shm://: the transports whose
consumer is the producer's peer (a broker's consumer is not)."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trustme

import tensorbus as tb
from tensorbus.transports import reader as reader_module
from tensorbus.transports import shm_control
from tensorbus.transports import socket as socket_transport
from tensorbus.transports.stream import ACK, ACK_REQUEST_MARKER, HELLO, TAKEN, proof
from tests.conftest import endpoint_url, require_native
from tests.waiting import wait_for

WAIT_S = 30.0


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    paths = {"ca": directory / "ca.pem", "cert": directory / "server.pem"}
    ca.cert_pem.write_to_path(paths["ca"])
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(paths["cert"])
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(params=["tcp-c", "tcp-python", "unix-c", "unix-python", "tcps-python", "memory-", "shm-"])
def ends(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tls: dict[str, str]
) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """A consumer URL with its options and the producer's: a socket's read by the C stream reader or by the
    Python one."""
    scheme, reader = request.param.split("-")
    if scheme in ("memory", "shm"):
        yield endpoint_url(scheme), {}, {}
        return
    if reader == "c":
        require_native(reader_module.NATIVE_STREAM is not None, "the C stream reader (tensorbus/transports/_stream.c)")
    else:
        monkeypatch.setattr(reader_module, "NATIVE_STREAM", None)
    if scheme == "tcps":
        yield "tcps://127.0.0.1:0", {"ssl_certfile": tls["cert"]}, {"ssl_cafile": tls["ca"]}
    elif scheme == "unix":
        yield f"unix://{tmp_path}/refusals.sock", {}, {}
    else:
        yield "tcp://127.0.0.1:0", {}, {}


def holds_back(consumer: tb.Consumer) -> bool:
    """Whether `consumer`'s transport holds a message back for room in its table."""
    transport: Any = consumer.transport
    if transport.url.scheme == "memory":
        return bool(transport._reader._held)
    if transport.url.scheme == "shm":
        return any(peer.held is not None for peer in transport._listener._peers.values())
    return bool(transport.reactor._held)


def test_a_frame_over_the_consumers_limit_is_rejected_at_the_producers_flush(ends: Any) -> None:
    url, consumer_options, producer_options = ends
    with tb.Consumer(url, max_payload_bytes=4096, **consumer_options) as consumer:
        with tb.Producer(consumer.address, **producer_options) as producer:
            producer.send("small", np.arange(4))
            big_id = producer.send("big", np.zeros(10_000))
            producer.send("after", np.ones(2))
            with pytest.raises(tb.Rejected, match=r"refused message .* \(key 'big'\): .*max_payload_bytes") as caught:
                producer.flush(WAIT_S)
            error = caught.value
            assert (error.key, error.message_id) == ("big", big_id) and "max_payload_bytes" in error.reason
            assert isinstance(error, tb.TransportError) and not error.retriable
            producer.flush(WAIT_S)  # once per refused message; everything else was acknowledged
            assert consumer.recv("small", timeout=WAIT_S).tolist() == [0, 1, 2, 3]
            assert consumer.recv("after", timeout=WAIT_S).tolist() == [1.0, 1.0]
            assert consumer.stats["rejected"] == 1  # not sent again


def test_the_next_send_raises_once_the_producer_has_read_the_refusal_and_sends_nothing(ends: Any) -> None:
    url, consumer_options, producer_options = ends
    key = tb.make_key("worker", 1, "ps", "grad")
    with tb.Consumer(url, **consumer_options) as consumer:
        with tb.Producer(consumer.address, **producer_options) as producer:
            producer.send(tb.make_key("worker", 2, "ps", "grad"), np.arange(2))  # the worker restarted...
            stale_id = producer.send(key, np.arange(3))  # ... and a frame of its old incarnation comes late
            producer.send("marker", np.ones(1))
            assert consumer.recv("marker", timeout=WAIT_S)[0] == 1.0  # (so the refusal is on its way back)
            sent: list[int] = []
            deadline = time.monotonic() + WAIT_S  # (shm:// is told within its consumer's LINGER_S)
            with pytest.raises(tb.Rejected, match="incarnation 1 of 'worker'") as caught:
                while time.monotonic() < deadline:
                    producer.send(f"n{len(sent)}", np.full(1, len(sent)))
                    sent.append(len(sent))
            assert caught.value.message_id == stale_id and caught.value.key == key
            if url.startswith(("tcp", "unix")):  # a socket producer reads acks every so many sends
                assert len(sent) < 2 * socket_transport.READ_ACKS_EVERY
            producer.send("last", np.ones(1))  # raised once: sends go on
            producer.flush(WAIT_S)
            assert [consumer.recv(f"n{i}", timeout=WAIT_S)[0] for i in sent] == sent
            assert consumer.recv("last", timeout=WAIT_S)[0] == 1.0
            assert len(consumer.table) == 1  # the new incarnation's tensor: the send that raised sent nothing


def test_a_chunked_message_the_consumer_refuses_raises_once(ends: Any) -> None:
    url, consumer_options, producer_options = ends
    with tb.Consumer(url, signing_key=b"k" * 32, **consumer_options) as consumer:
        with tb.Producer(consumer.address, max_frame_bytes=16384, **producer_options) as producer:
            message_id = producer.send("unsigned", np.zeros(20_000))  # ten chunks, none signed
            with pytest.raises(tb.Rejected, match="unsigned") as caught:
                producer.flush(WAIT_S)
            assert caught.value.message_id == message_id
            producer.flush(WAIT_S)


def test_a_producer_that_does_not_ask_for_refusals_gets_none(caplog: pytest.LogCaptureFixture) -> None:
    # (a producer of an older build: it would take a refusal for a broken ack)
    caplog.set_level(logging.CRITICAL)
    with tb.Consumer("tcp://127.0.0.1:0", max_payload_bytes=64) as consumer:
        host, port = consumer.address.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
            hello = sock.recv(HELLO.size, socket.MSG_WAITALL)
            sock.sendall(proof(None, HELLO.unpack(hello)[3]))
            assert sock.recv(1) == b"\x01"
            sock.sendall(bytes(tb.dumps(np.zeros(100), key="big")) + ACK_REQUEST_MARKER)
            assert ACK.unpack(sock.recv(ACK.size, socket.MSG_WAITALL)) == (1,)  # an ack, no refusal before it
            assert ACK.unpack(sock.recv(ACK.size, socket.MSG_WAITALL)) == (1 | TAKEN,)  # (settled: refused)
            sock.settimeout(0.2)
            with pytest.raises(TimeoutError):
                sock.recv(1)
        assert consumer.stats["rejected"] == 1


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_a_message_held_for_room_and_then_refused_is_told_too(ends: Any, chunked: bool) -> None:
    url, consumer_options, producer_options = ends
    newer, stale = tb.make_key("worker", 2, "ps", "grad"), tb.make_key("worker", 1, "ps", "grad")
    if chunked:  # (a chunked message is held decoded, its frames gone: its names are told)
        producer_options = {**producer_options, "max_frame_bytes": 4096}
    with tb.Consumer(url, max_buffered_bytes=20_000, **consumer_options) as consumer:
        with tb.Producer(consumer.address, **producer_options) as producer:
            producer.send(newer, np.zeros(2_400))  # fills the table
            stale_id = producer.send(stale, np.zeros(1_200 if chunked else 2))  # held for room: then found stale
            wait_for(lambda: holds_back(consumer), WAIT_S, "the stale tensor to be held")
            assert consumer.recv(newer, timeout=WAIT_S).size == 2_400
            with pytest.raises(tb.Rejected, match="incarnation 1 of 'worker'") as caught:
                producer.flush(WAIT_S)
            assert caught.value.message_id == stale_id


def test_a_refusal_reaches_the_producer_after_an_abort_dropped_tensors_and_acks_stopped(ends: Any) -> None:
    url, consumer_options, producer_options = ends
    consumer = tb.Consumer(url, max_payload_bytes=4096, **consumer_options)
    with tb.Producer(consumer.address, reconnect_timeout_s=1, **producer_options) as producer:
        producer.send("unreceived", np.arange(4))
        producer.flush(WAIT_S)
        consumer.abort("shutting down")  # drops "unreceived": no frame is acknowledged from now on
        big_id = producer.send("big", np.zeros(10_000))  # over max_payload_bytes: refused for good all the same
        wait_for(lambda: consumer.stats["rejected"] == 1, WAIT_S, "the consumer to refuse the frame")
        consumer.close()
        raised: list[tb.TransportError] = []
        for attempt in (lambda: producer.flush(WAIT_S), lambda: producer.send("next", np.ones(1))):
            try:
                attempt()
            except tb.TransportError as exc:  # (the consumer is gone: nothing acknowledges "big" now)
                raised.append(exc)
        rejections = [exc for exc in raised if isinstance(exc, tb.Rejected)]
        assert [(r.key, r.message_id) for r in rejections] == [("big", big_id)], raised
        assert "max_payload_bytes" in rejections[0].reason


def test_an_shm_producer_that_does_not_ask_for_refusals_gets_none(monkeypatch: pytest.MonkeyPatch) -> None:
    # (a producer of a build without "rejected" would take one for a broken connection)
    sent = shm_control.send

    def send_but_not_asking(sock: socket.socket, kind: str, *fields: Any, **options: Any) -> None:
        if kind != "refusals":
            sent(sock, kind, *fields, **options)

    monkeypatch.setattr(shm_control, "send", send_but_not_asking)
    with tb.Consumer(endpoint_url("shm"), max_payload_bytes=4096) as consumer:
        with tb.Producer(consumer.address) as producer:
            producer.send("big", np.zeros(10_000))
            producer.send("after", np.ones(2))
            producer.flush(WAIT_S)  # no "rejected" came: the producer goes on as before
            assert consumer.recv("after", timeout=WAIT_S).tolist() == [1.0, 1.0]
            assert consumer.stats["rejected"] == 1
