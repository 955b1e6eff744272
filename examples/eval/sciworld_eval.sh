#!/usr/bin/env bash
# Score a checkpoint on SciWorld's held-out items with scripts/eval.py (success rate, mean reward, Avg@k, pass^k;
# per-item table and episodes as JSON). Needs the env server(s) and gateway up, e.g.
#   LAUNCH_ONLY=1 bash scripts/launch_sciworld_grpo_tmux.sh
#   CKPT=runs/sciworld_grpo/model bash examples/eval/sciworld_eval.sh     (settings: scripts/lib/common.sh, "Evaluation")
set -euo pipefail
ENV_NAME=sciworld
: "${MAX_TURNS:=20}"
# shellcheck source-path=SCRIPTDIR source=../../scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib/common.sh"
cope_eval_main "$@"
