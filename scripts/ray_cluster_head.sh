#!/usr/bin/env bash
# Start the Ray head on this node:
#   bash scripts/ray_cluster_head.sh
# Then, on every other node:
#   HEAD_ADDRESS=<this node's ip>:6379 bash scripts/ray_cluster_worker.sh
# and submit training from here: RAY_ADDRESS=http://127.0.0.1:8265 bash scripts/run_<env>_grpo_train.sh
# (each node also runs its env servers and gateway: LAUNCH_ONLY=1 bash scripts/launch_<env>_grpo_tmux.sh).
#
#   RAY_PORT=6379  DASHBOARD_HOST=127.0.0.1 (0.0.0.0 to submit jobs from other hosts)  DASHBOARD_PORT=8265
#   NODE_IP=<first address of `hostname -I`>  NUM_GPUS= (Ray's own count)  RAY_BLOCK=0 (1: stay in the
#   foreground, as srun needs; SIGTERM then stops Ray here)
#   GLOO_SOCKET_IFNAME= (default: the interface holding NODE_IP; gloo's ranks on CPU and the CPU weight sync bind it)
#   DRY_RUN=1 prints the command.   `bash scripts/ray_cluster_head.sh stop`: stops Ray on this host (`ray stop`,
#   every Ray process of this machine; the processes get STOP_GRACE_S=10 seconds, then SIGKILL)
#   RAY_USAGE_STATS_ENABLED=0: Ray's usage statistics off, as `ray.init` keeps them for a release wheel (1 turns them
#   on); `ray start` then prints no usage-stats notice
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
if [ "${1:-}" = stop ]; then cope_ray_stop; exit; fi
# `ray start --head` prints a paragraph about usage statistics on every start (to a terminal, or to srun's log);
# `ray.init` never does for a release wheel, because it turns them off. The same here, unless the user chose; the
# notice itself stays off either way (RAY_USAGE_STATS_PROMPT_ENABLED=0: Ray's own switch for it)
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}" RAY_USAGE_STATS_PROMPT_ENABLED=0
: "${RAY_PORT:=6379}" "${DASHBOARD_HOST:=127.0.0.1}" "${DASHBOARD_PORT:=8265}" "${NUM_GPUS:=}" "${RAY_BLOCK:=0}"
: "${NODE_IP:=$(hostname -I 2>/dev/null | awk '{print $1}')}"
cope_export_gloo_ifname "$NODE_IP"  # GLOO_SOCKET_IFNAME for the workers, unless set
cmd=("$(cope_ray)" start --head --port "$RAY_PORT" --dashboard-host "$DASHBOARD_HOST" --dashboard-port "$DASHBOARD_PORT")
if [ -n "$NODE_IP" ]; then cmd+=(--node-ip-address "$NODE_IP"); fi
if [ -n "$NUM_GPUS" ]; then cmd+=(--num-gpus "$NUM_GPUS"); fi
cope_ray_start "${cmd[@]}"  # RAY_BLOCK=1: in the foreground; SIGTERM stops Ray here
