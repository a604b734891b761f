# shellcheck shell=bash
# Helpers for scripts/brokers.sh (sourced by it; uses its $BASE): logging, apt-get, processes.

log() { echo "[brokers] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Every broker process is started with setsid, so it leads its own process group and
# "alive" means: some non-zombie process is left in the group whose id is in the pid file.
group_alive() {
  local f line state pgrp
  for f in /proc/[0-9]*/stat; do
    read -r line 2>/dev/null <"$f" || continue
    read -r state _ pgrp _ <<<"${line##*) }"
    [[ $pgrp == "$1" && $state != Z ]] && return 0
  done
  return 1
}
pid_alive() { [[ -s $1 ]] && group_alive "$(cat "$1")"; }
# Right after `setsid CMD &` the child may not lead its group yet: while waiting for a broker this
# script has just started, the recorded process itself also counts (zombies aside). Only then: a
# pid file left from another boot may name an unrelated process.
launched_alive() {
  local line
  pid_alive "$1" && return 0
  read -r line 2>/dev/null <"/proc/$(cat "$1")/stat" || return 1
  [[ ${line##*) } != Z* ]]
}

fail_with_log() {  # $1 = message, $2.. = log files to show the tail of
  local msg=$1; shift
  for f in "$@"; do [[ -f $f ]] && { log "---- tail of $f ----"; tail -n 40 "$f" >&2; }; done
  die "$msg"
}

apt_install() {  # apt_install PKG...  (as root, or via sudo)
  local sudo=; [[ $(id -u) -eq 0 ]] || sudo=sudo
  log "installing $* with apt-get"
  mkdir -p "$BASE"
  $sudo apt-get update -q >"$BASE/apt.log" 2>&1 || true   # a stale index may still do
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "$@" \
    >>"$BASE/apt.log" 2>&1 || fail_with_log "apt-get install $* failed" "$BASE/apt.log"
}

stop_pid() {  # stop_pid NAME PIDFILE [TIMEOUT_S]: TERM the leader, wait, then KILL the group
  local name=$1 pidfile=$2 timeout=${3:-30} pid
  if ! pid_alive "$pidfile"; then rm -f "$pidfile"; return 0; fi
  pid=$(cat "$pidfile")
  log "stopping $name (pid $pid)"
  # TERM the leader (the rabbitmq-server wrapper forwards it to beam); the group if it is gone.
  if [[ -r /proc/$pid/stat && $(cut -d')' -f2 "/proc/$pid/stat") != " Z"* ]]; then
    kill -TERM "$pid" 2>/dev/null || true
  else
    kill -TERM -- "-$pid" 2>/dev/null || true
  fi
  for ((i = 0; i < timeout * 5; i++)); do group_alive "$pid" || break; sleep 0.2; done
  if group_alive "$pid"; then
    log "$name did not exit after ${timeout}s; sending KILL"
    kill -KILL -- "-$pid" 2>/dev/null || true
    sleep 0.5
  fi
  rm -f "$pidfile"
}
