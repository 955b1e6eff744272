"""benchmarks/learning_curve.py: the study runs the quickstart's recipe, its statistics are the stated ones, and it
scores each final model greedy and sampled with the training turn limit."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import learning_curve  # noqa: E402


def test_the_study_runs_the_quickstart_recipe():
    """Every recipe flag (and its value) appears in the quickstart's train step, so the two cannot drift apart."""
    script = open(os.path.join(ROOT, "scripts", "quickstart.sh")).read()
    train = script[script.index("step train"):script.index("\"${COPE_FLAGS[@]}\"")]
    flags = " ".join(re.sub(r"\\\n\s*", " ", train).split())
    recipe, i = learning_curve.RECIPE, 0
    while i < len(recipe):
        flag, value = recipe[i], recipe[i + 1] if i + 1 < len(recipe) and not recipe[i + 1].startswith("--") else None
        assert (f"{flag} {value}" if value else flag) in flags, (flag, value)
        i += 2 if value else 1
    # the quickstart's CoPE switches are the study's "filter" config
    assert re.findall(r"--cope\.\w+", flags) == learning_curve.CONFIGS["filter"]


def test_half_width_is_the_t_interval():
    assert learning_curve.half_width([0.5]) == 0.0
    values = [0.4, 0.5, 0.6]  # stdev 0.1, 2 degrees of freedom: t = 4.303
    assert learning_curve.half_width(values) == pytest.approx(4.303 * 0.1 / 3 ** 0.5)


def test_summary_reports_final_success_and_steps_to_grpo_final():
    def run(curve, step_s, greedy, avg4):
        # each eval's metrics hold the other's number too, so reading the wrong eval or key changes the row
        return {"eval": curve, "step_s": step_s,
                "greedy": {"success_rate": greedy, "avg@1": 0.01, "pass^1": greedy},
                "sampled": {"success_rate": 0.99, "avg@4": avg4, "pass^1": 0.99}}

    runs = {"grpo": [run({0: 0.4, 10: 0.5, 20: 0.6}, [20.0, 22.0], greedy=0.6, avg4=0.45),
                     run({0: 0.4, 10: 0.6, 20: 0.6}, [21.0], greedy=0.8, avg4=0.35)],
            "info": [run({0: 0.4, 10: 0.7, 20: 0.8}, [30.0], greedy=0.9, avg4=0.7),
                     run({0: 0.4, 10: 0.5, 20: 0.6}, [30.0], greedy=0.9, avg4=0.7)]}
    rows, curves = learning_curve.summarize("babyai", runs, greedy_before=0.55)
    assert curves["grpo"][1] == pytest.approx([0.4, 0.55, 0.6])
    # greedy: 0.55 before, mean 0.7 after, t(1) = 12.706 x stdev 0.1414 / sqrt 2 = 1.271; Avg@4: mean 0.4, 0.635
    assert rows[0] == ("| babyai | grpo | 2 | 0.400 | 0.600 ± 0.000 | 20 | 21.0 "
                       "| 0.550 → 0.700 ± 1.271 | 0.400 ± 0.635 |")
    assert rows[1].startswith("| babyai | info | 2 | 0.400 | 0.700 ± ")
    assert rows[1].endswith("| 10 | 30.0 | 0.550 → 0.900 ± 0.000 | 0.700 ± 0.000 |")
    assert [row.count("|") for row in learning_curve.HEADER] == [rows[0].count("|")] * 2


@pytest.mark.parametrize("env", ["babyai", "textcraft"])
def test_eval_commands_play_greedy_and_sampled_with_the_training_turn_limit(env):
    spec = importlib.util.spec_from_file_location("eval_script", os.path.join(ROOT, "scripts", "eval.py"))
    eval_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eval_script)
    played = {}
    for name in learning_curve.EVALS:
        cmd, env_vars = learning_curve.eval_command(env, "/m/model", "/w/heldout.jsonl", "/r/run", name,
                                                    "http://127.0.0.1:1")
        assert cmd[1] == os.path.join(ROOT, "scripts", "eval.py")
        args = eval_script.build_parser().parse_args(cmd[2:])
        assert (args.env, args.model, args.items, args.gateway) == (env, "/m/model", "/w/heldout.jsonl",
                                                                    "http://127.0.0.1:1")
        assert env_vars["MAX_TURNS"] == str(learning_curve.TURNS[env])  # eval.py's agent func reads the turn limit here
        assert (args.max_new_tokens, args.max_length, args.seed) == (2048, 2048, 0)  # as in training: see EVAL_BUDGET
        played[args.out] = (args.temperature, args.k)
    assert played == {"/r/run/eval_greedy.json": (0.0, 1), "/r/run/eval_sampled_k4.json": (1.0, 4)}


def test_evals_run_once_and_an_env_failure_is_not_kept(tmp_path, monkeypatch):
    failures, calls = {"n": 3}, []

    def fake_eval(cmd, **kwargs):  # scripts/eval.py's report, as it writes it to --out
        out = cmd[cmd.index("--out") + 1]
        calls.append(os.path.basename(out))
        with open(out, "w") as f:
            json.dump({"env_failures": failures["n"], "metrics": {"file": os.path.basename(out)}}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(learning_curve.subprocess, "run", fake_eval)
    with pytest.raises(RuntimeError, match="failed 3 episodes"):
        learning_curve.evaluate("babyai", "/m", str(tmp_path), "/items.jsonl", "http://127.0.0.1:1")
    assert sorted(os.listdir(tmp_path)) == ["eval_greedy.failed.json", "eval_greedy.log"]
    failures["n"] = 0
    expected = {"greedy": {"file": "eval_greedy.json"}, "sampled": {"file": "eval_sampled_k4.json"}}
    assert learning_curve.evaluate("babyai", "/m", str(tmp_path), "/items.jsonl", "http://127.0.0.1:1") == expected
    assert learning_curve.evaluate("babyai", "/m", str(tmp_path), "/items.jsonl", "http://127.0.0.1:1") == expected
    assert calls == ["eval_greedy.json", "eval_greedy.json", "eval_sampled_k4.json"]


def test_summary_says_not_run_for_missing_evals():
    runs = {"grpo": [{"eval": {0: 0.4, 10: 0.5}, "step_s": [20.0], "greedy": {"success_rate": 0.5}},
                     {"eval": {0: 0.4, 10: 0.7}, "step_s": [20.0]}]}  # the second seed's evals were not run
    rows, _ = learning_curve.summarize("babyai", runs, greedy_before=None)
    assert rows[0].endswith("| 20.0 | not run | not run |")


def test_one_seed_has_no_interval():
    rows, _ = learning_curve.summarize("babyai", {"te": [{"eval": {0: 0.6, 10: 0.64}, "step_s": [11.0]}]}, None)
    assert rows[0].startswith("| babyai | te | 1 | 0.600 | 0.640 (one seed) |")
