#!/usr/bin/env bash
# Score a checkpoint on SearchQA's held-out items with scripts/eval.py (success rate, mean reward, Avg@k, pass^k;
# per-item table and episodes as JSON). Needs the env server(s) and gateway up, e.g.
#   LAUNCH_ONLY=1 bash scripts/launch_searchqa_grpo_tmux.sh
#   CKPT=runs/searchqa_grpo/model bash examples/eval/searchqa_eval.sh     (settings: scripts/lib/common.sh, "Evaluation")
set -euo pipefail
ENV_NAME=searchqa
: "${MAX_TURNS:=5}"
# shellcheck source-path=SCRIPTDIR source=../../scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib/common.sh"
cope_eval_main "$@"
