#!/usr/bin/env bash
# A broker container's main process: starts what it runs with the native launcher (scripts/brokers.sh),
# marks it ready once the launcher's own checks passed (the image's healthcheck reads the mark), and
# lives as long as it runs; TERM stops it cleanly through the launcher.
#
#   entrypoint.sh rabbitmq|kafka           the single node; the container ends if the broker dies
#   entrypoint.sh cluster rabbitmq|kafka   the three-node cluster (brokers.sh cluster up); the container
#                                          outlives a node killed by `brokers.sh cluster kill NODE`
set -euo pipefail
launcher=/opt/tensorbus/scripts/brokers.sh
ready=/run/tensorbus-ready
BASE=$TENSORBUS_BROKER_DIR
# shellcheck source=../scripts/brokers/common.sh
source /opt/tensorbus/scripts/brokers/common.sh   # pid_alive, log, die

rm -f "$ready"
if [[ $1 == cluster ]]; then
  name=$2
  trap 'rm -f "$ready"; bash "$launcher" cluster down "$name"; exit 0' TERM INT
  bash "$launcher" cluster up "$name"
  touch "$ready"
  while :; do sleep 3600 & wait $!; done
fi

name=$1
case $name in rabbitmq) pidfile=$BASE/rabbitmq/rabbitmq.pid ;; kafka) pidfile=$BASE/kafka/kafka.pid ;;
  *) die "unknown broker '$name' (rabbitmq|kafka)" ;; esac
trap 'rm -f "$ready"; bash "$launcher" down "$name"; exit 0' TERM INT
bash "$launcher" up "$name"
touch "$ready"
while pid_alive "$pidfile"; do sleep 2 & wait $!; done
rm -f "$ready"
die "$name exited"
