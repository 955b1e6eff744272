"""Learning curves on BabyAI level 1: stock GRPO vs GRPO + forecast vs GRPO + information gain vs GRPO + all signals.

    .venv/bin/python benchmarks/learning_curve.py --model runs/quickstart/model-sft --data runs/quickstart/data \
        [--steps 24] [--eval-every 8] [--seeds 0 1 2] [--configs grpo forecast info all] [--out runs/learning_curve]

Every run starts from the same warm-started model (``--model``, e.g. the quickstart's ``model-sft``) with the same
flags except the CoPE switches and ``--train.seed``, as its own ``python -m cope_rlhf.local train`` process:
rollout batch 4 prompts x 4 samples, 6 turns, lr 1e-4, KL loss 0.001 (k3), held-out evaluation (greedy, the
``babyai_l1_heldout.jsonl`` items) before training and every ``--eval-every`` steps. Reads each run's
``eval/success_rate`` back from its TensorBoard events and writes

    <out>/learning_curve.png   mean held-out success rate (over seeds) against the step, one line per config
    <out>/learning_curve.md    the table: success after N steps, mean ± std over seeds, and its ratio to GRPO's

Run by hand (slow: each run starts vLLM, ~30 s, then ~20-30 s per step on 2 CPU cores). Needs matplotlib.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "grpo": [],
    "forecast": ["--cope.action_forecast_enable"],
    "info": ["--cope.info_intrinsic_weight", "0.1"],
    "all": ["--cope.action_forecast_enable", "--cope.te_enable", "--cope.te_lambda", "0.1",
            "--cope.te_warmup_steps", "0",
            "--cope.info_intrinsic_weight", "0.1", "--cope.grpo_filter_degenerate"],
}


def run_one(config: str, seed: int, args) -> str:
    out = os.path.join(args.out, f"{config}_seed{seed}")
    cmd = [sys.executable, "-m", "cope_rlhf.local", "train", "--env", "babyai",
           "--actor.model_name_or_path", args.model,
           "--data.prompt_dataset", os.path.join(args.data, "babyai_l1_train.jsonl"),
           "--eval.dataset", os.path.join(args.data, "babyai_l1_heldout.jsonl"),
           "--local.steps", str(args.steps), "--eval.steps", str(args.eval_every), "--local.max_turns", "6",
           "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--actor.adam.lr", "1e-4",
           "--algo.kl.init_coef", "0.001", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
           "--train.seed", str(seed), "--ckpt.path", os.path.join(out, "ckpt"),
           "--ckpt.output_dir", os.path.join(out, "model"), "--logger.tensorboard_dir", os.path.join(out, "tb"),
           *CONFIGS[config]]
    os.makedirs(out, exist_ok=True)
    t = time.time()
    with open(os.path.join(out, "train.log"), "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{config} seed {seed} failed ({code}); see {out}/train.log")
    print(f"[learning_curve] {config} seed {seed}: {time.time() - t:.0f} s", flush=True)
    return os.path.join(out, "tb")


def eval_curve(tb_dir: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir)
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("eval/success_rate")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the warm-started model every run starts from")
    parser.add_argument("--data", required=True, help="folder with babyai_l1_train.jsonl and babyai_l1_heldout.jsonl")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", default="runs/learning_curve")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {c: [eval_curve(run_one(c, s, args)) for s in args.seeds] for c in args.configs}
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = ["| config | success before | success after {} steps (mean ± std, {} seeds) | vs GRPO |".format(
        args.steps, len(args.seeds)), "|---|---|---|---|"]
    base = None
    for config, runs in curves.items():
        steps = sorted(set.intersection(*(set(r) for r in runs)))
        means = [statistics.mean(r[s] for r in runs) for s in steps]
        ax.plot(steps, means, marker="o", label=config)
        final = [r[args.steps] for r in runs]
        mean, std = statistics.mean(final), statistics.pstdev(final)
        base = mean if config == "grpo" else base
        ratio = f"{mean / base:.2f}x" if base else "-"
        rows.append(f"| {config} | {statistics.mean(r[0] for r in runs):.3f} | {mean:.3f} ± {std:.3f} | {ratio} |")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out success rate (greedy)")
    ax.set_title("BabyAI level 1 (GoToRedBallGrey), tiny model, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "learning_curve.png"), dpi=120)
    table = "\n".join(rows)
    with open(os.path.join(args.out, "learning_curve.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"[learning_curve] plot: {os.path.join(args.out, 'learning_curve.png')}")


if __name__ == "__main__":
    main()
