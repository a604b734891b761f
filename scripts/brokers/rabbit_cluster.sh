# shellcheck shell=bash
# A three-node RabbitMQ cluster beside the single node (sourced by scripts/brokers.sh, uses its $BASE,
# $REPO, $RMQ_BIN and common.sh): nodes rabbit1..3@localhost on 127.0.0.1:5681..5683, one cluster.
#
# Apart from the single node in everything: node names, AMQP and distribution ports (AMQP + 20000),
# an epmd of its own on a private port, a cookie of its own, data under $BASE/cluster/rabbitN.
# Each node's server is started with setsid, so `kill` is a SIGKILL of that node's process group.
#
# Env: TENSORBUS_AMQP_CLUSTER_PORT (5681: nodes on it, +1, +2) TENSORBUS_CLUSTER_EPMD_PORT (4372)
#      TENSORBUS_PYTHON (a Python with pika for the readiness probe; else .venv/bin/python, python3)

RMQC_PORT=${TENSORBUS_AMQP_CLUSTER_PORT:-5681}
RMQC_EPMD_PORT=${TENSORBUS_CLUSTER_EPMD_PORT:-4372}
RMQC=$BASE/cluster
RMQC_NODES=(rabbit1 rabbit2 rabbit3)

rmqc_index() {  # rmqc_index NODE: 0, 1 or 2
  local i
  for i in "${!RMQC_NODES[@]}"; do [[ ${RMQC_NODES[$i]} == "$1" ]] && { echo "$i"; return 0; }; done
  die "unknown RabbitMQ cluster node '$1' (${RMQC_NODES[*]})"
}

rmqc_env() {  # rmqc_env NODE: what the node's server and rabbitmqctl must agree on
  local node=$1 dir=$RMQC/$1 port=$((RMQC_PORT + $(rmqc_index "$1")))
  export HOME=$RMQC/home   # the cluster's cookie, shared by its three nodes (not the single node's)
  export RABBITMQ_NODENAME=$node@localhost RABBITMQ_USE_LONGNAME=false
  export ERL_EPMD_PORT=$RMQC_EPMD_PORT ERL_EPMD_ADDRESS=127.0.0.1
  export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT=$port RABBITMQ_DIST_PORT=$((port + 20000))
  export RABBITMQ_CONF_ENV_FILE=$dir/rabbitmq-env.conf RABBITMQ_CONFIG_FILE=$dir/rabbitmq.conf
  export RABBITMQ_ADVANCED_CONFIG_FILE=$dir/advanced.config RABBITMQ_ENABLED_PLUGINS_FILE=$dir/enabled_plugins
  export RABBITMQ_MNESIA_BASE=$dir/mnesia RABBITMQ_LOG_BASE=$dir/log
  export RABBITMQ_PID_FILE=$dir/rabbitmq.erl.pid ERL_CRASH_DUMP=$dir/log/erl_crash.dump
  # schedulers that sleep when idle (no busy-waiting on a shared machine), one async thread pool
  export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} +sbwt none +sbwtdcpu none +sbwtdio none"
  export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
  RMQC_DIR=$dir RMQC_AMQP=$port
}

rmqc_ctl() {  # rmqc_ctl NODE ARGS...: rabbitmqctl against that node
  local node=$1; shift
  (rmqc_env "$node"; "$RMQ_BIN/rabbitmqctl" -n "$node@localhost" "$@")
}

rmqc_configure() (  # rmqc_configure NODE: config files and directories (kept across kill/start)
  rmqc_env "$1"
  mkdir -p "$HOME" "$RABBITMQ_MNESIA_BASE" "$RABBITMQ_LOG_BASE"
  : >"$RABBITMQ_CONF_ENV_FILE"   # don't read /etc/rabbitmq/rabbitmq-env.conf
  echo '[].' >"$RABBITMQ_ENABLED_PLUGINS_FILE"
  cat >"$RABBITMQ_CONFIG_FILE" <<EOF
listeners.tcp.1 = 127.0.0.1:$RMQC_AMQP
loopback_users.guest = true
log.console = false
log.file.level = info
cluster_formation.peer_discovery_backend = classic_config
cluster_formation.classic_config.nodes.1 = rabbit1@localhost
cluster_formation.classic_config.nodes.2 = rabbit2@localhost
cluster_formation.classic_config.nodes.3 = rabbit3@localhost
# quorum queues: a smaller write-ahead log than the default 512 MB keeps each node's memory modest
raft.wal_max_size_bytes = 67108864
EOF
)

rmqc_launch() (  # rmqc_launch NODE: start the node's server in a process group of its own
  rmqc_env "$1"
  port_open "$RMQC_AMQP" && die "port $RMQC_AMQP is already in use (a RabbitMQ cluster node already running?)"
  if ! pid_alive "$RMQC/epmd.pid"; then
    port_open "$RMQC_EPMD_PORT" && die "epmd port $RMQC_EPMD_PORT is already in use (set TENSORBUS_CLUSTER_EPMD_PORT)"
    setsid epmd -port "$RMQC_EPMD_PORT" -address 127.0.0.1 >"$RMQC/epmd.log" 2>&1 &
    echo $! >"$RMQC/epmd.pid"
  fi
  log "starting RabbitMQ cluster node $RABBITMQ_NODENAME on 127.0.0.1:$RMQC_AMQP"
  setsid "$RMQ_BIN/rabbitmq-server" >"$RMQC_DIR/log/stdout.log" 2>&1 </dev/null &
  echo $! >"$RMQC_DIR/rabbitmq.pid"
)

rmqc_await() {  # rmqc_await NODE: wait until the node has booted and runs as a member of the cluster
  local node=$1 t0=$SECONDS dir=$RMQC/$1
  local logs=("$dir/log/stdout.log" "$dir/log/$node@localhost.log")
  until port_open "$((RMQC_PORT + $(rmqc_index "$node")))"; do
    launched_alive "$dir/rabbitmq.pid" || fail_with_log "RabbitMQ node $node exited during startup" "${logs[@]}"
    ((SECONDS - t0 < 120)) || fail_with_log "RabbitMQ node $node did not open its port in 120s" "${logs[@]}"
    sleep 0.5
  done
  rmqc_ctl "$node" -q await_startup --timeout 120 >"$dir/log/await.log" 2>&1 \
    || fail_with_log "rabbitmqctl await_startup failed for $node" "$dir/log/await.log" "${logs[@]}"
}

rmqc_running() {  # rmqc_running NODE: the cluster's running nodes, as NODE sees them (one a line)
  rmqc_ctl "$1" -q cluster_status --formatter json 2>/dev/null \
    | python3 -c 'import json, sys; print("\n".join(json.load(sys.stdin)["running_nodes"]))'
}

rmqc_await_members() {  # rmqc_await_members NODE N: until NODE sees N running nodes in its cluster
  local t0=$SECONDS
  until [[ $(rmqc_running "$1" | wc -l) -ge $2 ]]; do
    ((SECONDS - t0 < 60)) || die "RabbitMQ cluster: $1 sees $(rmqc_running "$1" | tr '\n' ' ') running, not $2 nodes"
    sleep 0.5
  done
}

rmqc_probe() {  # declare a quorum queue and publish to it (with confirms) through every node
  local python found=''
  for python in ${TENSORBUS_PYTHON:-} "$REPO/.venv/bin/python" python3; do
    "$python" -c 'import pika' 2>/dev/null && { found=$python; break; }
  done
  [[ -n $found ]] || die "the RabbitMQ cluster probe needs a Python with pika (set TENSORBUS_PYTHON)"
  "$found" "$REPO/scripts/brokers/amqp_cluster_probe.py" "$RMQC_PORT" "$((RMQC_PORT + 1))" "$((RMQC_PORT + 2))" \
    >"$RMQC/probe.log" 2>&1 || fail_with_log "the RabbitMQ cluster does not serve a quorum queue" "$RMQC/probe.log"
}

rmq_cluster_up() {  # three nodes, one cluster, a quorum queue served: wipes data unless TENSORBUS_KEEP_DATA=1
  local node all=1 t0=$SECONDS
  for node in "${RMQC_NODES[@]}"; do pid_alive "$RMQC/$node/rabbitmq.pid" || all=0; done
  if ((all)); then log "RabbitMQ cluster already running"; rmqc_probe; return 0; fi
  rmq_install   # (from brokers.sh: Debian's rabbitmq-server, once)
  rmq_cluster_down
  trap 'log "stopping the RabbitMQ cluster again"; rmq_cluster_down' EXIT   # whatever fails below
  [[ ${TENSORBUS_KEEP_DATA:-0} == 1 ]] || rm -rf "$RMQC/home" "${RMQC_NODES[@]/#/$RMQC/}"
  mkdir -p "$RMQC/home"
  if [[ ! -s $RMQC/home/.erlang.cookie ]]; then
    (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$RMQC/home/.erlang.cookie")
    chmod 400 "$RMQC/home/.erlang.cookie"
  fi
  for node in "${RMQC_NODES[@]}"; do rmqc_configure "$node"; done
  # the first node alone, then the others join it (started together, they might form clusters of their own)
  rmqc_launch rabbit1; rmqc_await rabbit1
  rmqc_launch rabbit2; rmqc_launch rabbit3
  rmqc_await rabbit2; rmqc_await rabbit3
  rmqc_await_members rabbit1 3
  rmqc_probe
  trap - EXIT
  log "RabbitMQ cluster ready: rabbit1..3 on 127.0.0.1:$RMQC_PORT..$((RMQC_PORT + 2)) (guest/guest) in $((SECONDS - t0))s"
}

rmq_cluster_down() {
  local node
  for node in "${RMQC_NODES[@]}"; do stop_pid "RabbitMQ $node" "$RMQC/$node/rabbitmq.pid" 60; done
  stop_pid "cluster epmd" "$RMQC/epmd.pid" 10
}

rmq_cluster_status() {
  local node rss
  for node in "${RMQC_NODES[@]}"; do
    rss=''
    if pid_alive "$RMQC/$node/rabbitmq.pid"; then
      rss=$(ps -o rss= -s "$(cat "$RMQC/$node/rabbitmq.pid")" | awk '{s += $1} END {printf "%d MB RSS", s / 1024}')
    fi
    status_one "$node" "$RMQC/$node/rabbitmq.pid" amqp="$((RMQC_PORT + $(rmqc_index "$node")))"
    [[ -z $rss ]] || echo "  $node: $rss; cluster members running: $(rmqc_running "$node" | paste -sd ' ')"
  done
}

rmq_cluster_kill() {  # SIGKILL the node's process group: no clean shutdown
  local pidfile=$RMQC/$1/rabbitmq.pid
  rmqc_index "$1" >/dev/null
  pid_alive "$pidfile" || die "RabbitMQ node $1 is not running"
  log "killing RabbitMQ node $1 (SIGKILL, process group $(cat "$pidfile"))"
  kill -KILL -- "-$(cat "$pidfile")"
  local t0=$SECONDS
  while group_alive "$(cat "$pidfile")"; do ((SECONDS - t0 < 10)) || die "$1 still alive after SIGKILL"; sleep 0.1; done
  rm -f "$pidfile"
}

rmq_cluster_start() {  # start a node again with its data: returns once it runs as a member of the cluster
  local node=$1 t0=$SECONDS
  rmqc_index "$node" >/dev/null
  if pid_alive "$RMQC/$node/rabbitmq.pid"; then log "RabbitMQ node $node already running"; return 0; fi
  [[ -d $RMQC/$node/mnesia ]] || die "RabbitMQ node $node has no data: run 'cluster up' first"
  rmqc_launch "$node"; rmqc_await "$node"
  rmqc_await_members "$node" 3
  log "RabbitMQ node $node rejoined the cluster in $((SECONDS - t0))s"
}

rmq_cluster_leader() {  # rmq_cluster_leader QUEUE: the node that leads the quorum queue (rabbit1..3)
  local node
  for node in "${RMQC_NODES[@]}"; do
    pid_alive "$RMQC/$node/rabbitmq.pid" || continue
    rmqc_ctl "$node" -q list_queues name leader --formatter json \
      | python3 -c 'import json, sys; print(*[q["leader"].split("@")[0] for q in json.load(sys.stdin) if q["name"] == sys.argv[1]])' "$1"
    return
  done
  die "no RabbitMQ cluster node is running"
}
