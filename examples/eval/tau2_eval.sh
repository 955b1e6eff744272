#!/usr/bin/env bash
# τ²-bench is scored by τ²'s own CLI under the published protocol (docs/TAU2_GRPO.md), so this example is
# scripts/tau2_align_eval.sh: it serves the checkpoint with vLLM (Hermes tool-call parser), runs `tau2 run` on every
# domain's test split (4 trials, step cap 200, results under RESULTS_DIR=runs/tau2) and scores them with
# scripts/tau2_align_score.py.
#   TAG=mine CKPT=runs/tau2_grpo/model bash examples/eval/tau2_eval.sh
#   TAG=mine POLICY_BASE_URL=http://host:8000/v1 bash examples/eval/tau2_eval.sh     (a policy already served)
# Every setting of scripts/tau2_align_eval.sh applies (DOMAINS, NUM_TRIALS, USER_LLM, DRY_RUN=1, ...).
set -euo pipefail
if [ -n "${CKPT:-}" ] && [ -z "${MODEL_PATH:-}" ]; then export MODEL_PATH="$CKPT"; fi  # the other examples' name
exec bash "$(dirname "${BASH_SOURCE[0]}")/../../scripts/tau2_align_eval.sh" "$@"
