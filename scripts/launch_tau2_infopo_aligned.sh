#!/usr/bin/env bash
# GRPO on τ²-bench with the published InfoPO training recipe (docs/TAU2_GRPO.md, "Protocol alignment"): the τ² server,
# the gateway and training, each in its own tmux window (scripts/lib/tmux.sh), as scripts/launch_tau2_grpo_tmux.sh.
#
#   bash scripts/launch_tau2_infopo_aligned.sh                          the published recipe (stock GRPO)
#   ACTION_FORECAST_ENABLE=1 bash scripts/launch_tau2_infopo_aligned.sh  the same recipe + a CoPE signal (an ablation;
#                                                                       every CoPE variable rides along, docs/METHOD.md)
#   DRY_RUN=1 bash scripts/launch_tau2_infopo_aligned.sh                print every window's command; start nothing
#   bash scripts/launch_tau2_infopo_aligned.sh stop                     tear it down
#
# Every published value below is a default; setting its variable overrides it, and a change that breaks comparability
# is printed as a deviation. The cluster decides two of them: a GPU of 40 GB or less gets the response budget 8192
# (16384 does not fit), and TAU2_USER_BASE_URL pointing at a local server means a user model other than the published
# one. A rollout batch × n that the training GPUs cannot share evenly, or a PPO mini-batch DeepSpeed cannot split into
# whole micro-batches, is refused (exit 2) with what to set instead. Other settings: scripts/lib/common.sh and
# scripts/lib/tmux.sh (GPUS_PER_NODE, NUM_NODES, MODEL_PATH, OUTPUT_DIR, RAY_ADDRESS, ...).
# The user model's key: .secrets/tau2_user_api_key, read by the τ² server (never argv, never logged).
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
ENV_NAME=tau2
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
note() { echo "launch_tau2_infopo_aligned: $*"; }
refuse() { echo "launch_tau2_infopo_aligned: error: $*" >&2; exit 2; }

# ---- the published recipe (InfoPO's training script and its Table 4, as CoPE's τ² launchers carry them) ---------
: "${RUN_NAME:=tau2_infopo_aligned}"
# Data: the train splits of all three domains together (airline 30 + retail 74 + telecom 74 = 178 tasks), written
# from the committed item-id files data/tau2_<domain>_train.jsonl.
: "${PROMPT_DATA:=data/generated/tau2_all_train.jsonl}"
: "${ROLLOUT_BATCH_SIZE:=32}"    # prompts per step (CoPE used 28 on 7 GPUs: 32 × 5 does not divide by 7)
: "${N_SAMPLES_PER_PROMPT:=5}"   # GRPO group size n
: "${PPO_MINI_BATCH:=14}"        # prompts per PPO update; OpenRLHF counts samples: TRAIN_BATCH_SIZE = 14 × n
: "${TRAIN_BATCH_SIZE:=$((PPO_MINI_BATCH * N_SAMPLES_PER_PROMPT))}"
: "${MICRO_TRAIN_BATCH_SIZE:=2}" # micro-batch per GPU
: "${LR:=1e-6}"                  # actor learning rate
: "${KL_COEF:=0}"                # no KL term at all (with 0 OpenRLHF builds no reference model)
: "${ENTROPY_COEF:=0.001}"       # entropy bonus (OpenRLHF --actor.entropy_coef)
: "${NUM_EPISODES:=10}"          # 10 passes over the 178 tasks
: "${MAX_TURNS:=50}"             # agent turns per episode
: "${MAX_NEW_TOKENS:=1024}"      # tokens per agent turn
: "${PROMPT_MAX_LEN:=8192}"      # the first prompt (telecom's policy alone is about 6,200 tokens)
: "${TAU2_MAX_STEPS:=200}"       # τ²'s orchestrator step cap, as its evaluation counts it
: "${TAU2_REWARD_SHAPE:=binary}" # τ²'s own success, 1 or 0
: "${TAU2_AGENT_PROMPT:=tau2}"   # τ²'s default agent prompt and tools, as `tau2 run` evaluates the model (the server's
                                 # --agent-prompt; "project": agent_funcs/tau2.py's own instruction and a done tool)
: "${TAU2_USER_MODEL:=openai/gpt-4o-mini-2024-07-18}"  # the user model of the published numbers ...
: "${TAU2_USER_BASE_URL:=https://api.openai.com/v1}"    # ... from its provider
: "${TAU2_USER_TEMPERATURE:=0}"  # ... at temperature 0
: "${ENV_SERVER_PORT:=8200}"

# The response budget (all of an episode's agent and environment tokens after the first prompt): 16384 published;
# a GPU of 40 GB or less cannot hold it, and gets 8192, as CoPE ran there. GPU_MEM_GB overrides the detection.
if [ -z "${GPU_MEM_GB:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then
    mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 | tr -d ' ')" ||
        true
    if [[ "$mib" =~ ^[0-9]+$ ]]; then GPU_MEM_GB=$((mib / 1024)); fi
fi
deviations=()
if [ -z "${RESPONSE_BUDGET:-}" ]; then
    RESPONSE_BUDGET=16384
    if [ -n "${GPU_MEM_GB:-}" ] && [ "$GPU_MEM_GB" -le 40 ]; then
        RESPONSE_BUDGET=8192
        deviations+=("response budget 8192 (published 16384), forced by ${GPU_MEM_GB} GB GPUs (CoPE's setting there)")
    fi
elif [ "$RESPONSE_BUDGET" != 16384 ]; then
    deviations+=("response budget $RESPONSE_BUDGET (published 16384)")
fi
: "${MAX_LEN:=$((PROMPT_MAX_LEN + RESPONSE_BUDGET))}"  # OpenRLHF's one length limit: prompt + response

# ---- what the cluster allows -------------------------------------------------------------------------------------
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ -z "${GPUS_PER_NODE:-}" ]; then
    IFS=, read -r -a visible <<<"$CUDA_VISIBLE_DEVICES"
    GPUS_PER_NODE="${#visible[@]}"
fi
: "${NUM_NODES:=1}" "${GPUS_PER_NODE:=8}"
gpus=$((NUM_NODES * GPUS_PER_NODE))
if [ "${1:-}" != stop ]; then
    samples=$((ROLLOUT_BATCH_SIZE * N_SAMPLES_PER_PROMPT))
    if ((samples % gpus != 0)); then
        fit=$((ROLLOUT_BATCH_SIZE - ROLLOUT_BATCH_SIZE % gpus))
        if [ "$fit" = 0 ]; then fit="$gpus"; fi
        refuse "ROLLOUT_BATCH_SIZE=$ROLLOUT_BATCH_SIZE × N_SAMPLES_PER_PROMPT=$N_SAMPLES_PER_PROMPT =" \
            "$samples samples do not divide evenly over $gpus training GPUs" \
            "(NUM_NODES=$NUM_NODES × GPUS_PER_NODE=$GPUS_PER_NODE):" \
            "use a GPU count that divides $samples, or set ROLLOUT_BATCH_SIZE to a multiple of $gpus" \
            "(e.g. $fit; CoPE ran 28 on 7 GPUs), a deviation from the published 32"
    fi
    if ((TRAIN_BATCH_SIZE % (MICRO_TRAIN_BATCH_SIZE * gpus) != 0)); then
        refuse "the PPO mini-batch, TRAIN_BATCH_SIZE=$TRAIN_BATCH_SIZE samples (PPO_MINI_BATCH=$PPO_MINI_BATCH ×" \
            "n=$N_SAMPLES_PER_PROMPT), is not a multiple of MICRO_TRAIN_BATCH_SIZE=$MICRO_TRAIN_BATCH_SIZE ×" \
            "$gpus GPUs = $((MICRO_TRAIN_BATCH_SIZE * gpus)); DeepSpeed needs whole gradient-accumulation steps." \
            "The published recipe ran on 7 GPUs (CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6 ROLLOUT_BATCH_SIZE=28, as CoPE);" \
            "or set PPO_MINI_BATCH (or TRAIN_BATCH_SIZE) so that it divides, a deviation from the published 14"
    fi
fi
[ "$ROLLOUT_BATCH_SIZE" = 32 ] || deviations+=("rollout batch $ROLLOUT_BATCH_SIZE prompts (published 32)")
[ "$N_SAMPLES_PER_PROMPT" = 5 ] || deviations+=("n = $N_SAMPLES_PER_PROMPT (published 5)")
[ "$TRAIN_BATCH_SIZE" = $((14 * N_SAMPLES_PER_PROMPT)) ] ||
    deviations+=("PPO mini-batch $TRAIN_BATCH_SIZE samples (published 14 prompts × n)")
[ "$TAU2_USER_MODEL" = openai/gpt-4o-mini-2024-07-18 ] ||
    deviations+=("user model $TAU2_USER_MODEL (published gpt-4o-mini-2024-07-18)")
case "$TAU2_USER_BASE_URL" in
    http://127.0.0.1* | http://localhost* | http://0.0.0.0*)
        deviations+=("a local user model at $TAU2_USER_BASE_URL (published: gpt-4o-mini from OpenAI)") ;;
esac
[ "$TAU2_AGENT_PROMPT" = tau2 ] ||
    deviations+=("agent prompt '$TAU2_AGENT_PROMPT' (published: tau2's default agent prompt, TAU2_AGENT_PROMPT=tau2)")
for d in "${deviations[@]}"; do note "deviation from the published recipe: $d"; done

# ---- hand over to the tmux launcher ------------------------------------------------------------------------------
# The τ² server: binary reward, τ²'s evaluation with every basis of the task's reward basis (EvaluationType.ALL, the
# server's only mode), its step cap, τ²'s default agent prompt, the user model at temperature 0. TAU2_SERVER_ARGS adds
# more server flags.
if [ -z "${ENV_SERVER_URLS:-}" ] && [ -z "${ENV_SERVER_ARGS:-}" ]; then
    ENV_SERVER_ARGS="--user-model $TAU2_USER_MODEL --user-base-url $TAU2_USER_BASE_URL --reward-shape \
$TAU2_REWARD_SHAPE --max-steps $TAU2_MAX_STEPS --agent-prompt $TAU2_AGENT_PROMPT --user-temperature \
$TAU2_USER_TEMPERATURE ${TAU2_SERVER_ARGS:-}"
fi
EXTRA_ARGS="--actor.entropy_coef $ENTROPY_COEF ${EXTRA_ARGS:-}"
export RUN_NAME PROMPT_DATA ROLLOUT_BATCH_SIZE N_SAMPLES_PER_PROMPT TRAIN_BATCH_SIZE MICRO_TRAIN_BATCH_SIZE LR KL_COEF \
    NUM_EPISODES MAX_TURNS MAX_NEW_TOKENS MAX_LEN NUM_NODES GPUS_PER_NODE EXTRA_ARGS ENV_SERVER_PORT TAU2_REWARD_SHAPE
export ENV_SERVER_ARGS

if [ "${1:-}" != stop ]; then
    sources=("$ROOT/data/tau2_airline_train.jsonl" "$ROOT/data/tau2_retail_train.jsonl"
        "$ROOT/data/tau2_telecom_train.jsonl")
    if [ "$PROMPT_DATA" = data/generated/tau2_all_train.jsonl ]; then
        if [[ "${DRY_RUN:-0}" =~ ^(1|true|yes|on)$ ]]; then
            note "would write $PROMPT_DATA: the train splits of airline, retail and telecom (178 tasks)"
        else
            mkdir -p "$ROOT/data/generated"
            cat "${sources[@]}" >"$ROOT/$PROMPT_DATA.tmp" && mv "$ROOT/$PROMPT_DATA.tmp" "$ROOT/$PROMPT_DATA"
            note "wrote $PROMPT_DATA ($(wc -l <"$ROOT/$PROMPT_DATA") tasks: train splits of airline, retail, telecom)"
        fi
    fi
fi
# shellcheck source-path=SCRIPTDIR source=lib/tmux.sh
source "$ROOT/scripts/lib/tmux.sh"
cope_tmux_main "$@"
