#!/usr/bin/env bash
# Join this node to a Ray cluster started by scripts/ray_cluster_head.sh:
#   HEAD_ADDRESS=<head ip>:6379 bash scripts/ray_cluster_worker.sh
#   NODE_IP=<first address of `hostname -I`>  NUM_GPUS= (Ray's own count)  RAY_BLOCK=0 (1: foreground, for srun;
#   SIGTERM then stops Ray here)
#   GLOO_SOCKET_IFNAME= (default: the interface holding NODE_IP; gloo's ranks on CPU and the CPU weight sync bind it)
#   DRY_RUN=1 prints the command.   `bash scripts/ray_cluster_worker.sh stop`: stops Ray on this host (`ray stop`,
#   every Ray process of this machine; the processes get STOP_GRACE_S=10 seconds, then SIGKILL)
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
if [ "${1:-}" = stop ]; then cope_ray_stop; exit; fi
: "${HEAD_ADDRESS:?set HEAD_ADDRESS=<head ip>:<port> (what ray_cluster_head.sh printed)}"
: "${NUM_GPUS:=}" "${RAY_BLOCK:=0}"
: "${NODE_IP:=$(hostname -I 2>/dev/null | awk '{print $1}')}"
cope_export_gloo_ifname "$NODE_IP"  # GLOO_SOCKET_IFNAME for the workers, unless set
cmd=("$(cope_ray)" start --address "$HEAD_ADDRESS")
if [ -n "$NODE_IP" ]; then cmd+=(--node-ip-address "$NODE_IP"); fi
if [ -n "$NUM_GPUS" ]; then cmd+=(--num-gpus "$NUM_GPUS"); fi
cope_ray_start "${cmd[@]}"  # RAY_BLOCK=1: in the foreground; SIGTERM stops Ray here
