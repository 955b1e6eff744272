#!/usr/bin/env bash
# Score a checkpoint on ALFWorld's held-out items with scripts/eval.py (success rate, mean reward, Avg@k, pass^k;
# per-item table and episodes as JSON). Needs the env server(s) and gateway up, e.g.
#   LAUNCH_ONLY=1 bash scripts/launch_alfworld_grpo_tmux.sh
#   CKPT=runs/alfworld_grpo/model bash examples/eval/alfworld_eval.sh     (settings: scripts/lib/common.sh, "Evaluation")
set -euo pipefail
ENV_NAME=alfworld
: "${MAX_TURNS:=50}"
# shellcheck source-path=SCRIPTDIR source=../../scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib/common.sh"
cope_eval_main "$@"
