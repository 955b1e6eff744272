#!/usr/bin/env bash
# GPU smoke test: does the CUDA path of CoPE-RLHF work on this host, end to end, within 8 minutes? Run it whenever
# a GPU machine is at hand, from a fresh clone, and paste what it prints into docs/results/gpu_smoke.md.
#
#   bash scripts/gpu_smoke.sh               on a CUDA host: both stages (set-up, stage 1, the rest of stage 2)
#   bash scripts/gpu_smoke.sh --stage 1     only what needs no more than python3 with torch + transformers and this
#                                           checkout (a borrowed GPU machine without vLLM, Ray, DeepSpeed, OpenRLHF,
#                                           flash-attn or a package index; 64 MiB of files carried there)
#   bash scripts/gpu_smoke.sh --stage 2     only the full-stack stages (a host that can install or has the stack)
#   bash scripts/gpu_smoke.sh --dry-run [--stage N]   (or DRY_RUN=1) print each stage's needs and commands; runs
#                                           nothing, needs no GPU
#
# Stages, in this order; each is timed, logged, and stopped when the budget (SMOKE_BUDGET_S) runs out:
#   gpu          nvidia-smi sees a GPU; otherwise the script refuses at once (exit 2). SMOKE_DEVICE=cpu (stage 1
#                only): no GPU asked for, stage 1 runs on the CPU (what the tests do)
#  stage 1 (SMOKE_PYTHON: .venv/bin/python where it exists, else python3)
#   torch        torch and transformers import and see the GPU; flex attention and triton are there
#   packed_signals  the packed signal engine (one row per trajectory with its branches, flex attention on CUDA)
#                equals the per-turn / per-sample references of cope_rlhf/signal_references.py: information gain, TE
#                members, forecast loss and gradients (scripts/gpu_smoke_checks.py packed-signals)
#   signal_shape benchmarks/signal_cost.py --shape smollm2 --no-joint: the signals' time and memory against a GRPO
#                step at SmolLM2-135M's shape (30 layers, hidden 576, vocab 49152; random weights from its config)
#  stage 2
#   setup        scripts/setup.sh with COPE_DEVICE=cuda (vLLM, flash-attn with its kernels) and the BabyAI server's
#                venv, after a 5-second look at the package index (an offline host fails here with the reason,
#                instead of in pip's retries)
#   stack        the trainer venv's torch sees the GPU; vLLM, DeepSpeed (cuda accelerator), Ray, OpenRLHF and the
#                CoPE patches import; PyTorch has flex attention
#   flash_attn   flash-attn's own varlen kernel, forward and backward, agrees with PyTorch's attention
#   signal_cost  benchmarks/signal_cost.py --turns 20 --device cuda: the CoPE signals (the trainer's packed path)
#                against a GRPO step; the packed path must run flex attention and give a dense mask's values
#   prepare      a tiny random Qwen2 (scripts/make_tiny_model.py: nothing from a model hub) and the first
#                STEPS x PROMPTS items of BabyAI's train split (scripts/make_itemids.py)
#   servers      the real BabyAI server and the gateway, started by the tmux launcher the run scripts use
#                (LAUNCH_ONLY=1; stopped on exit)
#   train        scripts/run_babyai_grpo_train.sh -> python -m cope_rlhf.cli.train_ppo_ray on one GPU: actor,
#                reference and vLLM colocated (vLLM sleeps while the actor trains), ZeRO-3, flash attention with
#                packed samples, every CoPE signal on (action forecast, TE with warm-up 0, info gain, degenerate
#                filter, branch packing); SMOKE_STEPS GRPO steps
#   tensorboard  every cope/* scalar those signals log is in the run's TensorBoard events
# With both stages: set-up, stage 1, then the rest of stage 2. The cheap checks that need no training run come first,
# so that a training run that hangs cannot hide them.
# Then one table: stage | status | seconds | key numbers (also written to <log folder>/summary.txt).
#
# Contract: exit 0 when every stage is OK; 1 when any stage failed, timed out or could not run (its prerequisite
# failed, or the budget was spent); 2 when nvidia-smi sees no GPU (checked unless --dry-run). If flash-attn's
# kernels are missing, the training still runs (sdpa, no packing) so the rest is checked, but the run fails.
# Every process it starts is stopped on exit. Logs: one per stage (stack and flash_attn share stack.log; train and
# tensorboard share train.log) in the log folder: $SMOKE_DIR, else $OUT (the device runner brings back what is
# written there), else runs/gpu_smoke. Models, data and the training run's outputs go to SMOKE_WORK_DIR.
#
# Why the recipe looks the way it does: the model is untrained, so it never wins a BabyAI episode. The forecast
# therefore takes every trajectory (ACTION_FORECAST_GATE=all, with group norm and skip-invalid off: group norm keeps
# winners only, and skip-invalid drops the invalid actions an untrained model writes), or its update would never
# run; with every reward equal, the degenerate filter removes every group's GRPO term and information gain keeps
# the action masks, so the PPO step, the TE term and the info-gain advantage all run.
#
# Settings (defaults):
#   SMOKE_BUDGET_S=480          the whole run, setup included
#   SMOKE_SKIP_SETUP=0          1: use the venvs as they are (an offline host set up earlier)
#   SMOKE_DIR / OUT             log folder (see above)      SMOKE_WORK_DIR=runs/gpu_smoke/work
#   SMOKE_GPU=0                 the GPU to use (CUDA_VISIBLE_DEVICES of the training run and the benchmark)
#   SMOKE_DEVICE=cuda           cpu: stage 1 on the CPU, no GPU needed (stage 2 refuses it)
#   SMOKE_PYTHON                stage 1's interpreter (default .venv/bin/python, else python3)
#   SMOKE_PACKED_TURNS="1 3 12" the packed-signals check's trajectories (turns each)
#   SMOKE_SHAPE_TURNS="5 20 40"  SMOKE_SHAPE_REPEATS=3  SMOKE_SHAPE_ARGS=  (more benchmarks/signal_cost.py arguments,
#                               e.g. "--layers 1 --hidden 64" for a quick run on a CPU)
#   SMOKE_STEPS=2  SMOKE_PROMPTS=4 (prompts per step)  SMOKE_SAMPLES=4 (episodes per prompt)  SMOKE_MAX_TURNS=4
#   SMOKE_VLLM_GPU_UTIL=0.15    vLLM's share of the GPU (the tiny model needs little; the actor shares the GPU)
#   SMOKE_TRAIN_TIMEOUT_S=300   the training stage's own limit (a hang must leave time for the summary)
#   SMOKE_ATTENTION=flash_attention_2  SMOKE_PACKING=1      the actor's attention and --ds.packing_samples
#   SMOKE_SIGNAL_TURNS=20  SMOKE_SIGNAL_REPEATS=3           benchmarks/signal_cost.py --turns / --repeats
#   SMOKE_SERVER_PORT=18100  SMOKE_GATEWAY_PORT=18800  SMOKE_SESSION=cope-gpu-smoke  (tmux session of the servers)
#   NVIDIA_SMI=nvidia-smi       the command asked whether a GPU is there
set -euo pipefail

SMOKE_SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
SMOKE_ROOT="$(cd "$(dirname "$SMOKE_SELF")/.." && pwd)"
# The summary's rows, in the order the stages run.
SMOKE_STAGE1=(gpu torch packed_signals signal_shape)
SMOKE_STAGE2=(setup stack flash_attn signal_cost prepare servers train tensorboard)
# Both: set-up first, so that stage 1 runs on the trainer venv it builds (a fresh clone's python3 may have no torch);
# where set-up fails (no package index), stage 1 still runs, on python3.
SMOKE_STAGES=(gpu setup "${SMOKE_STAGE1[@]:1}" "${SMOKE_STAGE2[@]:1}")

smoke_dry() {
    case "${DRY_RUN:-0}" in 1 | true | yes | on) return 0 ;; *) return 1 ;; esac
}

smoke_abs() {
    case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac
}

# Every setting, from the environment; the same in the main shell and in each stage's own process.
smoke_config() {
    : "${SMOKE_BUDGET_S:=480}" "${SMOKE_SKIP_SETUP:=0}" "${SMOKE_GPU:=0}" "${NVIDIA_SMI:=nvidia-smi}"
    : "${SMOKE_STEPS:=2}" "${SMOKE_PROMPTS:=4}" "${SMOKE_SAMPLES:=4}" "${SMOKE_MAX_TURNS:=4}"
    : "${SMOKE_VLLM_GPU_UTIL:=0.15}" "${SMOKE_TRAIN_TIMEOUT_S:=300}"
    : "${SMOKE_ATTENTION:=flash_attention_2}" "${SMOKE_PACKING:=1}"
    : "${SMOKE_SIGNAL_TURNS:=20}" "${SMOKE_SIGNAL_REPEATS:=3}"
    : "${SMOKE_SERVER_PORT:=18100}" "${SMOKE_GATEWAY_PORT:=18800}" "${SMOKE_SESSION:=cope-gpu-smoke}"
    : "${SMOKE_DEVICE:=cuda}" "${SMOKE_PACKED_TURNS:=1 3 12}" "${SMOKE_SHAPE_TURNS:=5 20 40}"
    : "${SMOKE_SHAPE_REPEATS:=3}" "${SMOKE_SHAPE_ARGS:=}"
    LOG_DIR="$(smoke_abs "${SMOKE_DIR:-${OUT:-$SMOKE_ROOT/runs/gpu_smoke}}")"
    WORK_DIR="$(smoke_abs "${SMOKE_WORK_DIR:-$SMOKE_ROOT/runs/gpu_smoke/work}")"
    PY="$SMOKE_ROOT/.venv/bin/python"
    if [ -n "${SMOKE_PYTHON:-}" ]; then
        PY1="$SMOKE_PYTHON"
    elif [ -x "$PY" ]; then
        PY1="$PY"
    else
        PY1=python3
    fi
    PROMPT_COUNT=$((SMOKE_STEPS * SMOKE_PROMPTS))
}

# Runs "$@", or prints it shell-quoted under DRY_RUN.
smoke_do() {
    if smoke_dry; then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

smoke_key() {
    echo "[smoke:key] $*"
}

# What each stage needs to run (printed by the dry run).
smoke_needs_text() {
    case "$1" in
    gpu) echo "an NVIDIA driver (nvidia-smi); none with SMOKE_DEVICE=cpu" ;;
    torch | packed_signals | signal_shape)
        echo "$PY1 with torch and transformers (flex attention and triton on a GPU), this checkout; nothing else" ;;
    setup) echo "a reachable package index (pip), nvcc or a prebuilt flash-attn wheel (for flash-attn's kernels)" ;;
    stack) echo ".venv with CUDA torch, vLLM, DeepSpeed, Ray, OpenRLHF (the setup stage, or SMOKE_SKIP_SETUP=1)" ;;
    flash_attn) echo "flash-attn's CUDA kernels in .venv" ;;
    signal_cost) echo ".venv with OpenRLHF (its joint cell runs the OpenRLHF actor's code)" ;;
    prepare) echo ".venv (transformers, tokenizers), the BabyAI item list in data/" ;;
    servers) echo "tmux, .venvs/babyai (the BabyAI server), .venv (the gateway), free ports" ;;
    train) echo "all of stage 2 above, one GPU" ;;
    tensorboard) echo ".venv (tensorboard), the train stage's event files" ;;
    esac
}

# ---- the stages' own work (each runs as `bash gpu_smoke.sh --internal NAME`, or prints under DRY_RUN) ----------
stage_torch() {
    smoke_do "$PY1" scripts/gpu_smoke_checks.py torch --device "$SMOKE_DEVICE"
}

stage_packed_signals() {
    local turns
    read -r -a turns <<<"$SMOKE_PACKED_TURNS"
    smoke_do env CUDA_VISIBLE_DEVICES="$SMOKE_GPU" "$PY1" scripts/gpu_smoke_checks.py packed-signals \
        --device "$SMOKE_DEVICE" --turns "${turns[@]}"
}

stage_signal_shape() {
    local turns extra
    read -r -a turns <<<"$SMOKE_SHAPE_TURNS"
    read -r -a extra <<<"$SMOKE_SHAPE_ARGS"
    smoke_do rm -f "$WORK_DIR/signal_cost_smollm2.json"  # the check must not read an earlier run's numbers
    smoke_do env CUDA_VISIBLE_DEVICES="$SMOKE_GPU" "$PY1" benchmarks/signal_cost.py --shape smollm2 --no-joint \
        --device "$SMOKE_DEVICE" --turns "${turns[@]}" --repeats "$SMOKE_SHAPE_REPEATS" "${extra[@]}" \
        --json "$WORK_DIR/signal_cost_smollm2.json"
    smoke_do "$PY1" scripts/gpu_smoke_checks.py signal-cost "$WORK_DIR/signal_cost_smollm2.json"
}

stage_setup() {
    smoke_do env COPE_DEVICE=cuda COPE_ENV_SERVERS=babyai bash scripts/setup.sh
    if ! smoke_dry; then
        if grep -q "nothing to install" "${SMOKE_STAGE_LOG:-/dev/null}"; then
            smoke_key "trainer venv up to date (cuda); BabyAI server venv"
        else
            smoke_key "trainer venv installed (cuda); BabyAI server venv"
        fi
    fi
}

stage_stack() {
    if ! smoke_dry && [ ! -x "$PY" ]; then
        echo "no $PY: the setup stage did not build the trainer venv"
        return 1
    fi
    smoke_do "$PY" scripts/gpu_smoke_checks.py stack
}

stage_flash_attn() {
    smoke_do "$PY" scripts/gpu_smoke_checks.py flash-attn
}

stage_signal_cost() {
    smoke_do rm -f "$WORK_DIR/signal_cost.json"  # the check must not read an earlier run's numbers
    smoke_do env CUDA_VISIBLE_DEVICES="$SMOKE_GPU" "$PY" benchmarks/signal_cost.py --turns "$SMOKE_SIGNAL_TURNS" \
        --device cuda --repeats "$SMOKE_SIGNAL_REPEATS" --json "$WORK_DIR/signal_cost.json"
    smoke_do "$PY" scripts/gpu_smoke_checks.py signal-cost "$WORK_DIR/signal_cost.json"
}

stage_prepare() {
    smoke_do rm -rf "$WORK_DIR/model" "$WORK_DIR/data"
    smoke_do "$PY" scripts/make_tiny_model.py --out "$WORK_DIR/model" --seed 0
    smoke_do "$PY" scripts/make_itemids.py --env babyai --split train --out "$WORK_DIR/data"
    # OpenRLHF runs len(prompts) / rollout.batch_size steps per episode: the prompt file sets the step count.
    if smoke_dry; then
        echo "+ head -n $PROMPT_COUNT $WORK_DIR/data/babyai_train.jsonl > $WORK_DIR/data/prompts.jsonl"
        return 0
    fi
    head -n "$PROMPT_COUNT" "$WORK_DIR/data/babyai_train.jsonl" >"$WORK_DIR/data/prompts.jsonl"
    local got
    got="$(wc -l <"$WORK_DIR/data/prompts.jsonl")"
    if [ "$got" -ne "$PROMPT_COUNT" ]; then
        echo "BabyAI's train split gave $got items; the run needs $PROMPT_COUNT"
        return 1
    fi
    smoke_key "tiny random Qwen2; $got BabyAI train items"
}

smoke_launcher_env() {
    LAUNCHER_ENV=(TMUX_SESSION="$SMOKE_SESSION" ENV_SERVER_PORT="$SMOKE_SERVER_PORT" GATEWAY_PORT="$SMOKE_GATEWAY_PORT")
}

stage_servers() {
    smoke_launcher_env
    local health=60
    if [ -n "${SMOKE_DEADLINE:-}" ]; then
        health=$((SMOKE_DEADLINE - $(date +%s)))
    fi
    # a session left by an interrupted smoke run holds the ports: stop it first (the name is this script's own)
    smoke_do env "${LAUNCHER_ENV[@]}" bash scripts/launch_babyai_grpo_tmux.sh stop
    if smoke_dry; then
        printf '+ env'
        printf ' %q' "${LAUNCHER_ENV[@]}" LAUNCH_ONLY=1 HEALTH_TIMEOUT="$health" bash scripts/launch_babyai_grpo_tmux.sh
        printf '\n'
    fi
    # under DRY_RUN the launcher prints its windows' commands itself
    env "${LAUNCHER_ENV[@]}" LAUNCH_ONLY=1 HEALTH_TIMEOUT="$health" bash scripts/launch_babyai_grpo_tmux.sh
    smoke_dry || smoke_key "BabyAI server :$SMOKE_SERVER_PORT and gateway :$SMOKE_GATEWAY_PORT healthy"
}

# The training run's settings, as the run scripts read them (scripts/lib/common.sh).
smoke_train_env() {
    TRAIN_ENV=(
        COPE_SECRETS_DIR="$WORK_DIR/no-secrets"  # no wandb: the host may have no way out
        CUDA_VISIBLE_DEVICES="$SMOKE_GPU"
        MODEL_PATH="$WORK_DIR/model" PROMPT_DATA="$WORK_DIR/data/prompts.jsonl" OUTPUT_DIR="$WORK_DIR/train"
        RUN_NAME=gpu_smoke GATEWAY_PORT="$SMOKE_GATEWAY_PORT"
        NUM_NODES=1 GPUS_PER_NODE=1 VLLM_NUM_ENGINES=1 VLLM_TP=1 VLLM_GPU_UTIL="$SMOKE_VLLM_GPU_UTIL"
        COLOCATE_ALL=1 ZERO_STAGE=3 GRADIENT_CHECKPOINTING=1 PACKING="$SMOKE_PACKING"
        ROLLOUT_BATCH_SIZE="$SMOKE_PROMPTS" N_SAMPLES_PER_PROMPT="$SMOKE_SAMPLES"
        TRAIN_BATCH_SIZE=$((SMOKE_PROMPTS * SMOKE_SAMPLES)) MICRO_TRAIN_BATCH_SIZE=4 MICRO_ROLLOUT_BATCH_SIZE=4
        MAX_TURNS="$SMOKE_MAX_TURNS" MAX_NEW_TOKENS=48 MAX_LEN=2048 NUM_EPISODES=1 SAVE_STEPS="$SMOKE_STEPS"
        ACTION_FORECAST_ENABLE=1 ACTION_FORECAST_GATE=all ACTION_FORECAST_GROUP_NORM=0 ACTION_FORECAST_SKIP_INVALID=0
        TE_ENABLE=1 TE_LAMBDA=0.1 TE_WARMUP_STEPS=0 INFO_INTRINSIC_WEIGHT=0.1 GRPO_FILTER_DEGENERATE=1
        # eager vLLM: no torch.compile and no CUDA-graph capture at start-up (tens of seconds the budget cannot spare)
        EXTRA_ARGS="--ds.attn_implementation $SMOKE_ATTENTION --vllm.enforce_eager --data.max_samples $PROMPT_COUNT"
    )
}

stage_train() {
    smoke_train_env
    # --ckpt.load_enable would resume a finished earlier run and train nothing
    smoke_do rm -rf "$WORK_DIR/train"
    if smoke_dry; then
        printf '+ env -u RAY_ADDRESS'
        printf ' %q' "${TRAIN_ENV[@]}" bash scripts/run_babyai_grpo_train.sh
        printf '\n'
    fi
    # RAY_ADDRESS would send the run to some other Ray cluster; under DRY_RUN the run script prints the trainer's
    # full command line itself
    env -u RAY_ADDRESS "${TRAIN_ENV[@]}" bash scripts/run_babyai_grpo_train.sh
    if ! smoke_dry; then
        local steps
        steps="$(grep -cE 'Global step [0-9]+:' "${SMOKE_STAGE_LOG:-/dev/null}" || true)"
        smoke_key "$steps steps logged; $SMOKE_ATTENTION$(smoke_packing_note), ZeRO-3, colocated," \
            "vLLM util $SMOKE_VLLM_GPU_UTIL"
    fi
}

smoke_packing_note() {
    if [ "$SMOKE_PACKING" = 1 ]; then echo " + packing"; else echo ", no packing"; fi
}

stage_tensorboard() {
    smoke_do "$PY" scripts/gpu_smoke_checks.py tensorboard "$WORK_DIR/train/tensorboard"
}

# ---- running stages, the table -------------------------------------------------------------------------------
smoke_init() {
    mkdir -p "$LOG_DIR" "$WORK_DIR"
    # this script's own files of an earlier run (the stages append to their logs)
    rm -f "$LOG_DIR"/{torch,packed_signals,signal_shape,setup,stack,signal_cost,prepare,servers,train}.log \
        "$LOG_DIR/summary.txt"
    declare -gA STATUS=() TOOK=() KEY=()
    SMOKE_T0=$SECONDS
    SMOKE_DEADLINE=$(($(date +%s) + SMOKE_BUDGET_S))
    SMOKE_CHILD=""
    export SMOKE_DEADLINE
}

smoke_record() {  # NAME STATUS SECONDS KEY... (the key's words joined by spaces)
    STATUS[$1]="$2"
    TOOK[$1]="$3"
    KEY[$1]="${*:4}"
}

# smoke_needs NAME STAGE...: true when every STAGE is OK (or OFF by request); otherwise NAME is recorded as skipped.
smoke_needs() {
    local name="$1" need
    shift
    for need in "$@"; do
        if [ "${STATUS[$need]:-}" != OK ] && [ "${STATUS[$need]:-}" != OFF ]; then  # OFF: not needed here
            smoke_record "$name" SKIP 0 "not run: needs $need (${STATUS[$need]:-not run})"
            echo "[smoke] $name: skipped (needs $need)"
            return 1
        fi
    done
}

# smoke_run_stage NAME LOG CAP_S COMMAND...: run COMMAND in its own process group with its output appended to
# LOG_DIR/LOG.log, for at most CAP_S seconds (0: no cap of its own) and never past the budget's deadline.
smoke_run_stage() {
    local name="$1" logname="$2" log="$LOG_DIR/$2.log" cap="$3"
    shift 3
    local left=$((SMOKE_DEADLINE - $(date +%s)))
    if [ "$cap" -gt 0 ] && [ "$cap" -lt "$left" ]; then left="$cap"; fi
    if [ "$left" -lt 1 ]; then
        smoke_record "$name" SKIP 0 "not run: the budget (SMOKE_BUDGET_S=$SMOKE_BUDGET_S) is spent"
        echo "[smoke] $name: skipped (budget spent)"
        return 1
    fi
    local offset=0 t0=$SECONDS rc=0
    if [ -f "$log" ]; then offset="$(stat -c %s "$log")"; fi
    echo "===== $name ($(date -u '+%F %T') UTC, limit ${left}s): $*" >>"$log"
    echo "[smoke] $name ..."
    # timeout puts itself and the command in a new process group and signals all of it: Ray, vLLM and DeepSpeed
    # children included. The stage reads its log (SMOKE_STAGE_LOG) only for its key numbers, after its commands.
    # shellcheck disable=SC2094
    SMOKE_STAGE_LOG="$log" timeout --kill-after=15 "$left" "$@" >>"$log" 2>&1 </dev/null &
    SMOKE_CHILD=$!
    wait "$SMOKE_CHILD" || rc=$?
    SMOKE_CHILD=""
    local took=$((SECONDS - t0)) status=OK section key reason
    if [ "$rc" -eq 124 ] || { [ "$rc" -eq 137 ] && [ "$took" -ge "$left" ]; }; then
        status=TIMEOUT
    elif [ "$rc" -ne 0 ]; then
        status=FAIL
    fi
    section="$(tail -c +"$((offset + 1))" "$log")"
    key="$(awk 'sub(/^\[smoke:key\] /, "") { printf "%s%s", sep, $0; sep = "; " }' <<<"$section")"
    if [ "$status" != OK ]; then
        reason="$(awk 'NF && !/^\[smoke/ && !/^=====/ { last = $0 } END { print last }' <<<"$section" |
            tr -s ' \t' ' ')"
        if [ "$status" = TIMEOUT ]; then
            reason="stopped after ${left}s; last: $reason"
        else
            reason="exit $rc: $reason"
        fi
        key="${key:+$key; }${reason:0:160} (log: $logname.log)"
    fi
    smoke_record "$name" "$status" "$took" "$key"
    echo "[smoke] $name: $status in ${took}s"
    [ "$status" = OK ]
}

# The table; returns 0 when every stage is OK (or off by request).
smoke_summary() {
    local name status failed=() not_run=() table
    table="GPU smoke (stage ${SMOKE_STAGE_ARG:-1+2}) $(date -u '+%F %H:%M') UTC, host $(uname -n),"
    table+=" budget ${SMOKE_BUDGET_S}s,"
    table+=" took $((SECONDS - SMOKE_T0))s"
    table+=$'\n'"$(printf '%-14s | %-7s | %7s | %s' stage status seconds "key numbers")"
    table+=$'\n'"---------------+---------+---------+$(printf '%.0s-' {1..60})"
    for name in "${SMOKE_STAGES[@]}"; do
        status="${STATUS[$name]:-SKIP}"
        table+=$'\n'"$(printf '%-14s | %-7s | %7s | %s' "$name" "$status" "${TOOK[$name]:-0}" "${KEY[$name]-not run}")"
        case "$status" in OK | OFF) ;; SKIP) not_run+=("$name") ;; *) failed+=("$name") ;; esac
    done
    if [ "${#failed[@]}" -eq 0 ] && [ "${#not_run[@]}" -eq 0 ]; then
        table+=$'\n'"PASSED"
    else
        table+=$'\n'"FAILED${failed[*]:+: ${failed[*]}}${not_run[*]:+ (not run: ${not_run[*]})}"
    fi
    echo "$table" | tee "$LOG_DIR/summary.txt"
    [ "${#failed[@]}" -eq 0 ] && [ "${#not_run[@]}" -eq 0 ]
}

smoke_cleanup() {
    if [ -n "${SMOKE_CHILD:-}" ] && kill -0 "$SMOKE_CHILD" 2>/dev/null; then
        echo "[smoke] stopping the running stage (pid $SMOKE_CHILD) ..." >&2
        kill -TERM -- "-$SMOKE_CHILD" 2>/dev/null || true
        for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$SMOKE_CHILD" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SMOKE_CHILD" 2>/dev/null || true
    fi
    if [ "${SMOKE_SERVERS_STARTED:-0}" = 1 ]; then
        smoke_launcher_env
        env "${LAUNCHER_ENV[@]}" bash "$SMOKE_ROOT/scripts/launch_babyai_grpo_tmux.sh" stop \
            >>"$LOG_DIR/servers.log" 2>&1 || true
    fi
}

# Can pip reach a package index? (No pip here to ask: let setup.sh find out.)
smoke_index_reachable() {
    local python
    python="$(command -v python3 || true)"
    if [ -z "$python" ] || ! "$python" -m pip --version >/dev/null 2>&1; then return 0; fi
    timeout 30 "$python" -m pip index versions pip --timeout 5 --retries 0 >/dev/null 2>&1
}

smoke_gpu_or_refuse() {
    local listing="" reason=""
    if ! command -v "$NVIDIA_SMI" >/dev/null 2>&1; then
        reason="$NVIDIA_SMI is not installed (no NVIDIA driver on this host)"
    elif ! listing="$("$NVIDIA_SMI" -L 2>&1)"; then
        reason="\`$NVIDIA_SMI -L\` failed: ${listing%%$'\n'*}"
    elif ! grep -q "^GPU " <<<"$listing"; then
        reason="\`$NVIDIA_SMI -L\` lists no GPU${listing:+: ${listing%%$'\n'*}}"
    fi
    if [ -n "$reason" ]; then
        echo "gpu_smoke: no GPU here: $reason" >&2
        echo "gpu_smoke: this script checks the CUDA path and needs a CUDA host;" \
            "--dry-run (or DRY_RUN=1) prints its commands" >&2
        exit 2
    fi
    GPU_KEY="$("$NVIDIA_SMI" --query-gpu=name,memory.total,driver_version --format=csv,noheader -i "$SMOKE_GPU" \
        2>/dev/null | head -n 1 || true)"
    GPU_KEY="${GPU_KEY:-$(head -n 1 <<<"$listing")}"
}

smoke_dry_run() {
    echo "# gpu_smoke.sh dry run (stage ${SMOKE_STAGE_ARG:-1+2}): each stage's needs and commands (nothing runs);" \
        "log folder $LOG_DIR, work folder $WORK_DIR"
    export DRY_RUN=1
    local name
    for name in "${SMOKE_STAGES[@]}"; do
        echo "## $name"
        echo "# needs: $(smoke_needs_text "$name")"
        case "$name" in
        gpu)
            if [ "$SMOKE_DEVICE" = cpu ]; then echo "# off (SMOKE_DEVICE=cpu)"; else smoke_do "$NVIDIA_SMI" -L; fi
            ;;
        setup)
            if [ "$SMOKE_SKIP_SETUP" = 1 ]; then
                echo "# off (SMOKE_SKIP_SETUP=1)"
            else
                smoke_do python3 -m pip index versions pip --timeout 5 --retries 0
                stage_setup
            fi
            ;;
        *) "stage_$name" ;;
        esac
    done
}

# --stage N: which stages run (sets SMOKE_STAGES and SMOKE_STAGE_ARG).
smoke_select() {
    case "$1" in
    1) SMOKE_STAGES=("${SMOKE_STAGE1[@]}") ;;
    2) SMOKE_STAGES=(gpu "${SMOKE_STAGE2[@]}") ;;
    all) ;;
    *)
        echo "gpu_smoke: --stage takes 1, 2 or all, got '$1'" >&2
        return 2
        ;;
    esac
    SMOKE_STAGE_ARG="$1"
}

smoke_has() {
    local name
    for name in "${SMOKE_STAGES[@]}"; do [ "$name" = "$1" ] && return 0; done
    return 1
}

smoke_stage1() {
    if smoke_needs torch gpu; then
        smoke_run_stage torch torch 0 bash "$SMOKE_SELF" --internal torch || true
    fi
    if smoke_needs packed_signals torch; then
        smoke_run_stage packed_signals packed_signals 0 bash "$SMOKE_SELF" --internal packed_signals || true
    fi
    if smoke_needs signal_shape torch; then
        smoke_run_stage signal_shape signal_shape 0 bash "$SMOKE_SELF" --internal signal_shape || true
    fi
}

smoke_main() {
    if [ "${1:-}" = --internal ]; then  # one stage's work, in the process smoke_run_stage starts
        smoke_config
        cd "$SMOKE_ROOT"
        "stage_$2"
        return
    fi
    local arg
    for arg in "$@"; do
        case "$arg" in -h | --help)
            sed -n '2,/^set -euo/p' "$SMOKE_SELF" | sed '$d; s/^# \{0,1\}//'
            return 0
            ;;
        esac
    done
    while [ $# -gt 0 ]; do
        case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --stage)
            smoke_select "${2:-}" || return 2
            shift
            ;;
        --stage=*) smoke_select "${1#--stage=}" || return 2 ;;
        *)
            echo "gpu_smoke: unknown argument '$1' (use --stage 1|2|all, --dry-run or --help)" >&2
            return 2
            ;;
        esac
        shift
    done
    smoke_config
    if [ "$SMOKE_DEVICE" = cpu ] && smoke_has setup; then
        echo "gpu_smoke: SMOKE_DEVICE=cpu runs stage 1 only (--stage 1): stage 2 trains on a GPU" >&2
        return 2
    fi
    if [ "$SMOKE_DEVICE" != cpu ] && [ "$SMOKE_DEVICE" != cuda ]; then
        echo "gpu_smoke: SMOKE_DEVICE is cuda or cpu, got '$SMOKE_DEVICE'" >&2
        return 2
    fi
    # the stages' own processes start in the repository: they get the folders as absolute paths
    export SMOKE_DIR="$LOG_DIR" SMOKE_WORK_DIR="$WORK_DIR"
    cd "$SMOKE_ROOT"
    if smoke_dry; then
        smoke_dry_run
        return 0
    fi
    if [ "$SMOKE_DEVICE" = cpu ]; then
        GPU_KEY=""
    else
        smoke_gpu_or_refuse
    fi
    smoke_init
    trap smoke_cleanup EXIT
    trap 'exit 130' INT TERM
    export SMOKE_ATTENTION SMOKE_PACKING SMOKE_DEVICE SMOKE_PYTHON
    if [ "$SMOKE_DEVICE" = cpu ]; then
        smoke_record gpu OFF 0 "off (SMOKE_DEVICE=cpu): stage 1 on the CPU"
        echo "[smoke] no GPU asked for (SMOKE_DEVICE=cpu); logs in $LOG_DIR"
    else
        smoke_record gpu OK 0 "$GPU_KEY"
        echo "[smoke] GPU: $GPU_KEY; logs in $LOG_DIR"
    fi
    if smoke_has setup; then
        smoke_setup
    fi
    if smoke_has torch; then
        smoke_stage1
    fi
    if smoke_has stack; then
        smoke_stage2
    fi
    echo
    smoke_summary
}

smoke_setup() {
    local probe_t0=$SECONDS
    if [ "$SMOKE_SKIP_SETUP" = 1 ]; then
        smoke_record setup OFF 0 "off (SMOKE_SKIP_SETUP=1): venvs used as they are"
    elif ! smoke_index_reachable; then
        smoke_record setup FAIL $((SECONDS - probe_t0)) "no package index reachable (pip index timed out):" \
            "scripts/setup.sh cannot install the CUDA stack here; on a host whose venvs were set up before," \
            "rerun with SMOKE_SKIP_SETUP=1"
        echo "[smoke] setup: FAIL (no package index reachable)"
    else
        smoke_run_stage setup setup 0 bash "$SMOKE_SELF" --internal setup || true
    fi
}

# Stage 2 after its set-up.
smoke_stage2() {
    smoke_run_stage stack stack 0 bash "$SMOKE_SELF" --internal stack || true
    if smoke_needs flash_attn stack; then
        smoke_run_stage flash_attn stack 0 bash "$SMOKE_SELF" --internal flash_attn || true
    fi
    if [[ "${STATUS[flash_attn]:-}" =~ ^(FAIL|TIMEOUT)$ ]] && [ "$SMOKE_ATTENTION" = flash_attention_2 ]; then
        # the rest of the path is still worth checking: PyTorch's attention, unpacked (packing needs flash-attn)
        SMOKE_ATTENTION=sdpa SMOKE_PACKING=0
        echo "[smoke] flash-attn unavailable: training with sdpa, no packing (the run fails all the same)"
    fi
    if smoke_needs signal_cost stack; then
        smoke_run_stage signal_cost signal_cost 0 bash "$SMOKE_SELF" --internal signal_cost || true
    fi
    if smoke_needs prepare stack; then
        smoke_run_stage prepare prepare 0 bash "$SMOKE_SELF" --internal prepare || true
    fi
    if smoke_needs servers prepare; then
        SMOKE_SERVERS_STARTED=1  # from here on, the exit stops the tmux session, whatever happened
        smoke_run_stage servers servers 0 bash "$SMOKE_SELF" --internal servers || true
    fi
    if smoke_needs train servers; then
        smoke_run_stage train train "$SMOKE_TRAIN_TIMEOUT_S" bash "$SMOKE_SELF" --internal train || true
    fi
    case "${STATUS[train]:-}" in
    OK | FAIL | TIMEOUT)  # a run that failed half-way may still have logged: look all the same
        smoke_run_stage tensorboard train 0 bash "$SMOKE_SELF" --internal tensorboard || true
        ;;
    *) smoke_needs tensorboard train || true ;;
    esac
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    smoke_main "$@"
fi
