# shellcheck shell=bash
# Sourced by scripts/setup.sh and scripts/setup_env.sh (which set ROOT). Contract:
#   need_free_gb GB WHAT HINT   exits 1, building nothing, when the filesystem of $ROOT has under GB gigabytes free
#                               (whole GB, rounded down), with a message that names WHAT, both numbers and HINT.
# Out of disk, pip fails minutes into a build with only "[Errno 28] No space left on device" and leaves a half-built
# venv behind (seen on a CI machine with ~7 GB free for a ~12 GB set-up).
need_free_gb() {
  local need="$1" what="$2" hint="$3" free
  free="$(df -Pk "$ROOT" | awk 'NR == 2 {print int($4 / 1048576)}')"
  if (( free < need )); then
    echo "[setup] not enough disk to build $what: it needs about $need GB, and the filesystem of $ROOT has $free GB" \
         "free (df -h $ROOT). $hint" >&2
    exit 1
  fi
}
