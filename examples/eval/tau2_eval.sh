#!/usr/bin/env bash
# τ²-bench is evaluated with its own CLI (docs/TAU2_GRPO.md): serve the checkpoint behind an OpenAI-compatible
# endpoint (vllm serve CKPT --served-model-name policy --enable-auto-tool-choice --tool-call-parser hermes), run
# `tau2 run` on every domain's test split with 4 trials, then compare with the published table:
#   TAG=mytag USER_LLM=gpt-4o-mini TAU2_RESULTS_DIR=<tau2 data dir>/simulations bash examples/eval/tau2_eval.sh
# Settings: TAG (required)  AGENT_LLM=openai/policy  USER_LLM=gpt-4o-mini (the published numbers' user)
#   AGENT_LLM_ARGS= USER_LLM_ARGS= (passed as --agent-llm-args / --user-llm-args)  TRIALS=4  MAX_STEPS=100
#   DOMAINS="airline retail telecom"  TAU2=.venvs/tau2/bin/tau2  TAU2_RESULTS_DIR=runs/tau2  DRY_RUN=1
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../../scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib/common.sh"
cd "$COPE_ROOT"
: "${TAG:?set TAG, the name this evaluation is saved under}" "${AGENT_LLM:=openai/policy}" "${USER_LLM:=gpt-4o-mini}"
: "${AGENT_LLM_ARGS:=}" "${USER_LLM_ARGS:=}" "${TRIALS:=4}" "${MAX_STEPS:=100}" "${DOMAINS:=airline retail telecom}"
: "${TAU2:=.venvs/tau2/bin/tau2}" "${TAU2_RESULTS_DIR:=runs/tau2}"
read -r -a domains <<<"$DOMAINS"
for domain in "${domains[@]}"; do
    cmd=("$TAU2" run --domain "$domain" --agent-llm "$AGENT_LLM" --user-llm "$USER_LLM" --num-trials "$TRIALS"
        --task-split-name test --max-steps "$MAX_STEPS" --save-to "${TAG}_${domain}")
    if [ -n "$AGENT_LLM_ARGS" ]; then cmd+=(--agent-llm-args "$AGENT_LLM_ARGS"); fi
    if [ -n "$USER_LLM_ARGS" ]; then cmd+=(--user-llm-args "$USER_LLM_ARGS"); fi
    cope_run_or_print "${cmd[@]}"
done
cope_run_or_print "$(cope_python)" scripts/tau2_align_score.py --tag "$TAG" --results-dir "$TAU2_RESULTS_DIR" \
    --trials "$TRIALS" --domains "${domains[@]}"
