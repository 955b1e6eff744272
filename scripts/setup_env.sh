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
#
# NAME = tau2 builds τ²-bench's server: the pins of requirements/tau2.txt, then the tau2 package with --no-deps from
# $TAU2_BENCH_DIR, a sierra-research/tau2-bench checkout at commit c5b2d22 (default: ../shared/tau2-bench-c5b2d22
# beside this repository). Its domain data (TAU2_BENCH_DIR/data) is copied into the venv, and a .pth file makes it
# tau2's default data folder (TAU2_DATA_DIR, set in the server's environment, still wins). Without the checkout it
# says so and builds nothing, exit 0 (tests/test_tau2_real.py then skips with the reason). About 75 s on 2 cores.
# The commit it was built from is recorded beside the venv (.venvs/tau2/tau2-commit.json): the checkout's git HEAD,
# or, for a copy that is no git checkout, the commit stated once with TAU2_COMMIT=c5b2d22 (scripts/tau2_commit.py).
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
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

# shellcheck source=scripts/lib/disk_check.sh
source "$ROOT/scripts/lib/disk_check.sh"

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
    local tau2_dir=""
    if [ "$name" = tau2 ]; then
        tau2_dir="${TAU2_BENCH_DIR:-$(dirname "$ROOT")/shared/tau2-bench-c5b2d22}"
        if [ ! -f "$tau2_dir/pyproject.toml" ] || [ ! -d "$tau2_dir/src/tau2" ] || [ ! -d "$tau2_dir/data/tau2" ]; then
            echo "setup_env: tau2: no tau2-bench checkout at $tau2_dir (pyproject.toml, src/tau2, data/tau2): set" \
                 "TAU2_BENCH_DIR to a sierra-research/tau2-bench checkout at commit c5b2d22 to build τ²-bench's" \
                 "server; skipped"
            return 0
        fi
        tau2_dir="$(cd "$tau2_dir" && pwd)"
    fi
    local want; want="$( (cat "$req"; echo "$agentgym_pkg"; echo "$tau2_dir") | sha256sum | cut -d' ' -f1)"
    local stamp="$venv/.requirements.sha256"

    if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        echo "setup_env: $name: venv up to date ($venv); checking"
    else
        # disk a build needs: its venv's size as built here rounded up to whole GB (5.6 GB for agentgym-alfworld, at
        # most 0.9 GB for the others), plus 1 GB for pip's unpacking
        local need_gb=2
        if [ "$name" = agentgym-alfworld ]; then need_gb=7; fi
        local leave_out="COPE_ENV_SERVERS=\"...\" bash scripts/setup.sh builds only the env servers it names"
        need_free_gb "$need_gb" ".venvs/$name" "Free some space and rerun, or leave $name out: $leave_out."
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
        if [ -n "$tau2_dir" ]; then
            # a copy of the package (the checkout may be read-only), and of its domain data: the installed package
            # looks for data beside its source tree, which a wheel install does not have
            local src; src="$(mktemp -d)"
            cp -r "$tau2_dir/pyproject.toml" "$tau2_dir/src" "$src/"
            [ -f "$tau2_dir/README.md" ] && cp "$tau2_dir/README.md" "$src/"
            [ -f "$tau2_dir/LICENSE" ] && cp "$tau2_dir/LICENSE" "$src/"
            chmod -R u+w "$src"
            "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$src"
            rm -rf "$src" "$venv/tau2-data" "$venv/tau2-commit.json"  # a new install: its commit is recorded below
            cp -r "$tau2_dir/data" "$venv/tau2-data" && chmod -R u+w "$venv/tau2-data"
        fi
        echo "$want" > "$stamp"
    fi
    # The repo root on sys.path, so `python -m env_gateway.servers.NAME` runs from the venv (rewritten every run:
    # a moved checkout keeps working).
    local site; site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$ROOT" > "$site/cope_rlhf_repo.pth"
    if [ -n "$tau2_dir" ]; then  # tau2 reads TAU2_DATA_DIR when first imported; an explicit setting wins
        echo "import os; os.environ.setdefault('TAU2_DATA_DIR', '$venv/tau2-data')" > "$site/cope_rlhf_tau2_data.pth"
    fi

    if [ -n "$agentgym_pkg" ]; then  # pip check would flag what the package declares but never imports
        local module; module="agentenv_${name#agentgym-}"
        (cd "$agentgym_pkg" && "$venv/bin/python" -c "import $module.server") || {
            echo "setup_env: $name: importing $module.server fails in $venv; delete it and rerun" >&2; return 1; }
        echo "setup_env: $name: ok"
        return 0
    fi
    if [ -n "$tau2_dir" ]; then
        local out
        out="$(cd "$ROOT" && "$venv/bin/python" -c "import tau2.registry, env_gateway.servers.tau2" 2>&1)" || {
            echo "$out" | tail -20 >&2
            echo "setup_env: tau2: importing tau2.registry fails in $venv (output above); delete it and rerun" >&2
            return 1; }
        # the commit the package came from, beside the venv: tau2 run records "unknown" for an install from a copy
        # that is not a git checkout, and the scorer reads this record instead (scripts/tau2_commit.py)
        local commit
        commit="$("$venv/bin/python" "$ROOT/scripts/tau2_commit.py" --venv "$venv" --record --checkout "$tau2_dir" \
            ${TAU2_COMMIT:+--commit "$TAU2_COMMIT"})" || return 2
        if [ "$commit" = unknown ]; then
            echo "setup_env: tau2: note: $tau2_dir is no git checkout, so the tau2 commit of this install is unknown" \
                 "and no evaluation made with it is comparable with published numbers: state it once, e.g." \
                 "TAU2_COMMIT=c5b2d22 bash scripts/setup_env.sh tau2 (recorded in $venv/tau2-commit.json)"
        else
            echo "setup_env: tau2: installed from tau2-bench commit $commit"
        fi
        if [ ! -f "$venv/tau2-data/tau2/user_simulator/simulation_guidelines.md" ]; then
            echo "setup_env: tau2: note: $tau2_dir/data has no tau2/user_simulator/simulation_guidelines.md (the user" \
                 "simulator's prompt); the server refuses to start conversations without it: set TAU2_DATA_DIR to" \
                 "the data folder of a full tau2-bench checkout at c5b2d22 when running it"
        fi
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
