"""Fan-out on memory://, tcp://, unix:// and tcps://: latest for late joiners, increasing versions, conflation."""

from __future__ import annotations

import logging
import socket
import tempfile
import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest
import trustme

import tensorbus as tb
from tensorbus.fanout.sockets import PUBLISHING, SUBSCRIBE
from tensorbus.transports.stream import handshake_as_producer, recv_exact
from tests.fanout_peers import check_four_subscriber_processes, crc_of
from tests.waiting import wait_for

Ends = tuple[str, dict[str, Any], dict[str, Any]]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA and a certificate for 127.0.0.1 it signed."""
    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    paths = {"ca": directory / "ca.pem", "cert": directory / "server.pem"}
    ca.cert_pem.write_to_path(paths["ca"])
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(paths["cert"])
    return {name: str(path) for name, path in paths.items()}


def _ends(scheme: str, tls: dict[str, str]) -> Ends:
    """A publisher URL with its options and the subscribers' options."""
    name = f"tb-{uuid.uuid4().hex[:12]}"
    if scheme == "memory":
        return f"memory://{name}", {}, {}
    if scheme == "unix":
        return f"unix://{tempfile.gettempdir()}/{name}.sock", {}, {}
    if scheme == "tcps":
        return "tcps://127.0.0.1:0", {"ssl_certfile": tls["cert"]}, {"ssl_cafile": tls["ca"]}
    return "tcp://127.0.0.1:0", {}, {}


@pytest.fixture(params=["memory", "tcp", "unix", "tcps"])
def ends(request: pytest.FixtureRequest, tls: dict[str, str]) -> Ends:
    return _ends(request.param, tls)


@pytest.fixture(params=["tcp", "unix", "tcps"])
def socket_ends(request: pytest.FixtureRequest, tls: dict[str, str]) -> Ends:
    return _ends(request.param, tls)


def test_a_late_subscriber_gets_the_latest_version_of_each_key(ends: Ends) -> None:
    url, pub_options, sub_options = ends
    with tb.Publisher(url, **pub_options) as pub:
        for version in (1, 2, 7):
            pub.publish("policy", np.full(1000, version, np.float32), version=version, metadata={"step": version})
        pub.publish("stats", np.arange(3), version=4)
        with tb.Subscriber(pub.address, **sub_options) as sub:
            policy = sub.latest("policy", timeout=30)
            assert (policy.key, policy.version, policy.metadata) == ("policy", 7, {"step": 7})
            assert policy.tensor.tolist() == [7.0] * 1000
            assert sub.latest("stats", timeout=30).version == 4
            pub.publish("policy", np.full(1000, 8, np.float32), version=8)
            newer = sub.latest("policy", newer_than=7, timeout=30)
            assert (newer.version, newer.tensor[0]) == (8, 8.0)


def test_publish_refuses_a_version_not_greater_than_the_last(ends: Ends) -> None:
    url, pub_options, _ = ends
    with tb.Publisher(url, **pub_options) as pub:
        pub.publish("w", np.zeros(2), version=5)
        for stale in (5, 4):
            with pytest.raises(tb.ConfigError, match="not greater"):
                pub.publish("w", np.zeros(2), version=stale)
        for bad in (-1, 1.5, True, 2**70):  # (2**70: more than a frame's header carries)
            with pytest.raises(tb.ConfigError, match="version must be an int from 0 to 2"):
                pub.publish("w", np.zeros(2), version=bad)  # type: ignore[arg-type]
        pub.publish("other", np.zeros(2), version=1)  # versions are per key
        assert pub.versions() == {"w": 5, "other": 1}
        pub.publish("big", np.zeros(2), version=2**64 - 1)  # (the largest one carried)
    with tb.Subscriber("memory://never-published") as sub, pytest.raises(tb.ConfigError, match="newer_than"):
        sub.latest("w", newer_than="1", timeout=0)  # type: ignore[arg-type]


def test_versions_only_increase_for_a_subscriber_and_the_last_arrives(ends: Ends) -> None:
    url, pub_options, sub_options = ends
    with tb.Publisher(url, **pub_options) as pub, tb.Subscriber(pub.address, **sub_options) as sub:
        seen: dict[str, list[int]] = {"a": [], "b": []}

        def read() -> None:
            while seen["a"][-1:] != [300] or seen["b"][-1:] != [300]:
                message = sub.next(timeout=60)
                seen[message.key or ""].append(message.version)
                assert message.tensor[0] == message.version  # the values are those of that version
                time.sleep(0.001)  # a reader slower than the publisher: it is given the newest, skipping

        reader = threading.Thread(target=read)
        reader.start()
        for version in range(1, 301):
            pub.publish("a", np.full(20_000, version), version=version)
            pub.publish("b", np.full(10, version), version=version)
        reader.join(60)
        assert not reader.is_alive()
        for versions in seen.values():
            assert versions == sorted(set(versions)), versions
            assert versions[-1] == 300


def test_publish_takes_a_snapshot_of_arrays_changed_in_place_afterwards(ends: Ends) -> None:
    url, pub_options, sub_options = ends
    with tb.Publisher(url, **pub_options) as pub:
        subs = [tb.Subscriber(pub.address, **sub_options) for _ in range(3)]
        try:
            weights = np.zeros(1 << 20, np.float32)
            for version in range(1, 4):
                weights += 1  # an optimizer step, in place, right after the previous publish
                pub.publish("weights", {"w": weights, "b": weights[:10]}, version=version)
            weights += 1
            for sub in subs:
                message = sub.latest("weights", newer_than=2, timeout=30)
                assert message.tensor["w"].min() == message.tensor["w"].max() == 3.0
        finally:
            for sub in subs:
                sub.close()


def test_four_subscriber_processes_get_the_last_16_mb_model(socket_ends: Ends) -> None:
    url, pub_options, sub_options = socket_ends
    with tb.Publisher(url, **pub_options) as pub:
        check_four_subscriber_processes(pub, pub.address, sub_options, 5)


def test_four_memory_subscribers_get_the_last_16_mb_model() -> None:
    with tb.Publisher("memory://model16") as pub:
        subs = [tb.Subscriber("memory://model16") for _ in range(4)]
        rng = np.random.default_rng(0)
        for version in range(1, 6):
            model = rng.integers(0, 255, 16 << 20, np.uint8)
            pub.publish("model", model, version=version)
        for sub in subs:
            message = sub.latest("model", newer_than=4, timeout=30)
            assert (message.version, crc_of(message.tensor)) == (5, crc_of(model))
            sub.close()


def _stalled_subscriber(address: str, options: dict[str, Any]) -> socket.socket:
    """A subscriber that joins and then never reads a byte (its socket buffers fill up)."""
    if address.startswith("unix://"):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(address[len("unix://") :])
    else:
        host, port = address.split("://")[1].rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    handshake_as_producer(sock, None, address)
    sock.sendall(SUBSCRIBE)
    answer = bytearray(len(PUBLISHING))
    assert recv_exact(sock, memoryview(answer)) == len(answer) and answer == PUBLISHING
    return sock


@pytest.mark.parametrize("scheme", ["tcp", "unix"])
def test_a_subscriber_that_never_reads_neither_slows_the_publisher_nor_grows_its_memory(
    scheme: str, tls: dict[str, str]
) -> None:
    url, _, _ = _ends(scheme, tls)
    frame_bytes = 4 << 20
    # (send_timeout_s: the stalled connection is not dropped for being stalled while the test runs)
    with tb.Publisher(url, max_retained_bytes=3 * frame_bytes, send_timeout_s=300) as pub:
        stalled = _stalled_subscriber(pub.address, {})
        reader = tb.Subscriber(pub.address)
        mailboxes = pub.side.mailbox_bytes  # type: ignore[attr-defined]
        try:
            wait_for(lambda: len(mailboxes()) == 2, 30, "both subscribers to have a mailbox")
            slowest = 0.0
            for version in range(1, 61):  # 240 MiB per key through a connection that takes a few KB
                for key in ("a", "b"):
                    started = time.monotonic()
                    pub.publish(key, np.full(frame_bytes // 8, version, np.int64), version=version)
                    slowest = max(slowest, time.monotonic() - started)
                # bounded: the stalled mailbox holds at most one version per key, retained within the bound
                assert max(mailboxes()) <= 2 * (frame_bytes + 4096)
                assert pub.retained.nbytes <= 3 * frame_bytes
            # the publisher never waited for the stalled subscriber: every publish returned while versions
            # still wait in its mailbox (one that waited would wait for good: the bound is only a backstop)
            assert max(mailboxes()) > 0
            assert slowest < 10.0
            assert reader.latest("a", newer_than=59, timeout=30).tensor[0] == 60
            assert reader.latest("b", newer_than=59, timeout=30).tensor[0] == 60
        finally:
            reader.close()
            stalled.close()


def test_a_never_reading_memory_subscriber_holds_one_version_per_key() -> None:
    with tb.Publisher("memory://idle") as pub, tb.Subscriber("memory://idle") as idle:
        for version in range(1, 101):
            pub.publish("a", np.full(1 << 16, version), version=version)
        assert idle.version("a") == 100
        assert len(idle._latest._latest) == 1  # nothing queued behind the newest


def test_a_publish_past_max_retained_bytes_is_refused_and_changes_nothing() -> None:
    with tb.Publisher("memory://bounded", max_retained_bytes=100_000) as pub:
        pub.publish("small", np.zeros(1000), version=1)
        with pytest.raises(tb.LimitExceeded, match="max_retained_bytes=100000"):
            pub.publish("big", np.zeros(20_000), version=1)
        assert pub.versions() == {"small": 1}
        pub.publish("big", np.zeros(5_000), version=1)  # the refused version may be sent again, smaller


def _free_address(scheme: str, tls: dict[str, str]) -> Ends:
    url, pub_options, sub_options = _ends(scheme, tls)
    if scheme in ("tcp", "tcps"):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            url = f"{scheme}://127.0.0.1:{probe.getsockname()[1]}"
    return url, pub_options, sub_options


@pytest.mark.parametrize("scheme", ["memory", "tcp", "unix", "tcps"])
def test_a_publisher_restart_and_a_reconnect_lose_no_newest_version(scheme: str, tls: dict[str, str]) -> None:
    url, pub_options, sub_options = _free_address(scheme, tls)
    with tb.Publisher(url, **pub_options) as pub:
        pub.publish("w", np.full(100, 3), version=3)
        sub = tb.Subscriber(pub.address, **sub_options)
        assert sub.latest("w", timeout=30).version == 3
    try:
        with tb.Publisher(url, **pub_options) as pub:  # a restart: the subscriber reconnects on its own
            pub.publish("w", np.full(100, 4), version=4)
            assert sub.latest("w", newer_than=3, timeout=30).tensor[0] == 4
        with tb.Publisher(url, **pub_options) as pub:  # a restart that begins its versions lower: ignored
            pub.publish("w", np.full(100, 1), version=1)
            pub.publish("x", np.full(100, 1), version=1)
            assert sub.latest("x", timeout=30).version == 1
            assert sub.latest("w", timeout=1).version == 4
            pub.publish("w", np.full(100, 5), version=5)
            assert sub.latest("w", newer_than=4, timeout=30).tensor[0] == 5
    finally:
        sub.close()


def test_signed_versions_reach_subscribers_with_the_key_only() -> None:
    with tb.Publisher("tcp://127.0.0.1:0", signing_key="k1") as pub:
        good = tb.Subscriber(pub.address, signing_key="k1")
        forged = tb.Subscriber(pub.address, signing_key="other")
        try:
            pub.publish("w", np.arange(4), version=1)
            assert good.latest("w", timeout=30).tensor.tolist() == [0, 1, 2, 3]
            with pytest.raises(tb.Timeout):
                forged.latest("w", timeout=1)
        finally:
            good.close()
            forged.close()


def test_a_wrong_auth_secret_is_an_error_at_the_subscriber() -> None:
    with tb.Publisher("tcp://127.0.0.1:0", auth_secret="s3cret") as pub:
        pub.publish("w", np.arange(4), version=1)
        with tb.Subscriber(pub.address, auth_secret="s3cret") as sub:
            assert sub.latest("w", timeout=30).version == 1
        with tb.Subscriber(pub.address, auth_secret="wrong") as sub, pytest.raises(tb.TransportError, match="refused"):
            sub.latest("w", timeout=30)


def test_iterating_yields_updates_in_publish_order_until_closed() -> None:
    with tb.Publisher("memory://order") as pub:
        sub = tb.Subscriber("memory://order")
        pub.publish("a", np.zeros(1), version=1)
        pub.publish("b", np.zeros(1), version=1)
        pub.publish("a", np.zeros(1), version=2)  # a moves behind b: its update is the newer
        got: list[tuple[str | None, int]] = []
        for message in sub:
            got.append((message.key, message.version))
            if len(got) == 2:
                sub.close()
        assert got == [("b", 1), ("a", 2)]


def test_a_subscriber_of_a_consumer_says_so_in_its_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="tensorbus.fanout.sockets"):
        with tb.Consumer("tcp://127.0.0.1:0") as consumer, tb.Subscriber(consumer.address):
            wait_for(lambda: "a Consumer, not a Publisher?" in caplog.text, 30, "the subscriber's error")


def test_a_connection_being_greeted_counts_and_must_subscribe_in_connect_timeout_s() -> None:
    from tensorbus.transports.stream import REFUSALS_WANTED

    with tb.Publisher("tcp://127.0.0.1:0", max_connections=1, connect_timeout_s=1.0) as pub:
        host, port = pub.address.split("://")[1].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as idle:
            handshake_as_producer(idle, None, pub.address)  # ...and never subscribes
            wait_for(lambda: pub.side.connections == 1, 10, "the greeting counted")  # (for max_connections=1)
            started = time.monotonic()
            while True:  # it keeps asking for refusals: the greeting still ends at its deadline
                try:
                    idle.sendall(REFUSALS_WANTED)
                except OSError:
                    break
                idle.settimeout(0.2)
                try:
                    if idle.recv(1) == b"":
                        break
                except TimeoutError:
                    pass
                except OSError:  # (closed with a request of ours unread: a reset, not an end of stream)
                    break
                assert time.monotonic() - started < 20, "the publisher kept a connection that never subscribed"
            wait_for(lambda: pub.side.connections == 0, 10, "the greeting given up")


def test_closing_a_subscriber_while_it_connects_ends_its_thread_and_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts, then never answers the handshake
        sub = tb.Subscriber(f"tcp://127.0.0.1:{server.getsockname()[1]}", connect_timeout_s=30)
        peer, _ = server.accept()
        with peer:
            sub.close()
            assert not sub.side._thread.is_alive()  # type: ignore[attr-defined]
            peer.settimeout(10)
            assert peer.recv(1) == b""  # the subscriber's end is closed


def test_a_frame_a_subscriber_refuses_is_skipped_and_later_versions_still_come(ends: Ends) -> None:
    url, pub_options, sub_options = ends
    with tb.Publisher(url, **pub_options) as pub:
        with tb.Subscriber(pub.address, max_payload_bytes=1000, **sub_options) as sub:
            pub.publish("small", np.zeros(10, np.float32), version=1)
            assert sub.latest("small", timeout=30).version == 1
            pub.publish("big", np.zeros(20_000, np.float32), version=1)  # (80 KB: over this subscriber's limit)
            pub.publish("small", np.ones(10, np.float32), version=2)
            newer = sub.latest("small", newer_than=1, timeout=30)
            assert (newer.version, newer.tensor.tolist()) == (2, [1.0] * 10)
            with pytest.raises(tb.Timeout):
                sub.latest("big", timeout=0.2)
            if not url.startswith("memory"):  # (read past, on the same connection)
                assert (sub.side.skipped, sub.side.connects) == (1, 1)  # type: ignore[attr-defined]


@pytest.mark.parametrize("scheme", ["tcp", "unix"])
def test_subscribers_that_went_away_free_their_places_before_the_next_publish(scheme: str, tls: dict[str, str]) -> None:
    url, pub_options, sub_options = _ends(scheme, tls)
    with tb.Publisher(url, max_connections=2, **pub_options) as pub:
        pub.publish("w", np.arange(4), version=1)
        for _ in range(2):
            with tb.Subscriber(pub.address, **sub_options) as gone:
                assert gone.latest("w", timeout=30).version == 1
        wait_for(lambda: pub.side.connections == 0, 10, "the closed subscribers' places freed")
        with tb.Subscriber(pub.address, **sub_options) as third:
            assert third.latest("w", timeout=30).version == 1


def test_a_subscriber_over_tcp_probes_a_quiet_publisher_with_keepalives() -> None:
    from tensorbus.fanout.sockets import KEEPALIVE_IDLE_S

    with tb.Publisher("tcp://127.0.0.1:0") as pub, tb.Subscriber(pub.address) as sub:
        pub.publish("w", np.arange(4), version=1)
        assert sub.latest("w", timeout=30).version == 1
        conn = sub.side._sock  # type: ignore[attr-defined]
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S


def test_a_fault_in_a_subscribers_receiving_thread_fails_its_receives(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorbus.fanout.api import Receiver

    def broken(self: Receiver, frame: Any) -> bool:
        raise RuntimeError("a fault of the receiving side's own")

    monkeypatch.setattr(Receiver, "__call__", broken)
    with tb.Publisher("tcp://127.0.0.1:0") as pub, tb.Subscriber(pub.address) as sub:
        pub.publish("w", np.arange(4), version=1)
        with pytest.raises(tb.TransportError, match="receiving failed"):
            sub.latest("w", timeout=30)  # (told, rather than left waiting)


def test_a_subscriber_that_cannot_connect_says_why_when_its_wait_ends() -> None:
    """A wrong port: the timeout says the connection was refused, not only that no version came."""
    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{free.getsockname()[1]}"
    with tb.Subscriber(url) as sub, pytest.raises(tb.Timeout, match=r"no version of 'w'.*not connected: .*refused"):
        sub.latest("w", timeout=2)


def test_a_closed_subscriber_or_publisher_refuses_every_use() -> None:
    """As a Consumer or Producer does after close (the README's `Closed`): a version held already is not handed
    out, and `with` on a closed one is refused."""
    with tb.Publisher("memory://closed-ends") as pub, tb.Subscriber("memory://closed-ends") as sub:
        pub.publish("w", np.arange(3), version=1)
        assert sub.latest("w", timeout=30).version == 1
    for call in (lambda: sub.latest("w", timeout=0), lambda: sub.version("w"), lambda: sub.next(timeout=0)):
        with pytest.raises(tb.Closed):
            call()
    for closed in (sub, pub):
        with pytest.raises(tb.Closed), closed:
            pass
