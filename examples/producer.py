"""The sending half of the README's example: send a few tensors to `examples/consumer.py`.

python examples/producer.py [URL]      # URL: tcp://127.0.0.1:5555 unless given
"""

from __future__ import annotations

import sys

import numpy as np

import tensorbus as tb

URL = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5555"

# (compression="lz4" or "zstd" would compress each frame: pip install 'tensorbus[compression]')
with tb.Producer(URL) as producer:
    producer.send("layer1/w", np.ones((1024, 1024), np.float32), metadata={"step": 7})  # never waits for a receiver
    producer.send("params", {"w": np.zeros((3, 3)), "b": np.zeros(3)}, metadata={"step": 7})  # a bundle: one frame
    indices, values = np.array([[0, 1], [2, 3]]), np.array([0.5, -1.0])  # COO: int64 indices, one row per value
    producer.send("grad", tb.SparseTensor(indices, values, dense_shape=(4, 4)))
    producer.send("done", np.arange(3))
    producer.flush(timeout=20)  # until the consumer has acknowledged them all
    print("sent layer1/w, params, grad and done")
