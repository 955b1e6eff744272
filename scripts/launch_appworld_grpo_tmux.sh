#!/usr/bin/env bash
# AppWorld: env server(s), gateway and GRPO training, each in its own tmux window (scripts/lib/tmux.sh).
#   bash scripts/launch_appworld_grpo_tmux.sh [stop]        LAUNCH_ONLY=1 / DRY_RUN=1 / HOLD=1: see scripts/lib/tmux.sh
# AppWorld has no built-in server: start its original server (it needs AppWorld's own data) and point at it:
#   ENV_SERVER_URLS=http://HOST:PORT[,http://HOST:PORT2] bash scripts/launch_appworld_grpo_tmux.sh
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
ENV_NAME=appworld
: "${ENV_SERVER=}"
# shellcheck source-path=SCRIPTDIR source=lib/tmux.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/tmux.sh"
cope_tmux_main "$@"
