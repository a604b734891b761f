"""The fan-out's parts without a transport: retained frames and their bound, the subscriber's latest versions,
reading a version from a stored (possibly chunked) frame."""

from __future__ import annotations

import logging
import threading
import uuid

import numpy as np
import pytest

import tensorbus as tb
from tensorbus.codec.chunking import split
from tensorbus.codec.frame import decode
from tensorbus.fanout.latest import Latest
from tensorbus.fanout.retained import Published, Retained
from tensorbus.fanout.versions import VERSION_FIELD, Encoder, peek_version, versioned


def _published(key: str, version: int, nbytes: int) -> Published:
    return Published(key, version, [bytes(nbytes)], nbytes, ("p", version))


def test_retained_keeps_the_latest_of_each_key_in_publish_order_within_its_bound() -> None:
    retained = Retained(max_bytes=300)
    retained.keep(_published("a", 1, 100))
    retained.keep(_published("b", 1, 100))
    retained.keep(_published("a", 2, 150))  # replaces a's frame: 250 retained
    assert [(p.key, p.version) for p in retained.frames()] == [("b", 1), ("a", 2)]
    assert retained.nbytes == 250
    with pytest.raises(tb.LimitExceeded, match="max_retained_bytes=300"):
        retained.keep(_published("c", 1, 51))
    assert retained.nbytes == 250 and retained.versions() == {"a": 2, "b": 1}
    with pytest.raises(tb.ConfigError, match="not greater"):
        retained.keep(_published("a", 2, 1))


def test_learned_versions_bound_later_publishes_without_retaining_frames() -> None:
    retained = Retained(max_bytes=10)
    retained.learn("w", 7)
    retained.learn("w", 3)  # (records read out of order: the highest stands)
    with pytest.raises(tb.ConfigError, match="not greater than its last one, 7"):
        retained.check("w", 7)
    assert retained.frames() == []


def _message(key: str, version: int) -> tb.fanout.VersionedMessage:
    return tb.fanout.VersionedMessage(key, np.full(2, version), {}, None, "ndarray", 0, version)


def test_latest_keeps_the_newest_ignores_older_and_logs_that_once_per_key(caplog: pytest.LogCaptureFixture) -> None:
    latest = Latest("test")
    assert latest.offer(_message("w", 5))
    assert not latest.offer(_message("w", 5))  # the same version again (a reconnect): silently
    with caplog.at_level(logging.WARNING, logger="tensorbus.fanout.latest"):
        assert not latest.offer(_message("w", 3))
        assert not latest.offer(_message("w", 4))
    assert latest.ignored == 2 and len(caplog.records) == 1 and "ignored version 3" in caplog.text
    assert latest.latest("w", None, 0).version == 5
    with pytest.raises(tb.Timeout):
        latest.latest("w", 5, 0.01)


def test_next_gives_each_updated_key_once_at_its_newest_in_update_order() -> None:
    latest = Latest("test")
    for key, version in (("a", 1), ("b", 1), ("a", 2), ("a", 3)):
        latest.offer(_message(key, version))
    assert [(m.key, m.version) for m in (latest.next(0), latest.next(0))] == [("b", 1), ("a", 3)]
    with pytest.raises(tb.Timeout):
        latest.next(0.01)


def test_a_held_latest_answers_nothing_until_released() -> None:
    latest = Latest("test")
    latest.hold()
    latest.offer(_message("w", 1))
    with pytest.raises(tb.Timeout):
        latest.latest("w", None, 0.01)
    threading.Timer(0.05, latest.release).start()
    assert latest.latest("w", None, 30).version == 1


def test_a_closed_or_failed_latest_raises_in_waiting_calls() -> None:
    latest = Latest("test")
    latest.fail(tb.TransportError("refused"))
    with pytest.raises(tb.TransportError, match="refused"):
        latest.latest("w", None, 1)
    latest.close()
    with pytest.raises(tb.Closed):
        latest.next(1)


def test_the_version_is_read_back_from_a_whole_frame_and_from_the_first_chunk_only() -> None:
    encoder = Encoder(None, True, None)
    frame, message_id = encoder.encode("w", np.arange(100_000), 42, {"step": 1}, snapshot=True)
    assert peek_version(frame[0]) == ("w", 42)
    message = versioned(decode(frame[0]))
    assert (message.version, message.metadata) == (42, {"step": 1})  # the version field is taken out
    chunks = [b"".join(c) for c in split(frame, max_chunk_bytes=100_000, message_id=message_id, key="w")]
    assert len(chunks) > 2
    assert [peek_version(c) for c in chunks] == [("w", 42)] + [None] * (len(chunks) - 1)
    assert peek_version(b"not a frame") is None


def test_a_snapshot_is_not_changed_by_the_caller_and_metadata_cannot_claim_the_version() -> None:
    encoder = Encoder(None, True, None)
    array = np.zeros(1 << 18)
    frame, _ = encoder.encode("w", array, 1, None, snapshot=True)
    array += 1
    assert decode(frame[0]).tensor.max() == 0
    shared, _ = encoder.encode("w", array, 2, None, snapshot=False)  # zero-copy: the caller's memory
    array += 1  # (breaking the promise of snapshot=False: the frame no longer matches its checksum)
    with pytest.raises(tb.ChecksumMismatch):
        decode(b"".join(shared))
    with pytest.raises(tb.ConfigError, match=VERSION_FIELD):
        encoder.encode("w", array, 3, {VERSION_FIELD: 9}, snapshot=True)


def test_where_a_broker_keeps_the_frames_only_versions_are_tracked() -> None:
    retained = Retained(max_bytes=10, keep_frames=False)
    retained.keep(_published("a", 1, 100))  # past max_bytes, but nothing is kept here
    assert retained.frames() == [] and retained.nbytes == 0 and retained.versions() == {"a": 1}
    with pytest.raises(tb.ConfigError, match="not greater"):
        retained.keep(_published("a", 1, 1))


def test_a_version_the_transport_refused_is_not_kept_and_may_be_published_again() -> None:
    with tb.Publisher("memory://refused-once") as pub, tb.Subscriber("memory://refused-once") as sub:
        side_publish = pub.side.publish

        def failing(published: Published) -> None:
            raise tb.TransportError("the broker went away")  # (as a broker side's send may)

        pub.side.publish = failing  # type: ignore[method-assign]
        with pytest.raises(tb.TransportError):
            pub.publish("w", np.full(4, 1.0), version=1)
        assert pub.versions() == {} and pub.retained.frames() == []
        pub.side.publish = side_publish  # type: ignore[method-assign]
        pub.publish("w", np.full(4, 1.0), version=1)
        assert sub.latest("w", timeout=10).version == 1 and pub.versions() == {"w": 1}


def test_peek_version_skips_odd_chunk_headers_and_with_a_key_unsigned_or_forged_frames() -> None:
    from tensorbus.codec.frame import encode_raw

    odd = b"".join(encode_raw({"kind": "chunk", "chunk": {"index": 0}}, [b"x"], 1))  # "chunk" not a list
    assert peek_version(odd) is None
    key, other = b"k" * 32, b"o" * 32
    unsigned, _ = Encoder(None, True, None).encode("w", np.arange(10), 7, None, snapshot=True)
    signed, message_id = Encoder(None, True, key).encode("w", np.arange(100_000), 8, None, snapshot=True)
    assert peek_version(unsigned[0], key) is None and peek_version(unsigned[0]) == ("w", 7)
    assert peek_version(signed[0], other) is None and peek_version(signed[0], key) == ("w", 8)
    chunks = [
        b"".join(c) for c in split(signed, max_chunk_bytes=100_000, message_id=message_id, key="w", signing_key=key)
    ]
    assert peek_version(chunks[0], key) == ("w", 8)
    forged = [
        b"".join(c) for c in split(signed, max_chunk_bytes=100_000, message_id=message_id, key="w", signing_key=other)
    ]
    assert peek_version(forged[0], key) is None


def test_memory_names_are_forgotten_once_unused_and_reassembly_timeout_s_is_the_subscribers() -> None:
    from tensorbus.fanout import memory

    name = "forgotten-once-unused"
    sub = tb.Subscriber(f"memory://{name}", reassembly_timeout_s=0.5)
    assert sub._receiver._reassembler.timeout_s == 0.5
    with tb.Publisher(f"memory://{name}") as pub:
        pub.publish("w", np.zeros(4), version=1)
        assert sub.latest("w", timeout=10).version == 1
    assert name in memory._TOPICS  # (a subscriber still waits for the next publisher)
    sub.close()
    assert name not in memory._TOPICS
    with tb.Subscriber(f"memory://{name}") as late, tb.Publisher(f"memory://{name}") as pub:
        pub.publish("w", np.ones(4), version=1)  # a name used again works as a new one
        assert late.latest("w", timeout=10).tensor[0] == 1.0
    assert name not in memory._TOPICS


@pytest.mark.parametrize("key", [None, 3, b"w"])
def test_a_published_key_must_be_a_str(key: object) -> None:
    with tb.Publisher(f"memory://keys-{uuid.uuid4().hex[:8]}") as pub:
        with pytest.raises(tb.ConfigError, match="a published key must be a str"):
            pub.publish(key, np.arange(3), version=1)  # type: ignore[arg-type]
        assert pub.versions() == {}
