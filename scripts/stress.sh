#!/usr/bin/env bash
# The whole pytest suite RUNS times in a row (default 3) beside two busy cores (two shell loops), to
# find waits that only hold on an idle machine. It runs in a network namespace of its own (so needs
# root: `unshare -n`), with its own native brokers, so it shares no port with anything else on the
# machine. Uses the venv scripts/test.sh makes. Logs: .brokers/stress-N.log; exits non-zero if a run
# failed (the others still run). Usage: [BURNERS=2] bash scripts/stress.sh [RUNS]
# (BURNERS=0: the suite alone, as CI runs it, but off this machine's ports.)
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" != "--inside" ]; then
  # (the namespace's brokers keep their data and pid files where this checkout's do: not both at once)
  if bash scripts/brokers.sh status 2>/dev/null | grep -q ": running"; then
    echo "[stress] this checkout's brokers are running: stop them (scripts/brokers.sh down), or run from another clone" >&2
    exit 2
  fi
  exec unshare -n bash "$0" --inside "${1:-3}"
fi
runs=$2 failed=0 burners=()
ip link set lo up
export CI=true
stop() {
  ((${#burners[@]})) && kill "${burners[@]}" 2>/dev/null
  TENSORBUS_PYTHON=.venv/bin/python bash scripts/brokers.sh cluster down
  bash scripts/brokers.sh down
}
trap stop EXIT
bash scripts/brokers.sh up && TENSORBUS_PYTHON=.venv/bin/python bash scripts/brokers.sh cluster up || exit 1
for ((b = 0; b < ${BURNERS:-2}; b++)); do
  (while :; do :; done) &
  burners+=($!)
done
mkdir -p .brokers
for ((i = 1; i <= runs; i++)); do
  t0=$SECONDS
  echo "[stress] run $i of $runs: $(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
  .venv/bin/python -m pytest -q -p no:cacheprovider -rf >".brokers/stress-$i.log" 2>&1 || failed=1
  echo "[stress] run $i: $(tail -n 1 ".brokers/stress-$i.log") ($((SECONDS - t0))s)"
done
exit $failed
