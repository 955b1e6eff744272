#!/usr/bin/env bash
# GRPO (+ CoPE signals) on BabyAI with OpenRLHF's Ray trainer.
# Defaults here: AgentGym-RL: 20 turns, n = 8.
# Every other setting, DRY_RUN=1 and RAY_ADDRESS: scripts/lib/common.sh. A method variant is one more variable:
#   TE_ENABLE=1 TE_LAMBDA=0.1 bash scripts/run_babyai_grpo_train.sh
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
ENV_NAME=babyai
: "${MAX_TURNS:=20}" "${N_SAMPLES_PER_PROMPT:=8}"
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
cope_train_main "$@"
