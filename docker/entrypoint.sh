#!/usr/bin/env bash
# A broker container's main process: starts the broker NAME (rabbitmq|kafka) with the native launcher,
# marks it ready once the launcher's own checks passed (the image's healthcheck reads the mark), and
# lives as long as the broker does; TERM stops the broker cleanly through the launcher.
set -euo pipefail
name=$1
launcher=/opt/tensorbus/scripts/brokers.sh
ready=/run/tensorbus-ready
BASE=$TENSORBUS_BROKER_DIR
# shellcheck source=../scripts/brokers/common.sh
source /opt/tensorbus/scripts/brokers/common.sh   # pid_alive, log
case $name in rabbitmq) pidfile=$BASE/rabbitmq/rabbitmq.pid ;; kafka) pidfile=$BASE/kafka/kafka.pid ;;
  *) die "unknown broker '$name' (rabbitmq|kafka)" ;; esac

rm -f "$ready"
trap 'rm -f "$ready"; bash "$launcher" down "$name"; exit 0' TERM INT
bash "$launcher" up "$name"
touch "$ready"
while pid_alive "$pidfile"; do sleep 2 & wait $!; done
rm -f "$ready"
die "$name exited"
