"""Held-out success by how long the server's expert needs for the goal: where the warm start wins, and where RL moves.

    .venv/bin/python docs/results/textcraft_20turns_pilot/success_by_plan_length.py [RECORD ...] [--expert]

An item's plan length is the number of turns the TextCraft server's expert (``GET /expert``, as in
``scripts/make_demos.py``) takes to win it, 40 at most; ``expert_turns.json`` beside this script holds them for the
200 held-out items (``--expert`` plays the expert again and rewrites it, which needs ``.venvs/textcraft``). Per
recorded run (``RECORD/textcraft/<config>_seed<n>``; default: this folder) and plan-length bucket: held-out success
(T = 1) at the first and last in-training eval with the paired gain and its 95% interval (``scripts/run_report.py``'s
``read_evals`` and ``paired_gain``), and greedy success before (the warm start) and after. First, pooled over every
run's step-0 eval (the same warm start each time): how many items of a bucket were never won.
"""

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)
from scripts.run_report import paired_gain, read_evals  # noqa: E402

TURNS_FILE = os.path.join(HERE, "expert_turns.json")
# (name, shortest, longest) plan; an item the expert does not win within 40 turns goes in the last bucket
BUCKETS = [("1-3", 1, 3), ("4-6", 4, 6), ("7-12", 7, 12), ("13-20", 13, 20), (">20", 21, 10 ** 9)]


def expert_turns(items: list[int]) -> dict[int, int]:
    """Turns the server's expert takes to win each item (10**9 where it does not win in 40)."""
    from env_gateway.servers.process import EnvServerProcess
    from scripts import make_demos

    with EnvServerProcess("textcraft") as server:
        episodes = {i: make_demos.episode(server.url, "textcraft", i, 40, None) for i in items}
    return {i: e["turns"] if e["success"] else 10 ** 9 for i, e in episodes.items()}


def bucket_of(turns: int) -> str:
    return next(name for name, low, high in BUCKETS if low <= turns <= high)


def greedy(folder: str, items: set) -> str:
    with open(os.path.join(folder, "eval_greedy.json")) as f:
        rows = [r for r in json.load(f)["per_item"] if int(r["item_id"]) in items]
    return f"{sum(r['successes'] for r in rows) / sum(r['trials'] for r in rows):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="*", default=[HERE], help="record folders (default: this one)")
    parser.add_argument("--expert", action="store_true", help="play the expert again and rewrite expert_turns.json")
    args = parser.parse_args()
    start = os.path.join(args.records[0], "textcraft", "warm_start")
    with open(os.path.join(start, "data", "heldout.jsonl")) as f:
        items = [int(json.loads(line)["label"]) for line in f]
    if args.expert:
        with open(TURNS_FILE, "w") as f:
            json.dump({str(i): t for i, t in expert_turns(items).items()}, f, indent=0)
    with open(TURNS_FILE) as f:
        turns = {int(i): t for i, t in json.load(f).items()}
    missing = set(items) - set(turns)
    if missing:
        sys.exit(f"{TURNS_FILE} has no plan length for {len(missing)} held-out items (e.g. {min(missing)}): "
                 "rerun with --expert")
    buckets = {name: {i for i in items if bucket_of(turns[i]) == name} for name, _, _ in BUCKETS}
    runs = [run for record in args.records
            for run in sorted(glob.glob(os.path.join(glob.escape(record), "textcraft", "*_seed*")))]

    evals_of = {run: read_evals(os.path.join(run, "ckpt", "eval_episodes.jsonl")) for run in runs}
    first = {}  # item -> step-0 outcomes over every run
    for evals in evals_of.values():
        for i, outcomes in evals[min(evals)].items():
            first.setdefault(int(i), []).extend(outcomes)
    print(f"step-0 held-out episodes of the warm start, pooled over {len(runs)} runs:")
    for name, members in buckets.items():
        won = [sum(first[i]) / len(first[i]) for i in members]
        print(f"  plan {name:>5} turns: {len(members):3d} items, success {sum(won) / max(len(won), 1):.3f}, "
              f"{sum(w == 0 for w in won)} never won in {len(first[min(members)]) if members else 0} episodes")
    for run, evals in evals_of.items():
        low_step, high_step = min(evals), max(evals)
        print(f"{os.path.relpath(run, ROOT)}: step {low_step} -> {high_step}")
        for name, members in buckets.items():
            before = {i: sum(v) / len(v) for i, v in evals[low_step].items() if int(i) in members}
            after = {i: sum(v) / len(v) for i, v in evals[high_step].items() if int(i) in members}
            gain, low, high, n = paired_gain(before, after)
            print(f"  plan {name:>5} turns: {sum(before.values()) / n:.3f} -> {sum(after.values()) / n:.3f}, paired "
                  f"gain {gain:+.3f} [{low:+.3f}, {high:+.3f}] over {n} items; greedy {greedy(start, members)} -> "
                  f"{greedy(run, members)}")


if __name__ == "__main__":
    main()
