"""tensorbus for asyncio: `Consumer` and `Producer` with the blocking API's URLs, options, frames and
errors, whose waits are awaited on the event loop instead of blocking it.

    import tensorbus.aio as tba

    async with tba.Consumer("tcp://127.0.0.1:5555") as consumer:
        weights = await consumer.recv("layer1/w", timeout=30)
"""

from __future__ import annotations

from .consumer import Consumer
from .producer import Producer

__all__ = ["Consumer", "Producer"]
