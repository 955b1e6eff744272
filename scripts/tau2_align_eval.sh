#!/usr/bin/env bash
# τ²-bench evaluation through τ²'s own CLI (`tau2 run`), on one machine, with the protocol the published τ² numbers
# used (docs/TAU2_GRPO.md, "Protocol alignment"); scripts/sbatch_tau2_align.sh is the Slurm twin and runs this script.
#
#   TAU2_VERSION=infopo MODEL_PATH=runs/x/model TAG=mine bash scripts/tau2_align_eval.sh
#   POLICY_BASE_URL=http://host:8000/v1 TAG=mine bash scripts/tau2_align_eval.sh     (a policy already served)
#   DRY_RUN=1 ... bash scripts/tau2_align_eval.sh                                     (print the plan, start nothing)
#
# What it does: serves MODEL_PATH with vLLM's OpenAI-compatible server and the Hermes tool-call parser (unless
# POLICY_BASE_URL names a running one), optionally serves a local user model the same way, writes the whole
# evaluation config to RESULTS_DIR/<TAG>_eval_config.json, runs `tau2 run` once per domain (results:
# RESULTS_DIR/<TAG>_<domain>.json, log: RESULTS_DIR/<TAG>_<domain>.log), then scores them with
# scripts/tau2_align_score.py --tag TAG. Every server it started is stopped on exit, failure included.
#
# Settings (default: the published protocol; changing one is a deviation, printed and written to the config):
#   TAG (required)  MODEL_PATH (required unless POLICY_BASE_URL)  TAU2_VERSION=infopo (the tau2 install: infopo =
#   tau2-bench at commit c5b2d22 in .venvs/tau2, from `bash scripts/setup_env.sh tau2`; TAU2_VENV overrides)
#   DOMAINS="airline retail telecom"  TASK_SPLIT=test  NUM_TRIALS=4  MAX_STEPS=200  AGENT_TEMPERATURE=0
#   USER_LLM=gpt-4o-mini-2024-07-18  USER_TEMPERATURE=0  MAX_MODEL_LEN=32768  SERVED_NAME=policy
#   USER_BASE_URL= (an OpenAI-compatible user endpoint; empty: the provider litellm picks for USER_LLM)
#   USER_MODEL_PATH= (serve this checkpoint as the user model with vLLM here: a deviation from the published user)
#   USER_KEY_FILE=.secrets/tau2_user_api_key (the user model's key: read from the file, given only to `tau2 run` as
#     OPENAI_API_KEY in its environment, never on a command line, never logged; may be absent for a local user model)
#   RESULTS_DIR=runs/tau2  ON_EXISTING=archive (a result file of the same TAG is moved to RESULTS_DIR/archive/ first;
#     resume: continue it, answering tau2's resume question; fail: stop)  TASK_IDS= NUM_TASKS= (subsets: tests only)
#   MAX_CONCURRENCY=3 (tau2's default)  VLLM=vllm (the CLI)  VLLM_ARGS= (more `vllm serve` arguments)
#   POLICY_CUDA_DEVICES= USER_CUDA_DEVICES= (CUDA_VISIBLE_DEVICES of each server)  STARTUP_TIMEOUT=1200 (seconds)
#   TAU2_BENCH_DIR=../shared/tau2-bench-c5b2d22 (tau2 records `git rev-parse HEAD` of its working directory as the
#     run's commit: `tau2 run` runs inside this checkout when it is a git checkout, else in an empty folder, where it
#     records "unknown")  PYTHON (for the scorer; default .venv/bin/python)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

die() { echo "tau2_align_eval: error: $*" >&2; exit 2; }
is_true() { case "${1,,}" in 1 | true | yes | on) return 0 ;; *) return 1 ;; esac; }
say() { echo "tau2_align_eval: $*"; }

# ---- the protocol (published τ²-bench evaluation settings; see docs/TAU2_GRPO.md) -------------------------------
: "${TAU2_VERSION:=infopo}"       # the tau2-bench commit the numbers were made with: c5b2d22
: "${DOMAINS:=airline retail telecom}"  # every domain of the published table
: "${TASK_SPLIT:=test}"           # report on the test split (training used train)
: "${NUM_TRIALS:=4}"              # Avg@4 and pass^1..4 need 4 trials of every task
: "${MAX_STEPS:=200}"             # tau2's own step cap (its default at c5b2d22; counted in messages)
: "${AGENT_TEMPERATURE:=0.0}"       # greedy policy (tau2's default agent temperature)
: "${USER_LLM:=gpt-4o-mini-2024-07-18}"  # the user model of the published numbers
: "${USER_TEMPERATURE:=0.0}"        # ... at temperature 0 (tau2's default)
: "${MAX_MODEL_LEN:=32768}"       # the policy server's context (vLLM --max-model-len), not a tau2 argument
: "${SERVED_NAME:=policy}" "${USER_SERVED_NAME:=user}"
: "${POLICY_BASE_URL:=}" "${MODEL_PATH:=}" "${USER_BASE_URL:=}" "${USER_MODEL_PATH:=}"
: "${USER_KEY_FILE:=${COPE_SECRETS_DIR:-$ROOT/.secrets}/tau2_user_api_key}"
: "${RESULTS_DIR:=runs/tau2}" "${ON_EXISTING:=archive}" "${TASK_IDS:=}" "${NUM_TASKS:=}" "${MAX_CONCURRENCY:=3}"
: "${VLLM:=vllm}" "${VLLM_ARGS:=}" "${POLICY_CUDA_DEVICES:=}" "${USER_CUDA_DEVICES:=}" "${STARTUP_TIMEOUT:=1200}"
: "${TAU2_BENCH_DIR:=$(dirname "$ROOT")/shared/tau2-bench-c5b2d22}"
: "${TAG:?set TAG, the name this evaluation is saved and scored under (e.g. TAG=mine)}"
[[ "$TAG" =~ ^[A-Za-z0-9._-]+$ ]] || die "TAG=$TAG: use letters, digits, '.', '_' and '-' only"

case "$TAU2_VERSION" in
    infopo) : "${TAU2_VENV:=$ROOT/.venvs/tau2}"; TAU2_COMMIT=c5b2d22 ;;
    *) die "TAU2_VERSION=$TAU2_VERSION: known versions: infopo (tau2-bench at commit c5b2d22, .venvs/tau2)" ;;
esac
TAU2="$TAU2_VENV/bin/tau2"
TAU2_PY="$TAU2_VENV/bin/python"
case "$ON_EXISTING" in
    archive | resume | fail) ;;
    *) die "ON_EXISTING=$ON_EXISTING: use archive, resume or fail" ;;
esac
if [ -z "$POLICY_BASE_URL" ] && [ -z "$MODEL_PATH" ]; then
    die "set MODEL_PATH (a Hugging Face checkpoint to serve with vLLM) or POLICY_BASE_URL (a running" \
        "OpenAI-compatible server whose model is named SERVED_NAME=$SERVED_NAME)"
fi
read -r -a domains <<<"$DOMAINS"
[ "${#domains[@]}" -ge 1 ] || die "DOMAINS is empty"
case "$RESULTS_DIR" in /*) RESULTS_ABS="$RESULTS_DIR" ;; *) RESULTS_ABS="$ROOT/$RESULTS_DIR" ;; esac
is_true "${DRY_RUN:-0}" || mkdir -p "$RESULTS_ABS"

# Deviations from the published protocol: printed, and written into the config.
deviations=()
[ "$DOMAINS" = "airline retail telecom" ] || deviations+=("domains: $DOMAINS (published: airline retail telecom)")
[ "$TASK_SPLIT" = test ] || deviations+=("task split $TASK_SPLIT (published: test)")
[ "$NUM_TRIALS" = 4 ] || deviations+=("$NUM_TRIALS trials (published: 4)")
[ "$MAX_STEPS" = 200 ] || deviations+=("max steps $MAX_STEPS (published: 200)")
[[ "$AGENT_TEMPERATURE" =~ ^0(\.0*)?$ ]] || deviations+=("agent temperature $AGENT_TEMPERATURE (published: 0)")
[[ "$USER_TEMPERATURE" =~ ^0(\.0*)?$ ]] || deviations+=("user temperature $USER_TEMPERATURE (published: 0)")
if [ -n "$USER_MODEL_PATH" ]; then
    deviations+=("user model: local $USER_MODEL_PATH served here (published: gpt-4o-mini-2024-07-18)")
elif [ "$USER_LLM" != gpt-4o-mini-2024-07-18 ]; then
    deviations+=("user model $USER_LLM (published: gpt-4o-mini-2024-07-18)")
fi
[ -z "$TASK_IDS$NUM_TASKS" ] || deviations+=("a subset of tasks (TASK_IDS=$TASK_IDS NUM_TASKS=$NUM_TASKS)")
for d in "${deviations[@]}"; do say "deviation from the published protocol: $d"; done

# ---- servers ----------------------------------------------------------------------------------------------------
server_pids=()
cleanup() {
    local pid
    for pid in "${server_pids[@]}"; do  # each server leads its own process group (setsid): stop the whole group
        kill -TERM -- "-$pid" 2>/dev/null || true
    done
    for pid in "${server_pids[@]}"; do
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "tau2_align_eval: server pid $pid ignored SIGTERM for 20 s; killing its group" >&2
            kill -KILL -- "-$pid" 2>/dev/null || true
        fi
    done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    "$TAU2_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# serve NAME MODEL DEVICES: starts `vllm serve` in its own process group; SERVED_URL := its /v1 URL once it answers.
serve() {
    local name="$1" model="$2" devices="$3" port="<a free port>" log
    # vLLM binds the port itself: chosen free just before, and the health wait below checks that it is vLLM there
    is_true "${DRY_RUN:-0}" || port="$(free_port)"
    log="$RESULTS_ABS/${TAG}_vllm_${name}.log"
    local served="$SERVED_NAME"
    [ "$name" = policy ] || served="$USER_SERVED_NAME"
    local extra
    read -r -a extra <<<"$VLLM_ARGS"
    local cmd=("$VLLM" serve "$model" --served-model-name "$served" --host 127.0.0.1 --port "$port"
        --enable-auto-tool-choice --tool-call-parser hermes --max-model-len "$MAX_MODEL_LEN" "${extra[@]}")
    SERVED_URL="http://127.0.0.1:$port/v1"
    if is_true "${DRY_RUN:-0}"; then
        printf '%s' "${devices:+CUDA_VISIBLE_DEVICES=$devices }"; printf '%q ' "${cmd[@]}"; echo
        return
    fi
    command -v "$VLLM" >/dev/null || die "$VLLM (vLLM's CLI) not found: install vLLM, set VLLM=<path>, or set" \
        "POLICY_BASE_URL to a running server"
    say "serving $model as '$served' on $SERVED_URL (log: $log)"
    if [ -n "$devices" ]; then
        CUDA_VISIBLE_DEVICES="$devices" setsid "${cmd[@]}" >"$log" 2>&1 </dev/null &
    else
        setsid "${cmd[@]}" >"$log" 2>&1 </dev/null &
    fi
    local pid=$!
    server_pids+=("$pid")
    local deadline=$((SECONDS + STARTUP_TIMEOUT))
    until curl -fsS -m 5 -o /dev/null "$SERVED_URL/models" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 30 "$log" >&2 || true
            die "the $name vLLM server exited before it answered $SERVED_URL/models (log above, whole: $log)"
        fi
        [ "$SECONDS" -lt "$deadline" ] || die "the $name vLLM server did not answer $SERVED_URL/models within" \
            "${STARTUP_TIMEOUT}s (STARTUP_TIMEOUT; log: $log)"
        sleep 2
    done
}

if [ -z "$POLICY_BASE_URL" ]; then
    serve policy "$MODEL_PATH" "$POLICY_CUDA_DEVICES"
    POLICY_BASE_URL="$SERVED_URL"
fi
if [ -n "$USER_MODEL_PATH" ]; then
    serve user "$USER_MODEL_PATH" "$USER_CUDA_DEVICES"
    USER_BASE_URL="$SERVED_URL" USER_LLM="openai/$USER_SERVED_NAME"
fi

# ---- tau2 -------------------------------------------------------------------------------------------------------
if ! is_true "${DRY_RUN:-0}"; then
    [ -x "$TAU2" ] || die "$TAU2 not found: build it with \`bash scripts/setup_env.sh tau2\` (TAU2_BENCH_DIR: a" \
        "sierra-research/tau2-bench checkout at commit $TAU2_COMMIT)"
fi
# tau2 writes DATA_DIR/simulations/<save-to>.json; pathlib drops DATA_DIR/simulations for an absolute <save-to>.
# The agent's arguments: τ²'s defaults (temperature 0) plus where the policy is. Nothing else: c5b2d22 hands
# every key to litellm, which sends unknown ones to the server, and vLLM refuses e.g. max_context_tokens.
agent_args="{\"temperature\": $AGENT_TEMPERATURE, \"api_base\": \"$POLICY_BASE_URL\", \"api_key\": \"EMPTY\"}"
user_args="{\"temperature\": $USER_TEMPERATURE${USER_BASE_URL:+, \"api_base\": \"$USER_BASE_URL\"}}"
scratch="$(mktemp -d "${TMPDIR:-/tmp}/tau2_align_eval.XXXXXX")"  # this script's own, removed on exit
trap 'cleanup; rm -rf "$scratch"' EXIT
run_dir="$scratch/cwd"  # tau2's working directory when no git checkout is there (tau2 records "unknown")
mkdir "$run_dir"
if git -C "$TAU2_BENCH_DIR" rev-parse HEAD >/dev/null 2>&1; then
    head_commit="$(git -C "$TAU2_BENCH_DIR" rev-parse HEAD)"
    [[ "$head_commit" == "$TAU2_COMMIT"* ]] || die "$TAU2_BENCH_DIR is at commit $head_commit, not $TAU2_COMMIT" \
        "(TAU2_VERSION=$TAU2_VERSION): check out $TAU2_COMMIT there, rebuild .venvs/tau2, or set TAU2_BENCH_DIR"
    run_dir="$(cd "$TAU2_BENCH_DIR" && pwd)"
fi

config="$RESULTS_ABS/${TAG}_eval_config.json"
write_config() {
    local dev_json
    dev_json="$(printf '%s\n' "${deviations[@]}")"
    DEVIATIONS="$dev_json" TAG="$TAG" TAU2_COMMIT="$TAU2_COMMIT" TAU2_VENV="$TAU2_VENV" MODEL_PATH="$MODEL_PATH" \
        POLICY_BASE_URL="$POLICY_BASE_URL" AGENT_ARGS="$agent_args" USER_LLM="$USER_LLM" USER_ARGS="$user_args" \
        USER_MODEL_PATH="$USER_MODEL_PATH" RESULTS_ABS="$RESULTS_ABS" RUN_DIR="$run_dir" \
        DOMAINS="$DOMAINS" TASK_SPLIT="$TASK_SPLIT" NUM_TRIALS="$NUM_TRIALS" MAX_STEPS="$MAX_STEPS" \
        MAX_MODEL_LEN="$MAX_MODEL_LEN" SERVED_NAME="$SERVED_NAME" TASK_IDS="$TASK_IDS" NUM_TASKS="$NUM_TASKS" \
        MAX_CONCURRENCY="$MAX_CONCURRENCY" TAU2_VERSION="$TAU2_VERSION" "$1" - "$2" <<'EOF'
import datetime, json, os, sys
e = os.environ
config = {
    "tag": e["TAG"], "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "tau2_version": e["TAU2_VERSION"], "tau2_commit": e["TAU2_COMMIT"], "tau2_venv": e["TAU2_VENV"],
    "tau2_working_dir": e["RUN_DIR"],
    "policy": {"model_path": e["MODEL_PATH"] or None, "served_name": e["SERVED_NAME"], "base_url": e["POLICY_BASE_URL"],
               "server": "vllm serve --enable-auto-tool-choice --tool-call-parser hermes" if e["MODEL_PATH"] else
               "given (POLICY_BASE_URL)", "max_model_len": int(e["MAX_MODEL_LEN"]),
               "agent_llm": "openai/" + e["SERVED_NAME"], "agent_llm_args": json.loads(e["AGENT_ARGS"])},
    "user": {"llm": e["USER_LLM"], "llm_args": json.loads(e["USER_ARGS"]),
             "local_model_path": e["USER_MODEL_PATH"] or None},
    "domains": e["DOMAINS"].split(), "task_split": e["TASK_SPLIT"], "num_trials": int(e["NUM_TRIALS"]),
    "max_steps": int(e["MAX_STEPS"]), "max_errors": "tau2 default (10)", "seed": "tau2 default (300)",
    "max_concurrency": int(e["MAX_CONCURRENCY"]), "task_ids": e["TASK_IDS"].split() or None,
    "num_tasks": int(e["NUM_TASKS"]) if e["NUM_TASKS"] else None,
    "results": {d: os.path.join(e["RESULTS_ABS"], f"{e['TAG']}_{d}.json") for d in e["DOMAINS"].split()},
    "deviations": [d for d in e["DEVIATIONS"].splitlines() if d],
}
config["api_key_in_config"] = False  # the user model's key is never written here
if sys.argv[1] == "-":
    print(json.dumps(config, indent=1))
else:
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
EOF
}

if is_true "${DRY_RUN:-0}"; then
    say "config ($config):"
    write_config "${PYTHON:-python3}" -
else
    write_config "$TAU2_PY" "$config"
    say "config written to $config"
fi

# The user model's key: from the file into tau2's environment only (OPENAI_API_KEY, which litellm reads).
user_key=""
if [ -f "$USER_KEY_FILE" ]; then
    user_key="$(tr -d '[:space:]' <"$USER_KEY_FILE")"
elif [ -n "$USER_MODEL_PATH" ] || is_true "${DRY_RUN:-0}"; then
    user_key="EMPTY"
else
    die "no user-model key at $USER_KEY_FILE: write the key there (chmod 600; any text for a local" \
        "OpenAI-compatible server), or set USER_KEY_FILE"
fi

redact() {  # copies stdin to stdout and FILE with the key replaced (the key reaches the filter by its environment)
    REDACT_KEY="$user_key" "$TAU2_PY" -u -c '
import os, sys
key = os.environ.pop("REDACT_KEY")
with open(sys.argv[1], "a", encoding="utf-8") as log:
    for line in sys.stdin:
        line = line.replace(key, "[redacted]") if len(key) >= 8 else line
        sys.stdout.write(line); sys.stdout.flush(); log.write(line); log.flush()
' "$1"
}

for domain in "${domains[@]}"; do
    save="$RESULTS_ABS/${TAG}_${domain}"
    cmd=("$TAU2" run --domain "$domain" --agent-llm "openai/$SERVED_NAME" --agent-llm-args "$agent_args"
        --user-llm "$USER_LLM" --user-llm-args "$user_args" --task-split-name "$TASK_SPLIT"
        --num-trials "$NUM_TRIALS" --max-steps "$MAX_STEPS" --max-concurrency "$MAX_CONCURRENCY" --save-to "$save")
    if [ -n "$TASK_IDS" ]; then read -r -a ids <<<"$TASK_IDS"; cmd+=(--task-ids "${ids[@]}"); fi
    if [ -n "$NUM_TASKS" ]; then cmd+=(--num-tasks "$NUM_TASKS"); fi
    if is_true "${DRY_RUN:-0}"; then
        printf '(cd %q && %q ' "$run_dir" "OPENAI_API_KEY=<from $USER_KEY_FILE>"; printf '%q ' "${cmd[@]}"
        printf '</dev/null)\n'
        continue
    fi
    # tau2 asks on stdin before it reuses an existing save file (an EOFError under sbatch, a hang in a terminal):
    # the file is moved aside first, or (resume) the question is answered; stdin is never a terminal.
    answer=/dev/null
    if [ -e "$save.json" ]; then
        case "$ON_EXISTING" in
            archive)
                mkdir -p "$RESULTS_ABS/archive"
                stamp="$(date -u +%Y%m%dT%H%M%SZ)"
                mv "$save.json" "$RESULTS_ABS/archive/${TAG}_${domain}.$stamp.json"
                [ ! -e "$save.log" ] || mv "$save.log" "$RESULTS_ABS/archive/${TAG}_${domain}.$stamp.log"
                say "$domain: the previous results of TAG=$TAG moved to $RESULTS_ABS/archive/ (*.$stamp.*)" ;;
            resume) answer="$scratch/resume-answer"; printf 'y\n' >"$answer"
                say "$domain: resuming $save.json (tau2 refuses if the run's config changed)" ;;
            fail) die "$save.json exists: pick another TAG, delete it, or set ON_EXISTING=archive|resume" ;;
        esac
    fi
    say "$domain: tau2 run (log: $save.log)"
    status=0
    (cd "$run_dir" && OPENAI_API_KEY="$user_key" "${cmd[@]}" <"$answer" 2>&1) | redact "$save.log" || status=$?
    if [ "$status" != 0 ] && grep -q "AssistantMessage must have either content or tool calls" "$save.log"; then
        die "$domain: \`tau2 run\` failed (exit $status; log: $save.log): the policy answered a turn with an empty" \
            "message, and tau2 at c5b2d22 then stops the whole domain, with no simulation saved (docs/TAU2_GRPO.md, \"Traps\")"
    fi
    [ "$status" = 0 ] || die "$domain: \`tau2 run\` failed (exit $status; log: $save.log)"
done

score=("${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}"
    scripts/tau2_align_score.py --tag "$TAG" --results-dir "$RESULTS_ABS" --trials "$NUM_TRIALS"
    --split "$TASK_SPLIT" --domains "${domains[@]}")
if is_true "${DRY_RUN:-0}"; then printf '%q ' "${score[@]}"; echo; exit 0; fi
"${score[@]}"
