#!/usr/bin/env bash
# The broker integration tests again, against brokers started by Docker Compose
# (docker-compose.yml): installs the engine and Compose if missing (scripts/docker.sh), starts dockerd
# when no engine answers and stops it again, builds the images (cached by the engine between runs),
# `docker compose up -d --wait` (with the cluster profile once the cluster launcher is there), runs the
# tests with the same environment variables as natively, then `docker compose down -v`.
# The host ports must be free: stop the native brokers first (scripts/test.sh does), or move them with
# the launcher's variables (TENSORBUS_AMQP_PORT, ...; the tests' URLs follow).
#
# `--prepare` only installs and starts the engine and builds the images, and leaves the engine running
# (scripts/test.sh runs it in the background, at the lowest priority, while the native passes run).
# `--up` does that and starts the brokers, and leaves them running; `--tests` then runs the tests against
# them and takes them down (scripts/test.sh starts them while its last native pass, which needs no
# broker, runs); `--down` only takes them down. None of these three stops the engine
# (`bash scripts/docker.sh down` does).
#
# Env: TENSORBUS_TEST_PYTHON (.venv/bin/python) and pytest arguments after the script's name.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${TENSORBUS_TEST_PYTHON:-.venv/bin/python}
t0=$SECONDS
took() { echo "[compose] $1: $((SECONDS - t0))s" >&2; t0=$SECONDS; }

profile=()   # the clusters, once the native launcher has them (scripts/brokers/*_cluster.sh)
if compgen -G "scripts/brokers/*_cluster.sh" >/dev/null; then profile=(--profile cluster); fi
compose=(docker compose "${profile[@]}")

mode=all
case ${1:-} in --prepare | --up | --tests | --down) mode=${1#--}; shift ;; esac
if [[ $mode == down ]]; then "${compose[@]}" down -v --timeout 120; exit; fi
engine_was_up=0
timeout 20 docker info >/dev/null 2>&1 && engine_was_up=1
down() { "${compose[@]}" down -v --timeout 120 || true; ((engine_was_up)) || bash scripts/docker.sh down; }
if [[ $mode == tests ]]; then  # (after `--up`: the engine answered, so it is left to the caller)
  trap down EXIT
else
  bash scripts/docker.sh up
  [[ $engine_was_up == 1 || $mode != all ]] || trap 'bash scripts/docker.sh down' EXIT
  took "engine and Compose"
  bash scripts/docker.sh prepare
  took "base image and Kafka's jars"
  "${compose[@]}" build --quiet
  docker image prune -f >/dev/null   # the untagged images earlier builds left behind (the build cache stays)
  took "images built"
  [[ $mode == prepare ]] && exit 0
  # `down` before `up`: containers a killed run left behind would hold the ports
  "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  [[ $mode == up ]] || trap down EXIT
  "${compose[@]}" up -d --wait --wait-timeout 600 || { "${compose[@]}" logs --tail 60; [[ $mode != up ]] || down; exit 1; }
  took "brokers up"
  [[ $mode == up ]] && exit 0
fi
"${compose[@]}" ps

export TENSORBUS_AMQP_URL=${TENSORBUS_AMQP_URL:-amqp://guest:guest@127.0.0.1:${TENSORBUS_AMQP_PORT:-5672}/%2F}
export TENSORBUS_KAFKA_URL=${TENSORBUS_KAFKA_URL:-kafka://127.0.0.1:${TENSORBUS_KAFKA_PORT:-9092}}
c=${TENSORBUS_AMQP_CLUSTER_PORT:-5681} k=${TENSORBUS_KAFKA_CLUSTER_PORT:-9191}
export TENSORBUS_AMQP_CLUSTER_URL=${TENSORBUS_AMQP_CLUSTER_URL:-amqp://guest:guest@127.0.0.1:$c,127.0.0.1:$((c + 1)),127.0.0.1:$((c + 2))/%2F}
export TENSORBUS_KAFKA_CLUSTER_URL=${TENSORBUS_KAFKA_CLUSTER_URL:-kafka://127.0.0.1:$k,127.0.0.1:$((k + 1)),127.0.0.1:$((k + 2))}
export TENSORBUS_BROKERS_SH=$PWD/scripts/compose-brokers.sh   # restarts and node kills act on the containers
# every integration test that talks to a broker (marked `broker`: the CLI's among them); the others met no
# broker in the native pass, and would meet none here
"$PYTHON" -m pytest -q --durations=15 tests/integration -m broker "$@"
took "tests"
