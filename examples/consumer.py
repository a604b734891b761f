"""The receiving half of the README's example: listen, and print each tensor the producer sends.

Start it first, then `examples/producer.py` in another shell (or the other way round: a producer
retries a consumer that is not listening yet, for `reconnect_timeout_s`):

    python examples/consumer.py [URL]      # URL: tcp://127.0.0.1:5555 unless given
"""

from __future__ import annotations

import sys

import tensorbus as tb

URL = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5555"

with tb.Consumer(URL) as consumer:  # the consumer owns the endpoint (it listens) and its rendezvous table
    print(f"listening on {consumer.address}", flush=True)
    weights = consumer.recv("layer1/w", timeout=20)  # waits for its key, whether it was sent before or after
    print(f"layer1/w: {weights.dtype} {weights.shape}, sum {weights.sum():g}")
    message = consumer.recv_message("params", timeout=10)  # the whole message: .key .tensor .metadata .message_id
    print(f"params: a bundle of {sorted(message.tensor)}, metadata {message.metadata}")
    grad = consumer.recv("grad", timeout=10)  # a tb.SparseTensor (COO)
    print(f"grad: sparse {grad.dense_shape}, {len(grad.values)} values, dense sum {grad.to_dense().sum():g}")
    for message in consumer:  # the rest in arrival order, whatever their keys (work-queue use)
        print(f"{message.key}: {message.tensor.tolist()}")
        if message.key == "done":
            break
