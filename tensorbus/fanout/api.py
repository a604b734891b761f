"""Publisher and Subscriber: versioned tensors from one publisher to many subscribers, the latest for late joiners.

The transport-independent half lives here (options, versions, signing, the retained frames, the
subscriber's latest versions); each URL scheme's half is a module of this package (`SIDES`).
"""

from __future__ import annotations

import importlib
import logging
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..api import _key_bytes
from ..codec.chunking import Reassembler
from ..codec.compression import check_codec
from ..codec.frame import Buffer, Limits
from ..codec.signing import frame_key
from ..codec.torch_bridge import check_like
from ..errors import Closed, ConfigError, brief
from ..options import build, defaults, finite_timeout, merge, redact
from ..transports import resolve_transport
from .latest import Latest
from .retained import Published, Retained
from .versions import Encoder, VersionedMessage, check_published_key, check_version, versioned

log = logging.getLogger(__name__)

#: each scheme's publishing and subscribing halves, imported when used
SIDES = {
    "memory": "tensorbus.fanout.memory",
    "tcp": "tensorbus.fanout.sockets",
    "tcps": "tensorbus.fanout.sockets",
    "unix": "tensorbus.fanout.sockets",
    "kafka": "tensorbus.fanout.kafka",
    "kafkas": "tensorbus.fanout.kafka",
    "amqp": "tensorbus.fanout.amqp",
    "amqps": "tensorbus.fanout.amqp",
}


@dataclass(frozen=True, kw_only=True)
class PublisherOptions:
    """A publisher's own options (its transport's are that transport's `Options`)."""

    #: the latest frames of all keys, kept for late joiners; a publish past it is refused
    max_retained_bytes: int = 1 << 30
    signing_key: bytes | str | None = None
    compression: str | None = None
    checksum: bool = True


@dataclass(frozen=True, kw_only=True)
class SubscriberOptions:
    """A subscriber's own options."""

    signing_key: bytes | str | None = None
    max_header_bytes: int = Limits.max_header_bytes
    max_payload_bytes: int = Limits.max_payload_bytes
    max_decompressed_bytes: int = Limits.max_decompressed_bytes
    max_reassembly_bytes: int = 1 << 31  # chunked versions (Kafka) part way received
    reassembly_timeout_s: float = 60.0  # ...dropped when not whole this long after their first chunk
    like: str = "numpy"


class PublishingSide(Protocol):
    """A scheme's publishing half: takes each published version to its subscribers, never waiting for one."""

    address: str

    def publish(self, published: Published) -> None: ...  # called under `Retained.lock`
    def close(self) -> None: ...


class SubscribingSide(Protocol):
    """A scheme's subscribing half: receives frames on a thread of its own and hands each to the `Receiver`."""

    def close(self) -> None: ...


def _open(
    url: str, own: type[Any], kwargs: dict[str, Any], role: str
) -> tuple[Any, urllib.parse.SplitResult, Any, Any]:
    """The scheme's module, the URL, the transport's options and the endpoint's own (each checked once)."""
    cls, parsed = resolve_transport(url)
    if parsed.scheme not in SIDES:
        raise ConfigError(f"{role} does not support {parsed.scheme}:// (known: {', '.join(sorted(SIDES))})")
    module = importlib.import_module(SIDES[parsed.scheme])
    known = {**defaults(own), **defaults(cls.Options)}
    options = merge(known, url=parsed, kwargs=kwargs, where=f"{role} {parsed.scheme}://")
    return module, parsed._replace(query=""), build(cls.Options, options), build(own, options)


class Receiver:
    """Where a subscribing side's frames go: checked, reassembled if chunked, kept if newer (`Latest.offer`)."""

    def __init__(self, latest: Latest, opts: SubscriberOptions, signing_key: bytes | None) -> None:
        limits = Limits(
            max_header_bytes=opts.max_header_bytes,
            max_payload_bytes=opts.max_payload_bytes,
            max_decompressed_bytes=opts.max_decompressed_bytes,
            max_frame_age_s=None,  # a retained version may be old: versions, not clocks, stop replays
        )
        self.latest, self.limits = latest, limits
        self._lock = threading.Lock()
        self._reassembler = Reassembler(
            max_bytes=opts.max_reassembly_bytes,
            timeout_s=opts.reassembly_timeout_s,
            limits=limits,
            signing_key=signing_key,
            like=check_like(opts.like),
        )

    def __call__(self, frame: Buffer) -> bool:
        """Take one frame (whole or a chunk) the subscriber owns; whether it completed a newer version.

        Raises a `CodecError` for a frame that fails its checks (the side decides what that costs the connection).
        """
        with self._lock:
            message = self._reassembler.feed(frame, owned=True)
        return message is not None and self.latest.offer(versioned(message))


class Publisher:
    """Publishes versions of keyed tensors to every subscriber of `url`; `publish` never waits for a subscriber."""

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        module, parsed, transport_opts, opts = _open(url, PublisherOptions, options, "Publisher")
        if opts.compression is not None:
            check_codec(opts.compression)
        secret = _key_bytes(opts.signing_key)
        signing_key = None if secret is None else frame_key(secret, module.endpoint(parsed))
        self._encoder = Encoder(opts.compression, opts.checksum, signing_key)
        self.retained = Retained(opts.max_retained_bytes, keep_frames=getattr(module, "KEEPS_FRAMES", True))
        self._closed = False
        # (a side that chunks versions signs the chunks with it; every side gets it, whether it chunks or not)
        self.side: PublishingSide = module.PublishingSide(parsed, transport_opts, self.retained, signing_key)

    @property
    def address(self) -> str:
        """The URL subscribers should use (for tcp://host:0, with the port actually bound)."""
        return self.side.address

    def publish(
        self,
        key: str,
        tensor: Any,
        *,
        version: int,
        metadata: dict[str, Any] | None = None,
        snapshot: bool = True,
    ) -> None:
        """Publish `version` of `key` (greater than its last one, else `ConfigError`).

        `snapshot=False`: no copy of the arrays is taken; the caller promises not to change them while
        any subscriber may still be sent this version (until a newer one of the key is published).
        """
        check_published_key(key)
        check_version(version)
        with self.retained.lock:
            if self._closed:
                raise Closed("publish on a closed Publisher")
            self.retained.check(key, version)
            # (a broker side copies each record's bytes before `publish` returns: that is the snapshot there)
            copy = snapshot and self.retained.keep_frames
            frame, message_id = self._encoder.encode(key, tensor, version, metadata, copy)
            published = Published(key, version, frame, sum(memoryview(b).nbytes for b in frame), message_id)
            self.retained.check_room(published)
            self.side.publish(published)  # (a version the transport did not take is not kept: it may be tried again)
            self.retained.keep(published)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the broker holds every version published so far (a subscriber joining then finds them);
        sockets and memory hand versions to subscribers directly: nothing to wait for."""
        flush = getattr(self.side, "flush", None)
        if flush is not None:
            flush(finite_timeout(timeout))

    def versions(self) -> dict[str, int]:
        """The last version of each key (published here, or learned from the broker when this publisher started)."""
        with self.retained.lock:
            return self.retained.versions()

    def close(self) -> None:
        """Stop publishing: subscribers keep what they have and wait for a publisher to come back."""
        with self.retained.lock:
            if self._closed:
                return
            self._closed = True
        self.side.close()

    def __enter__(self) -> Publisher:
        if self._closed:
            raise Closed("`with` on a closed Publisher")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscriber:
    """Follows the publisher at `url`: the newest version of each key, from what the publisher retains on."""

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        module, parsed, transport_opts, opts = _open(url, SubscriberOptions, options, "Subscriber")
        secret = _key_bytes(opts.signing_key)
        key = None if secret is None else frame_key(secret, module.endpoint(parsed))
        self._latest = Latest(redact(url))
        self._receiver = Receiver(self._latest, opts, key)
        self._closed = False
        self.side: SubscribingSide = module.SubscribingSide(parsed, transport_opts, self._receiver)

    def latest(self, key: str, *, newer_than: int | None = None, timeout: float | None = None) -> VersionedMessage:
        """The newest version received of `key`, waiting up to `timeout` for one (newer than `newer_than`, if given)."""
        if newer_than is not None and (isinstance(newer_than, bool) or not isinstance(newer_than, int)):
            raise ConfigError(f"newer_than must be a version (an int) or None, got {brief(newer_than)}")
        return self._latest.latest(key, newer_than, finite_timeout(timeout))

    def version(self, key: str) -> int | None:
        """The newest version received of `key`, without waiting (None: none yet)."""
        return self._latest.version(key)

    def next(self, timeout: float | None = None) -> VersionedMessage:
        """The next update: keys in the order they were updated, each at its newest version (older ones skipped)."""
        return self._latest.next(finite_timeout(timeout))

    def __iter__(self) -> Iterator[VersionedMessage]:
        """Yield updates (see `next`) until the subscriber is closed."""
        while True:
            try:
                yield self._latest.next()
            except Closed:
                return

    def close(self) -> None:
        """Stop receiving; waiting calls raise `Closed`."""
        if not self._closed:
            self._closed = True
            self._latest.close()
            self.side.close()

    def __enter__(self) -> Subscriber:
        if self._closed:
            raise Closed("`with` on a closed Subscriber")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
