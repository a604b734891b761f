#!/usr/bin/env bash
# Native (Docker-free) RabbitMQ + Kafka for tensorbus tests, listening on 127.0.0.1 only.
#
#   bash scripts/brokers.sh install [rabbitmq|kafka]   install (the server, or Kafka's jars) only
#   bash scripts/brokers.sh up      [rabbitmq|kafka]   install if needed, wipe data, start, wait until ready
#   bash scripts/brokers.sh down    [rabbitmq|kafka]   stop by PID (TERM, then KILL after a timeout)
#   bash scripts/brokers.sh restart  rabbitmq|kafka    stop + start KEEPING data (fault tests)
#   bash scripts/brokers.sh status  [rabbitmq|kafka]
#   bash scripts/brokers.sh tls                        make the test CA and certificate if missing (up does too)
#   bash scripts/brokers.sh cluster up|down|status [rabbitmq|kafka]   the three-node clusters, beside the above
#   bash scripts/brokers.sh cluster kill|start NODE   SIGKILL a node / start it again (returns once it rejoined);
#                                                     NODE is rabbit1..3 or kafka1..3
#   bash scripts/brokers.sh cluster leader QUEUE      the RabbitMQ node that leads a quorum queue
#
# Listeners: RabbitMQ AMQP 5672 and AMQPS (TLS) 5671, guest/guest. Kafka PLAINTEXT 9092, SSL 9093,
# SASL_SSL 9094 (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512: user tensorbus, password tensorbus-secret),
# KRaft controller 9095. Clusters: RabbitMQ rabbit1..3 on 5681..5683 (scripts/brokers/rabbit_cluster.sh),
# Kafka kafka1..3 on 9191..9193 (scripts/brokers/kafka_cluster.sh). TLS: a test CA and a server certificate for 127.0.0.1/localhost, made once
# per broker dir in $TENSORBUS_BROKER_DIR/tls (clients trust tls/ca.pem; see scripts/brokers/tls.sh).
#
# The broker images of docker/ run this same launcher inside their containers, with TENSORBUS_BIND=0.0.0.0
# (Docker publishes their ports on the host's 127.0.0.1 only); clients are always told 127.0.0.1.
#
# Env: TENSORBUS_AMQP_PORT (5672) TENSORBUS_AMQPS_PORT (5671) TENSORBUS_EPMD_PORT (4371)
#      TENSORBUS_RABBITMQ_DIST_PORT (AMQP port + 20000) TENSORBUS_RABBITMQ_NODENAME (tensorbus@localhost)
#      TENSORBUS_RABBITMQ_MANAGEMENT=1 (management UI on 127.0.0.1:$TENSORBUS_RABBITMQ_MANAGEMENT_PORT, 15672)
#      TENSORBUS_KAFKA_PORT (9092) TENSORBUS_KAFKA_SSL_PORT (9093) TENSORBUS_KAFKA_SASL_PORT (9094)
#      TENSORBUS_KAFKA_CONTROLLER_PORT (9095) TENSORBUS_KAFKA_VERSION (4.4.0)
#      TENSORBUS_BROKER_DIR ($REPO/.brokers) TENSORBUS_CACHE_DIR (~/.cache/tensorbus)
#      TENSORBUS_BROKER_TLS_DIR ($TENSORBUS_BROKER_DIR/tls) TENSORBUS_BIND (127.0.0.1: the listeners' address)
#      TENSORBUS_KEEP_DATA=1 (don't wipe on up)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE=${TENSORBUS_BROKER_DIR:-$REPO/.brokers}
CACHE=${TENSORBUS_CACHE_DIR:-$HOME/.cache/tensorbus}
TLS=${TENSORBUS_BROKER_TLS_DIR:-$BASE/tls}
BIND=${TENSORBUS_BIND:-127.0.0.1}
AMQP_PORT=${TENSORBUS_AMQP_PORT:-5672}
AMQPS_PORT=${TENSORBUS_AMQPS_PORT:-5671}
EPMD_PORT=${TENSORBUS_EPMD_PORT:-4371}   # not 4369: keeps clear of any system epmd
RMQ_DIST_PORT=${TENSORBUS_RABBITMQ_DIST_PORT:-$((AMQP_PORT + 20000))}
RMQ_NODE=${TENSORBUS_RABBITMQ_NODENAME:-tensorbus@localhost}
RMQ_MANAGEMENT_PORT=${TENSORBUS_RABBITMQ_MANAGEMENT_PORT:-15672}
KAFKA_PORT=${TENSORBUS_KAFKA_PORT:-9092}
KAFKA_SSL_PORT=${TENSORBUS_KAFKA_SSL_PORT:-9093}
KAFKA_SASL_PORT=${TENSORBUS_KAFKA_SASL_PORT:-9094}
CONTROLLER_PORT=${TENSORBUS_KAFKA_CONTROLLER_PORT:-9095}
KAFKA_SASL_USER=tensorbus KAFKA_SASL_PASSWORD=tensorbus-secret   # test credentials; tests use the same
KAFKA_VERSION=${TENSORBUS_KAFKA_VERSION:-4.4.0}  # pinned; keep in sync with docker-compose.yml
CLUSTER_ID=dGVuc29yYnVzLWthZmthMQ       # base64url("tensorbus-kafka1"): a fixed 16-byte id
RMQ_BIN=/usr/lib/rabbitmq/bin
RMQ=$BASE/rabbitmq
KAFKA=$BASE/kafka
KAFKA_LIBS=$CACHE/kafka-$KAFKA_VERSION/libs

# shellcheck source-path=SCRIPTDIR source=brokers/common.sh
source "$REPO/scripts/brokers/common.sh"   # log, die, port_open, pid_alive, apt_install, stop_pid
# shellcheck source-path=SCRIPTDIR source=brokers/tls.sh
source "$REPO/scripts/brokers/tls.sh"      # tls_ensure, tls_probe
# shellcheck source-path=SCRIPTDIR source=brokers/rabbit_cluster.sh
source "$REPO/scripts/brokers/rabbit_cluster.sh"   # rmq_cluster_up|down|status|kill|start
if [[ -f $REPO/scripts/brokers/kafka_cluster.sh ]]; then
  # shellcheck source-path=SCRIPTDIR source=/dev/null
  source "$REPO/scripts/brokers/kafka_cluster.sh"  # kafka_cluster_up|down|status|kill|start
fi

# ---------------------------------------------------------------- RabbitMQ
rmq_env() {  # everything the server and rabbitmqctl must agree on (cookie in $HOME)
  export HOME=$RMQ/home RABBITMQ_NODENAME=$RMQ_NODE RABBITMQ_USE_LONGNAME=false
  export ERL_EPMD_PORT=$EPMD_PORT ERL_EPMD_ADDRESS=127.0.0.1
  export RABBITMQ_NODE_IP_ADDRESS=$BIND RABBITMQ_NODE_PORT=$AMQP_PORT
  export RABBITMQ_DIST_PORT=$RMQ_DIST_PORT
  export RABBITMQ_CONF_ENV_FILE=$RMQ/rabbitmq-env.conf RABBITMQ_CONFIG_FILE=$RMQ/rabbitmq.conf
  export RABBITMQ_ADVANCED_CONFIG_FILE=$RMQ/advanced.config
  export RABBITMQ_ENABLED_PLUGINS_FILE=$RMQ/enabled_plugins
  export RABBITMQ_MNESIA_BASE=$RMQ/mnesia RABBITMQ_LOG_BASE=$RMQ/log
  export RABBITMQ_PID_FILE=$RMQ/rabbitmq.erl.pid ERL_CRASH_DUMP=$RMQ/log/erl_crash.dump
  export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
  export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
}

rmq_install() {
  [[ -x $RMQ_BIN/rabbitmq-server ]] && return 0
  apt_install rabbitmq-server
  # On a systemd host the package starts a system-wide node on 5672: we run our own instead.
  if command -v systemctl >/dev/null && systemctl is-active --quiet rabbitmq-server 2>/dev/null; then
    log "disabling the system rabbitmq-server service (it would hold port 5672)"
    systemctl disable --now rabbitmq-server >/dev/null 2>&1 || true
  fi
}

rmq_start() {
  rmq_install; tls_ensure; rmq_env
  mkdir -p "$HOME" "$RABBITMQ_MNESIA_BASE" "$RABBITMQ_LOG_BASE"
  : >"$RABBITMQ_CONF_ENV_FILE"   # don't read /etc/rabbitmq/rabbitmq-env.conf
  # guest/guest is allowed from loopback only (the default), which is all we listen on natively; in a
  # container the host's 127.0.0.1 reaches the broker through Docker's bridge, so it is allowed from any
  # address there (the ports are published on the host's 127.0.0.1 alone)
  local guest_loopback_only=true
  [[ $BIND == 127.0.0.1 ]] || guest_loopback_only=false
  cat >"$RABBITMQ_CONFIG_FILE" <<EOF
listeners.tcp.1 = $BIND:$AMQP_PORT
loopback_users.guest = $guest_loopback_only
log.console = false
log.file.level = info
# AMQPS: TLS with the test CA's server certificate; clients are not asked for certificates
listeners.ssl.1 = $BIND:$AMQPS_PORT
ssl_options.cacertfile = $TLS/ca.pem
ssl_options.certfile = $TLS/server.pem
ssl_options.keyfile = $TLS/server.key
ssl_options.verify = verify_none
ssl_options.fail_if_no_peer_cert = false
EOF
  if [[ ${TENSORBUS_RABBITMQ_MANAGEMENT:-0} == 1 ]]; then
    echo '[rabbitmq_management].' >"$RABBITMQ_ENABLED_PLUGINS_FILE"
    printf 'management.tcp.ip = %s\nmanagement.tcp.port = %s\n' "$BIND" "$RMQ_MANAGEMENT_PORT" >>"$RABBITMQ_CONFIG_FILE"
  else
    echo '[].' >"$RABBITMQ_ENABLED_PLUGINS_FILE"
  fi
  for p in "$AMQP_PORT" "$AMQPS_PORT"; do
    port_open "$p" && die "port $p is already in use (another RabbitMQ?)"
  done
  # Our own epmd on a private port, so `down` can stop it by PID.
  if ! pid_alive "$RMQ/epmd.pid"; then
    port_open "$EPMD_PORT" && die "epmd port $EPMD_PORT is already in use (set TENSORBUS_EPMD_PORT)"
    setsid epmd -port "$EPMD_PORT" -address 127.0.0.1 >"$RMQ/log/epmd.log" 2>&1 &
    echo $! >"$RMQ/epmd.pid"
  fi
  log "starting RabbitMQ ($RABBITMQ_NODENAME) on $BIND:$AMQP_PORT, AMQPS :$AMQPS_PORT"
  local t0=$SECONDS
  # $! is the rabbitmq-server wrapper: it forwards TERM to its beam.smp child (same group).
  setsid "$RMQ_BIN/rabbitmq-server" >"$RMQ/log/stdout.log" 2>&1 </dev/null &
  echo $! >"$RMQ/rabbitmq.pid"
  local logs=("$RMQ/log/stdout.log" "$RMQ/log/$RABBITMQ_NODENAME.log")
  until port_open "$AMQP_PORT"; do
    launched_alive "$RMQ/rabbitmq.pid" || { rmq_stop; fail_with_log "RabbitMQ exited during startup" "${logs[@]}"; }
    ((SECONDS - t0 < 120)) || { rmq_stop; fail_with_log "RabbitMQ did not open port $AMQP_PORT in 120s" "${logs[@]}"; }
    sleep 0.5
  done
  "$RMQ_BIN/rabbitmqctl" -n "$RABBITMQ_NODENAME" -q await_startup --timeout 120 >"$RMQ/log/await.log" 2>&1 \
    || { rmq_stop; fail_with_log "rabbitmqctl await_startup failed" "$RMQ/log/await.log" "${logs[@]}"; }
  tls_probe "$AMQPS_PORT" "$RMQ/log/tls-probe.log" || {
    rmq_stop; fail_with_log "RabbitMQ AMQPS port $AMQPS_PORT does not serve TLS" "$RMQ/log/tls-probe.log" "${logs[@]}"
  }
  log "RabbitMQ ready on 127.0.0.1:$AMQP_PORT and AMQPS :$AMQPS_PORT (guest/guest) in $((SECONDS - t0))s"
}

rmq_stop() {
  stop_pid RabbitMQ "$RMQ/rabbitmq.pid" 60
  stop_pid epmd "$RMQ/epmd.pid" 10
}

# ---------------------------------------------------------------- Kafka
kafka_install() {
  # A JDK, not just a JRE: the readiness probe is a single-file Java source program.
  command -v javac >/dev/null || apt_install openjdk-17-jdk-headless
  [[ -f $KAFKA_LIBS/.complete ]] && return 0
  command -v mvn >/dev/null || apt_install maven
  log "resolving Kafka $KAFKA_VERSION jars from Maven Central into $KAFKA_LIBS"
  rm -rf "$KAFKA_LIBS"; mkdir -p "$KAFKA_LIBS"
  mvn -B -Dstyle.color=never -f "$REPO/scripts/kafka/pom.xml" -Dkafka.version="$KAFKA_VERSION" \
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$KAFKA_LIBS" \
    >"$CACHE/mvn-kafka.log" 2>&1 \
    || fail_with_log "maven could not resolve org.apache.kafka:kafka_2.13:$KAFKA_VERSION" "$CACHE/mvn-kafka.log"
  touch "$KAFKA_LIBS/.complete"
}

kafka_ready() {  # kafka_ready JAVA... -- ARGS...: the readiness probe, scripts/kafka/KafkaReady.java, compiled once
  # into $CACHE per version of its source (a source-file launch compiles it on every run: seconds of CPU each
  # time a node starts on a busy machine)
  local src=$REPO/scripts/kafka/KafkaReady.java classes tmp java=()
  while [[ $1 != -- ]]; do java+=("$1"); shift; done; shift
  classes=$CACHE/kafka-ready-$(sha256sum "$src" | cut -c1-16)
  if [[ ! -f $classes/KafkaReady.class ]]; then
    mkdir -p "$CACHE"; tmp=$(mktemp -d "$CACHE/kafka-ready.XXXXXX")
    javac -nowarn -d "$tmp" -cp "$KAFKA_LIBS/*" "$src" >"$tmp/javac.log" 2>&1 \
      || fail_with_log "compiling KafkaReady.java failed" "$tmp/javac.log"
    mv -T "$tmp" "$classes" 2>/dev/null || rm -rf "$tmp"   # (another start compiled it meanwhile)
  fi
  "${java[@]}" -cp "$classes:$KAFKA_LIBS/*" KafkaReady "$@"   # (the last -cp is the one java uses)
}

KAFKA_JAVA=(java -Xms128m -Xmx512m -XX:+UseG1GC -Djava.awt.headless=true -Dlog4j2.shutdownHookEnabled=false
  -Dlog4j2.configurationFile="$REPO/scripts/kafka/log4j2.properties" -cp "$KAFKA_LIBS/*")

kafka_start() {
  kafka_install; tls_ensure
  mkdir -p "$KAFKA/data"
  sed -e "s|@KAFKA_PORT@|$KAFKA_PORT|g; s|@SSL_PORT@|$KAFKA_SSL_PORT|g; s|@SASL_PORT@|$KAFKA_SASL_PORT|g" \
    -e "s|@CONTROLLER_PORT@|$CONTROLLER_PORT|g; s|@DATA_DIR@|$KAFKA/data|g; s|@TLS_DIR@|$TLS|g; s|@BIND@|$BIND|g" \
    -e "s|@SASL_USER@|$KAFKA_SASL_USER|g; s|@SASL_PASSWORD@|$KAFKA_SASL_PASSWORD|g" \
    "$REPO/scripts/kafka/server.properties" >"$KAFKA/server.properties"
  chmod 600 "$KAFKA/server.properties"   # holds the SASL/PLAIN user table
  if [[ ! -f $KAFKA/data/meta.properties ]]; then  # SCRAM users live in the metadata log: added at format
    local scram="name=$KAFKA_SASL_USER,password=$KAFKA_SASL_PASSWORD"
    "${KAFKA_JAVA[@]}" kafka.tools.StorageTool format -t "$CLUSTER_ID" -c "$KAFKA/server.properties" \
      --add-scram "SCRAM-SHA-256=[$scram]" --add-scram "SCRAM-SHA-512=[$scram]" \
      >"$KAFKA/format.log" 2>&1 || fail_with_log "formatting Kafka storage failed" "$KAFKA/format.log"
  fi
  for p in "$KAFKA_PORT" "$KAFKA_SSL_PORT" "$KAFKA_SASL_PORT" "$CONTROLLER_PORT"; do
    port_open "$p" && die "port $p is already in use (another Kafka?)"
  done
  log "starting Kafka $KAFKA_VERSION (KRaft) on $BIND:$KAFKA_PORT, SSL :$KAFKA_SSL_PORT, SASL_SSL :$KAFKA_SASL_PORT"
  local t0=$SECONDS
  setsid "${KAFKA_JAVA[@]}" kafka.Kafka "$KAFKA/server.properties" >"$KAFKA/kafka.log" 2>&1 </dev/null &
  echo $! >"$KAFKA/kafka.pid"
  until port_open "$KAFKA_PORT" && grep -q 'Kafka Server started' "$KAFKA/kafka.log"; do
    launched_alive "$KAFKA/kafka.pid" || { kafka_stop; fail_with_log "Kafka exited during startup" "$KAFKA/kafka.log"; }
    ((SECONDS - t0 < 120)) || { kafka_stop; fail_with_log "Kafka not started after 120s" "$KAFKA/kafka.log"; }
    sleep 0.5
  done
  kafka_ready "${KAFKA_JAVA[@]}" -- "127.0.0.1:$KAFKA_PORT" >"$KAFKA/ready.log" 2>&1 \
    || { kafka_stop; fail_with_log "Kafka does not serve metadata" "$KAFKA/ready.log" "$KAFKA/kafka.log"; }
  for p in "$KAFKA_SSL_PORT" "$KAFKA_SASL_PORT"; do
    tls_probe "$p" "$KAFKA/tls-probe.log" \
      || { kafka_stop; fail_with_log "Kafka port $p does not serve TLS" "$KAFKA/tls-probe.log" "$KAFKA/kafka.log"; }
  done
  log "Kafka ready on 127.0.0.1:$KAFKA_PORT, SSL :$KAFKA_SSL_PORT, SASL_SSL :$KAFKA_SASL_PORT in $((SECONDS - t0))s"
}

kafka_stop() { stop_pid Kafka "$KAFKA/kafka.pid" 60; }

# ---------------------------------------------------------------- commands
up() {  # up NAME: idempotent; wipes data first unless TENSORBUS_KEEP_DATA=1
  local dir pidfile
  case $1 in rabbitmq) dir=$RMQ pidfile=$RMQ/rabbitmq.pid ;; kafka) dir=$KAFKA pidfile=$KAFKA/kafka.pid ;; esac
  if pid_alive "$pidfile"; then log "$1 already running (pid $(cat "$pidfile"))"; return 0; fi
  if [[ ${TENSORBUS_KEEP_DATA:-0} != 1 ]]; then
    [[ $1 == rabbitmq ]] && rmq_stop   # a stray epmd of ours
    rm -rf "$dir"
  fi
  if [[ $1 == rabbitmq ]]; then rmq_start; else kafka_start; fi
}

status_one() {  # status_one NAME PIDFILE LABEL=PORT...
  local name=$1 pidfile=$2 shown='' listener; shift 2
  if pid_alive "$pidfile"; then
    for listener in "$@"; do
      shown+="$listener"; port_open "${listener#*=}" || shown+=" NOT listening"; shown+=", "
    done
    echo "$name: running (pid $(cat "$pidfile"); 127.0.0.1 ${shown%, })"
  else
    echo "$name: stopped (127.0.0.1 $*)"
  fi
}

cluster() {  # cluster VERB [rabbitmq|kafka|NODE]: rmq_cluster_VERB and kafka_cluster_VERB
  local verb=${1:-} what=${2:-all} prefixes=() args=()
  case $verb in
    up|down|status)
      case $what in all) prefixes=(rmq kafka) ;; rabbitmq) prefixes=(rmq) ;; kafka) prefixes=(kafka) ;;
        *) die "unknown cluster '$what' (rabbitmq|kafka)" ;; esac ;;
    kill|start)
      args=("$what")
      case $what in rabbit[1-3]) prefixes=(rmq) ;; kafka[1-3]) prefixes=(kafka) ;;
        *) die "cluster $verb needs a node: rabbit1..3 or kafka1..3, not '$what'" ;; esac ;;
    leader) [[ -n ${2:-} ]] || die "cluster leader needs a queue name"; rmq_cluster_leader "$2"; return ;;
    *) die "unknown cluster command '$verb' (up|down|status|kill NODE|start NODE|leader QUEUE)" ;;
  esac
  local prefix
  for prefix in "${prefixes[@]}"; do
    if declare -F "${prefix}_cluster_$verb" >/dev/null; then
      "${prefix}_cluster_$verb" "${args[@]}"
    else
      log "no ${prefix}_cluster_$verb here yet (scripts/brokers/kafka_cluster.sh missing): skipped"
    fi
  done
}

main() {
  local cmd=${1:-} what=${2:-all} names
  if [[ $cmd == cluster ]]; then cluster "${@:2}"; return; fi
  case $what in all) names="rabbitmq kafka" ;; rabbitmq|kafka) names=$what ;;
    *) die "unknown broker '$what' (rabbitmq|kafka)" ;; esac
  case $cmd in
    tls) tls_ensure; echo "tls: clients trust $TLS/ca.pem" ;;
    install) for n in $names; do if [[ $n == rabbitmq ]]; then rmq_install; else kafka_install; fi; done ;;
    up) for n in $names; do up "$n"; done ;;
    down) for n in $names; do if [[ $n == rabbitmq ]]; then rmq_stop; else kafka_stop; fi; done ;;
    restart)
      [[ $what != all ]] || die "restart needs a broker name: rabbitmq|kafka"
      if [[ $what == rabbitmq ]]; then rmq_stop; rmq_start; else kafka_stop; kafka_start; fi ;;
    status)
      for n in $names; do
        if [[ $n == rabbitmq ]]; then status_one rabbitmq "$RMQ/rabbitmq.pid" amqp="$AMQP_PORT" amqps="$AMQPS_PORT"
        else status_one kafka "$KAFKA/kafka.pid" plaintext="$KAFKA_PORT" ssl="$KAFKA_SSL_PORT" \
          sasl_ssl="$KAFKA_SASL_PORT" controller="$CONTROLLER_PORT"; fi
      done
      if [[ -s $TLS/ca.pem ]]; then echo "tls: clients trust $TLS/ca.pem"; else echo "tls: not generated yet"; fi ;;
    *) sed -n '2,/^set /p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
  esac
}

main "$@"
