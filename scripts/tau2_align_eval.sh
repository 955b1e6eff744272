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
#     OPENAI_API_KEY in its environment, never on a command line, never logged; may be absent for a local user model:
#     USER_MODEL_PATH, or a USER_BASE_URL on this machine (127.0.0.0/8, localhost, [::1]), which get the placeholder)
#   TELECOM_TASKS= (the telecom task file tau2 loads: empty = tasks.json, as published; small or full = tasks_small.json
#     or tasks_full.json of the same data folder, used in place, without copying: a deviation; pair small with
#     TASK_SPLIT=small, the only split it holds)
#   RESULTS_DIR=runs/tau2  ON_EXISTING=archive (a result file of the same TAG is moved to RESULTS_DIR/archive/ first;
#     resume: continue it, answering tau2's resume question; fail: stop)  TASK_IDS= NUM_TASKS= (subsets: tests only)
#   MAX_CONCURRENCY=3 (tau2's default)  VLLM=vllm (the CLI)  VLLM_ARGS= (more `vllm serve` arguments)
#   POLICY_CUDA_DEVICES= USER_CUDA_DEVICES= (CUDA_VISIBLE_DEVICES of each server)  STARTUP_TIMEOUT=1200 (seconds)
#   TAU2_BENCH_DIR=../shared/tau2-bench-c5b2d22 (tau2 records `git rev-parse HEAD` of its working directory as the
#     run's commit: `tau2 run` runs inside this checkout when it is a git checkout, else in an empty folder, where it
#     records "unknown"; the config then records the install's commit, from pip or from .venvs/tau2/tau2-commit.json,
#     which `TAU2_COMMIT=c5b2d22 bash scripts/setup_env.sh tau2` writes: scripts/tau2_commit.py)
#   PYTHON (for the scorer; default .venv/bin/python)
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
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
: "${TELECOM_TASKS:=}"
: "${VLLM:=vllm}" "${VLLM_ARGS:=}" "${POLICY_CUDA_DEVICES:=}" "${USER_CUDA_DEVICES:=}" "${STARTUP_TIMEOUT:=1200}"
: "${TAU2_BENCH_DIR:=$(dirname "$ROOT")/shared/tau2-bench-c5b2d22}"
: "${TAG:?set TAG, the name this evaluation is saved and scored under (e.g. TAG=mine)}"
[[ "$TAG" =~ ^[A-Za-z0-9._-]+$ ]] || die "TAG=$TAG: use letters, digits, '.', '_' and '-' only"

case "$TAU2_VERSION" in
    infopo) : "${TAU2_VENV:=$ROOT/.venvs/tau2}"; TAU2_PINNED=c5b2d22 ;;
    *) die "TAU2_VERSION=$TAU2_VERSION: known versions: infopo (tau2-bench at commit c5b2d22, .venvs/tau2)" ;;
esac
TAU2="$TAU2_VENV/bin/tau2"
TAU2_PY="$TAU2_VENV/bin/python"
case "$ON_EXISTING" in
    archive | resume | fail) ;;
    *) die "ON_EXISTING=$ON_EXISTING: use archive, resume or fail" ;;
esac
case "$TELECOM_TASKS" in
    "" | small | full) ;;
    *) die "TELECOM_TASKS=$TELECOM_TASKS: leave it empty (tasks.json, as published), or name small or full" ;;
esac
is_loopback() {  # URL: whether its host is this machine (a local server needs no real key)
    local host="${1#*://}"
    host="${host%%/*}"; host="${host##*@}"
    case "$host" in
        \[::1\]*) return 0 ;;
    esac
    host="${host%%:*}"
    case "$host" in
        localhost | 127.*) return 0 ;;
        *) return 1 ;;
    esac
}
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
[ -z "$TELECOM_TASKS" ] || deviations+=("telecom task file tasks_$TELECOM_TASKS.json (published: tasks.json)")
[ "$MAX_MODEL_LEN" = 32768 ] || deviations+=("policy context $MAX_MODEL_LEN (published: 32768)")
if [ -n "$USER_BASE_URL" ] && [ -z "$USER_MODEL_PATH" ]; then
    deviations+=("user endpoint $USER_BASE_URL (published: the provider's own API)")
fi
# The tau2 commit: tau2 records its working directory's git HEAD (a TAU2_BENCH_DIR git checkout, below); for an
# install from a plain copy it records "unknown", so the install's own record is read (pip, or setup_env.sh's).
installed="$("${PYTHON:-python3}" "$ROOT/scripts/tau2_commit.py" --venv "$TAU2_VENV" --source 2>/dev/null || true)"
TAU2_INSTALLED="$(sed -n 1p <<<"$installed")" TAU2_COMMIT_SOURCE="$TAU2_VENV: $(sed -n 2p <<<"$installed")"
[ -n "$TAU2_INSTALLED" ] || TAU2_INSTALLED=unknown
top="$(git -C "$TAU2_BENCH_DIR" rev-parse --show-toplevel 2>/dev/null || true)"
if [ -n "$top" ] && [ "$(cd "$top" && pwd -P)" = "$(cd "$TAU2_BENCH_DIR" && pwd -P)" ]; then
    TAU2_INSTALLED="$(git -C "$TAU2_BENCH_DIR" rev-parse HEAD)"
    TAU2_COMMIT_SOURCE="git rev-parse HEAD of $TAU2_BENCH_DIR, where tau2 runs"
fi
if [ "$TAU2_INSTALLED" = unknown ]; then
    TAU2_COMMIT_SOURCE=""
    why="$TAU2_VENV records none (state it once: TAU2_COMMIT=$TAU2_PINNED bash scripts/setup_env.sh tau2)"
    deviations+=("tau2 commit unknown: $why and TAU2_BENCH_DIR is no git checkout (published: $TAU2_PINNED)")
elif [[ "$TAU2_INSTALLED" != "$TAU2_PINNED"* ]]; then
    deviations+=("tau2 commit $TAU2_INSTALLED (published: $TAU2_PINNED)")
fi
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
    if ! is_true "${DRY_RUN:-0}" && ! command -v "$VLLM" >/dev/null; then
        if [ "$name" = policy ]; then
            die "$VLLM (vLLM's CLI) not found, to serve the policy MODEL_PATH=$model: install vLLM, set VLLM=<path>," \
                "or set POLICY_BASE_URL to a running policy server"
        fi
        die "$VLLM (vLLM's CLI) not found, to serve the user model USER_MODEL_PATH=$model: install vLLM, set" \
            "VLLM=<path>, or serve the user model elsewhere and set USER_BASE_URL (and USER_LLM=openai/<its name>)" \
            "instead of USER_MODEL_PATH"
    fi
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
        "sierra-research/tau2-bench checkout at commit $TAU2_PINNED)"
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
    [[ "$head_commit" == "$TAU2_PINNED"* ]] || die "$TAU2_BENCH_DIR is at commit $head_commit, not $TAU2_PINNED" \
        "(TAU2_VERSION=$TAU2_VERSION): check out $TAU2_PINNED there, rebuild .venvs/tau2, or set TAU2_BENCH_DIR"
    run_dir="$(cd "$TAU2_BENCH_DIR" && pwd)"
fi

# TELECOM_TASKS: tau2 reads telecom's tasks from tasks.json of its data folder. The named file takes that place in a
# folder of links to the data folder (nothing copied, nothing of tau2 changed), given to the telecom run only.
telecom_data=""
link_all() {  # link_all SRC DST SKIP: DST/<entry> links to SRC/<entry>, for every entry of SRC but SKIP
    local src="$1" dst="$2" skip="$3" entry
    mkdir -p "$dst"
    for entry in "$src"/* "$src"/.[!.]*; do
        [ -e "$entry" ] || [ -L "$entry" ] || continue
        [ "$(basename "$entry")" = "$skip" ] || ln -s "$entry" "$dst/"
    done
}
if [ -n "$TELECOM_TASKS" ] && [[ " ${domains[*]} " == *" telecom "* ]]; then
    if is_true "${DRY_RUN:-0}"; then
        telecom_data="<links to tau2's data folder, tasks.json -> tasks_$TELECOM_TASKS.json>"
    else
        data_dir="${TAU2_DATA_DIR:-}"
        [ -n "$data_dir" ] ||
            data_dir="$("$TAU2_PY" -c 'from tau2.utils.utils import DATA_DIR; print(DATA_DIR)' 2>/dev/null)"
        telecom="$data_dir/tau2/domains/telecom"
        [ -f "$telecom/tasks_$TELECOM_TASKS.json" ] || die "TELECOM_TASKS=$TELECOM_TASKS: tau2's data folder" \
            "has no tau2/domains/telecom/tasks_$TELECOM_TASKS.json (TAU2_DATA_DIR=$data_dir)"
        held="$("$TAU2_PY" -c 'import json, sys
tasks = {str(t["id"]) for t in json.load(open(sys.argv[1]))}
split = json.load(open(sys.argv[2])).get(sys.argv[3], [])
print(sum(str(t) in tasks for t in split))' "$telecom/tasks_$TELECOM_TASKS.json" "$telecom/split_tasks.json" \
            "$TASK_SPLIT")"
        [ "$held" -gt 0 ] || die "TELECOM_TASKS=$TELECOM_TASKS: tasks_$TELECOM_TASKS.json holds none of the tasks of" \
            "telecom's $TASK_SPLIT split (split_tasks.json): pick the split it holds, e.g. TASK_SPLIT=$TELECOM_TASKS"
        telecom_data="$scratch/tau2-data"
        link_all "$data_dir" "$telecom_data" tau2
        link_all "$data_dir/tau2" "$telecom_data/tau2" domains
        link_all "$data_dir/tau2/domains" "$telecom_data/tau2/domains" telecom
        link_all "$telecom" "$telecom_data/tau2/domains/telecom" tasks.json
        ln -s "$telecom/tasks_$TELECOM_TASKS.json" "$telecom_data/tau2/domains/telecom/tasks.json"
    fi
fi

config="$RESULTS_ABS/${TAG}_eval_config.json"
write_config() {
    local dev_json
    dev_json="$(printf '%s\n' "${deviations[@]}")"
    DEVIATIONS="$dev_json" TAG="$TAG" TAU2_INSTALLED="$TAU2_INSTALLED" TAU2_COMMIT_SOURCE="$TAU2_COMMIT_SOURCE" \
        TAU2_VENV="$TAU2_VENV" MODEL_PATH="$MODEL_PATH" TELECOM_TASKS="$TELECOM_TASKS" \
        POLICY_BASE_URL="$POLICY_BASE_URL" AGENT_ARGS="$agent_args" USER_LLM="$USER_LLM" USER_ARGS="$user_args" \
        USER_MODEL_PATH="$USER_MODEL_PATH" RESULTS_ABS="$RESULTS_ABS" RUN_DIR="$run_dir" \
        DOMAINS="$DOMAINS" TASK_SPLIT="$TASK_SPLIT" NUM_TRIALS="$NUM_TRIALS" MAX_STEPS="$MAX_STEPS" \
        MAX_MODEL_LEN="$MAX_MODEL_LEN" SERVED_NAME="$SERVED_NAME" TASK_IDS="$TASK_IDS" NUM_TASKS="$NUM_TASKS" \
        MAX_CONCURRENCY="$MAX_CONCURRENCY" TAU2_VERSION="$TAU2_VERSION" "$1" - "$2" <<'EOF'
import datetime, json, os, sys
e = os.environ
config = {
    "tag": e["TAG"], "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "tau2_version": e["TAU2_VERSION"], "tau2_commit": e["TAU2_INSTALLED"],
    "tau2_commit_source": e["TAU2_COMMIT_SOURCE"] or None, "tau2_venv": e["TAU2_VENV"],
    "tau2_working_dir": e["RUN_DIR"],
    "policy": {"model_path": e["MODEL_PATH"] or None, "served_name": e["SERVED_NAME"], "base_url": e["POLICY_BASE_URL"],
               "server": "vllm serve --enable-auto-tool-choice --tool-call-parser hermes" if e["MODEL_PATH"] else
               "given (POLICY_BASE_URL)", "max_model_len": int(e["MAX_MODEL_LEN"]),
               "agent_llm": "openai/" + e["SERVED_NAME"], "agent_llm_args": json.loads(e["AGENT_ARGS"])},
    "user": {"llm": e["USER_LLM"], "llm_args": json.loads(e["USER_ARGS"]),
             "local_model_path": e["USER_MODEL_PATH"] or None},
    "domains": e["DOMAINS"].split(), "task_split": e["TASK_SPLIT"], "num_trials": int(e["NUM_TRIALS"]),
    "max_steps": int(e["MAX_STEPS"]), "max_errors": "tau2 default (10)", "seed": "tau2 default (300)",
    "telecom_tasks": f"tasks_{e['TELECOM_TASKS']}.json" if e["TELECOM_TASKS"] else "tasks.json",
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
elif [ -n "$USER_MODEL_PATH" ] || { [ -n "$USER_BASE_URL" ] && is_loopback "$USER_BASE_URL"; } ||
    is_true "${DRY_RUN:-0}"; then
    user_key="EMPTY"  # a server on this machine (vLLM's, say) takes any key: the placeholder, no file needed
else
    die "no user-model key at $USER_KEY_FILE: write the key there (chmod 600), or set USER_KEY_FILE (a user" \
        "model served on this machine needs none: USER_MODEL_PATH, or a loopback USER_BASE_URL)"
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
        printf '(cd %q && %q ' "$run_dir" "OPENAI_API_KEY=<from $USER_KEY_FILE>"
        if [ "$domain" = telecom ] && [ -n "$telecom_data" ]; then printf '%q ' "TAU2_DATA_DIR=$telecom_data"; fi
        printf '%q ' "${cmd[@]}"
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
    domain_data=""
    if [ "$domain" = telecom ]; then domain_data="$telecom_data"; fi
    (cd "$run_dir" && export OPENAI_API_KEY="$user_key" && if [ -n "$domain_data" ]; then
        export TAU2_DATA_DIR="$domain_data"; fi && "${cmd[@]}" <"$answer" 2>&1) | redact "$save.log" || status=$?
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
