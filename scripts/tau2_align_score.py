"""Score a τ²-bench run (τ²'s own `tau2 run` output) and set it beside the published Avg@4 table.

    tau2 run --domain <d> ... --num-trials 4 --task-split-name test --save-to <TAG>_<d>     (for each domain)
    python scripts/tau2_align_score.py --tag TAG --results-dir <tau2 checkout>/data/simulations [--out s.json]

Reads ``<results-dir>/<TAG>_<domain>.json`` (τ²'s Results: ``info.num_trials``, ``info.user_info.llm``,
``info.git_commit``, ``simulations[]`` with ``task_id``, ``trial``, ``reward_info.reward``). It refuses (exit 2)
to score a domain whose run is incomplete: every task of the split (data/tau2_<domain>_<split>.jsonl) must have
trials 0 … k−1, and no simulation may belong to another split; a partial run is biased toward short tasks.
A simulation without a reward (crashed, timed out) counts as reward 0, as docs/TAU2_GRPO.md rule 4 says.
A domain or split without a committed item-id file (τ²'s ``mock`` test domain, its ``base`` split) is checked
against the task list τ² itself saved in the Results (``tasks[].id``) and has no published row.
Success: |reward − 1| ≤ 1e-6. Metrics: Avg@k and pass^1..k (scripts/agent_metrics.py). The published rows
(docs/BASELINES.md, Avg@4 in %, gpt-4o-mini user) are compared only when the run used that user model, 4 trials
and commit c5b2d22; otherwise the table says why the numbers are not comparable.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file, this module sees only scripts/

from scripts.agent_metrics import avg_at_k, pass_hat_k  # noqa: E402

DOMAINS = ("airline", "retail", "telecom")
SCORABLE = DOMAINS + ("mock",)  # mock: τ²'s own small test domain, for tests of the evaluation path
PINNED_COMMIT = "c5b2d22"
PUBLISHED_USER = "gpt-4o-mini"
PUBLISHED_AVG4 = {  # Avg@4 (%), gpt-4o-mini user: airline, retail, telecom
    "base": (8.8, 9.4, 8.1), "GRPO@25": (18.8, 10.0, 1.9), "RAGEN": (15.0, 17.5, 17.5), "InfoPO": (16.3, 18.8, 18.1),
}


class IncompleteRun(ValueError):
    pass


def split_task_ids(domain: str, split: str, results: dict | None = None) -> list[str]:
    """The split's task ids: the committed item-id file, or where there is none, the tasks τ² saved in ``results``."""
    path = os.path.join(ROOT, "data", f"tau2_{domain}_{split}.jsonl")
    if not os.path.exists(path) and results is not None:
        ids = [str(t["id"]) for t in results.get("tasks") or []]
        if not ids:
            raise IncompleteRun(f"{domain}: no item-id file {path} and no task list in the results")
        return ids
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["label"].split("/", 1)[1] for line in f if line.strip()]


def results_file(results_dir: str, tag: str, domain: str) -> str:
    exact = os.path.join(results_dir, f"{tag}_{domain}.json")
    if os.path.exists(exact):
        return exact
    found = sorted(glob.glob(os.path.join(glob.escape(results_dir), f"{glob.escape(tag)}_{domain}*.json")))
    if len(found) != 1:
        raise IncompleteRun(f"{domain}: expected one results file {exact} (tau2 run --save-to {tag}_{domain}); "
                            f"found {found or 'none'}")
    return found[0]


def score_domain(results: dict, task_ids: list[str], trials: int, domain: str) -> dict:
    """Avg@k and pass^1..k of one domain's Results; raises IncompleteRun naming what is missing."""
    rewards: dict[str, dict[int, float]] = {t: {} for t in task_ids}
    foreign = set()
    for sim in results.get("simulations", []):
        task, trial = str(sim["task_id"]), sim.get("trial")
        if task not in rewards:
            foreign.add(task)
            continue
        reward = (sim.get("reward_info") or {}).get("reward")
        rewards[task][trial] = float(reward) if reward is not None else 0.0  # crashed: a failure, never dropped
    if foreign:
        raise IncompleteRun(f"{domain}: simulations of tasks outside the split: {sorted(foreign)[:10]} "
                            "(run --task-split-name with the split you score)")
    missing = [f"{task} (trials {sorted(set(range(trials)) - set(got))})" for task, got in rewards.items()
               if not set(range(trials)) <= set(got)]
    if missing:
        raise IncompleteRun(f"{domain}: incomplete run, refusing to score it: {len(missing)} of {len(task_ids)} "
                            f"tasks lack trials: {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
    per_task = [[rewards[t][j] for j in range(trials)] for t in task_ids]
    counts = [(trials, sum(abs(r - 1.0) <= 1e-6 for r in rs)) for rs in per_task]
    return {f"avg@{trials}": avg_at_k(per_task), **{f"pass^{k}": pass_hat_k(counts, k) for k in range(1, trials + 1)},
            "tasks": len(task_ids)}


def comparability(results: dict, trials: int) -> str:
    """Empty when the run is comparable with the published table, else why not."""
    info = results.get("info", {})
    user = str((info.get("user_info") or {}).get("llm", ""))
    reasons = []
    if info.get("environment_info", {}).get("domain_name", "") not in DOMAINS + ("",):
        reasons.append("no published number for this domain")
    if PUBLISHED_USER not in user:
        reasons.append(f"user model {user or '?'} is not {PUBLISHED_USER}")
    if trials != 4:
        reasons.append(f"{trials} trials, not 4")
    if not str(info.get("git_commit", "")).startswith(PINNED_COMMIT):
        reasons.append(f"tau2 commit {info.get('git_commit', '?')} is not {PINNED_COMMIT}")
    return "; ".join(reasons)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", required=True)
    p.add_argument("--results-dir", default=os.path.join(ROOT, "runs", "tau2"))
    p.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=SCORABLE)
    p.add_argument("--split", default="test", help="train or test (the committed splits); others read τ²'s task list")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--out", help="write the scores as JSON")
    args = p.parse_args(argv)
    scores, problems = {}, []
    for domain in args.domains:
        try:
            path = results_file(args.results_dir, args.tag, domain)
            with open(path, encoding="utf-8") as f:
                results = json.load(f)
            declared = (results.get("info") or {}).get("num_trials")
            if declared is not None and declared < args.trials:
                raise IncompleteRun(f"{domain}: the run declares {declared} trials; --trials {args.trials} needs more")
            score = score_domain(results, split_task_ids(domain, args.split, results), args.trials, domain)
        except IncompleteRun as e:
            problems.append(str(e))
            continue
        score["not_comparable"] = comparability(results, args.trials)
        scores[domain] = score
    if problems:
        print("tau2_align_score: refusing to score:\n  " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(2)
    k = args.trials
    print(f"τ²-bench {args.split}, tag {args.tag}: Avg@{k} (%) and pass^k")
    print(f"{'domain':10}{'ours':>8}" + "".join(f"{name:>15}" for name in PUBLISHED_AVG4) + "  " +
          " ".join(f"pass^{j}" for j in range(1, k + 1)))
    for domain, score in scores.items():
        ours = 100 * score[f"avg@{k}"]
        if score["not_comparable"] or domain not in DOMAINS:
            published = "".join(f"{'n/a':>15}" for _ in PUBLISHED_AVG4)
        else:
            column = DOMAINS.index(domain)
            published = "".join(f"{row[column]:.1f} ({ours - row[column]:+.1f})".rjust(15)
                                for row in PUBLISHED_AVG4.values())
        passes = " ".join(f"{score[f'pass^{j}']:6.3f}" for j in range(1, k + 1))
        print(f"{domain:10}{ours:8.1f}{published}  {passes}")
        if score["not_comparable"]:
            print(f"  {domain}: not comparable with the published table: {score['not_comparable']}")
    report = {"tag": args.tag, "split": args.split, "trials": k, "scores": scores,
              "published_avg4": {name: dict(zip(DOMAINS, row)) for name, row in PUBLISHED_AVG4.items()}}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
