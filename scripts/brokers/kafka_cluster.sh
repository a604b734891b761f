# shellcheck shell=bash
# A three-broker Kafka KRaft cluster for the node-loss tests, sourced by scripts/brokers.sh (uses its
# $BASE, $REPO, $KAFKA_LIBS, kafka_install and the helpers of common.sh).
#
# Brokers kafka1..3 are node ids 1..3, each broker + controller (a three-voter quorum), on
# 127.0.0.1:9191..9193 (controllers 9291..9293), data in $BASE/cluster/kafkaN, same Kafka version and
# jars as the single node. Plaintext only.
#
#   kafka_cluster_up       wipe (unless TENSORBUS_KEEP_DATA=1), format, start all three; returns once the
#                          cluster formed and a topic with replication factor 3 takes an acks=all write
#   kafka_cluster_down     stop all three (TERM, then KILL after a timeout)
#   kafka_cluster_status   one line per broker
#   kafka_cluster_kill N   SIGKILL broker N's processes (no clean shutdown); N is 1..3 or kafka1..kafka3
#   kafka_cluster_start N  start broker N on its data; returns once it is in every ISR it belongs to
#
# Env: TENSORBUS_KAFKA_CLUSTER_PORT (9191: brokers on it and the next two ports)
#      TENSORBUS_KAFKA_CLUSTER_CONTROLLER_PORT (9291: likewise) TENSORBUS_KAFKA_CLUSTER_HEAP (384m)

KCLUSTER=$BASE/cluster
KCLUSTER_PORT=${TENSORBUS_KAFKA_CLUSTER_PORT:-9191}
KCLUSTER_CONTROLLER_PORT=${TENSORBUS_KAFKA_CLUSTER_CONTROLLER_PORT:-9291}
KCLUSTER_ID=dGVuc29yYnVzLWtjbHVzdA   # base64url("tensorbus-kclust"): a fixed 16-byte id
KCLUSTER_HEAP=${TENSORBUS_KAFKA_CLUSTER_HEAP:-384m}
KCLUSTER_READY_TOPIC=tensorbus-cluster-ready
KCLUSTER_JAVA=(java -Xms64m "-Xmx$KCLUSTER_HEAP" -XX:+UseG1GC -Djava.awt.headless=true
  -Dlog4j2.shutdownHookEnabled=false -Dlog4j2.configurationFile="$REPO/scripts/kafka/log4j2.properties"
  -cp "$KAFKA_LIBS/*")

kcluster_port() { echo $((KCLUSTER_PORT + $1 - 1)); }
kcluster_dir() { echo "$KCLUSTER/kafka$1"; }
kcluster_bootstrap() { echo "127.0.0.1:$(kcluster_port 1),127.0.0.1:$(kcluster_port 2),127.0.0.1:$(kcluster_port 3)"; }
kcluster_node() {  # kcluster_node N|kafkaN: prints N, which must be 1, 2 or 3
  local n=${1#kafka}
  [[ $n =~ ^[123]$ ]] || die "Kafka cluster broker must be 1, 2 or 3 (kafka1..kafka3), not '${1:-}'"
  echo "$n"
}

kcluster_ready() {  # kcluster_ready LOG ARGS...: run KafkaReady.java (kafka_ready) against the cluster
  local out=$1; shift
  kafka_ready "${KCLUSTER_JAVA[@]}" -- "$(kcluster_bootstrap)" "$@" >"$out" 2>&1
}

kcluster_render() {  # kcluster_render N: write broker N's server.properties, format its storage once
  local n=$1 dir voters='' i
  dir=$(kcluster_dir "$n")
  for i in 1 2 3; do voters+="$i@127.0.0.1:$((KCLUSTER_CONTROLLER_PORT + i - 1)),"; done
  mkdir -p "$dir/data"
  sed -e "s|@NODE_ID@|$n|g; s|@PORT@|$(kcluster_port "$n")|g; s|@VOTERS@|${voters%,}|g" \
    -e "s|@CONTROLLER_PORT@|$((KCLUSTER_CONTROLLER_PORT + n - 1))|g; s|@DATA_DIR@|$dir/data|g" \
    "$REPO/scripts/kafka/cluster.properties" >"$dir/server.properties"
  if [[ ! -f $dir/data/meta.properties ]]; then
    "${KCLUSTER_JAVA[@]}" kafka.tools.StorageTool format -t "$KCLUSTER_ID" -c "$dir/server.properties" \
      >"$dir/format.log" 2>&1 || fail_with_log "formatting kafka$n's storage failed" "$dir/format.log"
  fi
}

kcluster_launch() {  # kcluster_launch N: start broker N's JVM in the background (its data kept)
  local n=$1 dir p
  dir=$(kcluster_dir "$n")
  pid_alive "$dir/kafka.pid" && die "kafka$n is already running (pid $(cat "$dir/kafka.pid"))"
  for p in "$(kcluster_port "$n")" "$((KCLUSTER_CONTROLLER_PORT + n - 1))"; do
    port_open "$p" && die "port $p is already in use (another Kafka?)"
  done
  kcluster_render "$n"
  log "starting kafka$n (node $n) on 127.0.0.1:$(kcluster_port "$n"), controller :$((KCLUSTER_CONTROLLER_PORT + n - 1))"
  setsid "${KCLUSTER_JAVA[@]}" kafka.Kafka "$dir/server.properties" >>"$dir/kafka.log" 2>&1 </dev/null &
  echo $! >"$dir/kafka.pid"
}

kcluster_await_started() {  # kcluster_await_started N T0: until broker N serves (started since line count T0)
  local n=$1 from=$2 dir t0=$SECONDS
  dir=$(kcluster_dir "$n")
  until port_open "$(kcluster_port "$n")" && tail -n "+$from" "$dir/kafka.log" | grep -q 'Kafka Server started'; do
    launched_alive "$dir/kafka.pid" || fail_with_log "kafka$n exited during startup" "$dir/kafka.log"
    ((SECONDS - t0 < 120)) || fail_with_log "kafka$n not started after 120s" "$dir/kafka.log"
    sleep 0.5
  done
}

kcluster_log_lines() { local f; f="$(kcluster_dir "$1")/kafka.log"; echo $(($([[ -f $f ]] && wc -l <"$f" || echo 0) + 1)); }

kafka_cluster_up() {
  local n t0=$SECONDS from=()
  if pid_alive "$(kcluster_dir 1)/kafka.pid" && pid_alive "$(kcluster_dir 2)/kafka.pid" \
    && pid_alive "$(kcluster_dir 3)/kafka.pid"; then
    log "Kafka cluster already running"; return 0
  fi
  kafka_cluster_down
  [[ ${TENSORBUS_KEEP_DATA:-0} == 1 ]] || rm -rf "$KCLUSTER"/kafka[123]
  kafka_install
  trap kafka_cluster_down EXIT   # a broker that failed to start takes the others down with it
  local formats=()
  for n in 1 2 3; do kcluster_render "$n" & formats+=($!); done   # formatting is a JVM start each: side by side
  for n in "${formats[@]}"; do wait "$n" || exit 1; done   # each by its PID: `wait -n` may answer for another job
  for n in 1 2 3; do from[n]=$(kcluster_log_lines "$n"); kcluster_launch "$n"; done
  for n in 1 2 3; do kcluster_await_started "$n" "${from[n]}"; done
  kcluster_ready "$KCLUSTER/ready.log" --brokers 3 --topic "$KCLUSTER_READY_TOPIC" \
    || fail_with_log "the Kafka cluster did not form" "$KCLUSTER/ready.log"
  trap - EXIT
  log "Kafka cluster ready on $(kcluster_bootstrap) in $((SECONDS - t0))s (replication factor 3 writable)"
}

kafka_cluster_down() {  # all three at once: one by one, the last would wait for a quorum that is gone
  local n
  for n in 1 2 3; do stop_pid "kafka$n" "$(kcluster_dir "$n")/kafka.pid" 60 & done
  wait
}

kafka_cluster_status() {
  local n
  for n in 1 2 3; do
    status_one "kafka$n" "$(kcluster_dir "$n")/kafka.pid" plaintext="$(kcluster_port "$n")" \
      controller="$((KCLUSTER_CONTROLLER_PORT + n - 1))"
  done
}

kafka_cluster_kill() {
  local n pid pidfile
  n=$(kcluster_node "${1:-}") || exit 1
  pidfile="$(kcluster_dir "$n")/kafka.pid"
  pid_alive "$pidfile" || { log "kafka$n is not running"; return 0; }
  pid=$(cat "$pidfile")
  log "killing kafka$n (SIGKILL to process group $pid)"
  kill -KILL -- "-$pid" 2>/dev/null || true
  while group_alive "$pid"; do sleep 0.1; done
  rm -f "$pidfile"
}

kafka_cluster_start() {
  local n from t0=$SECONDS
  n=$(kcluster_node "${1:-}") || exit 1
  if pid_alive "$(kcluster_dir "$n")/kafka.pid"; then log "kafka$n already running"; return 0; fi
  [[ -f $(kcluster_dir "$n")/data/meta.properties ]] || die "kafka$n has no data: run 'cluster up' first"
  from=$(kcluster_log_lines "$n")
  kcluster_launch "$n"
  kcluster_await_started "$n" "$from"
  kcluster_ready "$(kcluster_dir "$n")/ready.log" --brokers 1 --in-isr "$n" \
    || fail_with_log "kafka$n did not rejoin the in-sync replicas" "$(kcluster_dir "$n")/ready.log"
  log "kafka$n rejoined (in every ISR it belongs to) in $((SECONDS - t0))s"
}
