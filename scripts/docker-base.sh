#!/usr/bin/env bash
# The base image of docker/*/Dockerfile, debian:bookworm-slim, on a machine that has none: pulled from
# the registry if it answers, else made with debootstrap (--variant=minbase bookworm, Debian's package
# mirror) and `docker import`ed under the same tag, so the Dockerfiles build the same either way.
# Does nothing when the image is already there. Needs a running engine (bash scripts/docker.sh up).
#
# Env: TENSORBUS_DEBIAN_MIRROR (http://deb.debian.org/debian) TENSORBUS_DEBIAN_SECURITY_MIRROR (.../debian-security)
#      TENSORBUS_BROKER_DIR ($REPO/.brokers)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE=${TENSORBUS_BROKER_DIR:-$REPO/.brokers}
IMAGE=debian:bookworm-slim
MIRROR=${TENSORBUS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${TENSORBUS_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

# shellcheck source-path=SCRIPTDIR source=brokers/common.sh
source "$REPO/scripts/brokers/common.sh"   # log, die, apt_install, fail_with_log

docker image inspect "$IMAGE" >/dev/null 2>&1 && exit 0
mkdir -p "$BASE"
if timeout 120 docker pull -q "$IMAGE" >"$BASE/docker-pull.log" 2>&1; then
  log "pulled $IMAGE"
  exit 0
fi
log "$IMAGE cannot be pulled ($(tail -n 1 "$BASE/docker-pull.log")): building it with debootstrap"
command -v debootstrap >/dev/null || apt_install debootstrap
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$BASE/debootstrap.log" 2>&1 \
  || fail_with_log "debootstrap bookworm failed" "$BASE/debootstrap.log"
# As in the official image: the release, its updates and its security fixes; no package lists kept.
rm -f "$root/etc/apt/sources.list"
cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
# Also as there: packages installed in a build do not start their services.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
tar -C "$root" -c . | docker import -c 'CMD ["bash"]' - "$IMAGE" >/dev/null
log "imported $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE") bytes)"
