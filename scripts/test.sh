#!/usr/bin/env bash
# Run the whole test suite from nothing: a venv with every extra, the brokers started natively
# (scripts/brokers.sh), ruff (lint and format), mypy on the package, pytest, then the unit and socket
# tests again on the Python paths alone (TENSORBUS_NATIVE=0); the native brokers are stopped again, and
# the broker and CLI integration tests run once more against Docker Compose's brokers
# (scripts/test-compose.sh; TENSORBUS_COMPOSE=0 leaves that out). Each part says how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
took() { echo "[test.sh] $1: $((SECONDS - t0))s" >&2; t0=$SECONDS; }
t0=$SECONDS

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[rabbitmq,kafka,kafka-fast,compression,bench,cli,dev,torch,metrics,tracing,aio]"

took "venv"
native_down() { bash scripts/brokers.sh cluster down; bash scripts/brokers.sh down; }
if [ "${TENSORBUS_BROKERS:-auto}" != "external" ]; then
  trap native_down EXIT
  bash scripts/brokers.sh up
  # the three-node clusters of the node-loss tests (marked `cluster`), beside the single nodes
  TENSORBUS_PYTHON=.venv/bin/python bash scripts/brokers.sh cluster up
fi
took "native brokers up"

.venv/bin/ruff check .
.venv/bin/ruff format --check tensorbus tests benchmarks examples setup.py
.venv/bin/python -m mypy tensorbus
# say in the log what the folding-CRC tests (tests/unit/test_crc_folding.py) skip for on a CPU without it
.venv/bin/python -c "from tensorbus.codec import native; m = native.load('tensorbus.codec._crc'); print('[test.sh] folding CRC32C:', 'used (AVX2 + VPCLMULQDQ)' if m and m.ACCELERATED else 'this CPU lacks AVX2 + VPCLMULQDQ: its tests skip, and frames are checksummed (and tested) with the crc32c package')"
.venv/bin/python -m pytest "$@"
# the Python codec and socket paths alone, as where the C extensions cannot be built (brokers aside:
# their transports use only the codec, and the unit tests cover its Python path)
TENSORBUS_NATIVE=0 .venv/bin/python -m pytest -q tests/unit tests/integration -m "not broker" \
  --ignore=tests/unit/test_native.py --ignore=tests/unit/test_crc_folding.py --ignore=tests/unit/test_native_stream.py --ignore=tests/unit/test_fast_delivery.py --ignore=tests/integration/test_socket_send.py \
  --deselect tests/integration/test_benchmarks.py::test_the_native_speedup_benchmark_runs_both_ways \
  --deselect tests/integration/test_socket.py::test_plain_connections_are_read_by_the_c_reader_and_tls_ones_in_python \
  --deselect tests/integration/test_socket.py::test_a_ctrl_c_just_after_the_c_delivery_loses_no_tensor_and_delivers_it_once \
  --deselect tests/integration/test_socket_reading.py::test_with_one_producer_a_waiting_recv_busy_polls_by_reading_the_connection
took "native pass"

if [ "${TENSORBUS_BROKERS:-auto}" != "external" ] && [ "${TENSORBUS_COMPOSE:-1}" != 0 ]; then
  native_down   # the compose brokers take the same ports
  trap - EXIT
  bash scripts/test-compose.sh
  took "compose pass"
fi
