# shellcheck shell=bash
# Shared logic of scripts/run_<env>_grpo_train.sh: every setting is an environment variable with a default,
# turned into one `python -m cope_rlhf.cli.train_ppo_ray` command (OpenRLHF's trainer + the --cope.* group).
#
# A run script sets ENV_NAME and its env's defaults (MAX_TURNS, N_SAMPLES_PER_PROMPT, ...), sources this file
# and calls `cope_train_main "$@"` (extra arguments are appended to the trainer's command line).
#
#   DRY_RUN=1          print the command (one shell-quoted line, secrets redacted) instead of running it
#   RAY_ADDRESS=...    submit through `ray job submit` (the repository is the job's working dir; the agent funcs'
#                      variables travel in the job's runtime env, written to a private file, never on argv;
#                      JOB_PYTHON: the interpreter on the cluster, default this checkout's .venv/bin/python;
#                      data, model and output paths become absolute: the upload leaves out git-ignored files)
#
# Model, data, output (defaults):
#   MODEL_PATH=Qwen/Qwen2.5-7B-Instruct      PROMPT_DATA=data/generated/<env>_train.jsonl   EVAL_DATA= (none)
#   RUN_NAME=<env>_grpo                      OUTPUT_DIR=runs/<RUN_NAME> (tensorboard/, ckpt/, model/ inside)
# Resources:
#   NUM_NODES=1  GPUS_PER_NODE=8 (or the count in CUDA_VISIBLE_DEVICES)  VLLM_TP=1  VLLM_NUM_ENGINES=NUM_NODES*GPUS_PER_NODE/VLLM_TP
#   VLLM_GPU_UTIL=0.6  COLOCATE_ALL=1 (actor, ref and vLLM share GPUs, vLLM sleeps during training)
#   ZERO_STAGE=3  GRADIENT_CHECKPOINTING=1  PACKING=0 (--ds.packing_samples)
# GRPO (AgentGym-RL's defaults):
#   ROLLOUT_BATCH_SIZE=16  N_SAMPLES_PER_PROMPT=8  TRAIN_BATCH_SIZE=ROLLOUT_BATCH_SIZE*N_SAMPLES_PER_PROMPT
#   MICRO_TRAIN_BATCH_SIZE=1  MICRO_ROLLOUT_BATCH_SIZE=2  LR=1e-6  KL_COEF=0.001 (k3 KL as a loss)
#   TEMPERATURE=1.0  MAX_LEN=16384 (whole episode)  MAX_NEW_TOKENS=1024  NUM_EPISODES=20  SAVE_STEPS=50
#   EVAL_STEPS=-1  SEED=42  EXTRA_ARGS= (more trainer arguments, split on spaces)
# Episodes (read by agent_funcs/base.py in the rollout workers):
#   COPE_GATEWAY_URL=http://127.0.0.1:${GATEWAY_PORT:-8800}   MAX_TURNS=<env default>   EPISODE_TIMEOUT_S  ENV_CALL_TIMEOUT_S
#   HORIZON_SCHEDULE="6,13,20" (ScalingInter-RL; overrides MAX_TURNS)  HORIZON_STAGE_STEPS=100
#   HORIZON_EPISODES_PER_STEP (default ROLLOUT_BATCH_SIZE*N_SAMPLES_PER_PROMPT/VLLM_NUM_ENGINES)  COPE_TRAIN_STEP_FILE
#   COPE_GATEWAY_TOKEN_FILE= the token file of a gateway started with --auth-token-file (e.g. in GATEWAY_ARGS;
#   a path on every node, mode 600), for a gateway other hosts can reach
# CoPE (docs/METHOD.md: every variable, its default and range): each variable in COPE_VARS adds
#   `--cope.<lower-case name> VALUE` only when set. As upstream CoPE's run scripts do, ACTION_FORECAST_ENABLE=1
#   defaults ACTION_FORECAST_GROUP_NORM to 1, and ACTION_FORECAST_ENABLE=1 or TE_ENABLE=1 ACTION_FORECAST_SKIP_INVALID
#   to 1 (set them to 0 to turn them off).
# Evaluation (cope_eval_main, examples/eval/<env>_eval.sh -> scripts/eval.py): CKPT=<OUTPUT_DIR>/model
#   EVAL_ITEMS=data/generated/<env>_test.jsonl  EVAL_K=4  EVAL_TEMPERATURE=1.0  EVAL_ENGINE= (vllm when it imports)
#   EVAL_OUT=runs/eval/<RUN_NAME>.json  EVAL_LIMIT= (first N items)  plus MAX_TURNS, MAX_NEW_TOKENS, MAX_LEN
# Preflight (cope_rlhf/preflight.py): the trainer checks datasets, model, agent func, gateway, GPUs, folders and
#   secrets before it allocates anything, listing every problem with its fix (exit 2); with RAY_ADDRESS it runs
#   here before `ray job submit` too. COPE_SKIP_PREFLIGHT=1 skips it; RAY_PG_TIMEOUT_S=600 bounds the wait for GPUs.
# Secrets: only from .secrets/ (git-ignored; COPE_SECRETS_DIR moves it): .secrets/wandb_api_key turns on wandb
#   (WANDB_PROJECT=cope_rlhf). A key reaches the trainer through the environment, never through argv or a log.

COPE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# Must list cope_rlhf/config.py's CoPEConfig fields, upper-cased (tests/test_launchers.py checks it).
COPE_VARS=(ACTION_FORECAST_ENABLE ACTION_FORECAST_COEF ACTION_FORECAST_K ACTION_FORECAST_GATE
    ACTION_FORECAST_GROUP_NORM ACTION_FORECAST_SKIP_INVALID ACTION_FORECAST_SUCCESS_THRESHOLD
    ACTION_FORECAST_LAYOUT ACTION_FORECAST_MODE ACTION_FORECAST_MAX_LENGTH ACTION_FORECAST_LR_SCALE
    SFT_MINI_BATCH_SIZE TE_ENABLE TE_LAMBDA TE_ETA TE_WARMUP_STEPS TE_HOLD_BELOW TE_TRAJ_SUBSAMPLE
    TE_MICRO_BATCH_SIZE_PER_GPU
    INFO_INTRINSIC_WEIGHT INFO_GATE_TEMP INFO_MAX_TURNS INFO_PROBE_TOKENS INFO_KL_BATCH GRPO_FILTER_DEGENERATE
    EVAL_FIRST_AND_LAST EVAL_DISPATCH_SIZE)
# What the agent funcs (rollout workers) and the trainer read; exported locally, put in the runtime env of a Ray job
# (tests/test_runtime_env_vars.py: every variable they read is here, or named there with why it must not travel).
AGENT_VARS=(COPE_GATEWAY_URL MAX_TURNS HORIZON_SCHEDULE HORIZON_STAGE_STEPS HORIZON_EPISODES_PER_STEP
    COPE_TRAIN_STEP_FILE EPISODE_TIMEOUT_S ENV_CALL_TIMEOUT_S COPE_GATEWAY_TOKEN_FILE
    COPE_SKIP_PREFLIGHT RAY_PG_TIMEOUT_S COPE_ZERO3_RELEASE_PARAMS COPE_WEIGHT_SYNC_TIMEOUT_S
    VLLM_CPU_KVCACHE_SPACE VLLM_CPU_OMP_THREADS_BIND)

cope_die() {
    echo "error: $*" >&2
    exit 2
}

cope_is_true() {
    case "${1,,}" in 1 | true | yes | on) return 0 ;; *) return 1 ;; esac
}

cope_defaults() {
    [ -n "${ENV_NAME:-}" ] || cope_die "ENV_NAME is not set: run one of scripts/run_<env>_grpo_train.sh"
    : "${MODEL_PATH:=Qwen/Qwen2.5-7B-Instruct}"
    : "${RUN_NAME:=${ENV_NAME}_grpo}"
    : "${OUTPUT_DIR:=runs/${RUN_NAME}}"
    : "${PROMPT_DATA:=data/generated/${ENV_NAME}_train.jsonl}"
    : "${EVAL_DATA:=}"
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then  # the GPUs this node may use
        local visible
        IFS=, read -r -a visible <<<"$CUDA_VISIBLE_DEVICES"
        : "${GPUS_PER_NODE:=${#visible[@]}}"
    fi
    : "${NUM_NODES:=1}" "${GPUS_PER_NODE:=8}" "${VLLM_TP:=1}" "${VLLM_GPU_UTIL:=0.6}" "${COLOCATE_ALL:=1}"
    : "${VLLM_NUM_ENGINES:=$((NUM_NODES * GPUS_PER_NODE / VLLM_TP))}"
    : "${ZERO_STAGE:=3}" "${GRADIENT_CHECKPOINTING:=1}" "${PACKING:=0}"
    : "${ROLLOUT_BATCH_SIZE:=16}" "${N_SAMPLES_PER_PROMPT:=8}"
    : "${TRAIN_BATCH_SIZE:=$((ROLLOUT_BATCH_SIZE * N_SAMPLES_PER_PROMPT))}"
    : "${MICRO_TRAIN_BATCH_SIZE:=1}" "${MICRO_ROLLOUT_BATCH_SIZE:=2}" "${LR:=1e-6}" "${KL_COEF:=0.001}"
    : "${TEMPERATURE:=1.0}" "${MAX_LEN:=16384}" "${MAX_NEW_TOKENS:=1024}" "${NUM_EPISODES:=20}"
    : "${SAVE_STEPS:=50}" "${EVAL_STEPS:=-1}" "${SEED:=42}" "${EXTRA_ARGS:=}"
    : "${COPE_GATEWAY_URL:=http://127.0.0.1:${GATEWAY_PORT:-8800}}"
    # upstream CoPE's run-script defaults
    if cope_is_true "${ACTION_FORECAST_ENABLE:-0}"; then : "${ACTION_FORECAST_GROUP_NORM:=1}"; fi
    if cope_is_true "${ACTION_FORECAST_ENABLE:-0}" || cope_is_true "${TE_ENABLE:-0}"; then
        : "${ACTION_FORECAST_SKIP_INVALID:=1}"
    fi
    [ "$VLLM_NUM_ENGINES" -ge 1 ] || cope_die "VLLM_NUM_ENGINES=$VLLM_NUM_ENGINES: need at least one vLLM engine"
    if [ -n "${HORIZON_SCHEDULE:-}" ]; then
        [[ "$HORIZON_SCHEDULE" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
            cope_die "HORIZON_SCHEDULE=$HORIZON_SCHEDULE: give comma-separated turn counts, e.g. 6,13,20"
        : "${HORIZON_STAGE_STEPS:=100}"
        # The agent func counts its engine's episodes to know the training step (unless a step file exists).
        : "${HORIZON_EPISODES_PER_STEP:=$(((ROLLOUT_BATCH_SIZE * N_SAMPLES_PER_PROMPT + VLLM_NUM_ENGINES - 1) / VLLM_NUM_ENGINES))}"
    fi
}

# Fills COPE_CMD: the trainer's module and arguments (without the interpreter).
cope_build_args() {
    COPE_CMD=(-m cope_rlhf.cli.train_ppo_ray
        --actor.model_name_or_path "$MODEL_PATH"
        --train.agent_func_path "agent_funcs/${ENV_NAME}.py"
        --data.prompt_dataset "$PROMPT_DATA" --data.input_key prompt --data.label_key label
        --actor.num_nodes "$NUM_NODES" --actor.num_gpus_per_node "$GPUS_PER_NODE"
        --ref.num_nodes "$NUM_NODES" --ref.num_gpus_per_node "$GPUS_PER_NODE"
        # OpenRLHF starts no reward-model group when the agent func gives the rewards (it sets --reward.remote_url
        # agent); sized as the actor's all the same, so that a run given a reward model instead places it.
        --reward.num_nodes "$NUM_NODES" --reward.num_gpus_per_node "$GPUS_PER_NODE"
        --vllm.num_engines "$VLLM_NUM_ENGINES" --vllm.tensor_parallel_size "$VLLM_TP"
        --vllm.gpu_memory_utilization "$VLLM_GPU_UTIL"
        --algo.advantage.estimator group_norm
        --rollout.batch_size "$ROLLOUT_BATCH_SIZE" --rollout.n_samples_per_prompt "$N_SAMPLES_PER_PROMPT"
        --rollout.micro_batch_size "$MICRO_ROLLOUT_BATCH_SIZE" --rollout.temperature "$TEMPERATURE"
        --rollout.max_new_tokens "$MAX_NEW_TOKENS" --data.max_len "$MAX_LEN"
        --train.batch_size "$TRAIN_BATCH_SIZE" --train.micro_batch_size "$MICRO_TRAIN_BATCH_SIZE"
        --train.num_episodes "$NUM_EPISODES" --train.seed "$SEED"
        --actor.adam.lr "$LR" --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef "$KL_COEF"
        --ds.zero_stage "$ZERO_STAGE" --ds.param_dtype bf16
        --logger.tensorboard_dir "$OUTPUT_DIR/tensorboard"
        --ckpt.path "$OUTPUT_DIR/ckpt" --ckpt.output_dir "$OUTPUT_DIR/model" --ckpt.save_steps "$SAVE_STEPS"
        --ckpt.save_hf --ckpt.load_enable)
    if cope_is_true "$COLOCATE_ALL"; then
        COPE_CMD+=(--train.colocate_all --vllm.enable_sleep --ds.enable_sleep)
    fi
    if cope_is_true "$GRADIENT_CHECKPOINTING"; then COPE_CMD+=(--actor.gradient_checkpointing_enable); fi
    if cope_is_true "$PACKING"; then COPE_CMD+=(--ds.packing_samples); fi
    if [ -n "$EVAL_DATA" ]; then
        COPE_CMD+=(--eval.dataset "$EVAL_DATA" --eval.steps "$EVAL_STEPS")
    fi
    if [ -n "${WANDB_API_KEY:-}" ]; then
        # OpenRLHF turns wandb on when --logger.wandb.key is non-empty, and logs in with WANDB_API_KEY from the
        # environment when that is set; the flag therefore carries a placeholder, never the key.
        COPE_CMD+=(--logger.wandb.key from-env --logger.wandb.project "${WANDB_PROJECT:-cope_rlhf}"
            --logger.wandb.run_name "$RUN_NAME")
    fi
    local var
    for var in "${COPE_VARS[@]}"; do
        if [ -n "${!var:-}" ]; then COPE_CMD+=("--cope.${var,,}" "${!var}"); fi
    done
    local extra
    read -r -a extra <<<"$EXTRA_ARGS"
    COPE_CMD+=("${extra[@]}" "$@")
}

# Secrets come only from .secrets/ (git-ignored), into the environment; never onto a command line or a log.
cope_load_secrets() {
    local file="${COPE_SECRETS_DIR:-$COPE_ROOT/.secrets}/wandb_api_key"
    if [ -f "$file" ]; then
        WANDB_API_KEY="$(tr -d '[:space:]' <"$file")"
        export WANDB_API_KEY
    fi
}

cope_python() {
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"
    elif [ -x "$COPE_ROOT/.venv/bin/python" ]; then echo "$COPE_ROOT/.venv/bin/python"
    else echo python3; fi
}

cope_ray() {
    if [ -x "$COPE_ROOT/.venv/bin/ray" ]; then echo "$COPE_ROOT/.venv/bin/ray"; else echo ray; fi
}

# Runs "$@", or prints it (shell-quoted) under DRY_RUN=1.
cope_run_or_print() {
    if cope_is_true "${DRY_RUN:-0}"; then cope_print_cmd "$@"; else "$@"; fi
}

# The runtime env of a Ray job as JSON (env_vars: the agent funcs' variables, set ones only, and the secrets).
cope_runtime_env_json() {
    local redact="${1:-}" var sep="" out='{"env_vars": {'
    local names=("${AGENT_VARS[@]}")
    if [ -n "${WANDB_API_KEY:-}" ]; then names+=(WANDB_API_KEY); fi
    for var in "${names[@]}"; do
        if [ -n "${!var:-}" ]; then
            local value="${!var}"
            if [ -n "$redact" ] && [ "$var" = WANDB_API_KEY ]; then value="<redacted>"; fi
            value="${value//\\/\\\\}"
            out+="$sep\"$var\": \"${value//\"/\\\"}\""
            sep=", "
        fi
    done
    echo "$out}}"
}

cope_print_cmd() {
    local first=1 arg
    for arg in "$@"; do
        if [ "$first" = 1 ]; then first=0; else printf ' '; fi
        printf '%q' "$arg"
    done
    printf '\n'
}

# Gloo (DeepSpeed's ranks on CPU, the CPU weight sync to vLLM) binds the address of the host name unless
# GLOO_SOCKET_IFNAME names an interface; where the host name resolves to loopback, ranks on other nodes cannot
# connect. A Ray node started with NODE_IP passes its workers the interface that holds NODE_IP.
cope_export_gloo_ifname() {
    local node_ip="$1" ifname
    if [ -n "${GLOO_SOCKET_IFNAME:-}" ] || [ -z "$node_ip" ] || ! command -v ip >/dev/null; then return 0; fi
    ifname="$(ip -o -4 addr show 2>/dev/null |
        awk -v want="$node_ip" '{split($4, a, "/")} a[1] == want {print $2; exit}')"
    if [ -n "$ifname" ]; then export GLOO_SOCKET_IFNAME="$ifname"; fi
}

# Stops Ray on this host (`ray stop`: every Ray process of the machine; STOP_GRACE_S=10 seconds, then SIGKILL).
cope_ray_stop() {
    cope_run_or_print "$(cope_ray)" stop --grace-period "${STOP_GRACE_S:-10}"
}

# Runs a `ray start` command line. With RAY_BLOCK=1 it stays in the foreground (`--block`, as srun or a supervisor
# needs) and a SIGTERM/SIGINT stops Ray on this host (`ray stop`, STOP_GRACE_S=10): `ray start --block` alone exits
# on the signal and leaves its raylet and workers running.
cope_ray_start() {
    if ! cope_is_true "${RAY_BLOCK:-0}"; then cope_run_or_print "$@"; return; fi
    if cope_is_true "${DRY_RUN:-0}"; then cope_print_cmd "$@" --block; return; fi
    "$@" --block &
    local pid=$! status=0 stopped=0
    trap 'stopped=1; cope_ray_stop >&2 || true; kill -TERM "$pid" 2>/dev/null' TERM INT
    while :; do
        wait "$pid"; status=$?
        kill -0 "$pid" 2>/dev/null || break  # exited; alive means the trap interrupted the wait
    done
    trap - TERM INT
    if [ "$stopped" = 1 ]; then return 0; fi
    return "$status"
}

cope_abspath() {
    case "$1" in /*) echo "$1" ;; *) echo "$COPE_ROOT/$1" ;; esac
}

cope_train_main() {
    cope_load_secrets
    cope_defaults
    if [ -n "${RAY_ADDRESS:-}" ]; then
        # The job's working dir is an upload of the repository without its git-ignored files (data/generated/,
        # runs/, .secrets/): data and outputs are addressed by absolute path (a shared filesystem on a cluster).
        OUTPUT_DIR="$(cope_abspath "$OUTPUT_DIR")"
        PROMPT_DATA="$(cope_abspath "$PROMPT_DATA")"
        if [ -n "$EVAL_DATA" ]; then EVAL_DATA="$(cope_abspath "$EVAL_DATA")"; fi
        if [ -e "$COPE_ROOT/$MODEL_PATH" ]; then MODEL_PATH="$(cope_abspath "$MODEL_PATH")"; fi
    fi
    cope_build_args "$@"
    local var
    for var in "${AGENT_VARS[@]}"; do
        if [ -n "${!var:-}" ]; then export "${var?}"; fi
    done
    cd "$COPE_ROOT" || exit 1
    if cope_is_true "${PREFLIGHT_ONLY:-0}"; then  # the tmux launcher, before it starts servers and the gateway
        "$(cope_python)" -m cope_rlhf.preflight --no-gateway "${COPE_CMD[@]:2}"
        return
    fi
    if [ -n "${RAY_ADDRESS:-}" ]; then
        if ! cope_is_true "${DRY_RUN:-0}" && ! cope_is_true "${COPE_SKIP_PREFLIGHT:-0}"; then
            # here, before anything is uploaded; the job's driver checks the cluster's GPUs once Ray is up
            "$(cope_python)" -m cope_rlhf.preflight "${COPE_CMD[@]:2}" || exit 2
        fi
        local submit=("$(cope_ray)" job submit --address "$RAY_ADDRESS" --working-dir "$COPE_ROOT")
        if cope_is_true "${DRY_RUN:-0}"; then
            echo "# runtime env: $(cope_runtime_env_json redact)"
            cope_print_cmd "${submit[@]}" --runtime-env "<private file>" -- "${JOB_PYTHON:-$(cope_python)}" "${COPE_CMD[@]}"
            return 0
        fi
        local runtime_env
        runtime_env="$(umask 077 && mktemp "${TMPDIR:-/tmp}/cope_runtime_env.XXXXXX.yaml")"
        trap 'rm -f "$runtime_env"' RETURN
        cope_runtime_env_json >"$runtime_env"  # JSON is YAML
        "${submit[@]}" --runtime-env "$runtime_env" -- "${JOB_PYTHON:-$(cope_python)}" "${COPE_CMD[@]}"
        return
    fi
    local python
    python="$(cope_python)"
    if cope_is_true "${DRY_RUN:-0}"; then
        for var in "${AGENT_VARS[@]}"; do
            if [ -n "${!var:-}" ]; then printf '%s=%q ' "$var" "${!var}"; fi
        done
        cope_print_cmd "$python" "${COPE_CMD[@]}"
        return 0
    fi
    mkdir -p "$OUTPUT_DIR"
    exec "$python" "${COPE_CMD[@]}"
}

cope_eval_main() {
    cope_defaults
    : "${CKPT:=$OUTPUT_DIR/model}" "${EVAL_ITEMS:=data/generated/${ENV_NAME}_test.jsonl}" "${EVAL_K:=4}"
    : "${EVAL_TEMPERATURE:=1.0}" "${EVAL_ENGINE:=}" "${EVAL_OUT:=runs/eval/${RUN_NAME}.json}" "${EVAL_LIMIT:=}"
    local python var
    python="$(cope_python)"
    local cmd=("$python" scripts/eval.py --env "$ENV_NAME" --model "$CKPT" --items "$EVAL_ITEMS" --k "$EVAL_K"
        --out "$EVAL_OUT" --gateway "$COPE_GATEWAY_URL" --temperature "$EVAL_TEMPERATURE"
        --max-new-tokens "$MAX_NEW_TOKENS" --max-length "$MAX_LEN")
    if [ -n "$EVAL_ENGINE" ]; then cmd+=(--engine "$EVAL_ENGINE"); fi
    if [ -n "$EVAL_LIMIT" ]; then cmd+=(--limit "$EVAL_LIMIT"); fi
    cmd+=("$@")
    cd "$COPE_ROOT" || exit 1
    for var in MAX_TURNS EPISODE_TIMEOUT_S ENV_CALL_TIMEOUT_S; do
        if [ -n "${!var:-}" ]; then
            export "${var?}"
            if cope_is_true "${DRY_RUN:-0}"; then printf '%s=%q ' "$var" "${!var}"; fi
        fi
    done
    if cope_is_true "${DRY_RUN:-0}"; then cope_print_cmd "${cmd[@]}"; return 0; fi
    exec "${cmd[@]}"
}
