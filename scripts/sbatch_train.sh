#!/usr/bin/env bash
#SBATCH --job-name=cope-rlhf
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=slurm-%x-%j.out
# Multi-node GRPO (+ CoPE) under Slurm: env servers and a gateway on every node (agent funcs talk to their own
# node's gateway at 127.0.0.1), a Ray head on the first node, Ray workers on the others, then `ray job submit`.
#   ENV_NAME=babyai sbatch --nodes=4 scripts/sbatch_train.sh          every run-script variable passes through
#   ENV_NAME=babyai TE_ENABLE=1 sbatch scripts/sbatch_train.sh        (scripts/lib/common.sh lists them)
#   DRY_RUN=1 NODES="node1 node2" ENV_NAME=babyai bash scripts/sbatch_train.sh    prints the plan, runs nothing
# Settings: NODES (default: the allocation's hosts)  GPUS_PER_NODE (default SLURM_GPUS_ON_NODE or 8)
#   RAY_PORT=6379  DASHBOARD_PORT=8265  GATEWAY_PORT=8800  STARTUP_TIMEOUT=600 (seconds for Ray and servers)
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "${BASH_SOURCE[0]}")/..}"
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source scripts/lib/common.sh
: "${ENV_NAME:?set ENV_NAME: one of babyai sciworld textcraft alfworld searchqa webshop webarena appworld tau2}"
[ -f "scripts/run_${ENV_NAME}_grpo_train.sh" ] || cope_die "no scripts/run_${ENV_NAME}_grpo_train.sh"
: "${NODES:=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a Slurm job: set NODES}")}"
read -r -d '' -a nodes <<<"$NODES" || true
head="${nodes[0]}"
: "${RAY_PORT:=6379}" "${DASHBOARD_PORT:=8265}" "${GATEWAY_PORT:=8800}" "${STARTUP_TIMEOUT:=600}"
: "${GPUS_PER_NODE:=${SLURM_GPUS_ON_NODE:-8}}"
NUM_NODES="${#nodes[@]}"
export ENV_NAME NUM_NODES GPUS_PER_NODE GATEWAY_PORT
session="cope-${ENV_NAME}-${SLURM_JOB_ID:-dry}"
head_ip="$(getent hosts "$head" | awk '{print $1; exit}')" || true
head_ip="${head_ip:-$head}"

steps=()
background() {  # a job step that lives as long as the job; killed (by its pid) when the script exits
    if cope_is_true "${DRY_RUN:-0}"; then cope_print_cmd "$@"; return; fi
    "$@" &
    steps+=("$!")
}
cleanup() {
    if [ "${#steps[@]}" -gt 0 ]; then kill -TERM "${steps[@]}" 2>/dev/null || true; wait || true; fi
}
trap cleanup EXIT

background srun --overlap --nodes="$NUM_NODES" --ntasks-per-node=1 \
    env LAUNCH_ONLY=1 HOLD=1 TMUX_SESSION="$session" bash "scripts/launch_${ENV_NAME}_grpo_tmux.sh"
background srun --overlap --nodes=1 --ntasks=1 -w "$head" \
    env RAY_BLOCK=1 RAY_PORT="$RAY_PORT" DASHBOARD_PORT="$DASHBOARD_PORT" bash scripts/ray_cluster_head.sh
for node in "${nodes[@]:1}"; do
    background srun --overlap --nodes=1 --ntasks=1 -w "$node" \
        env RAY_BLOCK=1 HEAD_ADDRESS="$head_ip:$RAY_PORT" bash scripts/ray_cluster_worker.sh
done

if ! cope_is_true "${DRY_RUN:-0}"; then
    deadline=$((SECONDS + STARTUP_TIMEOUT))
    until curl -fsS -m 2 -o /dev/null "http://127.0.0.1:$GATEWAY_PORT/v1/health" 2>/dev/null &&
        [ "$("$(cope_ray)" list nodes --address "$head_ip:$RAY_PORT" --filter state=ALIVE 2>/dev/null | grep -c ALIVE)" -ge "$NUM_NODES" ]; do
        [ "$SECONDS" -lt "$deadline" ] || cope_die "Ray ($NUM_NODES nodes at $head_ip:$RAY_PORT) or the gateway on $head did not come up within ${STARTUP_TIMEOUT}s"
        sleep 5
    done
fi
RAY_ADDRESS="http://127.0.0.1:$DASHBOARD_PORT" bash "scripts/run_${ENV_NAME}_grpo_train.sh" "$@"
