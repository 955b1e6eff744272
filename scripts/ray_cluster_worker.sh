#!/usr/bin/env bash
# Join this node to a Ray cluster started by scripts/ray_cluster_head.sh:
#   HEAD_ADDRESS=<head ip>:6379 bash scripts/ray_cluster_worker.sh
#   NODE_IP=<first address of `hostname -I`>  NUM_GPUS= (Ray's own count)  RAY_BLOCK=0 (1: foreground, for srun)
#   DRY_RUN=1 prints the command
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
: "${HEAD_ADDRESS:?set HEAD_ADDRESS=<head ip>:<port> (what ray_cluster_head.sh printed)}"
: "${NUM_GPUS:=}" "${RAY_BLOCK:=0}"
: "${NODE_IP:=$(hostname -I 2>/dev/null | awk '{print $1}')}"
cmd=("$(cope_ray)" start --address "$HEAD_ADDRESS")
if [ -n "$NODE_IP" ]; then cmd+=(--node-ip-address "$NODE_IP"); fi
if [ -n "$NUM_GPUS" ]; then cmd+=(--num-gpus "$NUM_GPUS"); fi
if cope_is_true "$RAY_BLOCK"; then cmd+=(--block); fi
cope_run_or_print "${cmd[@]}"
