"""The learning study: stock GRPO against each CoPE signal, over seeds and envs, from one warm start per env.

    .venv/bin/python benchmarks/learning_curve.py [--envs babyai textcraft] [--configs grpo filter forecast te info all]
        [--seeds 0 1 2] [--steps 60] [--eval-every 10] [--out runs/learning_curve]

Per env, ``scripts/prepare_warm_start.py`` runs once (``WARM_START[env]``: item ids, held-out ids, demos (BabyAI:
the quickstart's view-hesitant demonstrator), a tiny model and its SFT) unless ``<out>/<env>/warm_start/model-sft``
exists. Then every (config, seed) is its own ``python -m cope_rlhf.local train`` process from that model: the
quickstart's recipe (``RECIPE``), ``TURNS[env]`` turns, held-out evals every ``--eval-every`` steps, and only the
CoPE switches (``CONFIGS``; the forecast in joint mode, docs/results/quickstart_diagnosis.md) and ``--train.seed``
differing. A run whose ``summary.json`` exists is kept, so rerunning the command finishes an interrupted study.

Writes ``<out>/learning_curve.png``: per env, held-out success (temperature 1, 2 episodes per item) per eval step,
mean over seeds ± 95% t-interval (as a band), one line per config; and ``<out>/learning_curve.md``: per env and
config, held-out success before and at the last step (mean ± 95% half-width over seeds), the first eval step whose
mean reaches GRPO's final mean ("never" if none), and seconds per training step (median over all steps of all
seeds, rollout + update). Each run also gets its own scripts/run_report.py PNG. Slow: every run starts vLLM (~45 s);
BabyAI took 5-7 s per step and 8-9 min per 60-step run on 2 CPU cores (docs/results/quickstart_diagnosis.md
point 22); the default grid is 2 envs x 6 configs x 3 seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

# Stock GRPO, GRPO + the degenerate-group filter (the quickstart's recipe), each CoPE signal on top of that filter,
# and all together. The signals sit on "filter", not on stock GRPO: stock GRPO's group_norm turns float rounding in
# all-equal groups into advantages up to +-60 (docs/results/quickstart_diagnosis.md point 19), and a run that
# collapses from that would say nothing about the signal.
FILTER = ["--cope.grpo_filter_degenerate"]
FORECAST = ["--cope.action_forecast_enable", "--cope.action_forecast_mode", "joint"]
TE = ["--cope.te_enable", "--cope.te_lambda", "0.1", "--cope.te_warmup_steps", "0"]
INFO = ["--cope.info_intrinsic_weight", "0.1"]
CONFIGS = {"grpo": [], "filter": FILTER, "forecast": FILTER + FORECAST, "te": FILTER + FORECAST + TE,
           "info": FILTER + INFO, "all": FILTER + FORECAST + TE + INFO}
WARM_START = {"babyai": ["--levels", "1", "--heldout", "200", "--demos", "300", "--demo-policy", "view-hesitant",
                         "--epochs", "16"],
              "textcraft": ["--heldout", "100", "--demos", "300", "--epochs", "16"]}
TURNS = {"babyai": 3, "textcraft": 10}
# The quickstart's recipe less its CoPE switch (scripts/quickstart.sh; tests/test_learning_curve.py keeps the two
# equal).
RECIPE = ["--algo.advantage.estimator", "group_norm", "--actor.loss_agg_mode", "seq-mean-token-mean",
          "--rollout.batch_size", "8", "--rollout.n_samples_per_prompt", "8", "--train.batch_size", "32",
          "--actor.adam.lr", "3e-4", "--actor.lr_warmup_ratio", "0.1",
          "--actor.lr_scheduler", "constant_with_warmup", "--algo.kl.init_coef", "0.01",
          "--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--vllm.enable_prefix_caching",
          "--eval.temperature", "1.0", "--eval.n_samples_per_prompt", "2"]
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def half_width(values: list[float]) -> float:
    """95% t-interval half-width of the mean (0 for a single value)."""
    if len(values) < 2:
        return 0.0
    return T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def warm_start(env: str, out: str) -> str:
    folder = os.path.join(out, env, "warm_start")
    if not os.path.isdir(os.path.join(folder, "model-sft")):
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "prepare_warm_start.py"), "--env", env, "--out", folder,
               *WARM_START[env]]
        print(f"[learning_curve] {env}: warm start -> {folder}", flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    return folder


def run_one(env: str, config: str, seed: int, start: str, args) -> str:
    out = os.path.join(args.out, env, f"{config}_seed{seed}")
    if os.path.isfile(os.path.join(out, "ckpt", "summary.json")):
        return out
    cmd = [sys.executable, "-m", "cope_rlhf.local", "train", "--env", env,
           "--actor.model_name_or_path", os.path.join(start, "model-sft"),
           "--data.prompt_dataset", os.path.join(start, "data", "train.jsonl"),
           "--eval.dataset", os.path.join(start, "data", "heldout.jsonl"),
           "--local.steps", str(args.steps), "--eval.steps", str(args.eval_every),
           "--local.max_turns", str(TURNS[env]), "--train.seed", str(seed),
           "--ckpt.path", os.path.join(out, "ckpt"), "--ckpt.output_dir", os.path.join(out, "model"),
           "--ckpt.save_steps", "-1", "--logger.tensorboard_dir", os.path.join(out, "tb"), *RECIPE,
           *CONFIGS[config]]
    os.makedirs(out, exist_ok=True)
    t = time.time()
    with open(os.path.join(out, "train.log"), "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{env} {config} seed {seed} failed ({code}); see {out}/train.log")
    print(f"[learning_curve] {env} {config} seed {seed}: {time.time() - t:.0f} s", flush=True)
    return out


def read_run(out: str) -> dict:
    """{"eval": {step: success}, "step_s": [seconds per step]} from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(out, "tb"))
    acc.Reload()
    rollout = {e.step: e.value for e in acc.Scalars("rollout/time_s")}
    update = {e.step: e.value for e in acc.Scalars("train/time_s")}
    return {"eval": {e.step: e.value for e in acc.Scalars("eval/success_rate")},
            "step_s": [rollout[s] + update[s] for s in rollout if s in update]}


def summarize(env: str, runs: dict[str, list[dict]]) -> tuple[list[str], dict]:
    """Table rows for one env, and per config the curve (steps, means, half-widths)."""
    curves, rows = {}, []
    for config, seeds in runs.items():
        steps = sorted(set.intersection(*(set(r["eval"]) for r in seeds)))
        values = {s: [r["eval"][s] for r in seeds] for s in steps}
        curves[config] = (steps, [statistics.fmean(values[s]) for s in steps], [half_width(values[s]) for s in steps])
    goal = curves["grpo"][1][-1] if "grpo" in curves else None
    for config, (steps, means, halves) in curves.items():
        reach = next((s for s, m in zip(steps, means) if goal is not None and m >= goal), None)
        step_s = statistics.median(t for r in runs[config] for t in r["step_s"])
        rows.append(f"| {env} | {config} | {len(runs[config])} | {means[0]:.3f} | {means[-1]:.3f} ± {halves[-1]:.3f} "
                    f"| {'never' if reach is None else reach} | {step_s:.1f} |")
    return rows, curves


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", default=list(WARM_START), choices=list(WARM_START))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", default="runs/learning_curve")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be >= 1")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from run_report import main as run_report

    rows = ["| env | config | seeds | held-out success before | after the last step (mean ± 95%) "
            "| first eval step at GRPO's final | s / step |", "|---|---|---|---|---|---|---|"]
    fig, axes = plt.subplots(1, len(args.envs), figsize=(6 * len(args.envs), 4), squeeze=False)
    for ax, env in zip(axes[0], args.envs):
        start = warm_start(env, args.out)
        runs = {}
        for config in args.configs:
            runs[config] = []
            for seed in args.seeds:
                out = run_one(env, config, seed, start, args)
                run_report(["--ckpt", os.path.join(out, "ckpt"), "--png", os.path.join(out, "curve.png")])
                runs[config].append(read_run(out))
        env_rows, curves = summarize(env, runs)
        rows += env_rows
        for config, (steps, means, halves) in curves.items():
            ax.plot(steps, means, marker="o", label=config)
            ax.fill_between(steps, [m - h for m, h in zip(means, halves)], [m + h for m, h in zip(means, halves)],
                            alpha=0.15)
        ax.set_title(f"{env}: held-out success (temperature 1),\nmean ± 95% over {len(args.seeds)} seeds", fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel("success rate")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "learning_curve.png")
    fig.savefig(png, dpi=120)
    command = "benchmarks/learning_curve.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = "\n".join([f"Command: `{command.strip()}`", "", *rows])
    with open(os.path.join(args.out, "learning_curve.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"[learning_curve] plot: {png}")
    with open(os.path.join(args.out, "learning_curve.json"), "w") as f:
        json.dump({"args": vars(args), "table": rows}, f, indent=1)
    return png


if __name__ == "__main__":
    main()
