#!/usr/bin/env bash
# Run the whole test suite from nothing: a venv with every extra (and the checkout's bytecode), the
# brokers started natively (scripts/brokers.sh), ruff (lint and format), mypy on the package, pytest,
# then the unit and socket tests again on the Python paths alone (TENSORBUS_NATIVE=0); where Compose's
# tests follow, the native brokers are stopped before that pass, which needs none, and the broker
# integration tests run once more against Docker Compose's brokers (on confluent-kafka only its behaviour suite and
# test_kafka.py: below; scripts/test-compose.sh, whose
# engine and images are prepared in the background meanwhile, and whose brokers start during the pass
# of the Python paths; TENSORBUS_COMPOSE=0 leaves that out). The heartbeat tests (a 1 ms beat in an event
# loop while tensors cross it, held to 50 ms) that need no broker run last, on both paths, once the brokers
# (and Docker's engine) this script started are stopped (a `-k` of your own among the arguments replaces the
# one that leaves them out of the main pass). Each part says how long it took, each pytest pass which tests
# took longest.
set -euo pipefail
cd "$(dirname "$0")/.."
took() { echo "[test.sh] $1: $((SECONDS - t0))s" >&2; t0=$SECONDS; }
t0=$SECONDS

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[rabbitmq,kafka,kafka-fast,compression,bench,cli,dev,torch,metrics,tracing,aio]"
# the bytecode of the checkout, once: with PYTHONDONTWRITEBYTECODE set, every process the tests start (CLI
# runs, spawned producers, consumers and bench workers) would compile tensorbus again (~0.1 s each)
.venv/bin/python -m compileall -q -j 0 tensorbus tests benchmarks examples \
  || echo "[test.sh] compileall: some files did not compile (ruff and pytest below say which)" >&2

took "venv"
native=0 compose=0 prep=0 up=0 compose_up=0 engine_ours=0
not_heartbeat="not never_blocked"
[ "${TENSORBUS_BROKERS:-auto}" != "external" ] && native=1
((native)) && [ "${TENSORBUS_COMPOSE:-1}" != 0 ] && compose=1
native_down() { bash scripts/brokers.sh cluster down; bash scripts/brokers.sh down; }
cleanup() {  # (errexit is off here: one failing step must not skip the others)
  set +e
  if ((prep)); then kill -- -"$prep" 2>/dev/null; fi
  if ((up)); then kill -- -"$up" 2>/dev/null; wait "$up"; fi   # (its own process group: compose too)
  if ((compose_up)); then  # (a pass failed before Compose's tests ran)
    tail -n 20 .brokers/compose-up.log >&2
    bash scripts/test-compose.sh --down >/dev/null 2>&1
  fi
  if ((native)); then native_down; fi
  if ((engine_ours)); then bash scripts/docker.sh down; fi
  return 0
}
trap cleanup EXIT
if ((native)); then
  bash scripts/brokers.sh up
  # the three-node clusters of the node-loss tests (marked `cluster`), beside the single nodes
  TENSORBUS_PYTHON=.venv/bin/python bash scripts/brokers.sh cluster up
fi
took "native brokers up"
if ((compose)); then
  # The Docker engine, Compose and the images take many minutes on a fresh machine: made ready at the
  # lowest CPU and I/O priority while the native passes run, and waited for before the compose pass.
  timeout 20 docker info >/dev/null 2>&1 || engine_ours=1   # (an engine found running is left alone)
  mkdir -p .brokers
  setsid nice -n 19 ionice -c 3 bash scripts/test-compose.sh --prepare >.brokers/compose-prepare.log 2>&1 &
  prep=$!
fi

.venv/bin/ruff check .
.venv/bin/ruff format --check tensorbus tests benchmarks examples setup.py
.venv/bin/python -m mypy tensorbus
# say in the log what the folding-CRC tests (tests/unit/test_crc_folding.py) skip for on a CPU without it
.venv/bin/python -c "from tensorbus.codec import native; m = native.load('tensorbus.codec._crc'); print('[test.sh] folding CRC32C:', 'used (AVX2 + VPCLMULQDQ)' if m and m.ACCELERATED else 'this CPU lacks AVX2 + VPCLMULQDQ: its tests skip, and frames are checksummed (and tested) with the crc32c package')"
# (the slowest 30 named: where the run's time goes; the heartbeat tests but those through brokers run last)
.venv/bin/python -m pytest --durations=30 -k "$not_heartbeat or broker" "$@"
took "ruff, mypy, pytest"
prepared=0
if ((compose)); then  # Compose's brokers start while the next pass, which needs none, runs
  native_down   # the compose brokers take the same ports
  native=0
  wait "$prep" && prepared=1   # (a failure is reported after the next pass, which runs all the same)
  prep=0
  grep '^\[compose\]' .brokers/compose-prepare.log >&2 || true
  took "stopping the native brokers, waiting for Docker's preparation"
  if ((prepared)); then
    compose_up=1
    setsid bash scripts/test-compose.sh --up >.brokers/compose-up.log 2>&1 &
    up=$!
  fi
fi
# the Python codec and socket paths alone, as where the C extensions cannot be built (brokers aside:
# their transports use only the codec, and the unit tests cover its Python path). Not again here: the
# tests of the layers above the API (the CLI, the README's examples, the bench's harness and scripts,
# the API's signatures as mypy sees them), which run in the pass above and reach the Python paths only
# through the API the tests here call directly.
python_paths=(env TENSORBUS_NATIVE=0 .venv/bin/python -m pytest -q -m "not broker")
"${python_paths[@]}" --durations=15 tests/unit tests/integration -k "$not_heartbeat" \
  --ignore=tests/integration/test_cli.py --ignore=tests/integration/test_fanout_cli.py \
  --ignore=tests/integration/test_readme.py --ignore=tests/integration/test_benchmarks.py \
  --ignore=tests/unit/test_bench.py --ignore=tests/unit/test_bench_metrics.py --deselect tests/unit/test_api_signature.py::test_mypy_sees_the_option_types \
  --ignore=tests/unit/test_native.py --ignore=tests/unit/test_crc_folding.py --ignore=tests/unit/test_native_stream.py --ignore=tests/unit/test_fast_delivery.py --ignore=tests/integration/test_socket_send.py \
  --deselect tests/integration/test_socket.py::test_plain_connections_are_read_by_the_c_reader_and_tls_ones_in_python \
  --deselect tests/integration/test_socket.py::test_a_ctrl_c_just_after_the_c_delivery_loses_no_tensor_and_delivers_it_once \
  --deselect tests/integration/test_socket_reading.py::test_with_one_producer_a_waiting_recv_busy_polls_by_reading_the_connection
took "the pass of the Python paths"

if ((compose && prepared)); then
  status=0
  wait "$up" || status=$?
  up=0
  cat .brokers/compose-up.log >&2
  ((status == 0)) || { echo "[test.sh] starting Compose's brokers failed (log above)" >&2; exit 1; }
  took "waiting for Compose's brokers"
  compose_up=0   # (`--tests` takes them down, whatever the tests do)
  # Every broker test on kafka-python, and on confluent-kafka the behaviour suite and test_kafka.py: how a broker
  # was started does not change what a client does with it, and the native pass ran every test on both clients.
  # The rest of confluent's cases against Compose's brokers (the node-loss ones among them: ~3.5 of the pass's ~16
  # minutes) run by hand: `bash scripts/test-compose.sh` (docs/TESTING.md).
  bash scripts/test-compose.sh --tests -k "not confluent or test_behaviour or test_kafka.py"
  took "compose pass"
fi
# the engine this script started stops before the heartbeat tests, which want a machine with nothing else running
if ((engine_ours)); then
  bash scripts/docker.sh down || echo "[test.sh] stopping Docker's engine failed: the heartbeat tests run beside it" >&2
  engine_ours=0
  took "stopping Docker's engine"
fi

# The heartbeat tests that need no broker, on the C paths and on the Python paths, the brokers stopped:
# a beat waits for the interpreter lock whenever the kernel keeps the thread holding it from a CPU, and
# brokers starting or settling beside them made beats 50-70 ms late (docs/TESTING.md).
if ((native)); then native_down; native=0; fi
.venv/bin/python -m pytest -q -m "not broker" tests/integration/test_aio.py -k never_blocked
"${python_paths[@]}" tests/integration/test_aio.py -k never_blocked
took "the heartbeat tests, C and Python paths"
if ((compose && !prepared)); then
  tail -n 40 .brokers/compose-prepare.log
  echo "[test.sh] preparing Docker failed (log above)" >&2
  exit 1
fi
