#!/usr/bin/env bash
# BabyAI: env server(s), gateway and GRPO training, each in its own tmux window (scripts/lib/tmux.sh).
#   bash scripts/launch_babyai_grpo_tmux.sh [stop]        LAUNCH_ONLY=1 / DRY_RUN=1 / HOLD=1: see scripts/lib/tmux.sh
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
ENV_NAME=babyai
: "${ENV_SERVER_PORT:=8100}"
# shellcheck source-path=SCRIPTDIR source=lib/tmux.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/tmux.sh"
cope_tmux_main "$@"
