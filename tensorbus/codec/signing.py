"""What a signed frame is bound to: an endpoint, a consumer's incarnation and a time (docs/FORMAT.md, Signing).

A producer and a consumer sharing `signing_key` K do not sign frames with K itself but with a key
derived for the endpoint (and, on sockets, for the one run of the consumer that the producer is
connected to): a frame captured on one endpoint, or before a consumer restarted, carries a MAC no
other endpoint or run will accept. Each signed message also carries the producer's clock (`ts`),
and a consumer refuses those more than `max_frame_age_s` away from its own.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Callable
from typing import Any

from ..errors import Replayed, SignatureError, brief

_CONTEXT = b"tensorbus-frame-key-v2"
#: the header field that carries the producer's clock in a signed message
TIMESTAMP = "ts"


def frame_key(key: bytes, endpoint: str, incarnation: bytes = b"") -> bytes:
    """The key frames for `endpoint` (and the consumer run `incarnation`, on sockets) are signed with."""
    material = _CONTEXT + b"\0" + endpoint.encode() + b"\0" + incarnation
    return hmac.new(key, material, hashlib.sha256).digest()


def resign(frame: list[Any], key: bytes) -> None:
    """Replace a signed frame's MAC (its last buffer) with one made with `key` (e.g. for a new consumer run)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in frame[:-1]:
        mac.update(part)
    frame[-1] = mac.digest()


def check_age(header: dict[str, Any], max_age_s: float | None, clock: Callable[[], float] = time.time) -> None:
    """Refuse a signed message whose `ts` is missing, or more than `max_age_s` from this clock (either way)."""
    if max_age_s is None:
        return
    stamp = header.get(TIMESTAMP)
    if type(stamp) is not float or not math.isfinite(stamp):
        raise SignatureError(f"signed message has no valid timestamp ({TIMESTAMP!r}: {brief(stamp)})")
    age = clock() - stamp
    if abs(age) > max_age_s:
        when = f"{age:.0f} s old" if age > 0 else f"{-age:.0f} s in the future"
        raise Replayed(f"signed message is {when}; max_frame_age_s={max_age_s:g} (a replay, or clocks apart)")
