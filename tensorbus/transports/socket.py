"""`tcp://HOST:PORT`, `tcps://` (TLS) and `unix:///path`: frames straight over a stream socket, no broker.

The consumer listens (127.0.0.1 unless told otherwise) and producers connect, many per consumer.
A frame goes out as one scatter-gather `sendmsg` of header and array memory, and comes in with
`recv_into` a buffer sized from the frame's prefix, so the tensor bytes are never copied twice.
The consumer acknowledges a frame as received (the producer's credit, and `flush`) and as taken
(ledger.py: the application has its tensor); a producer keeps the frames not taken (by reference:
do not modify a sent array before `flush`) and sends them again after reconnecting to a restarted
consumer or its successor. Duplicates are dropped above, by message id.

Each side is an object of its own, with only its side's interface (`base.ProducerSide`,
`base.ConsumerSide`): `SocketProducer` (socket_producer.py, its acks in socket_acks.py) and
`SocketConsumer` (socket_consumer.py), both a `SocketEndpoint` (the address, TLS and secret:
socket_endpoint.py). See `stream.py` for the handshake and the records, `listener.py` for how the consumer
accepts producers, `reactor.py` for how it reads them.
"""

from __future__ import annotations

from .socket_acks import READ_ACKS_EVERY
from .socket_consumer import SocketConsumer
from .socket_endpoint import SocketEndpoint
from .socket_producer import PROBE_AFTER_S, SocketProducer

__all__ = ["PROBE_AFTER_S", "READ_ACKS_EVERY", "SocketConsumer", "SocketEndpoint", "SocketProducer"]
