"""``python -m cope_rlhf.local train``: OpenRLHF's real ``train_ppo_ray`` path on one machine, with the env side
started for you. There is one driver: this runs ``cope_rlhf.cli.train_ppo_ray.main`` — OpenRLHF's driver and Ray
placement groups, CoPE's PPOTrainer, one DeepSpeed policy rank, one reference rank (when ``--algo.kl.init_coef`` > 0),
one vLLM engine and the weight broadcast after every step, exactly as on a cluster — and adds:

- defaults sized for a small run (``LOCAL_DEFAULTS``) and, on a host without CUDA, the CPU preset (``CPU_PRESET``:
  sdpa attention, fp32 training (``cpu_cluster``), gloo weight sync, eager vLLM); on a CUDA host everything shares one GPU (``GPU_PRESET``);
- ``--env E``: the agent func ``agent_funcs/E.py`` and, unless ``--local.gateway_url`` names a running one, a gateway
  supervising E's server (``EnvStack``, its log in ``<ckpt.path>/gateway.log``), whose URL reaches the rollout workers
  as ``COPE_GATEWAY_URL``;
- ``--local.steps N``: N training steps (``--data.max_samples`` = N x ``rollout.batch_size`` prompts, one pass; with
  fewer training items, several passes over the most of them that divide N into whole passes);
- with ``--eval.dataset``: held-out evals before the first step and after the last (``--cope.eval_first_and_last``)
  and every ``--eval.steps`` between, each episode a line of ``<ckpt.path>/eval_episodes.jsonl``;
- at the end, ``<ckpt.path>/summary.json``: held-out success before and after, steps, TensorBoard folder, model.

Every other flag is ``train_ppo_ray``'s (``--help`` lists them with ``--cope.*``) and passes through unchanged: a
value the user gives wins over the defaults here. TensorBoard: OpenRLHF's ``train/*`` (``train/rollout/success_rate``
and the other episode metrics, ``train/policy_loss``, ``train/kl``, ``train/cope/*``, ``train/timing/*``) and
``eval/*`` (``eval/success_rate``, OpenRLHF's pass@k). ``--ckpt.load_enable`` resumes from OpenRLHF's checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# train_ppo_ray flags whose defaults suit a GPU cluster; here: a few-minute run of a small model.
LOCAL_DEFAULTS = {
    "algo.advantage.estimator": "group_norm", "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4,
    "rollout.micro_batch_size": 4, "train.micro_batch_size": 4, "actor.adam.lr": 1e-4, "actor.lr_warmup_ratio": 0.0,
    "actor.lr_scheduler": "constant_with_warmup", "algo.kl.init_coef": 0.0, "data.max_len": 2048,
    "rollout.max_new_tokens": 64, "eval.temperature": 0.0, "eval.n_samples_per_prompt": 1,
    "ckpt.path": "./ckpt/local", "ckpt.output_dir": "./ckpt/local_final", "data.input_key": "prompt",
    "data.label_key": "label", "ds.zero_stage": 2,
    # one process per model group, one engine
    "actor.num_nodes": 1, "actor.num_gpus_per_node": 1, "ref.num_nodes": 1, "ref.num_gpus_per_node": 1,
    "reward.num_nodes": 1, "reward.num_gpus_per_node": 1, "vllm.num_engines": 1, "vllm.tensor_parallel_size": 1,
}
CPU_PRESET = ["--ds.attn_implementation", "sdpa", "--ds.param_dtype", "fp32", "--vllm.sync_backend", "gloo",
              "--vllm.enforce_eager"]
GPU_PRESET = ["--train.colocate_all", "--vllm.gpu_memory_utilization", "0.4"]
ESTIMATORS = ("group_norm", "reinforce_baseline", "rloo", "dr_grpo", "reinforce")  # those without a critic


def add_local_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    local = parser.add_argument_group("single machine", "the local front-end's own settings")
    local.add_argument("--env", required=True, help="environment: agent_funcs/<env>.py and env_gateway.servers.<env>")
    local.add_argument("--local.steps", dest="steps", type=int, default=10, help="training steps (rollout batches)")
    local.add_argument("--local.gateway_url", dest="gateway_url", default=None,
                       help="use this running gateway instead of starting one with the env server")
    local.add_argument("--local.env_replicas", dest="env_replicas", type=int, default=1)
    local.add_argument("--local.max_turns", dest="max_turns", type=int, default=None,
                       help="actions per episode (the agent func's MAX_TURNS; default: the env's own)")
    local.add_argument("--local.eval_batch_size", dest="eval_batch_size", type=int, default=128,
                       help="held-out prompts whose episodes run at once (--cope.eval_dispatch_size; each holds an env "
                            "instance: keep it under the env server's --max-instances)")
    return parser


def train_parser() -> argparse.ArgumentParser:
    """``train_ppo_ray``'s flags, ``--cope.*`` and this front-end's own (for parsing and ``--help``)."""
    from cope_rlhf.cli.args import build_parser

    parser = add_local_args(build_parser())
    parser.prog = "python -m cope_rlhf.local train"
    parser.description = __doc__.split("\n\n")[0]
    return parser


def count_rows(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def cli_argv(argv: List[str]) -> tuple:
    """(this front-end's settings, the ``train_ppo_ray`` argv, that argv parsed): the defaults here, the preset,
    what the local settings imply, then the user's own flags (the last value of a flag wins). Errors exit with
    code 2 and say what to change."""
    from cope_rlhf.cli.args import combination_error

    parser = train_parser()
    defaults = [item for key, value in LOCAL_DEFAULTS.items() for item in (f"--{key}", str(value))]
    full = vars(parser.parse_args(defaults + argv))  # --help, unknown flags and a missing --env end here
    local, rest = add_local_args(argparse.ArgumentParser(add_help=False)).parse_known_args(argv)
    agent = full["train.agent_func_path"] or os.path.join(ROOT, "agent_funcs", f"{local.env}.py")
    if not os.path.exists(agent):
        parser.error(f"--env {local.env}: there is no agent func {agent}")
    full["train.agent_func_path"] = agent
    if local.steps < 1 or local.eval_batch_size < 1:
        parser.error("--local.steps and --local.eval_batch_size must be >= 1")
    estimator, n = full["algo.advantage.estimator"], full["rollout.n_samples_per_prompt"]
    if estimator not in ESTIMATORS:
        parser.error(f"--algo.advantage.estimator {estimator}: the single-machine front-end starts no critic; use one "
                     f"of {', '.join(ESTIMATORS)} (group_norm = GRPO)")
    if estimator != "reinforce" and n < 2:
        parser.error(f"{estimator} compares samples of one prompt: --rollout.n_samples_per_prompt must be >= 2")
    problem = combination_error(argparse.Namespace(**full))
    if problem:
        parser.error(problem)
    for flag in ("actor.model_name_or_path", "data.prompt_dataset"):
        if not full[flag]:
            parser.error(f"--{flag} is required")
    # N steps of B prompts: one pass over N x B prompts, or, with fewer items, passes of k x B prompts where k is
    # the largest divisor of N that the items allow (OpenRLHF's --train.num_episodes counts the passes)
    per_pass, rollout_batch = local.steps, full["rollout.batch_size"]
    if os.path.isfile(full["data.prompt_dataset"]):
        rows = count_rows(full["data.prompt_dataset"])
        per_pass = max((k for k in range(1, local.steps + 1) if local.steps % k == 0 and k * rollout_batch <= rows),
                       default=0)
        if not per_pass:
            parser.error(f"{full['data.prompt_dataset']} has {rows} items, fewer than one rollout batch "
                         f"(--rollout.batch_size {rollout_batch}): a smaller batch, or more items "
                         "(scripts/make_itemids.py)")
    prompts = per_pass * rollout_batch
    if full["eval.dataset"] and os.path.isfile(full["eval.dataset"]) and count_rows(full["eval.dataset"]) > prompts:
        # OpenRLHF caps the eval set at data.max_samples too (prepare_datasets)
        parser.error(f"{full['eval.dataset']} has {count_rows(full['eval.dataset'])} items, more than the "
                     f"{prompts} prompts of a pass over the training items, and OpenRLHF reads at most that many "
                     "held-out items: fewer held-out items, or more steps")
    episodes = full["rollout.batch_size"] * n
    batch = full["train.batch_size"] if "--train.batch_size" in argv else episodes  # default: one step per rollout
    if episodes % batch or batch % full["train.micro_batch_size"]:
        parser.error(f"rollout.batch_size x n_samples_per_prompt ({episodes}) must be a multiple of train.batch_size "
                     f"({batch}), and that of train.micro_batch_size ({full['train.micro_batch_size']})")
    implied = ["--train.agent_func_path", agent, "--data.max_samples", str(prompts),
               "--train.num_episodes", str(local.steps // per_pass),
               "--cope.eval_dispatch_size", str(local.eval_batch_size), "--train.batch_size", str(episodes)]
    if full["eval.dataset"]:
        implied += ["--cope.eval_first_and_last"]
    preset = GPU_PRESET if torch.cuda.is_available() else CPU_PRESET
    train_argv = defaults + preset + implied + rest
    return local, train_argv, vars(parser.parse_args(train_argv + ["--env", local.env]))


def write_summary(ckpt_path: str, steps: int, tensorboard_dir: str, model: str) -> Dict[str, float]:
    """``summary.json`` from the held-out episodes: success at the first and the last eval step."""
    per_step: Dict[int, List[float]] = {}
    from cope_rlhf.ppo_trainer import EVAL_EPISODES

    episodes = os.path.join(ckpt_path, EVAL_EPISODES)
    if os.path.isfile(episodes):
        with open(episodes) as f:
            for line in f:
                record = json.loads(line)
                per_step.setdefault(record["step"], []).append(record["success"])
    summary: Dict = {}
    if per_step:
        first, last = min(per_step), max(per_step)
        summary = {"eval_before": sum(per_step[first]) / len(per_step[first]),
                   "eval_after": sum(per_step[last]) / len(per_step[last])}
    summary.update(steps=steps, tensorboard_dir=tensorboard_dir, model=model)
    with open(os.path.join(ckpt_path, "summary.json"), "w") as f:
        json.dump(summary, f)
    return summary


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    argv = sys.argv[1:] if argv is None else list(argv)
    local, train_argv, args = cli_argv(argv)
    from cope_rlhf.cli.train_ppo_ray import main as train_ppo_ray
    from cope_rlhf.local.env_stack import EnvStack

    tensorboard = args["logger.tensorboard_dir"] or os.path.join(args["ckpt.path"], "tensorboard")
    train_argv += ["--logger.tensorboard_dir", tensorboard]
    step_dir = tempfile.mkdtemp(prefix="cope-local-")
    saved = dict(os.environ)
    try:
        with EnvStack(local.env, local.gateway_url, local.env_replicas,
                      log_path=os.path.join(args["ckpt.path"], "gateway.log")) as stack:
            # Ray workers (the engine's agent func) inherit this environment from the Ray that the driver starts
            os.environ.update(COPE_GATEWAY_URL=stack.url, COPE_TRAIN_STEP_FILE=os.path.join(step_dir, "train_step"),
                              RAY_ADDRESS="")
            if local.max_turns:
                os.environ["MAX_TURNS"] = str(local.max_turns)
            train_ppo_ray(train_argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(step_dir, ignore_errors=True)
    summary = write_summary(args["ckpt.path"], local.steps, tensorboard, args["ckpt.output_dir"])
    print("[local] summary " + json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
