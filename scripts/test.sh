#!/usr/bin/env bash
# Run the whole test suite from nothing: a venv with every extra, the brokers (Docker Compose if an
# engine answers, native otherwise), ruff (lint and format), mypy on the package, pytest, then the unit
# and socket tests again on the Python paths alone (TENSORBUS_NATIVE=0); the brokers are stopped again
# on the way out.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[rabbitmq,kafka,compression,bench,cli,dev,torch]"

if [ "${TENSORBUS_BROKERS:-auto}" != "external" ] && [ -f scripts/brokers.sh ]; then
  if docker info >/dev/null 2>&1; then
    docker compose up -d --wait
    trap 'docker compose down' EXIT
  else
    trap 'bash scripts/brokers.sh cluster down; bash scripts/brokers.sh down' EXIT
    bash scripts/brokers.sh up
    # the three-node clusters of the node-loss tests (marked `cluster`), beside the single nodes
    TENSORBUS_PYTHON=.venv/bin/python bash scripts/brokers.sh cluster up
  fi
fi

.venv/bin/ruff check .
.venv/bin/ruff format --check tensorbus tests benchmarks examples setup.py
.venv/bin/python -m mypy tensorbus
.venv/bin/python -m pytest "$@"
# the Python codec and socket paths alone, as where the C extensions cannot be built (brokers aside:
# their transports use only the codec, and the unit tests cover its Python path)
TENSORBUS_NATIVE=0 .venv/bin/python -m pytest -q tests/unit tests/integration -m "not broker" \
  --ignore=tests/unit/test_native.py --ignore=tests/unit/test_crc_folding.py --ignore=tests/unit/test_native_stream.py --ignore=tests/unit/test_lane.py --ignore=tests/integration/test_socket_send.py \
  --deselect tests/integration/test_benchmarks.py::test_the_native_speedup_benchmark_runs_both_ways \
  --deselect tests/integration/test_socket.py::test_plain_connections_are_read_by_the_c_reader_and_tls_ones_in_python \
  --deselect tests/integration/test_socket.py::test_a_ctrl_c_just_after_the_c_delivery_loses_no_tensor_and_delivers_it_once \
  --deselect tests/integration/test_socket_reading.py::test_with_one_producer_a_waiting_recv_busy_polls_by_reading_the_connection
