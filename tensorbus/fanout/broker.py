"""What the broker publishing sides (amqp://, kafka://) share: the transport they publish through,
chunked past `max_frame_bytes` and signed chunk by chunk; its `flush` and `close` are theirs."""

from __future__ import annotations

from collections.abc import Callable

from ..codec.chunking import split
from ..codec.frame import Buffer
from ..transports.base import Transport
from .retained import Published, Retained
from .versions import peek_version


class BrokerPublishingSide:
    """A publishing side that hands each version to a broker transport; the broker keeps it for late joiners."""

    def __init__(self, transport: Transport, max_frame_bytes: int | None, signing_key: bytes | None) -> None:
        self._transport = transport
        self.address = transport.address
        self._signing_key = signing_key  # signs each chunk: a subscriber with a key takes only signed ones
        self._max_record = max_frame_bytes or 1 << 62

    @staticmethod
    def learner(retained: Retained, signing_key: bytes | None) -> Callable[[bytes], None]:
        """What takes each frame read back from the broker at start: its version, learned by `retained`."""

        def learn(value: bytes) -> None:
            found = peek_version(value, signing_key)
            if found is not None:
                retained.learn(*found)

        return learn

    def chunks(self, published: Published) -> list[list[Buffer]]:
        """The version's frame, split into records of at most `max_frame_bytes`, each signed."""
        return split(
            published.frame,
            max_chunk_bytes=self._max_record,
            message_id=published.message_id,
            key=published.key,
            signing_key=self._signing_key,
        )

    def flush(self, timeout: float | None) -> None:
        """Wait until the broker holds every version sent so far."""
        self._transport.flush(timeout)

    def close(self) -> None:
        self._transport.close()
