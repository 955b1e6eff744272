#!/usr/bin/env bash
# tau2-bench: env server(s), gateway and GRPO training, each in its own tmux window (scripts/lib/tmux.sh).
#   bash scripts/launch_tau2_grpo_tmux.sh [stop]        LAUNCH_ONLY=1 / DRY_RUN=1 / HOLD=1: see scripts/lib/tmux.sh
# The τ² server needs the user simulator: TAU2_USER_MODEL (e.g. openai/gpt-4o-mini) and TAU2_USER_BASE_URL (an
# OpenAI-compatible endpoint); its key is read from .secrets/tau2_user_api_key by the server (docs/TAU2_GRPO.md).
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
ENV_NAME=tau2
: "${ENV_SERVER_PORT:=8200}" "${TAU2_REWARD_SHAPE:=binary}"
if [ "${1:-}" != stop ] && [ -z "${ENV_SERVER_URLS:-}" ] && [ -z "${ENV_SERVER_ARGS:-}" ]; then
    ENV_SERVER_ARGS="--user-model ${TAU2_USER_MODEL:?set TAU2_USER_MODEL, e.g. openai/gpt-4o-mini} \
--user-base-url ${TAU2_USER_BASE_URL:?set TAU2_USER_BASE_URL, an OpenAI-compatible /v1 URL} \
--reward-shape $TAU2_REWARD_SHAPE"
fi
# shellcheck source-path=SCRIPTDIR source=lib/tmux.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/tmux.sh"
cope_tmux_main "$@"
