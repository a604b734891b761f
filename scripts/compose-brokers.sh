#!/usr/bin/env bash
# The commands of scripts/brokers.sh that act on running brokers, for the compose-started ones
# (docker-compose.yml): tests that restart a broker or kill a cluster node are given this script instead
# of scripts/brokers.sh (TENSORBUS_BROKERS_SH) when the brokers run in Docker.
#
#   bash scripts/compose-brokers.sh restart rabbitmq|kafka   stop the broker's container and start it again
#                                                            on its data; returns once it is healthy
#   bash scripts/compose-brokers.sh status [rabbitmq|kafka]
#   bash scripts/compose-brokers.sh cluster kill|start|status NODE|rabbitmq|kafka, cluster leader QUEUE
#                                  brokers.sh itself, run inside the cluster profile's container
set -euo pipefail
cd "$(dirname "$0")/.."
compose=(docker compose --profile cluster)
case ${1:-} in
  restart)
    [[ ${2:-} == rabbitmq || ${2:-} == kafka ]] || { echo "usage: $0 restart rabbitmq|kafka" >&2; exit 2; }
    "${compose[@]}" restart "$2"
    exec "${compose[@]}" up -d --wait --no-deps "$2" ;;
  status) exec "${compose[@]}" ps ${2:+"$2"} ;;
  cluster)
    case ${2:-}:${3:-} in leader:* | *:rabbit[1-3] | *:rabbitmq) service=rabbitmq-cluster ;;
      *:kafka[1-3] | *:kafka) service=kafka-cluster ;;
      *) echo "usage: $0 cluster kill|start|status NODE (rabbit1..3, kafka1..3) or rabbitmq|kafka, cluster leader QUEUE" >&2
         exit 2 ;;
    esac
    exec "${compose[@]}" exec -T "$service" bash /opt/tensorbus/scripts/brokers.sh "$@" ;;
  *) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac
