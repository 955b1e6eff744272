#!/usr/bin/env bash
#SBATCH --job-name=tau2-align
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%x-%j.out
# τ²-bench evaluation through τ²'s own CLI under Slurm: one node, the policy served by vLLM on its GPU, `tau2 run` per
# domain with the published protocol, then the scorer. All the work is scripts/tau2_align_eval.sh (the one-machine
# twin); every setting there passes through (--export=ALL):
#   sbatch --export=ALL,TAU2_VERSION=infopo,MODEL_PATH=<hf-ckpt>,TAG=mine scripts/sbatch_tau2_align.sh
#   sbatch --gpus-per-node=2 --export=ALL,MODEL_PATH=<ckpt>,TAG=mine,USER_MODEL_PATH=<user ckpt>,\
#          POLICY_CUDA_DEVICES=0,USER_CUDA_DEVICES=1 scripts/sbatch_tau2_align.sh      (a local user model: a deviation)
#   DRY_RUN=1 TAG=mine MODEL_PATH=<ckpt> bash scripts/sbatch_tau2_align.sh                (print the plan, run nothing)
# Then: python scripts/tau2_align_score.py --tag mine  and  python scripts/tau2_viz_trajectories.py "mine=mine" ...
# The user model's key is read from .secrets/tau2_user_api_key by the twin (never argv, never the job's log).
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "${BASH_SOURCE[0]}")/..}"
exec bash scripts/tau2_align_eval.sh "$@" </dev/null
