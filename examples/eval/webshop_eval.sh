#!/usr/bin/env bash
# Score a checkpoint on WebShop's held-out items with scripts/eval.py (success rate, mean reward, Avg@k, pass^k;
# per-item table and episodes as JSON). Needs the env server(s) and gateway up, e.g.
#   LAUNCH_ONLY=1 bash scripts/launch_webshop_grpo_tmux.sh
#   CKPT=runs/webshop_grpo/model bash examples/eval/webshop_eval.sh     (settings: scripts/lib/common.sh, "Evaluation")
set -euo pipefail
ENV_NAME=webshop
: "${MAX_TURNS:=15}"
# shellcheck source-path=SCRIPTDIR source=../../scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib/common.sh"
cope_eval_main "$@"
