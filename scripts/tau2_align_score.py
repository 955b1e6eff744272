"""Score a τ²-bench run (τ²'s own `tau2 run` output) and set it beside the published Avg@4 table.

    tau2 run --domain <d> ... --num-trials 4 --task-split-name test --save-to <TAG>_<d>     (for each domain)
    python scripts/tau2_align_score.py --tag TAG --results-dir <tau2 checkout>/data/simulations [--out s.json]

Reads ``<results-dir>/<TAG>_<domain>.json`` (τ²'s Results: ``info`` with ``num_trials``, ``max_steps``,
``max_errors``, ``seed``, ``git_commit``, ``agent_info`` and ``user_info`` (each ``implementation``, ``llm``,
``llm_args``); ``simulations[]`` with ``task_id``, ``trial``, ``reward_info.reward``), and the evaluation's config
``<results-dir>/<TAG>_eval_config.json`` that scripts/tau2_align_eval.sh writes beside it. It refuses (exit 2) to
score a domain whose run is incomplete: every task of the split (data/tau2_<domain>_<split>.jsonl) must have trials
0 … k−1, and no simulation may belong to another split; a partial run is biased toward short tasks. A simulation
without a reward (crashed, timed out) counts as reward 0, as docs/TAU2_GRPO.md rule 4 says. A domain or split without
a committed item-id file (τ²'s ``mock`` test domain, its ``base`` split) is checked against the task list τ² itself
saved in the Results (``tasks[].id``) and has no published row.

Success: |reward − 1| ≤ 1e-6. Metrics: Avg@k and pass^1..k (scripts/agent_metrics.py). The published rows
(docs/BASELINES.md, Avg@4 in %) are compared, with the difference printed, only when the run matches every setting
of the evaluation protocol (``PROTOCOL``, docs/TAU2_GRPO.md "The evaluation protocol"): the tau2 commit (the
Results' own, or where τ² recorded "unknown", the install's commit that the config records), the split, the trials,
the step and error caps, the seed, τ²'s default agent and user simulator, the agent's and the user's temperature and
other sampling arguments, the user model and its endpoint, the policy server's context, and a config with no
recorded deviation. Otherwise the row prints the numbers without differences and every setting that differs is
listed by name.
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
PUBLISHED_USER = "gpt-4o-mini-2024-07-18"
PUBLISHED_AVG4 = {  # Avg@4 (%), gpt-4o-mini user: airline, retail, telecom
    "base": (8.8, 9.4, 8.1), "GRPO@25": (18.8, 10.0, 1.9), "RAGEN": (15.0, 17.5, 17.5), "InfoPO": (16.3, 18.8, 18.1),
}
# The evaluation protocol the published numbers were made with (docs/TAU2_GRPO.md): setting -> its value.
PROTOCOL = {
    "domain": "airline, retail or telecom",
    "tau2 commit": PINNED_COMMIT,
    "task split": "test",
    "trials": 4,
    "step cap": 200,
    "error cap": 10,
    "seed": 300,
    "agent": "llm_agent (tau2's default agent)",
    "agent temperature": 0.0,
    "agent sampling arguments": "none but the temperature",
    "user simulator": "user_simulator (tau2's default)",
    "user model": PUBLISHED_USER,
    "user temperature": 0.0,
    "user sampling arguments": "none but the temperature",
    "user endpoint": "the provider's own API (no api_base)",
    "policy context": 32768,
    "eval config": "scripts/tau2_align_eval.sh's <TAG>_eval_config.json beside the results",
    "recorded deviations": "none",
}
# llm_args keys that say where a model is, not how it samples
ENDPOINT_ARGS = ("api_base", "base_url", "api_key")
UNKNOWN_COMMITS = ("", "unknown", "none")


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


def _differs(name: str, got: object) -> str:
    return f"{name}: {got} (published: {PROTOCOL[name]})"


def _number(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _model_side(differences: list[str], role: str, side: dict, implementation: str) -> None:
    """The agent's or the user's implementation, temperature and other sampling arguments, as τ² recorded them."""
    if side.get("implementation") != implementation:
        differences.append(_differs("agent" if role == "agent" else "user simulator", side.get("implementation")))
    args = side.get("llm_args") or {}
    temperature = _number(args.get("temperature"))
    if temperature is None or temperature != PROTOCOL[f"{role} temperature"]:
        differences.append(_differs(f"{role} temperature", args.get("temperature", "not set (the server's default)")))
    extra = sorted(k for k in args if k != "temperature" and k not in ENDPOINT_ARGS)
    if extra:
        differences.append(_differs(f"{role} sampling arguments", ", ".join(f"{k}={args[k]!r}" for k in extra)))


def _run_commit(info: dict, config: dict | None) -> tuple[str, str]:
    """The tau2 commit of the run and where it was read: the Results' own, else the install's from the config (the
    eval script reads it from scripts/tau2_commit.py, never assumes it)."""
    commit = str(info.get("git_commit") or "").strip()
    if commit.lower() not in UNKNOWN_COMMITS:
        return commit, "the results"
    if config and config.get("tau2_commit_source"):
        recorded = str(config.get("tau2_commit") or "").strip()
        if recorded.lower() not in UNKNOWN_COMMITS:
            return recorded, f"the eval config ({config['tau2_commit_source']})"
    return "unknown", ""


def differences(domain: str, results: dict, config: dict | None, split: str, trials: int,
                config_path: str = "") -> list[str]:
    """Every setting of ``PROTOCOL`` in which the run differs from the published evaluation, each as
    "<setting>: <the run's value> (published: <value>)"; empty when the run is comparable with the published table."""
    info = results.get("info") or {}
    out: list[str] = []
    if domain not in DOMAINS:
        out.append(_differs("domain", f"{domain} (no published number)"))
    commit, source = _run_commit(info, config)
    if not commit.lower().startswith(PINNED_COMMIT):
        how = f", read from {source}" if source else (": τ² ran outside a git checkout and the install records no "
                                                      "commit (TAU2_COMMIT=c5b2d22 bash scripts/setup_env.sh tau2)")
        out.append(_differs("tau2 commit", f"{commit}{how}"))
    if split != PROTOCOL["task split"] or (config and config.get("task_split", split) != PROTOCOL["task split"]):
        out.append(_differs("task split", split if split != PROTOCOL["task split"] else config.get("task_split")))
    declared = [v for v in (info.get("num_trials"), (config or {}).get("num_trials")) if v is not None]
    if trials != PROTOCOL["trials"] or any(_number(v) != PROTOCOL["trials"] for v in declared):
        out.append(_differs("trials", ", ".join(str(v) for v in dict.fromkeys([trials, *declared]))))
    for name, key in (("step cap", "max_steps"), ("error cap", "max_errors"), ("seed", "seed")):
        values = [info.get(key)] + ([config[key]] if config and isinstance(config.get(key), int) else [])
        if any(_number(v) != PROTOCOL[name] for v in values):
            out.append(_differs(name, ", ".join(str(v) for v in dict.fromkeys(values))))
    _model_side(out, "agent", info.get("agent_info") or {}, "llm_agent")
    user = info.get("user_info") or {}
    _model_side(out, "user", user, "user_simulator")
    model = str(user.get("llm") or "?")
    if model.removeprefix("openai/") != PUBLISHED_USER:
        out.append(_differs("user model", model))
    endpoint = (user.get("llm_args") or {}).get("api_base") or (user.get("llm_args") or {}).get("base_url")
    if endpoint:
        out.append(_differs("user endpoint", endpoint))
    if config is None:
        out.append(_differs("eval config", f"none at {config_path or '<TAG>_eval_config.json'} (the policy "
                                           "server's context and the run's deviations are unknown)"))
    else:
        context = (config.get("policy") or {}).get("max_model_len")
        if _number(context) != PROTOCOL["policy context"]:
            out.append(_differs("policy context", context))
        for deviation in config.get("deviations") or []:
            out.append(_differs("recorded deviations", deviation))
    return out


def read_config(results_dir: str, tag: str) -> tuple[dict | None, str]:
    """The eval script's config beside the results, or None where there is none (a run made by hand)."""
    path = os.path.join(results_dir, f"{tag}_eval_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return None, path
    except ValueError as e:
        raise IncompleteRun(f"{path} is not JSON ({e}): the run's settings cannot be read") from None
    return (config if isinstance(config, dict) else None), path


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
    try:
        config, config_path = read_config(args.results_dir, args.tag)
    except IncompleteRun as e:
        config, config_path = None, ""
        problems.append(str(e))
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
        score["differences"] = differences(domain, results, config, args.split, args.trials, config_path)
        score["not_comparable"] = "; ".join(score["differences"])
        scores[domain] = score
    if problems:
        print("tau2_align_score: refusing to score:\n  " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(2)
    k = args.trials
    print(f"τ²-bench {args.split}, tag {args.tag}: Avg@{k} (%) and pass^k; published rows: Avg@4, "
          f"{PUBLISHED_USER} user (the difference is shown only where every protocol setting matches)")
    print(f"{'domain':10}{'ours':>8}" + "".join(f"{name:>15}" for name in PUBLISHED_AVG4) + "  " +
          " ".join(f"pass^{j}" for j in range(1, k + 1)))
    for domain, score in scores.items():
        ours = 100 * score[f"avg@{k}"]
        if domain not in DOMAINS:
            published = "".join(f"{'n/a':>15}" for _ in PUBLISHED_AVG4)
        else:
            column = DOMAINS.index(domain)
            published = "".join((f"{row[column]:.1f}" if score["differences"] else
                                 f"{row[column]:.1f} ({ours - row[column]:+.1f})").rjust(15)
                                for row in PUBLISHED_AVG4.values())
        passes = " ".join(f"{score[f'pass^{j}']:6.3f}" for j in range(1, k + 1))
        print(f"{domain:10}{ours:8.1f}{published}  {passes}")
    for domain, score in scores.items():
        if score["differences"]:
            print(f"{domain}: not comparable with the published table; the settings that differ:")
            for line in score["differences"]:
                print(f"  - {line}")
    report = {"tag": args.tag, "split": args.split, "trials": k, "scores": scores,
              "published_avg4": {name: dict(zip(DOMAINS, row)) for name, row in PUBLISHED_AVG4.items()}}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
