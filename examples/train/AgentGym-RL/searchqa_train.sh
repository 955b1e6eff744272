#!/usr/bin/env bash
# AgentGym-RL baseline on SearchQA: GRPO with a fixed horizon of 5 turns, n = 4, lr 1e-6, k3 KL loss 0.001
# (docs/BASELINES.md). Plain config: variables, then the run script (scripts/lib/common.sh lists every setting;
# anything set before calling this file wins).
set -euo pipefail
: "${N_SAMPLES_PER_PROMPT:=4}" "${ROLLOUT_BATCH_SIZE:=16}" "${LR:=1e-6}" "${KL_COEF:=0.001}"
: "${MAX_TURNS:=5}" "${RUN_NAME:=agentgym_rl_searchqa}"
export N_SAMPLES_PER_PROMPT ROLLOUT_BATCH_SIZE LR KL_COEF MAX_TURNS RUN_NAME
exec bash "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/run_searchqa_grpo_train.sh" "$@"
