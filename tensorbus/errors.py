"""The tensorbus exception tree: one root, a few branches, behaviour on the class."""

from __future__ import annotations

import reprlib
from typing import Any

_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 80, 80


def brief(value: object) -> str:
    """A short repr of a received value for an error message: bounded in length and depth (a value
    nested a thousand levels deep must not overflow the stack while it is being refused)."""
    return _BRIEF.repr(value)


class TensorBusError(Exception):
    """Root of every error tensorbus raises on purpose."""

    retriable = False


# -- codec -------------------------------------------------------------------------------------


class CodecError(TensorBusError, ValueError):
    """A frame, header or object that the codec refuses."""

    #: the `reason` a consumer's metrics count a frame refused with this error under
    reason_label = "malformed"


class TruncatedFrame(CodecError):
    """The buffer ends before the frame it claims to hold."""


class BadMagic(CodecError):
    """The buffer does not start with the tensorbus magic bytes."""


class UnsupportedVersion(CodecError):
    """The frame was written by a format version this build cannot read."""


class ChecksumMismatch(CodecError):
    """The CRC32C stored in the frame does not match its bytes."""

    reason_label = "checksum"


class SignatureError(CodecError):
    """A frame is unsigned, or its HMAC does not match, where a signature is required."""

    reason_label = "signature"


class Replayed(SignatureError):
    """A signed frame's producer timestamp is further from the consumer's clock than `max_frame_age_s`."""

    reason_label = "replay"


class LimitExceeded(CodecError):
    """A size, count or memory limit set for untrusted input would be exceeded."""

    reason_label = "limit"


class UnsupportedDtype(CodecError, TypeError):
    """A dtype that cannot travel without pickling (object, structured, void) or is unknown."""


class MalformedHeader(CodecError):
    """The msgpack header is not valid msgpack, or does not describe a consistent tensor."""


class InvalidTensor(CodecError):
    """What `send` was given cannot make a frame any receiver takes: a sparse tensor whose parts
    disagree, metadata that is not a map, a masked array, an unsupported leaf of a structure."""


# -- configuration -----------------------------------------------------------------------------


class ConfigError(TensorBusError, ValueError):
    """An unknown option, a bad value, or a URL scheme nobody registered."""


# -- transport and rendezvous ------------------------------------------------------------------


class TransportError(TensorBusError):
    """The connection to a peer or broker failed; retrying may succeed."""

    retriable = True


class Rejected(TransportError):
    """The consumer refused a tensor this producer sent (over one of its limits, a bad signature, a stale
    incarnation...) and said so (stream sockets, memory://, shm://). Raised by the producer's next `send`, which
    then sends nothing, or its `flush`; once per refused message. The message is not sent again: it would be
    refused again.
    """

    retriable = False

    def __init__(self, text: str, *, key: str | None = None, message_id: Any = None, reason: str = "") -> None:
        super().__init__(text)
        self.key, self.message_id, self.reason = key, message_id, reason

    def __reduce__(self) -> tuple[Any, ...]:
        return _rejected, (self.args, self.key, self.message_id, self.reason)


def _rejected(args: tuple[Any, ...], key: str | None, message_id: Any, reason: str) -> Rejected:
    """A `Rejected` again (unpickled: its fields are keyword-only)."""
    return Rejected(*args, key=key, message_id=message_id, reason=reason)


class AuthRefused(TransportError):
    """A socket consumer refused this producer's `auth_secret` (or the producer has none and one is required);
    retrying with the same secret cannot succeed."""

    retriable = False


class Timeout(TensorBusError, TimeoutError):
    """An operation did not finish within its deadline."""

    retriable = True


class Aborted(TensorBusError):
    """The rendezvous was aborted; every pending and later operation fails with the reason."""


class Cancelled(TensorBusError):
    """A `recv_async` was cancelled through its handle before a message arrived."""


class StaleIncarnation(TensorBusError):
    """A key names an older incarnation of a source than one already seen (a restarted producer)."""

    reason_label = "stale"


class Closed(TensorBusError):
    """The producer or consumer was used after `close()`."""


class CallbackInterrupted(KeyboardInterrupt):
    """A Ctrl-C landed in a `recv_async` callback that ran on the application's main thread (one
    reading for its own `recv`). It is the application's, so it propagates; the tensor counts as
    delivered (the callback had it), so it is acknowledged and never delivered again."""
