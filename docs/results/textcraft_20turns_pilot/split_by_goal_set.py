"""The pilot's held-out success by goal set: A (goals RL never plays) and B (goals RL plays in other texts).

    .venv/bin/python docs/results/textcraft_20turns_pilot/split_by_goal_set.py

Per recorded run and set: held-out success at each in-training eval (``ckpt/eval_episodes.jsonl``), the paired gain
last eval minus first with its 95% interval (``scripts/run_report.py``'s ``read_evals`` and ``paired_gain``), and
the greedy success of the warm start and of the final model (``eval_greedy.json``'s ``per_item``). An item's goal is
its id mod 544 (``goal_sets.json`` lists the goals)."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
from scripts.run_report import paired_gain, read_evals  # noqa: E402

GOALS = 544
with open(os.path.join(HERE, "goal_sets.json")) as f:
    SETS = {name: set(goals) for name, goals in json.load(f).items()}
SETS = {"all": SETS["A"] | SETS["B"], **SETS}


def greedy(folder: str, goals: set) -> float:
    with open(os.path.join(folder, "eval_greedy.json")) as f:
        rows = [r for r in json.load(f)["per_item"] if int(r["item_id"]) % GOALS in goals]
    return sum(r["successes"] for r in rows) / sum(r["trials"] for r in rows)


start = os.path.join(HERE, "textcraft", "warm_start")
for run in sorted(r for r in os.listdir(os.path.join(HERE, "textcraft")) if "_seed" in r):
    folder = os.path.join(HERE, "textcraft", run)
    evals = read_evals(os.path.join(folder, "ckpt", "eval_episodes.jsonl"))
    steps = sorted(evals)
    for name, goals in SETS.items():
        per_step = {s: {i: sum(v) / len(v) for i, v in evals[s].items() if int(i) % GOALS in goals} for s in steps}
        curve = " ".join(f"{s}:{sum(per_step[s].values()) / len(per_step[s]):.3f}" for s in steps)
        gain, low, high, n = paired_gain(per_step[steps[0]], per_step[steps[-1]])
        print(f"{run} {name}: {curve}  paired gain {gain:+.3f} [{low:+.3f}, {high:+.3f}] over {n} items  "
              f"greedy {greedy(start, goals):.2f} -> {greedy(folder, goals):.2f}")
