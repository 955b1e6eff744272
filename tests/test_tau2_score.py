"""scripts/tau2_align_score.py's comparability rule, and scripts/tau2_commit.py (the commit of a tau2 install).

A run is set beside the published Avg@4 table, with differences, only when it matches every setting of the
evaluation protocol (docs/TAU2_GRPO.md, "The evaluation protocol"; ``PROTOCOL`` in the scorer). Each test below
starts from a run that matches all of them (``published_run``: τ²'s Results files for the three domains, shaped as
``tau2 run`` saves them, and the config scripts/tau2_align_eval.sh writes beside them) and changes one setting: the
scorer must then print no difference and name that setting. Fast: no tau2 package, no server.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

DOMAINS = ("airline", "retail", "telecom")
DELTA = re.compile(r"\([+-]\d+\.\d\)")  # "(+1.2)": a difference from a published number


def load(name: str):
    """scripts/<name>.py as ``scripts.<name>``, the name mutmut gives its mutants (scripts/mutation_test.sh)."""
    return importlib.import_module(f"scripts.{name}")


def task_ids(domain: str, split: str) -> list[str]:
    with open(os.path.join(ROOT, "data", f"tau2_{domain}_{split}.jsonl")) as f:
        return [json.loads(line)["label"].split("/", 1)[1] for line in f if line.strip()]


def results(domain: str, split: str = "test", trials: int = 4) -> dict:
    """τ²'s Results at the published settings; task k succeeds in trials j < k % 5."""
    tasks = task_ids(domain, split)
    sims = [{"task_id": t, "trial": j, "reward_info": {"reward": 1.0 if j < k % 5 else 0.0}}
            for k, t in enumerate(tasks) for j in range(trials)]
    return {"info": {"git_commit": "c5b2d22d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b", "num_trials": trials, "max_steps": 200,
                     "max_errors": 10, "seed": 300,
                     "user_info": {"implementation": "user_simulator", "llm": "gpt-4o-mini-2024-07-18",
                                   "llm_args": {"temperature": 0.0}},
                     "agent_info": {"implementation": "llm_agent", "llm": "openai/policy",
                                    "llm_args": {"temperature": 0.0, "api_base": "http://127.0.0.1:8000/v1",
                                                 "api_key": "EMPTY"}},
                     "environment_info": {"domain_name": domain}},
            "tasks": [{"id": t} for t in tasks], "simulations": sims}


def config(split: str = "test", trials: int = 4) -> dict:
    """The config scripts/tau2_align_eval.sh writes (the fields the scorer reads)."""
    return {"tag": "t1", "tau2_version": "infopo", "tau2_commit": "c5b2d22",
            "tau2_commit_source": "tau2-commit.json (stated at install)", "task_split": split, "num_trials": trials,
            "max_steps": 200, "policy": {"max_model_len": 32768}, "user": {"llm": "gpt-4o-mini-2024-07-18"},
            "deviations": []}


def published_run() -> tuple[dict, dict]:
    return {d: results(d) for d in DOMAINS}, config()


def score(tmp_path, runs: dict, cfg: dict | None, *flags: str, capsys) -> tuple[dict, str]:
    for domain, data in runs.items():
        (tmp_path / f"t1_{domain}.json").write_text(json.dumps(data))
    if cfg is not None:
        (tmp_path / "t1_eval_config.json").write_text(json.dumps(cfg))
    elsewhere = tmp_path.parent / f"{tmp_path.name}-cwd"
    elsewhere.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(elsewhere)  # item-id files are found beside the script, results in --results-dir: not here
        report = load("tau2_align_score").main(["--tag", "t1", "--results-dir", str(tmp_path), *flags])
    return report, capsys.readouterr().out


def rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.split(" ", 1)[0] in DOMAINS]


def test_a_run_at_every_published_setting_is_compared_with_differences(tmp_path, capsys):
    runs, cfg = published_run()
    report, out = score(tmp_path, runs, cfg, capsys=capsys)
    assert all(report["scores"][d]["differences"] == [] for d in DOMAINS), report["scores"]
    assert len(rows(out)) == 3 and all(len(DELTA.findall(row)) == 4 for row in rows(out)), out
    assert "not comparable" not in out


def _set(path: str, value):
    """A change to the Results (``info.…``) or the config (``config.…``); None deletes the key."""
    def change(runs: dict, cfg: dict) -> None:
        where, *keys = path.split(".")
        for target in ([r["info"] for r in runs.values()] if where == "info" else [cfg]):
            for key in keys[:-1]:
                target = target[key]
            if value is None:
                target.pop(keys[-1], None)
            else:
                target[keys[-1]] = value
    return change


# (the setting the scorer must name, the change that breaks only it, the line it must print)
ONE_SETTING_OFF = [
    ("tau2 commit", _set("info.git_commit", "0123abcd"), "0123abcd, read from the results (published: c5b2d22)"),
    ("tau2 commit", lambda runs, cfg: (_set("info.git_commit", "unknown")(runs, cfg),
                                       _set("config.tau2_commit", "unknown")(runs, cfg)),
     "unknown: τ² ran outside a git checkout and the install records no commit (TAU2_COMMIT=c5b2d22 bash "
     "scripts/setup_env.sh tau2) (published: c5b2d22)"),
    ("tau2 commit", lambda runs, cfg: (_set("info.git_commit", "unknown")(runs, cfg),  # a claim, not a record
                                       _set("config.tau2_commit_source", None)(runs, cfg)), "unknown: τ² ran"),
    ("tau2 commit", lambda runs, cfg: (_set("info.git_commit", None)(runs, cfg),
                                       _set("config.tau2_commit", "fedcba9")(runs, cfg)),
     "fedcba9, read from the eval config (tau2-commit.json (stated at install)) (published: c5b2d22)"),
    ("trials", _set("config.num_trials", 2), "trials: 4, 2 (published: 4)"),
    ("trials", _set("info.num_trials", 5), "trials: 4, 5 (published: 4)"),
    ("task split", _set("config.task_split", "train"), "task split: train (published: test)"),
    ("step cap", _set("info.max_steps", 10), "step cap: 10, 200 (published: 200)"),
    ("step cap", _set("config.max_steps", 10), "step cap: 200, 10 (published: 200)"),
    ("step cap", _set("info.max_steps", None), "step cap: None, 200 (published: 200)"),
    ("error cap", _set("info.max_errors", 5), "error cap: 5 (published: 10)"),
    ("seed", _set("info.seed", 42), "seed: 42 (published: 300)"),
    ("agent", _set("info.agent_info.implementation", "llm_agent_solo"),
     "agent: llm_agent_solo (published: llm_agent (tau2's default agent))"),
    ("agent temperature", _set("info.agent_info.llm_args.temperature", 1.0), "agent temperature: 1.0 (published: 0.0)"),
    ("agent temperature", _set("info.agent_info.llm_args.temperature", None),
     "agent temperature: not set (the server's default) (published: 0.0)"),
    ("agent temperature", _set("info.agent_info.llm_args.temperature", "warm"), "agent temperature: warm"),
    ("agent sampling arguments", lambda runs, cfg: (_set("info.agent_info.llm_args.top_p", 0.9)(runs, cfg),
                                                    _set("info.agent_info.llm_args.max_tokens", 64)(runs, cfg)),
     "agent sampling arguments: max_tokens=64, top_p=0.9 (published: none but the temperature)"),
    ("user simulator", _set("info.user_info.implementation", "dummy_user"),
     "user simulator: dummy_user (published: user_simulator (tau2's default))"),
    ("user model", _set("info.user_info.llm", "gpt-4o-mini"), "user model: gpt-4o-mini (published: gpt-4o-mini-2024-"),
    ("user model", _set("info.user_info.llm", None), "user model: ? (published: gpt-4o-mini-2024-07-18)"),
    ("user model", _set("info.user_info.llm", "gpt-4o-mini-2024-07-18/openai/"), "user model: gpt-4o-mini-2024-07-18/"),
    ("user model", _set("info.user_info.llm", "ft:gpt-4o-mini-2024-07-18:mine"),  # passed the old substring test
     "user model: ft:gpt-4o-mini-2024-07-18:mine"),
    ("user temperature", _set("info.user_info.llm_args.temperature", 0.7), "user temperature: 0.7 (published: 0.0)"),
    ("user sampling arguments", _set("info.user_info.llm_args.max_tokens", 64), "user sampling arguments: max_tokens=64"),
    ("user endpoint", _set("info.user_info.llm_args.api_base", "http://127.0.0.1:8001/v1"),
     "user endpoint: http://127.0.0.1:8001/v1 (published: the provider's own API (no api_base))"),
    ("user endpoint", _set("info.user_info.llm_args.base_url", "http://127.0.0.1:8002/v1"),
     "user endpoint: http://127.0.0.1:8002/v1"),
    ("policy context", _set("config.policy.max_model_len", 8192), "policy context: 8192 (published: 32768)"),
    ("recorded deviations", _set("config.deviations", ["a subset of tasks (TASK_IDS=1 2 NUM_TASKS=)", "domains: x"]),
     "recorded deviations: a subset of tasks (TASK_IDS=1 2 NUM_TASKS=) (published: none)"),
]


@pytest.mark.parametrize("setting,change,line", ONE_SETTING_OFF,
                         ids=[f"{s}-{i}" for i, (s, _, _) in enumerate(ONE_SETTING_OFF)])
def test_a_run_off_the_protocol_in_one_setting_prints_no_difference_and_names_it(setting, change, line, tmp_path,
                                                                                   capsys):
    runs, cfg = published_run()
    change(runs, cfg)
    report, out = score(tmp_path, runs, cfg, capsys=capsys)
    assert not DELTA.search(out), out  # no "(+x.x)" beside any published number
    assert len(rows(out)) == 3
    for domain in DOMAINS:
        differences = report["scores"][domain]["differences"]
        named = [d for d in differences if d.startswith(f"{setting}:")]
        assert named and {d.split(":", 1)[0] for d in differences} == {setting}, (domain, differences)
        assert f"  - {named[0]}" in out and report["scores"][domain]["not_comparable"] == "; ".join(differences)
        assert f"{domain}: not comparable with the published table; the settings that differ:" in out
    assert line in out, out
    assert "16.3" in out  # the published numbers are still printed, without differences


def test_the_issues_run_step_cap_10_and_agent_temperature_1_names_both(tmp_path, capsys):
    """The run the issue found printed as "+90.6 vs base": --max-steps 10, agent temperature 1.0, everything else
    as published (user gpt-4o-mini, 4 trials, commit c5b2d22)."""
    runs, cfg = published_run()
    for data in runs.values():
        data["info"]["max_steps"] = 10
        data["info"]["agent_info"]["llm_args"]["temperature"] = 1.0
        for sim in data["simulations"]:
            sim["reward_info"]["reward"] = 1.0
    cfg["max_steps"] = 10
    report, out = score(tmp_path, runs, cfg, capsys=capsys)
    assert not DELTA.search(out) and "+90.6" not in out, out
    assert "step cap: 10 (published: 200)" in out and "agent temperature: 1.0 (published: 0.0)" in out


@pytest.mark.parametrize("split,trials", [("train", 4), ("test", 5)])
def test_another_split_or_trial_count_is_named(split, trials, tmp_path, capsys):
    runs = {d: results(d, split, trials) for d in DOMAINS}
    report, out = score(tmp_path, runs, config(split, trials), "--split", split, "--trials", str(trials),
                        capsys=capsys)
    assert not DELTA.search(out), out
    assert ("task split: train" if split == "train" else "trials: 5") in out


def test_without_the_eval_config_the_run_is_not_comparable(tmp_path, capsys):
    runs, _ = published_run()
    report, out = score(tmp_path, runs, None, capsys=capsys)
    assert not DELTA.search(out), out
    assert (f"  - eval config: none at {tmp_path / 't1_eval_config.json'} (the policy server's context and the run's "
            "deviations are unknown) (published: scripts/tau2_align_eval.sh's") in out
    (tmp_path / "t1_eval_config.json").write_text("[]")  # JSON, but no config
    report, out = score(tmp_path, runs, None, capsys=capsys)
    assert "eval config: none at" in out and not DELTA.search(out)


def test_the_command_line(tmp_path, capsys):
    scorer = load("tau2_align_score")
    with pytest.raises(SystemExit):
        scorer.main([])  # --tag is required
    assert "--tag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        scorer.main(["--tag", "t1", "--domains", "shopping"])
    assert "invalid choice: 'shopping'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the default results folder: runs/tau2 of the repository
        scorer.main(["--tag", "no-such-tag-here", "--domains", "airline"])
    assert os.path.join(ROOT, "runs", "tau2", "no-such-tag-here_airline.json") in capsys.readouterr().err
    runs, cfg = published_run()
    _, out = score(tmp_path, runs, cfg, capsys=capsys)
    assert out.splitlines()[1] == ("domain        ours           base        GRPO@25          RAGEN         InfoPO  "
                                   "pass^1 pass^2 pass^3 pass^4")


def test_the_user_model_may_carry_litellms_provider_prefix(tmp_path, capsys):
    runs, cfg = published_run()
    for data in runs.values():
        data["info"]["user_info"]["llm"] = "openai/gpt-4o-mini-2024-07-18"
    report, out = score(tmp_path, runs, cfg, capsys=capsys)
    assert all(report["scores"][d]["differences"] == [] for d in DOMAINS) and DELTA.search(out)


def test_a_run_whose_tau2_recorded_unknown_is_comparable_by_the_installs_recorded_commit(tmp_path, capsys):
    """tau2 run records "unknown" outside a git checkout; the eval script records the install's commit in its config
    (scripts/tau2_commit.py), and the scorer takes it."""
    runs, cfg = published_run()
    for data in runs.values():
        data["info"]["git_commit"] = "unknown"
    report, out = score(tmp_path, runs, cfg, capsys=capsys)
    assert all(report["scores"][d]["differences"] == [] for d in DOMAINS), report["scores"]
    assert DELTA.search(out)


# ---- the rest of the scorer, in process: completeness, file names, metrics -------------------------------------
def refused(tmp_path, runs: dict, capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as stop:
        score(tmp_path, runs, config(), *flags, capsys=capsys)
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_the_metrics_of_a_complete_run(tmp_path, capsys):
    runs, cfg = published_run()
    runs["retail"]["simulations"][4]["reward_info"] = None  # task 1's first trial, a win, crashed: reward 0
    report, out = score(tmp_path, runs, cfg, "--out", str(tmp_path / "s.json"), capsys=capsys)
    n = len(task_ids("airline", "test"))
    airline = report["scores"]["airline"]
    assert airline["tasks"] == n == 20 and airline["avg@4"] == pytest.approx(sum(min(k % 5, 4) / 4 for k in range(n)) / n)
    wins = [min(k % 5, 4) for k in range(n)]  # successes per task, of 4
    for k in (1, 2, 3, 4):
        expected = sum(math.comb(c, k) / math.comb(4, k) for c in wins) / n
        assert airline[f"pass^{k}"] == pytest.approx(expected), k
    retail = sum(min(k % 5, 4) / 4 for k in range(40)) / 40 - (1 / 4) / 40
    assert report["scores"]["retail"]["avg@4"] == pytest.approx(retail)
    row = next(line for line in out.splitlines() if line.startswith("airline "))
    assert row.split()[1] == f"{100 * airline['avg@4']:.1f}" and f"{airline['pass^4']:6.3f}".strip() in row.split()
    assert f"8.8 ({100 * airline['avg@4'] - 8.8:+.1f})" in row and f"16.3 ({100 * airline['avg@4'] - 16.3:+.1f})" in row
    assert out.splitlines()[0].startswith("τ²-bench test, tag t1: Avg@4 (%) and pass^k")
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["scores"]["airline"]["avg@4"] == airline["avg@4"] and saved["trials"] == 4 and saved["split"] == "test"
    assert saved["tag"] == "t1"
    ours = 100 * airline["avg@4"]
    assert row == f"{'airline':10}{ours:8.1f}" + "".join(f"{v:.1f} ({ours - v:+.1f})".rjust(15) for v in
                                                        (8.8, 18.8, 15.0, 16.3)) + "  " + \
        " ".join(f"{airline[f'pass^{j}']:6.3f}" for j in range(1, 5))
    assert saved["published_avg4"]["InfoPO"] == {"airline": 16.3, "retail": 18.8, "telecom": 18.1}


def test_a_run_is_scored_against_the_committed_split_not_the_task_list_it_saved(tmp_path, capsys):
    runs, cfg = published_run()
    for data in runs.values():
        data["tasks"].append({"id": "not-in-the-split"})  # τ²'s own list holds one more task: it is not the split
    report, _ = score(tmp_path, runs, cfg, capsys=capsys)
    assert [report["scores"][d]["tasks"] for d in DOMAINS] == [20, 40, 40]


@pytest.mark.parametrize("damage,says", [
    (lambda data: data["simulations"].pop(), "incomplete run, refusing to score it: 1 of 20 tasks lack trials"),
    (lambda data: data["simulations"].append({"task_id": "0", "trial": 0, "reward_info": {"reward": 1.0}}),
     "simulations of tasks outside the split: ['0']"),
    (lambda data: data["info"].update(num_trials=2), "the run declares 2 trials; --trials 4 needs more"),
])
def test_an_incomplete_or_foreign_run_is_refused_with_what_is_wrong(damage, says, tmp_path, capsys):
    runs, _ = published_run()
    damage(runs["airline"])
    runs["retail"]["simulations"].pop(0)  # a second domain's problem is listed too
    err = refused(tmp_path, runs, capsys)
    assert err.startswith(f"tau2_align_score: refusing to score:\n  airline: {says}"), err
    assert "\n  retail: incomplete run" in err
    last = task_ids("airline", "test")[-1]
    if "lack trials" in says:
        assert f"{last} (trials [3])" in err


def test_what_an_incomplete_run_lacks_is_listed_up_to_eight_tasks(tmp_path, capsys):
    ids = task_ids("airline", "test")
    for lacking, shown, more in ((8, 8, False), (9, 8, True)):
        runs, _ = published_run()
        runs["airline"]["simulations"] = [s for s in runs["airline"]["simulations"]
                                          if s["task_id"] not in ids[:lacking] or s["trial"] != 1]
        err = refused(tmp_path, runs, capsys)
        assert f"{lacking} of 20 tasks lack trials" in err and err.count("(trials [1])") == shown, err
        assert err.rstrip().endswith(" …") == more, err
    runs, _ = published_run()
    del runs["airline"]["simulations"]
    assert "20 of 20 tasks lack trials" in refused(tmp_path, runs, capsys)
    runs, _ = published_run()
    runs["airline"]["simulations"] += [{"task_id": f"x{i:02}", "trial": 0, "reward_info": {"reward": 0.0}}
                                       for i in range(11)]
    err = refused(tmp_path, runs, capsys)
    assert "'x09'" in err and "'x10'" not in err and "(run --task-split-name with the split you score)" in err


def test_results_files_are_found_by_tag_and_domain(tmp_path, capsys):
    runs, cfg = published_run()
    named = {f"t1_{d}_run2" if d == "retail" else d: data for d, data in runs.items()}
    for name, data in named.items():  # t1_retail_run2.json: the one file that starts so is taken
        (tmp_path / (f"{name}.json" if name.startswith("t1_") else f"t1_{name}.json")).write_text(json.dumps(data))
    report, _ = score(tmp_path, {}, cfg, capsys=capsys)
    assert set(report["scores"]) == set(DOMAINS)
    (tmp_path / "t1_retail_run3.json").write_text(json.dumps(runs["retail"]))
    with pytest.raises(SystemExit):
        score(tmp_path, {}, cfg, capsys=capsys)
    err = capsys.readouterr().err
    assert "retail: expected one results file" in err and "t1_retail_run2.json" in err and "t1_retail_run3.json" in err
    (tmp_path / "none").mkdir()
    err = refused(tmp_path / "none", {}, capsys)
    assert "airline: expected one results file" in err and "found none" in err


def test_taus_mock_domain_is_scored_on_the_task_list_it_saved_and_has_no_published_row(tmp_path, capsys):
    mock = results("airline")
    mock["tasks"] = [{"id": "create_task_1"}, {"id": "update_task_1"}]
    mock["simulations"] = [{"task_id": t["id"], "trial": j, "reward_info": {"reward": 1.0}}
                           for t in mock["tasks"] for j in range(4)]
    report, out = score(tmp_path, {"mock": mock}, config("base"), "--domains", "mock", "--split", "base",
                        capsys=capsys)
    assert report["scores"]["mock"]["avg@4"] == 1.0 and report["scores"]["mock"]["tasks"] == 2
    row = next(line for line in out.splitlines() if line.startswith("mock "))
    assert row.split()[1:6] == ["100.0", "n/a", "n/a", "n/a", "n/a"] and not DELTA.search(out)
    assert "domain: mock (no published number)" in out and "task split: base" in out
    mock["tasks"] = []
    err = refused(tmp_path, {"mock": mock}, capsys, "--domains", "mock", "--split", "base")
    assert "mock: no item-id file" in err and "no task list in the results" in err


def test_a_config_that_is_not_json_is_refused(tmp_path, capsys):
    runs, _ = published_run()
    (tmp_path / "t1_eval_config.json").write_text("{not json")
    for domain, data in runs.items():
        (tmp_path / f"t1_{domain}.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit):
        load("tau2_align_score").main(["--tag", "t1", "--results-dir", str(tmp_path)])
    assert "t1_eval_config.json is not JSON" in capsys.readouterr().err


# ---- scripts/tau2_commit.py ----------------------------------------------------------------------------------
def fake_venv(tmp_path, direct_url: dict | None = None):
    venv = tmp_path / "venv"
    dist = venv / "lib" / "python3.11" / "site-packages" / "tau2-0.2.1.dev0.dist-info"
    dist.mkdir(parents=True)
    if direct_url is not None:
        (dist / "direct_url.json").write_text(json.dumps(direct_url))
    return venv


def test_the_commit_of_an_install_from_pip_or_from_the_record_beside_the_venv(tmp_path):
    commit = load("tau2_commit")
    # pip's own record of a VCS install
    vcs = fake_venv(tmp_path / "a", {"url": "https://github.com/sierra-research/tau2-bench",
                                     "vcs_info": {"vcs": "git", "commit_id": "C5B2D22" + "0" * 33}})
    assert commit.installed_commit(str(vcs)) == ("c5b2d22" + "0" * 33, "pip (direct_url.json vcs_info)")
    # an install from a copy (what setup_env.sh does): pip records a folder, no commit
    copy_venv = fake_venv(tmp_path / "b", {"url": "file:///tmp/tmp.x", "dir_info": {}})
    plain = tmp_path / "plain-copy"
    plain.mkdir()
    assert commit.installed_commit(str(copy_venv)) == ("unknown", "")
    assert commit.record(str(copy_venv), str(plain))["commit"] == "unknown"  # nothing stated: nothing recorded
    assert commit.record(str(copy_venv), str(plain), "c5b2d22")["commit"] == "c5b2d22"
    assert commit.installed_commit(str(copy_venv))[0] == "c5b2d22"
    assert commit.record(str(copy_venv), str(plain))["commit"] == "c5b2d22"  # a rebuild without TAU2_COMMIT keeps it
    with pytest.raises(ValueError, match="not a commit"):
        commit.record(str(copy_venv), str(plain), "latest")
    # a git checkout: its HEAD, and a stated commit that contradicts it is refused
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "f").write_text("x\n")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    for args in (["init", "-q"], ["add", "f"], ["commit", "-q", "-m", "x"]):
        subprocess.run(git + args, check=True, capture_output=True, timeout=30)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert commit.record(str(copy_venv), str(checkout))["commit"] == head
    with pytest.raises(ValueError, match="contradicts"):
        commit.record(str(copy_venv), str(checkout), "c5b2d22")
    # the command line prints it (the eval script reads it so)
    done = subprocess.run([sys.executable, "scripts/tau2_commit.py", "--venv", str(copy_venv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == head


def test_the_published_protocol_table_is_the_docs_table():
    """docs/TAU2_GRPO.md's evaluation-protocol table lists exactly the settings the scorer checks."""
    path = os.path.join(ROOT, "docs", "TAU2_GRPO.md")
    if not os.path.exists(path):  # scripts/mutation_test.sh's copy of the tree holds the code, not the docs
        pytest.skip(f"{path} is not in this copy of the tree")
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    section = doc[doc.index("### The evaluation protocol"):]
    section = section[:section.index("\n#", 1)]
    named = re.findall(r"^\| ([a-z0-9 ]+) \|", section, flags=re.M)
    assert [n for n in named if n != "setting"] == list(load("tau2_align_score").PROTOCOL), named


# ---- rules the mutation run (scripts/mutation_test.sh scripts/tau2_align_score.py) found unpinned ----------------
def test_an_item_id_is_everything_after_the_domain_even_with_a_slash_in_it(tmp_path, monkeypatch):
    """``data/tau2_<domain>_<split>.jsonl`` labels are ``<domain>/<task id>``; a task id may itself hold a slash."""
    scorer = load("tau2_align_score")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tau2_telecom_odd.jsonl").write_text(
        '{"prompt": "tau2/telecom/a/b/c", "label": "telecom/a/b/c"}\n\n{"prompt": "tau2/telecom/7", "label": "telecom/7"}\n')
    monkeypatch.setattr(scorer, "ROOT", str(tmp_path))
    assert scorer.split_task_ids("telecom", "odd") == ["a/b/c", "7"]


def test_the_task_split_is_named_by_the_run_and_by_its_config_separately():
    scorer = load("tau2_align_score")
    data = results("airline")
    cfg = config()
    del cfg["task_split"]  # a config from before the field existed says nothing about the split: not a difference
    assert scorer.differences("airline", data, cfg, "test", 4) == []
    assert scorer.differences("airline", data, cfg, "train", 4) == ["task split: train (published: test)"]
    assert scorer.differences("airline", data, config("train"), "test", 4) == ["task split: train (published: test)"]


def test_an_empty_recorded_commit_is_unknown_not_a_commit():
    scorer = load("tau2_align_score")
    data = results("airline")
    data["info"]["git_commit"] = "unknown"
    cfg = {**config(), "tau2_commit": ""}
    [named] = scorer.differences("airline", data, cfg, "test", 4)
    assert named.startswith("tau2 commit: unknown: τ² ran outside a git checkout and the install records no commit"), named


def test_without_a_config_path_the_missing_config_is_named_by_its_pattern():
    scorer = load("tau2_align_score")
    names = scorer.differences("airline", results("airline"), None, "test", 4)
    assert names == ["eval config: none at <TAG>_eval_config.json (the policy server's context and the run's deviations "
                     f"are unknown) (published: {scorer.PROTOCOL['eval config']})"], names


def test_the_incomplete_and_foreign_run_messages_word_for_word():
    scorer = load("tau2_align_score")
    ids = task_ids("airline", "test")
    data = results("airline")
    data["simulations"] = [s for s in data["simulations"] if s["task_id"] not in ids[:2] or s["trial"] != 1]
    with pytest.raises(scorer.IncompleteRun) as refused_run:
        scorer.score_domain(data, ids, 4, "airline")
    assert str(refused_run.value) == (f"airline: incomplete run, refusing to score it: 2 of 20 tasks lack trials: "
                                      f"{ids[0]} (trials [1]), {ids[1]} (trials [1])")
    data = results("airline")
    data["simulations"].append({"task_id": "x1", "trial": 0, "reward_info": {"reward": 0.0}})
    with pytest.raises(scorer.IncompleteRun) as refused_run:
        scorer.score_domain(data, ids, 4, "airline")
    assert str(refused_run.value) == ("airline: simulations of tasks outside the split: ['x1'] "
                                      "(run --task-split-name with the split you score)")
