#!/usr/bin/env bash
# Mutation testing of the code users rely on when things go wrong: mutmut changes one thing at a time (an operator,
# a constant, a comparison, a removed call) and runs the tests that pin that file; a mutant that no test notices
# "survives". By hand, not in CI (hours on 2 cores for all five files).
#
#   bash scripts/mutation_test.sh                          # every file below
#   bash scripts/mutation_test.sh cope_rlhf/advantage.py   # one of them
#
# Each file runs in a throwaway git worktree of HEAD (mutmut edits the file in place; the working tree is never
# touched, so commit first what you want tested), with this checkout's .venv and .venvs linked into it. mutmut
# 2.5.1 (pinned) lives in its own venv, .venvs/mutmut; the tests run in .venv. Report per file, survivors with their
# diffs: runs/mutation/<file>.txt (MUTATION_OUT). A survivor is either a missing test or an equivalent mutant (one
# that changes no behaviour); the note that reports a run says which.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${MUTATION_OUT:-$ROOT/runs/mutation}"

# file -> the tests that pin it (run with -x: the first failure kills the mutant)
declare -A TESTS=(
  [env_gateway/server.py]="tests/test_gateway.py tests/test_adapters_contract.py"
  [agent_funcs/base.py]="tests/test_agent_funcs.py tests/test_adapters_contract.py tests/test_action_formats.py"
  [cope_rlhf/advantage.py]="tests/test_advantage.py"
  [cope_rlhf/forecast.py]="tests/test_forecast.py"
  [scripts/eval.py]="tests/test_eval.py tests/test_adapters_contract.py"
)
files=("$@")
if ((${#files[@]} == 0)); then files=(env_gateway/server.py agent_funcs/base.py cope_rlhf/advantage.py
                                     cope_rlhf/forecast.py scripts/eval.py); fi
for file in "${files[@]}"; do
  [[ -n "${TESTS[$file]:-}" ]] || { echo "mutation_test.sh: no tests listed for '$file'; known: ${!TESTS[*]}" >&2; exit 2; }
done
[[ -x .venv/bin/python ]] || { echo "mutation_test.sh: .venv is missing: run bash scripts/setup.sh" >&2; exit 2; }
if [[ ! -x .venvs/mutmut/bin/mutmut ]]; then
  python3 -m venv .venvs/mutmut
  .venvs/mutmut/bin/pip install -q "mutmut==2.5.1"
fi

mkdir -p "$OUT"
for file in "${files[@]}"; do
  work="$(mktemp -d /tmp/cope-mutation-XXXX)/tree"
  git worktree add -q --detach "$work" HEAD
  ln -s "$ROOT/.venv" "$work/.venv"
  ln -s "$ROOT/.venvs" "$work/.venvs"
  report="$OUT/$(echo "$file" | tr / _).txt"
  echo "== $file: mutants checked by ${TESTS[$file]}; report: $report"
  (
    cd "$work"
    # exit status: a bit set per kind of surviving mutant (see mutmut run --help); the report says which
    .venvs/mutmut/bin/mutmut run --paths-to-mutate "$file" --tests-dir tests/ --simple-output \
      --runner ".venv/bin/python -m pytest -x -q -p no:cacheprovider ${TESTS[$file]}" || true
    {
      echo "# mutmut 2.5.1 on $file at $(git rev-parse --short HEAD), tests: ${TESTS[$file]}"
      .venvs/mutmut/bin/mutmut results
      for id in $(.venvs/mutmut/bin/mutmut result-ids survived); do
        echo "--- survivor $id"
        .venvs/mutmut/bin/mutmut show "$id"
      done
    } > "$report"
  )
  git worktree remove --force "$work"
  rmdir "$(dirname "$work")"
  tail -n +2 "$report" | sed -n '1,12p'
done
