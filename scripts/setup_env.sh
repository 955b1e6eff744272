#!/usr/bin/env bash
# Create the virtual environment of one built-in environment server: .venvs/NAME/ from
# env_gateway/servers/requirements/NAME.txt (exact pins), with the repository root importable through a .pth
# file (the trainer stack is not installed there). Idempotent: when the venv exists and was built from the same
# requirements file (sha256 stamp), a second run only checks it (`pip check` + importing the server module).
#
#   bash scripts/setup_env.sh NAME [NAME ...]      e.g. bash scripts/setup_env.sh babyai textcraft searchqa
#   PYTHON=python3.11 bash scripts/setup_env.sh NAME   (interpreter that creates the venv; default python3.11)
#
# NAME = agentgym-ENV builds AgentGym's own ENV server (the parity tests' reference): the pins of
# requirements/agentgym-ENV.txt, then $AGENTGYM_DIR/agentenv-ENV with --no-deps, where AGENTGYM_DIR is an AgentGym
# checkout at commit 3ef9235 (default: ../shared/agentgym-3ef9235 beside this repository). Without that folder it
# says so and builds nothing (the parity tests then skip with the reason).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ_DIR="$ROOT/env_gateway/servers/requirements"

if [ $# -eq 0 ]; then
    echo "usage: bash scripts/setup_env.sh NAME [NAME ...]   (NAME is one of: $(cd "$REQ_DIR" 2>/dev/null && for f in *.txt; do printf '%s ' "${f%.txt}"; done))" >&2
    exit 2
fi

PYTHON="${PYTHON:-python3.11}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    PYTHON=python3
fi

setup_one() {
    local name="$1"
    local req="$REQ_DIR/$name.txt"
    local venv="$ROOT/.venvs/$name"
    if [ ! -f "$req" ]; then
        echo "setup_env: no requirements file $req; known envs: $(cd "$REQ_DIR" && for f in *.txt; do printf '%s ' "${f%.txt}"; done)" >&2
        return 2
    fi
    local agentgym_pkg=""
    if [[ "$name" == agentgym-* ]]; then
        local agentgym_dir="${AGENTGYM_DIR:-$(dirname "$ROOT")/shared/agentgym-3ef9235}"
        agentgym_pkg="$agentgym_dir/agentenv-${name#agentgym-}"
        if [ ! -f "$agentgym_pkg/pyproject.toml" ]; then
            echo "setup_env: $name: no AgentGym package at $agentgym_pkg: set AGENTGYM_DIR to an AgentGym checkout at" \
                 "3ef9235 to build AgentGym's own server; skipped"
            return 0
        fi
    fi
    local want; want="$( (cat "$req"; echo "$agentgym_pkg") | sha256sum | cut -d' ' -f1)"
    local stamp="$venv/.requirements.sha256"

    if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        echo "setup_env: $name: venv up to date ($venv); checking"
    else
        echo "setup_env: $name: building $venv from $req"
        [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
        if [ -n "$agentgym_pkg" ]; then
            # a copy: the checkout may be read-only and pip builds in the source tree
            local src; src="$(mktemp -d)"
            cp -r "$agentgym_pkg" "$src/" && chmod -R u+w "$src"
            "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$src/$(basename "$agentgym_pkg")"
            rm -rf "$src"
        fi
        echo "$want" > "$stamp"
    fi
    # The repo root on sys.path, so `python -m env_gateway.servers.NAME` runs from the venv (rewritten every run:
    # a moved checkout keeps working).
    local site; site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$ROOT" > "$site/cope_rlhf_repo.pth"

    if [ -n "$agentgym_pkg" ]; then  # pip check would flag what the package declares but never imports
        local module; module="agentenv_${name#agentgym-}"
        (cd "$agentgym_pkg" && "$venv/bin/python" -c "import $module.server") || {
            echo "setup_env: $name: importing $module.server fails in $venv; delete it and rerun" >&2; return 1; }
        echo "setup_env: $name: ok"
        return 0
    fi
    "$venv/bin/python" -m pip check --disable-pip-version-check >/dev/null || {
        echo "setup_env: $name: 'pip check' reports broken requirements in $venv; delete it and rerun" >&2; return 1; }
    if [ -f "$ROOT/env_gateway/servers/$name.py" ]; then
        (cd "$ROOT" && "$venv/bin/python" -c "import env_gateway.servers.$name") || {
            echo "setup_env: $name: importing env_gateway.servers.$name fails in $venv" >&2; return 1; }
    fi
    echo "setup_env: $name: ok"
}

for name in "$@"; do
    setup_one "$name"
done
