"""Held-out success before → after one local run, with 95% intervals, and a PNG of its learning curve.

    python scripts/run_report.py --ckpt CKPT_PATH [--tensorboard TB_DIR] [--png OUT.png] [--json OUT.json]
        [--versus OTHER_CKPT_PATH]

Reads ``<ckpt>/eval_episodes.jsonl`` (``python -m cope_rlhf.local train`` writes one line per held-out episode and
eval step: step, item_id, success, reward) and the run's TensorBoard scalars (default folder: the one its
``summary.json`` names).

  success at step s      p_s = mean success over that eval's episodes; 95% interval: Wilson's, over its n episodes
  gain                   paired by item: d_i = (mean success of item i at the last eval) − (same at the first),
                         gain = mean_i d_i, 95% interval gain ± 1.96 · sd(d) / sqrt(n_items) (normal approximation;
                         pairing removes the spread between easy and hard items)
  versus (--versus)      at each eval step both runs have: d_i = (item i's mean success in the other run) − (in
                         this one), mean and interval as for the gain; two runs of one seed play the same episodes'
                         seeds, so this compares two configs item by item

The PNG has rollout success per step (each step's episodes, and a 5-step moving mean) and held-out success at each
eval step with its Wilson interval. Prints one line per eval and the gain; ``--json`` also writes them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections import defaultdict

Z95 = 1.959964


def wilson(successes: float, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + Z95 ** 2 / (2 * n)) / (1 + Z95 ** 2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / (1 + Z95 ** 2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_gain(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, float, int]:
    """(gain, low, high, n) over the items both evals scored; values are per-item mean success."""
    items = sorted(set(before) & set(after))
    if not items:
        raise ValueError("the two evals share no item ids")
    d = [after[i] - before[i] for i in items]
    gain = statistics.fmean(d)
    half = Z95 * (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("inf"))
    return gain, gain - half, gain + half, len(d)


def read_evals(path: str) -> dict[int, dict[str, list[float]]]:
    """step -> item_id -> successes of that item's episodes."""
    if not os.path.isfile(path):
        raise SystemExit(f"run_report: {path} does not exist (a run with --eval.dataset writes it)")
    evals: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                evals[int(row["step"])][str(row["item_id"])].append(float(row["success"]))
    if not evals:
        raise SystemExit(f"run_report: {path} holds no held-out episodes")
    return evals


def per_item(episodes: dict[str, list[float]]) -> dict[str, float]:
    return {item: statistics.fmean(values) for item, values in episodes.items()}


def report(ckpt: str, tensorboard: str | None = None, png: str | None = None, versus: str | None = None) -> dict:
    evals = read_evals(os.path.join(ckpt, "eval_episodes.jsonl"))
    steps = sorted(evals)
    table = []
    for step in steps:
        values = [v for vs in evals[step].values() for v in vs]
        low, high = wilson(sum(values), len(values))
        table.append({"step": step, "success": statistics.fmean(values), "low": low, "high": high,
                      "episodes": len(values), "items": len(evals[step])})
    gain, low, high, n = paired_gain(per_item(evals[steps[0]]), per_item(evals[steps[-1]]))
    out = {"evals": table, "gain": {"from_step": steps[0], "to_step": steps[-1], "gain": gain, "low": low,
                                    "high": high, "items": n}}
    if versus is not None:
        other = read_evals(os.path.join(versus, "eval_episodes.jsonl"))
        shared = sorted(set(evals) & set(other))
        if not shared:
            raise SystemExit(f"run_report: {ckpt} (steps {steps}) and {versus} (steps {sorted(other)}) have no "
                             "held-out eval at the same step")
        out["versus"] = {"ckpt": versus, "steps": []}
        for step in shared:
            try:
                d, low, high, n = paired_gain(per_item(evals[step]), per_item(other[step]))
            except ValueError:
                raise SystemExit(f"run_report: the evals at step {step} of {ckpt} and {versus} share no item ids: "
                                 "--versus compares two runs on the same held-out items") from None
            out["versus"]["steps"].append({"step": step, "difference": d, "low": low, "high": high, "items": n})
    if png:
        if tensorboard is None:
            with open(os.path.join(ckpt, "summary.json")) as f:
                tensorboard = json.load(f)["tensorboard_dir"]
        plot(tensorboard, table, png)
        out["png"] = png
    return out


def plot(tensorboard: str, table: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from cope_rlhf.tb_scalars import read_scalars

    scalars = read_scalars(tensorboard)
    # train/rollout/...: OpenRLHF's logger (one driver, after commit 6e0d933); rollout/...: runs of the retired local loop
    rollout = sorted(scalars.get("train/rollout/success_rate", scalars.get("rollout/success_rate", {})).items())
    fig, ax = plt.subplots(figsize=(7, 4))
    if rollout:
        x, y = zip(*rollout)
        ax.plot(x, y, color="tab:blue", alpha=0.35, lw=1, label="rollout success (each step's episodes)")
        mean5 = [statistics.fmean(y[max(0, i - 4):i + 1]) for i in range(len(y))]
        ax.plot(x, mean5, color="tab:blue", lw=2, label="rollout success, 5-step moving mean")
    ax.errorbar([r["step"] for r in table], [r["success"] for r in table],
                yerr=[[r["success"] - r["low"] for r in table], [r["high"] - r["success"] for r in table]],
                color="tab:red", marker="o", capsize=4, lw=2,
                label=f"held-out success ({table[0]['episodes']} episodes, 95% interval)")
    ax.set_xlabel("training step")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="the run's --ckpt.path")
    parser.add_argument("--tensorboard", help="the run's TensorBoard folder (default: from its summary.json)")
    parser.add_argument("--png", help="write the learning-curve plot here")
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--versus", help="another run's --ckpt.path: its held-out success minus this run's at each "
                                         "eval step both have, paired by item")
    args = parser.parse_args(argv)
    out = report(args.ckpt, args.tensorboard, args.png, args.versus)
    for r in out["evals"]:
        print(f"  held-out success at step {r['step']:>3}: {r['success']:.3f}  "
              f"[{r['low']:.3f}, {r['high']:.3f}]  ({r['episodes']} episodes, {r['items']} items)")
    g = out["gain"]
    print(f"  gain, step {g['from_step']} -> {g['to_step']}: {g['gain']:+.3f}  "
          f"95% interval [{g['low']:+.3f}, {g['high']:+.3f}]  (paired over {g['items']} items)")
    for r in out.get("versus", {}).get("steps", []):
        print(f"  {args.versus} minus this run at step {r['step']:>3}: {r['difference']:+.3f}  "
              f"95% interval [{r['low']:+.3f}, {r['high']:+.3f}]  (paired over {r['items']} items)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
