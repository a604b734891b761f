"""The README's monitoring example: a consumer and a producer with Prometheus metrics on, and the
exposition they serve, as Prometheus would scrape it (needs `pip install 'tensorbus[metrics]'`):

    python examples/monitoring.py [URL]      # URL: tcp://127.0.0.1:5555 unless given
"""

from __future__ import annotations

import sys
import urllib.request

import numpy as np

import tensorbus as tb

URL = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5555"

port = tb.serve_metrics(0)  # /metrics on 127.0.0.1, any free port (a Prometheus job would name one)
with tb.Consumer(URL, metrics=True) as consumer, tb.Producer(consumer.address, metrics=True) as producer:
    for step in range(3):
        producer.send("layer1/w", np.full((32, 32), step, np.float32))
        consumer.recv("layer1/w", timeout=20)
    producer.flush(20)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as response:
        exposition = response.read().decode()
print("\n".join(line for line in exposition.splitlines() if line.startswith(("tensorbus_sent", "tensorbus_received"))))
