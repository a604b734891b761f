#!/usr/bin/env bash
# A Docker engine and the Compose v2 CLI for the compose-started brokers (docker-compose.yml).
#
#   bash scripts/docker.sh install   the engine (Debian's docker.io) if none is installed, and the
#                                    `docker compose` plugin if the docker CLI lacks it
#   bash scripts/docker.sh up        install, then start dockerd if no engine answers (pid file below)
#   bash scripts/docker.sh down      stop the dockerd that `up` started (an engine it found is left alone)
#   bash scripts/docker.sh prepare   what docker-compose.yml's builds need from the host: the base image
#                                    (scripts/docker-base.sh) and Kafka's jars, resolved by the native
#                                    launcher into docker/kafka/libs-<version>/ (containers here cannot
#                                    reach Maven Central over https; the image resolves them itself if absent)
#   bash scripts/docker.sh status
#
# Compose v2 is built from its Go module (github.com/docker/compose/v2, pinned below) with the Go
# toolchain, once per machine: Debian bookworm packages only Compose v1. The binary is kept in
# $TENSORBUS_CACHE_DIR/compose-<version>/ and linked into ~/.docker/cli-plugins/.
#
# Env: TENSORBUS_CACHE_DIR (~/.cache/tensorbus) TENSORBUS_BROKER_DIR ($REPO/.brokers)
#      TENSORBUS_COMPOSE_VERSION (v2.40.3)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE=${TENSORBUS_BROKER_DIR:-$REPO/.brokers}
CACHE=${TENSORBUS_CACHE_DIR:-$HOME/.cache/tensorbus}
COMPOSE_VERSION=${TENSORBUS_COMPOSE_VERSION:-v2.40.3}
COMPOSE_BIN=$CACHE/compose-$COMPOSE_VERSION/docker-compose
PLUGINS=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins
DOCKERD=$BASE/dockerd   # pid file and log of a dockerd started here

# shellcheck source-path=SCRIPTDIR source=brokers/common.sh
source "$REPO/scripts/brokers/common.sh"   # log, die, pid_alive, apt_install, stop_pid

engine_answers() { timeout 20 docker info >/dev/null 2>&1; }

engine_install() {
  if command -v dockerd >/dev/null; then return 0; fi
  apt_install docker.io
}

compose_works() { timeout 20 docker compose version >/dev/null 2>&1; }

compose_build() {  # go build of the pinned Compose v2 module into $COMPOSE_BIN
  command -v go >/dev/null || apt_install golang-go
  local module=github.com/docker/compose/v2 src work
  log "building Docker Compose $COMPOSE_VERSION from the Go module $module (once per machine)"
  mkdir -p "$(dirname "$COMPOSE_BIN")"
  src=$(go mod download -json "$module@$COMPOSE_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  [[ -d $src ]] || die "go mod download $module@$COMPOSE_VERSION gave no source directory"
  # The module has exclude directives, so `go install module@version` refuses it: build in a copy.
  work=$(mktemp -d)
  cp -r "$src/." "$work"; chmod -R u+w "$work"
  (cd "$work" && CGO_ENABLED=0 go build -trimpath -o "$COMPOSE_BIN.tmp" \
    -ldflags "-s -w -X $module/internal.Version=$COMPOSE_VERSION" ./cmd) \
    >"$CACHE/compose-build.log" 2>&1 || { rm -rf "$work"; fail_with_log "building Compose failed" "$CACHE/compose-build.log"; }
  rm -rf "$work"
  mv "$COMPOSE_BIN.tmp" "$COMPOSE_BIN"
}

compose_install() {
  compose_works && return 0
  [[ -x $COMPOSE_BIN ]] || compose_build
  mkdir -p "$PLUGINS"
  ln -sf "$COMPOSE_BIN" "$PLUGINS/docker-compose"
  compose_works || die "docker compose does not run after linking $COMPOSE_BIN into $PLUGINS"
}

dockerd_start() {
  engine_answers && return 0
  mkdir -p "$DOCKERD"
  log "starting dockerd (log: $DOCKERD/dockerd.log)"
  local t0=$SECONDS
  # at the default CPU and I/O priority even when started from a low-priority preparation (test.sh's):
  # the containers the engine starts inherit its priority, and brokers must not be starved by the tests
  setsid ionice -c 2 -n 4 nice -n "$((-$(nice)))" dockerd --pidfile "$DOCKERD/dockerd.real.pid" >"$DOCKERD/dockerd.log" 2>&1 </dev/null &
  echo $! >"$DOCKERD/dockerd.pid"
  until engine_answers; do
    launched_alive "$DOCKERD/dockerd.pid" || fail_with_log "dockerd exited during startup" "$DOCKERD/dockerd.log"
    ((SECONDS - t0 < 60)) || { dockerd_stop; fail_with_log "dockerd did not answer in 60s" "$DOCKERD/dockerd.log"; }
    sleep 0.5
  done
  log "dockerd answers after $((SECONDS - t0))s"
}

# Containers are stopped by dockerd itself on TERM (with their own stop timeouts), so allow for that.
dockerd_stop() { stop_pid dockerd "$DOCKERD/dockerd.pid" 60; }

prepare() {
  bash "$REPO/scripts/docker-base.sh"
  local version=${TENSORBUS_KAFKA_VERSION:-4.4.0} libs dest
  libs=$CACHE/kafka-$version/libs dest=$REPO/docker/kafka/libs-$version
  [[ -f $dest/.complete ]] && return 0
  bash "$REPO/scripts/brokers.sh" install kafka
  rm -rf "$dest"
  cp -al "$libs" "$dest" 2>/dev/null || cp -a "$libs" "$dest"
}

main() {
  case ${1:-} in
    install) engine_install; compose_install ;;
    up) engine_install; compose_install; dockerd_start ;;
    down) dockerd_stop ;;
    prepare) prepare ;;
    status)
      if pid_alive "$DOCKERD/dockerd.pid"; then echo "dockerd: running (pid $(cat "$DOCKERD/dockerd.pid"), started here)"
      elif engine_answers; then echo "dockerd: an engine answers (not started here)"
      else echo "dockerd: no engine answers"; fi
      if compose_works; then docker compose version; else echo "docker compose: missing"; fi ;;
    *) sed -n '2,/^set /p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
  esac
}

main "$@"
