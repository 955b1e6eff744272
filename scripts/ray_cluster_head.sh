#!/usr/bin/env bash
# Start the Ray head on this node. Then, on every other node:
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
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
if [ "${1:-}" = stop ]; then cope_ray_stop; exit; fi
: "${RAY_PORT:=6379}" "${DASHBOARD_HOST:=127.0.0.1}" "${DASHBOARD_PORT:=8265}" "${NUM_GPUS:=}" "${RAY_BLOCK:=0}"
: "${NODE_IP:=$(hostname -I 2>/dev/null | awk '{print $1}')}"
cope_export_gloo_ifname "$NODE_IP"  # GLOO_SOCKET_IFNAME for the workers, unless set
cmd=("$(cope_ray)" start --head --port "$RAY_PORT" --dashboard-host "$DASHBOARD_HOST" --dashboard-port "$DASHBOARD_PORT")
if [ -n "$NODE_IP" ]; then cmd+=(--node-ip-address "$NODE_IP"); fi
if [ -n "$NUM_GPUS" ]; then cmd+=(--num-gpus "$NUM_GPUS"); fi
cope_ray_start "${cmd[@]}"  # RAY_BLOCK=1: in the foreground; SIGTERM stops Ray here
