#!/usr/bin/env bash
# The test suite, RUNS times in a row, while `stress --cpu LOAD_CPUS` keeps the machine's cores busy: the check that
# no test's outcome hangs on timing or on a free CPU (a 2-core CI host shared with other jobs is the case it stands
# for).
#   bash scripts/test_under_load.sh              # 5 runs of the README's suite (scripts/test.sh), stress on every core
#   RUNS=2 LOAD_CPUS=1 bash scripts/test_under_load.sh tests/test_gateway.py    # extra arguments go to pytest
# After `bash scripts/setup.sh` (scripts/test.sh runs it; this script does not, to leave it out of the load). Per run:
# pytest with scripts/test.sh's options, its output in $LOAD_LOGS/run<k>.log (default runs/test_under_load) and its
# last line here. Stops at the first run that fails (exit 1); the stress workers stop on any exit. Needs `stress`
# (scripts/setup.sh installs it where it can).
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RUNS="${RUNS:-5}"
LOAD_CPUS="${LOAD_CPUS:-$(nproc)}"
LOAD_LOGS="${LOAD_LOGS:-runs/test_under_load}"
if ! [[ "$RUNS" =~ ^[1-9][0-9]*$ && "$LOAD_CPUS" =~ ^[1-9][0-9]*$ ]]; then
  echo "test_under_load: RUNS and LOAD_CPUS must be positive integers, got RUNS=$RUNS LOAD_CPUS=$LOAD_CPUS" >&2
  exit 2
fi
command -v stress >/dev/null || { echo "test_under_load: needs stress (apt-get install stress)" >&2; exit 2; }
[[ -x .venv/bin/python ]] || { echo "test_under_load: no .venv here: run bash scripts/setup.sh first" >&2; exit 2; }
mkdir -p "$LOAD_LOGS"
# Its own session, so that the trap stops stress's forked workers with it, and waits (10 s, then KILL) until none is
# left.
setsid stress --cpu "$LOAD_CPUS" >/dev/null 2>&1 &
STRESS=$!
stop_stress() {
  kill -TERM -- "-$STRESS" 2>/dev/null || return 0
  wait "$STRESS" 2>/dev/null || true  # reaps the master; its workers are reparented and reaped elsewhere
  for _ in $(seq 100); do kill -0 -- "-$STRESS" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL -- "-$STRESS" 2>/dev/null || true
}
trap stop_stress EXIT
echo "[test_under_load] stress --cpu $LOAD_CPUS (pid $STRESS) on $(nproc) cores; $RUNS runs; logs in $LOAD_LOGS"
for run in $(seq 1 "$RUNS"); do
  log="$LOAD_LOGS/run$run.log"
  start=$(date +%s)
  if .venv/bin/python -m pytest -q -rs --durations=15 "$@" >"$log" 2>&1; then status=passed; else status=failed; fi
  echo "[test_under_load] run $run of $RUNS: $status in $(( $(date +%s) - start )) s: $(tail -n 1 "$log")"
  [[ $status == passed ]] || { echo "[test_under_load] stopped at run $run; see $log" >&2; exit 1; }
done
echo "[test_under_load] $RUNS of $RUNS runs passed under stress --cpu $LOAD_CPUS"
