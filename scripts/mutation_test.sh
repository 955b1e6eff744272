#!/usr/bin/env bash
# Mutation testing of the code users rely on when things go wrong: mutmut changes one thing at a time (an operator,
# a constant, a comparison, a string, a removed argument) and runs the tests that cover the changed function; a
# mutant that no test notices "survives". By hand, not in CI.
#
#   bash scripts/mutation_test.sh                          # every file below
#   bash scripts/mutation_test.sh cope_rlhf/advantage.py   # one of them
#
# Each file runs in a throwaway git worktree of HEAD (commit first what you want tested; MUTATION_SOURCE=working: a
# copy of this checkout's files as they are, tracked and untracked-not-ignored, for work not committed yet), with this
# checkout's .venv
# and .venvs linked into it and a [mutmut] section in its setup.cfg naming the file and its tests. mutmut 3.8.1
# (pinned) runs inside .venv's interpreter, as its tests do (it forks per mutant after importing them once); it and
# the packages .venv lacks are installed into .venvs/mutmut-lib, put on PYTHONPATH for mutmut only, so .venv itself
# is not changed. Per file: <MUTATION_OUT>/<file>.txt (default runs/mutation), the tally and every survivor's diff.
# MUTATION_SAMPLE=N tests N of a file's mutants drawn uniformly (seed MUTATION_SAMPLE_SEED, default 0; another seed
# draws another sample) instead of all of them, for a file whose tests take minutes per mutant (the BabyAI server's:
# 1,122 mutants, its AgentGym parity test alone 2 minutes); the tally is then an estimate, its report says so.
# MUTATION_ONLY="probe reap_loop Pool.__init__" tests only the mutants of those functions (a method: its name, or
# Class.method), e.g. the rest of a run that was stopped; its report says which.
# A survivor is a missing test or an equivalent mutant (one that changes no behaviour); the note reporting a run says
# which.
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${MUTATION_OUT:-$ROOT/runs/mutation}"
LIB="$ROOT/.venvs/mutmut-lib"

# file -> the test files that pin it (mutmut runs, per mutant, those of their tests that call the changed function;
# tests that start the gateway or an eval as a subprocess run the mutant there too: it is chosen by an environment
# variable the subprocess inherits). forecast.py's loss is pinned by tests/test_forecast.py (forecast_loss and
# packed_forecast_nll against their formulas), tests/test_branches.py (packed against per-sample, several
# trajectories) and tests/test_temporal_ensemble.py (TE's members cut at their last slot); the policy actor's tests
# that also reach it take minutes each. The same for advantage.py: tests/test_advantage.py alone killed every
# non-equivalent mutant of it (80 in 3 min at 6d0db08), where adding tests/test_actor.py made a run last hours.
declare -A TESTS=(
  [env_gateway/server.py]="tests/test_gateway.py tests/test_gateway_answers.py tests/test_gateway_cli.py
                           tests/test_gateway_adapters.py tests/test_adapters_contract.py tests/test_gateway_hostile.py"
  [env_gateway/servers/_base.py]="tests/test_server_base.py tests/test_gateway_hostile.py"
  [cope_rlhf/preflight.py]="tests/test_preflight_units.py tests/test_preflight.py"
  [agent_funcs/base.py]="tests/test_agent_base_contract.py tests/test_agent_funcs.py tests/test_adapters_contract.py
                         tests/test_action_formats.py"
  [cope_rlhf/advantage.py]="tests/test_advantage.py"
  [cope_rlhf/forecast.py]="tests/test_forecast.py tests/test_action_formats.py tests/test_branches.py
                           tests/test_temporal_ensemble.py"
  [cope_rlhf/temporal_ensemble.py]="tests/test_temporal_ensemble.py tests/test_branches.py"
  [cope_rlhf/info_gain.py]="tests/test_info_gain.py tests/test_branches.py"
  [scripts/eval.py]="tests/test_eval.py tests/test_adapters_contract.py"
  [agent_funcs/tau2.py]="tests/test_tau2.py tests/test_action_formats.py tests/test_agent_base_contract.py"
  [scripts/tau2_align_score.py]="tests/test_tau2_score.py tests/test_eval.py"
  [env_gateway/servers/babyai.py]="tests/test_server_babyai.py tests/test_parity_babyai.py"
  [scripts/reply_census.py]="tests/test_reply_census.py"
  [scripts/run_report.py]="tests/test_run_report.py"
)
# A file whose tests need packages only an env server's venv has runs there: mutmut in that venv's interpreter, with
# mutmut and pytest (and their requirements) from .venvs/mutmut-lib-full, since that venv has neither. Run by its own
# venv, the tests serve the env in process (tests/env_server_proc.py), where mutmut sees which test reaches what.
declare -A VENV=([env_gateway/servers/babyai.py]=.venvs/babyai)
files=("$@")
if ((${#files[@]} == 0)); then files=(env_gateway/server.py env_gateway/servers/_base.py agent_funcs/base.py
                                     scripts/eval.py cope_rlhf/advantage.py cope_rlhf/forecast.py
                                     cope_rlhf/temporal_ensemble.py cope_rlhf/info_gain.py
                                     cope_rlhf/preflight.py agent_funcs/tau2.py scripts/tau2_align_score.py
                                     env_gateway/servers/babyai.py scripts/reply_census.py); fi
for file in "${files[@]}"; do
  [[ -n "${TESTS[$file]:-}" ]] || { echo "mutation_test.sh: no tests listed for '$file'; known: ${!TESTS[*]}" >&2
                                    exit 2; }
done
[[ -x .venv/bin/python ]] || { echo "mutation_test.sh: .venv is missing: run bash scripts/setup.sh" >&2; exit 2; }
if [[ ! -f "$LIB/mutmut/__init__.py" ]]; then  # mutmut's own requirements .venv lacks; the rest it shares with .venv
  .venv/bin/python -m pip install -q --no-deps --target "$LIB" mutmut==3.8.1 coverage==7.17.5 libcst==1.9.0 \
    textual==8.2.8 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
FULL_LIB="$ROOT/.venvs/mutmut-lib-full"
for file in "${files[@]}"; do
  venv="${VENV[$file]:-}"
  [[ -z "$venv" || -x "$venv/bin/python" ]] || { echo "mutation_test.sh: $file's tests run in $venv, which is missing:" \
                                                      "run bash scripts/setup_env.sh $(basename "$venv")" >&2; exit 2; }
  if [[ -n "$venv" && ! -f "$FULL_LIB/mutmut/__init__.py" ]]; then
    .venv/bin/python -m pip install -q --target "$FULL_LIB" mutmut==3.8.1 coverage==7.17.5 libcst==1.9.0 \
      textual==8.2.8 pytest=="$(.venv/bin/python -c 'import pytest; print(pytest.__version__)')" pytest-timeout==2.4.0 \
      2>&1 | { grep -v "^WARNING: Location\|requires\|dependency conflicts" || true; }
  fi
done
# One torch thread: mutmut forks a child per mutant from a parent that has run the tests, and a child forked while
# torch's intra-op thread pool held a lock waited on it forever (seen with the TE and branch tests).
mutmut() {
  if [[ -n "${VENV[$file]:-}" ]]; then local python="$ROOT/${VENV[$file]}/bin/python" lib="$FULL_LIB"
  else local python="$ROOT/.venv/bin/python" lib="$LIB"; fi
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH="$lib" "$python" -m mutmut "$@"
}

mkdir -p "$OUT"
source="$(git rev-parse --short HEAD)"
[[ "${MUTATION_SOURCE:-HEAD}" != working ]] || source="$source with this checkout's uncommitted changes"
for file in "${files[@]}"; do
  read -r -d '' -a tests <<<"${TESTS[$file]}" || true  # the words of all its lines
  work="$(mktemp -d /tmp/cope-mutation-XXXX)/tree"
  if [[ "${MUTATION_SOURCE:-HEAD}" == working ]]; then  # deleted-but-tracked files are skipped, not an error
    mkdir -p "$work"
    git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -cf - 2>/dev/null \
      | tar -xf - -C "$work"
    (cd "$work" && git init -q && git add -A && git -c user.name=mutation -c user.email=m@localhost commit -qm tree)
  else
    git worktree add -q --detach "$work" HEAD
  fi
  ln -s "$ROOT/.venv" "$work/.venv"
  ln -s "$ROOT/.venvs" "$work/.venvs"
  # the tests run inside mutmut's copy (mutants/), and find the env servers' venvs from there: without these links the
  # tests that start a server skip, and every mutant only they would catch "survives"
  mkdir -p "$work/mutants"
  ln -s "$ROOT/.venv" "$work/mutants/.venv"
  ln -s "$ROOT/.venvs" "$work/mutants/.venvs"
  # and the data beside the checkout (../shared: AgentGym's servers, tau2's package and data), which the parity and
  # tau2 tests look for beside their own root (the tree, or mutmut's copy in it); without it they skip
  if [[ -d "$ROOT/../shared" ]]; then
    ln -s "$(cd "$ROOT/.." && pwd)/shared" "$work/shared"
    ln -s "$(cd "$ROOT/.." && pwd)/shared" "$(dirname "$work")/shared"
  fi
  printf '[mutmut]\nsource_paths=\n    %s/\nonly_mutate=\n    %s\npytest_add_cli_args_test_selection=%s\n' \
    "$(dirname "$file")" "$file" "$(printf '\n    %s' "${tests[@]}")" > "$work/setup.cfg"
  printf 'also_copy=\n    agent_funcs/\n    cope_rlhf/\n    env_gateway/\n    scripts/\n    data/\n' >> "$work/setup.cfg"
  report="$OUT/$(echo "$file" | tr / _).txt"
  echo "== $file: mutants checked by ${tests[*]}${VENV[$file]:+ in ${VENV[$file]}}; report: $report"
  (
    cd "$work"
    if [[ -n "${MUTATION_SAMPLE:-}" ]]; then
      # a run that matches no mutant generates them all and maps them to tests, then stops: the sample is drawn from
      # the generated names, and the second run reuses the mapping
      mutmut run "no-such-mutant" > "$work/generate.log" 2>&1 || true
      mapfile -t sample < <("$ROOT/.venv/bin/python" - "$MUTATION_SAMPLE" "${MUTATION_SAMPLE_SEED:-0}" <<'PY'
import glob, json, random, sys
names = sorted(k for meta in glob.glob("mutants/**/*.meta", recursive=True)
               for k in json.load(open(meta))["exit_code_by_key"])
print("\n".join(sorted(random.Random(int(sys.argv[2])).sample(names, min(int(sys.argv[1]), len(names))))))
PY
)
      if ((${#sample[@]})); then mutmut run "${sample[@]}" > "$work/run.log" 2>&1 || true
      else { echo "mutation_test.sh: mutmut generated no mutants of $file:"; tail -n 20 generate.log; } | tee run.log >&2
      fi
    else
      only=()  # mutmut takes fnmatch patterns of mutant names: module.x_func__mutmut_N, module.xǁClassǁmethod__mutmut_N
      for name in ${MUTATION_ONLY:-}; do
        if [[ $name == *.* ]]; then only+=("*ǁ${name%%.*}ǁ${name#*.}__mutmut_*")
        else only+=("*ǁ${name}__mutmut_*" "*.x_${name}__mutmut_*"); fi
      done
      mutmut run "${only[@]}" > "$work/run.log" 2>&1 || true  # exit status: whether mutants survived
    fi
    {
      echo "# mutmut 3.8.1 on $file at $source, tests: ${tests[*]}${VENV[$file]:+ (run by ${VENV[$file]})}"
      [[ -z "${MUTATION_ONLY:-}" ]] || echo "# only the mutants of: $MUTATION_ONLY; the others are 'not checked'"
      [[ -z "${MUTATION_SAMPLE:-}" ]] ||
        echo "# a uniform sample (seed ${MUTATION_SAMPLE_SEED:-0}) of ${#sample[@]} mutants; the others are" \
             "'not checked': an estimate"
      tr '\r' '\n' < run.log | grep -v '^\s*$' | tail -n 1
      mutmut results --all true | awk '{print $NF}' | sort | uniq -c
      for id in $(mutmut results | awk -F: '/: survived/ {print $1}'); do
        echo "--- survivor $id"
        mutmut show "$id" | grep '^[-+][^-+]' || echo "(mutmut show $id: no diff lines)"
      done
    } > "$report"
    # mutmut maps a mutant to the tests that reached its function in this interpreter; a module the tests only run in
    # a subprocess of another venv (an env server in .venvs/<env>) is reached by none, and every mutant goes untested
    grep -qE '^ +[0-9]+ (killed|survived)$' "$report" ||
      { echo "mutation_test.sh: no test reached $file in process, so no mutant of it was tested; mutmut's log ends:"
        tr '\r' '\n' < run.log | grep -v '^\s*$' | tail -n 40; } | tee -a "$report" >&2
  )
  if [[ "${MUTATION_SOURCE:-HEAD}" == working ]]; then rm -rf "$work"; else git worktree remove --force "$work"; fi
  rm -f "$(dirname "$work")/shared"
  rmdir "$(dirname "$work")"
  sed -n '1,8p' "$report"
done
