"""benchmarks/learning_curve.py: the study runs the quickstart's recipe, its statistics are the stated ones, and it
scores each final model greedy and sampled with the training turn limit; a SIGTERM stops it and what it started."""

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import learning_curve  # noqa: E402


# What the study sets per run (paths, steps, turns, seed) rather than in its recipe.
PER_RUN = {"--env", "--actor.model_name_or_path", "--data.prompt_dataset", "--eval.dataset", "--local.steps",
           "--local.max_turns", "--eval.steps", "--ckpt.save_steps", "--ckpt.path", "--ckpt.output_dir",
           "--logger.tensorboard_dir"}


class NoStack:
    """EnvStack's stand-in where no eval is played: an address nothing listens on."""
    url = "http://127.0.0.1:1"

    def __init__(self, env):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def flag_pairs(words: list[str]) -> list[str]:
    """A command line's words as "--flag value" / "--flag" strings."""
    pairs, i = [], 0
    while i < len(words):
        value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None
        pairs.append(f"{words[i]} {value}" if value else words[i])
        i += 2 if value else 1
    return pairs


def test_the_study_runs_the_quickstart_recipe():
    """The study's recipe is the quickstart's train step, flag for flag both ways, so the two cannot drift apart."""
    script = open(os.path.join(ROOT, "scripts", "quickstart.sh")).read()
    train = script[script.index("step train"):script.index("\"${COPE_FLAGS[@]}\"")]
    words = re.sub(r"\\\n\s*", " ", train).split()
    quickstart = [p for p in flag_pairs(words[words.index("cope_rlhf.local") + 2:]) if p.split()[0] not in PER_RUN]
    cope = [p for p in quickstart if p.startswith("--cope.")]
    # the quickstart's CoPE switches (given as "--cope.x true") are the study's "filter" config
    assert [p.split()[0] for p in cope] == learning_curve.CONFIGS["filter"]
    assert sorted(flag_pairs(learning_curve.RECIPE)) == sorted(p for p in quickstart if p not in cope)


def test_the_study_warm_starts_babyai_as_the_quickstart_does():
    script = open(os.path.join(ROOT, "scripts", "quickstart.sh")).read()
    step = script[script.index("step warmstart"):script.index("rm -rf")]
    words = re.sub(r"\\\n\s*", " ", step).replace('"$HELDOUT"', "200").replace('"$DEMOS"', "300").replace(
        '"$EPOCHS"', "16").split()
    quickstart = [p for p in flag_pairs(words[words.index("scripts/prepare_warm_start.py") + 1:])
                  if p.split()[0] not in ("--env", "--out")]
    # --sft-schedule cosine is prepare_warm_start.py's default
    assert sorted(flag_pairs(learning_curve.WARM_START["babyai"] + ["--sft-schedule", "cosine"])) == sorted(quickstart)


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
                                                    "http://127.0.0.1:1", learning_curve.TURNS[env])
        assert cmd[1] == os.path.join(ROOT, "scripts", "eval.py")
        args = eval_script.build_parser().parse_args(cmd[2:])
        assert (args.env, args.model, args.items, args.gateway) == (env, "/m/model", "/w/heldout.jsonl",
                                                                    "http://127.0.0.1:1")
        assert env_vars["MAX_TURNS"] == str(learning_curve.TURNS[env])  # eval.py's agent func reads the turn limit here
        assert (args.max_new_tokens, args.max_length, args.seed) == (2048, 2048, 0)  # as in training: see EVAL_BUDGET
        played[args.out] = (args.temperature, args.k)
    assert played == {"/r/run/eval_greedy.json": (0.0, 1), "/r/run/eval_sampled_k4.json": (1.0, 4)}


@pytest.mark.parametrize("flag, turns", [([], learning_curve.TURNS["textcraft"]), (["--max-turns", "25"], 25)])
def test_max_turns_is_the_turn_limit_of_training_and_of_every_eval(tmp_path, monkeypatch, flag, turns):
    """--max-turns reaches the warm start's eval, each run's trainer and each run's evals alike (a study whose
    before and after were played at different limits would compare nothing)."""
    import cope_rlhf.local.env_stack

    seen = []

    def fake_train(env, config, seed, start, out, run_turns, args):
        seen.append(("train", run_turns))
        os.makedirs(os.path.join(out, "ckpt"))
        with open(os.path.join(out, "ckpt", "summary.json"), "w") as f:
            json.dump({}, f)

    monkeypatch.setattr(cope_rlhf.local.env_stack, "EnvStack", NoStack)
    monkeypatch.setattr(learning_curve, "warm_start", lambda env, out, args: str(tmp_path / env / "warm_start"))
    monkeypatch.setattr(learning_curve, "evaluate", lambda *a, **k: seen.append(("eval", a[5])) or {})
    monkeypatch.setattr(learning_curve, "run_one", fake_train)
    monkeypatch.setattr("scripts.run_report.main", lambda argv: None)
    monkeypatch.setattr(learning_curve, "read_run", lambda out: {"eval": {0: 0.1}, "step_s": [1.0], "train": {}})
    learning_curve.main(["--envs", "textcraft", "--configs", "grpo", "--seeds", "0", "--steps", "1", "--out",
                         str(tmp_path), *flag])
    assert seen == [("eval", turns), ("train", turns), ("eval", turns)]
    with pytest.raises(SystemExit):
        learning_curve.main(["--envs", "textcraft", "--max-turns", "0", "--out", str(tmp_path)])


def test_evals_run_once_and_an_env_failure_is_not_kept(tmp_path, monkeypatch):
    failures, calls = {"n": 3}, []

    def fake_eval(cmd, log=None, env=None):  # scripts/eval.py's report, as it writes it to --out
        out = cmd[cmd.index("--out") + 1]
        calls.append(os.path.basename(out))
        with open(out, "w") as f:
            json.dump({"env_failures": failures["n"], "metrics": {"file": os.path.basename(out)}}, f)
        return 0

    monkeypatch.setattr(learning_curve, "run_child", fake_eval)
    with pytest.raises(RuntimeError, match="failed 3 episodes"):
        learning_curve.evaluate("babyai", "/m", str(tmp_path), "/items.jsonl", "http://127.0.0.1:1", 3)
    assert sorted(os.listdir(tmp_path)) == ["eval_greedy.failed.json", "eval_greedy.log"]
    failures["n"] = 0
    expected = {"greedy": {"file": "eval_greedy.json"}, "sampled": {"file": "eval_sampled_k4.json"}}
    assert learning_curve.evaluate("babyai", "/m", str(tmp_path), "/items.jsonl", "http://127.0.0.1:1", 3) == expected
    assert learning_curve.evaluate("babyai", "/m", str(tmp_path), "/items.jsonl", "http://127.0.0.1:1", 3) == expected
    assert calls == ["eval_greedy.json", "eval_greedy.json", "eval_sampled_k4.json"]


def test_summary_says_not_run_for_missing_evals():
    runs = {"grpo": [{"eval": {0: 0.4, 10: 0.5}, "step_s": [20.0], "greedy": {"success_rate": 0.5}},
                     {"eval": {0: 0.4, 10: 0.7}, "step_s": [20.0]}]}  # the second seed's evals were not run
    rows, _ = learning_curve.summarize("babyai", runs, greedy_before=None)
    assert rows[0].endswith("| 20.0 | not run | not run |")


def test_one_seed_has_no_interval():
    rows, _ = learning_curve.summarize("babyai", {"te": [{"eval": {0: 0.6, 10: 0.64}, "step_s": [11.0]}]}, None)
    assert rows[0].startswith("| babyai | te | 1 | 0.600 | 0.640 (one seed) |")


def test_the_training_table_reads_each_runs_step_metrics_from_its_tensorboard_events(tmp_path):
    """The second table: per config, each step metric averaged over each run's first / last 10 steps (or all of them),
    then over the seeds, read back from real TensorBoard event files; "—" for a metric no seed logged, and how many
    seeds did when not all."""
    from torch.utils.tensorboard import SummaryWriter

    def logged_run(folder, success, rejected, kl, filtered=None, te_member=None, kl_all_rows=None):
        with SummaryWriter(str(tmp_path / folder / "tb" / "launch1")) as writer:
            for step in range(1, 26):  # 25 steps: the first 10 and the last 10 do not overlap
                late = step > 15
                writer.add_scalar("eval/success_rate", 0.5, step)
                writer.add_scalar("train/timing/step_total", 10.0, step)
                writer.add_scalar("train/rollout/success_rate", success[late], step)
                writer.add_scalar("train/rollout/rejected_action_rate", rejected[late], step)
                writer.add_scalar("train/kl", kl[late], step)
                if filtered is not None:
                    writer.add_scalar("train/cope/filtered_frac", filtered if step % 2 else 0.0, step)
                if kl_all_rows is not None:
                    writer.add_scalar("train/cope/kl_all_rows", kl_all_rows[late], step)
                if te_member is not None:
                    writer.add_scalar("train/cope/te_member_first_token_prob", te_member[late], step)
                if kl_all_rows is not None and te_member is not None:  # te0, logged since the upstream recipe
                    writer.add_scalar("train/cope/te_member_prob_valid", (0.01, 0.5)[late], step)
                    writer.add_scalar("train/cope/te_invalid_target_frac", 0.0, step)
                writer.add_scalar("train/return", 9.0, step)  # logged, but not one of the table's metrics
        return learning_curve.read_run(str(tmp_path / folder))

    runs = {"grpo": [logged_run("grpo", success=(0.5, 0.7), rejected=(0.1, 0.05), kl=(0.0, 0.3))],
            "te": [logged_run("te0", success=(0.6, 0.2), rejected=(0.1, 0.7), kl=(0.0, 1.0), filtered=0.5,
                              te_member=(0.001, 0.2), kl_all_rows=(0.0, 0.4)),
                   logged_run("te1", success=(0.4, 0.4), rejected=(0.2, 0.3), kl=(0.0, 0.6), filtered=0.25,
                              te_member=(0.003, 0.4))]}
    assert set(runs["grpo"][0]["train"]) == {"train/rollout/success_rate", "train/rollout/rejected_action_rate",
                                             "train/kl"}
    rows = learning_curve.training_rows("babyai", runs)
    assert rows[0] == "| babyai | grpo | 1 | 0.500 → 0.700 | 0.100 → 0.050 | 0.300 | — | — | — | — → — | — |"
    # filtered: 13 of 25 steps odd, so 0.5 x 13/25 = 0.26 and 0.25 x 13/25 = 0.13, mean 0.195; the whole batch's KL:
    # only te0 logged it (a run from before the metric has none), so its mean is te0's own, not halved by te1, and
    # the cell says it is one seed's of the row's two
    assert rows[1] == ("| babyai | te | 2 | 0.500 → 0.300 | 0.150 → 0.500 | 0.800 | 0.400 (1 of 2 seeds) | 0.195 "
                       "| 0.300 | 0.010 (1 of 2 seeds) → 0.500 (1 of 2 seeds) | 0.000 (1 of 2 seeds) |")
    assert [row.count("|") for row in learning_curve.TRAINING_HEADER] == [rows[0].count("|")] * 2


def test_a_record_reports_the_study_without_its_models(tmp_path, monkeypatch):
    """--record keeps what the report reads and the warm start, not the trained models; the report rebuilt from the
    record alone (no eval run) is the study's own, row for row; and a study resumed from a copy of the record trains
    and builds nothing that the record has."""
    from torch.utils.tensorboard import SummaryWriter

    from tests.env_server_proc import require_venv

    require_venv("babyai")  # the report starts the evals' gateway and env server, as the study does
    out, rec = tmp_path / "out", tmp_path / "record"
    start = out / "babyai" / "warm_start"
    (start / "model-sft").mkdir(parents=True)
    (start / "model-sft" / "model.safetensors").write_bytes(b"weights")
    (start / "data").mkdir()
    (start / "data" / "heldout.jsonl").write_text('{"item_id": 7}\n{"item_id": 9}\n')
    (start / "eval_greedy.json").write_text(json.dumps({"metrics": {"success_rate": 0.9}, "env_failures": 0}))
    for seed, final in ((0, 0.75), (1, 0.5)):
        run = out / "babyai" / f"grpo_seed{seed}"
        (run / "model").mkdir(parents=True)
        (run / "model" / "model.safetensors").write_bytes(b"weights")
        (run / "ckpt").mkdir()
        (run / "ckpt" / "summary.json").write_text(json.dumps({"tensorboard_dir": "/gone/tb"}))
        with open(run / "ckpt" / "eval_episodes.jsonl", "w") as f:
            for step, success in ((0, 0.0), (2, 1.0)):
                for item in (7, 9):
                    f.write(json.dumps({"step": step, "item_id": item, "success": success, "reward": success}) + "\n")
        with SummaryWriter(str(run / "tb" / "launch1")) as writer:
            for step in (1, 2):
                writer.add_scalar("train/timing/step_total", 10.0 + seed, step)
                writer.add_scalar("train/rollout/success_rate", final, step)
            writer.add_scalar("eval/success_rate", 0.5, 0)
            writer.add_scalar("eval/success_rate", final, 2)
        (run / "eval_greedy.json").write_text(json.dumps({"metrics": {"success_rate": final}, "env_failures": 0}))
    study = ["--envs", "babyai", "--configs", "grpo", "--seeds", "0", "1", "--report-only", "--evals"]
    learning_curve.main([*study, "--out", str(out), "--record", str(rec)])
    kept = sorted(str(p.relative_to(rec)) for p in rec.rglob("*") if p.is_file())
    assert kept == ["babyai/grpo_seed0/run_record.json", "babyai/grpo_seed1/run_record.json",
                    "babyai/warm_start/data/heldout.jsonl", "babyai/warm_start/run_record.json"]
    with open(rec / "babyai" / "grpo_seed1" / "run_record.json") as f:
        kept_run = json.load(f)
    assert kept_run["episodes"] == {"0": [[7, 0.0], [9, 0.0]], "2": [[7, 1.0], [9, 1.0]]}  # first and last eval
    assert kept_run["evals"] == {"greedy": {"success_rate": 0.5}}
    resumed = tmp_path / "resumed"
    shutil.copytree(rec, resumed)
    # resuming needs the warm start's model back (the record keeps no model)
    shutil.copytree(start / "model-sft", resumed / "babyai" / "warm_start" / "model-sft")

    def nothing_to_run(cmd, log=None, env=None):
        raise AssertionError(f"the record has this already: {cmd}")

    with monkeypatch.context() as patch:
        patch.setattr(learning_curve, "run_child", nothing_to_run)
        learning_curve.main(["--envs", "babyai", "--configs", "grpo", "--seeds", "0", "1", "--out", str(resumed),
                             "--evals", "greedy"])
    learning_curve.main([*study, "--out", str(rec)])
    assert not (rec / "babyai" / "warm_start" / "model-sft").exists()
    rows = {str(out): [], str(rec): []}
    for folder in rows:
        with open(os.path.join(folder, "learning_curve.json")) as f:
            report = json.load(f)
        rows[folder] = report["table"] + report["training"]
    assert rows[str(rec)] == rows[str(out)]
    assert rows[str(rec)][2] == ("| babyai | grpo | 2 | 0.500 | 0.625 ± 1.588 | 2 | 10.5 | 0.900 → 0.625 ± 1.588 "
                                 "| not run |")


@pytest.mark.parametrize("name", ["learning_study", "textcraft_20turns_pilot", "textcraft_20turns_16samples",
                                  "te_upstream_recipe", "te_upstream_recipe_textcraft", "smollm2_study"])
def test_the_published_study_report_is_what_its_record_gives(tmp_path, name):
    """docs/results/<record>/learning_curve.json (and .png) is the report of the runs recorded next to it: rebuilt
    from a copy of that record by the command it names, every row of both tables comes out the same, and
    docs/RESULTS.md shows every row."""
    from tests.env_server_proc import require_venv

    record = os.path.join(ROOT, "docs", "results", name)
    with open(os.path.join(record, "learning_curve.json")) as f:
        published = json.load(f)
    args = published["args"]
    for env in args["envs"]:
        require_venv(env)
    shutil.copytree(record, tmp_path / "record")
    recipe = [flag for key in ("max_turns", "lr", "samples_per_prompt", "prompts_per_step", "micro_batch")
              if args.get(key)
              for flag in ("--" + key.replace("_", "-"), str(args[key]))]
    learning_curve.main(["--envs", *args["envs"], "--configs", *args["configs"], "--seeds", *map(str, args["seeds"]),
                         *recipe, "--out", str(tmp_path / "record"), "--report-only", "--evals"])
    with open(tmp_path / "record" / "learning_curve.json") as f:
        rebuilt = json.load(f)
    assert rebuilt["table"] == published["table"]
    assert rebuilt["training"] == published["training"]
    with open(os.path.join(ROOT, "docs", "RESULTS.md")) as f:
        markdown = f.read()
    assert [row for row in published["table"] + published["training"] if row not in markdown] == []


def test_an_unfinished_run_starts_over(tmp_path, monkeypatch):
    """A run killed mid-way left TensorBoard events; rerunning the study must not read them as part of the new run."""
    out = tmp_path / "grpo_seed0"
    (out / "tb").mkdir(parents=True)
    (out / "tb" / "events.out.tfevents.stale").write_text("from the killed run")
    seen = []

    def fake_train(cmd, log=None, env=None):
        seen.append(sorted(str(p.relative_to(out)) for p in out.rglob("*")))
        return 0

    monkeypatch.setattr(learning_curve, "run_child", fake_train)
    args = type("Args", (), {"steps": 2, "eval_every": 1, "lr": None, "samples_per_prompt": None,
                             "prompts_per_step": None, "micro_batch": None, "gradient_checkpointing": False})()
    learning_curve.run_one("babyai", "grpo", 0, str(tmp_path / "start"), str(out), 3, args)
    assert seen == [["recipe.json", "train.log"]]


@pytest.fixture
def trained_without_training(tmp_path, monkeypatch) -> list:
    """The study with each run's trainer, evals, report and gateway replaced: a run "trains" by leaving its
    summary.json; the list collects each trainer command."""
    commands = []

    def fake_train(cmd, log=None, env=None):
        commands.append(cmd)
        os.makedirs(os.path.join(cmd[cmd.index("--ckpt.path") + 1]))
        with open(os.path.join(cmd[cmd.index("--ckpt.path") + 1], "summary.json"), "w") as f:
            json.dump({}, f)
        return 0

    monkeypatch.setattr(learning_curve, "run_child", fake_train)
    monkeypatch.setattr(learning_curve, "evaluate", lambda *a, **k: {})
    monkeypatch.setattr(learning_curve, "warm_start", lambda env, out, args: str(tmp_path / env / "warm_start"))
    monkeypatch.setattr("scripts.run_report.main", lambda argv: None)
    monkeypatch.setattr(learning_curve, "read_run", lambda out: {"eval": {0: 0.1}, "step_s": [1.0], "train": {}})
    monkeypatch.setattr("cope_rlhf.local.env_stack.EnvStack", NoStack)
    return commands


@pytest.mark.parametrize("flags, changed", [
    ([], {}),
    (["--lr", "3e-4", "--samples-per-prompt", "16", "--prompts-per-step", "4"],
     {"--actor.adam.lr": "0.0003", "--rollout.n_samples_per_prompt": "16", "--rollout.batch_size": "4"}),
    (["--micro-batch", "2"], {"--train.micro_batch_size": "2", "--rollout.micro_batch_size": "2"})])
def test_recipe_flags_replace_the_recipe_value_and_nothing_else(tmp_path, trained_without_training, flags, changed):
    """--lr, --samples-per-prompt, --prompts-per-step and --micro-batch reach the trainer in place of RECIPE's value
    (one value per flag: the trainer would take the last of two), and every other flag of the run is the recipe's."""
    commands = trained_without_training
    learning_curve.main(["--envs", "textcraft", "--configs", "grpo", "--seeds", "0", "--steps", "1", "--out",
                         str(tmp_path), *flags])
    (cmd,) = commands
    recipe = dict(zip(learning_curve.RECIPE, learning_curve.RECIPE[1:]))
    pairs = flag_pairs(cmd[3:])
    for flag in recipe:
        if flag.startswith("--") and not recipe[flag].startswith("--"):
            assert [p for p in pairs if p.split()[0] == flag] == [f"{flag} {changed.get(flag, recipe[flag])}"]


def test_gradient_checkpointing_reaches_every_run_and_is_not_a_recipe(tmp_path, trained_without_training):
    """--gradient-checkpointing puts OpenRLHF's --actor.gradient_checkpointing_enable on each run's trainer; it
    changes memory, not what trains, so recipe.json leaves it out and a study may resume without it."""
    trained = trained_without_training
    study = ["--envs", "textcraft", "--configs", "grpo", "--steps", "1", "--out", str(tmp_path / "out")]
    learning_curve.main([*study, "--seeds", "0", "--gradient-checkpointing"])
    learning_curve.main([*study, "--seeds", "1"])
    assert ["--actor.gradient_checkpointing_enable" in cmd for cmd in trained] == [True, False]
    with open(tmp_path / "out" / "textcraft" / "grpo_seed0" / "recipe.json") as f:
        assert "--actor.gradient_checkpointing_enable" not in json.load(f)["recipe"]


@pytest.mark.parametrize("steps, played", [(2, 8), (3, 10)])
def test_a_study_shorter_than_its_held_out_items_evaluates_the_first_it_can(tmp_path, trained_without_training,
                                                                            steps, played):
    """OpenRLHF reads at most --steps x --prompts-per-step held-out items (the trainer refuses more): a shorter
    study's runs evaluate the first that many while they train; a longer one's the warm start's whole file."""
    commands = trained_without_training
    data = tmp_path / "babyai" / "warm_start" / "data"
    data.mkdir(parents=True)
    items = [json.dumps({"item": i}) + "\n" for i in range(10)]
    (data / "heldout.jsonl").write_text("".join(items))
    learning_curve.main(["--envs", "babyai", "--configs", "grpo", "--seeds", "0", "--steps", str(steps),
                         "--prompts-per-step", "4", "--samples-per-prompt", "8", "--out", str(tmp_path)])
    (cmd,) = commands
    with open(cmd[cmd.index("--eval.dataset") + 1]) as f:
        assert f.readlines() == items[:played]


def test_a_study_refuses_to_add_runs_trained_another_way(tmp_path, trained_without_training, capsys):
    """Each run keeps the recipe it trained with (recipe.json, copied by --record); a command that would add a run
    trained at another learning rate or turn limit is refused before anything trains, naming the flag and both
    values; the study's own values, however written, add the run."""
    trained = trained_without_training
    study = ["--envs", "textcraft", "--configs", "grpo", "--steps", "1", "--out", str(tmp_path / "out")]
    learning_curve.main([*study, "--seeds", "0", "--lr", "3e-4", "--record", str(tmp_path / "record")])
    with open(tmp_path / "record" / "textcraft" / "grpo_seed0" / "recipe.json") as f:
        kept = json.load(f)
    assert kept["max_turns"] == learning_curve.TURNS["textcraft"]
    assert kept["recipe"] == trained[0][trained[0].index("--algo.advantage.estimator"):]  # grpo: no CoPE switch
    assert "--actor.adam.lr 0.0003" in flag_pairs(kept["recipe"])

    for other, message in ((["--seeds", "1"], "--actor.adam.lr 0.0003 there, 1e-4 now"),
                           (["--seeds", "1", "--lr", "3e-4", "--max-turns", "20"], "--max-turns 10 there, 20 now"),
                           (["--seeds", "1", "--lr", "3e-4", "--micro-batch", "2"],
                            "--train.micro_batch_size 8 there, 2 now")):
        with pytest.raises(SystemExit, match="trained another way") as refused:
            learning_curve.main([*study, *other])
        assert message in str(refused.value) and "grpo_seed0" in str(refused.value)
    assert len(trained) == 1
    learning_curve.main([*study, "--seeds", "1", "--lr", "0.0003"])
    assert len(trained) == 2 and "--actor.adam.lr 0.0003" in flag_pairs(trained[1])

    # the recipe's own value written out is the recipe: a study at the default learning rate takes --lr 1e-4 too
    default = ["--envs", "textcraft", "--configs", "grpo", "--steps", "1", "--out", str(tmp_path / "default")]
    learning_curve.main([*default, "--seeds", "0"])
    learning_curve.main([*default, "--seeds", "1", "--lr", "0.0001"])
    assert len(trained) == 4
    # a run recorded before recipe.json existed cannot be checked: said, not refused
    os.remove(tmp_path / "default" / "textcraft" / "grpo_seed0" / "recipe.json")
    (tmp_path / "default" / "textcraft" / "warm_start").mkdir()  # the warm start's evals: not a run
    (tmp_path / "default" / "textcraft" / "warm_start" / "run_record.json").write_text('{"evals": {}}')
    learning_curve.main([*default, "--seeds", "2"])
    assert "textcraft: grpo_seed0 recorded no recipe.json" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--lr", "0"], ["--samples-per-prompt", "4", "--prompts-per-step", "4"],
                                   ["--micro-batch", "3"], ["--micro-batch", "0"]])
def test_recipe_flags_that_the_trainer_cannot_run_are_refused(tmp_path, flags, capsys):
    with pytest.raises(SystemExit):
        learning_curve.main(["--envs", "textcraft", "--out", str(tmp_path), *flags])
    assert "--train.batch_size 32" in capsys.readouterr().err


@pytest.mark.parametrize("flags, changed", [
    ([], {}),
    (["--base-model", "tests", "--sft-lr", "2e-5", "--sft-epochs", "2", "--sft-demos", "64",
      "--gradient-checkpointing"],
     {"--base-model": "tests", "--sft-lr": "2e-05", "--epochs": "2", "--demos": "64",
      "--sft-gradient-checkpointing": None})])
def test_a_base_model_and_its_sft_settings_reach_the_warm_start_and_nothing_else(tmp_path, monkeypatch, flags,
                                                                                  changed):
    """--base-model / --sft-lr / --sft-epochs / --sft-demos / --gradient-checkpointing (a pretrained model's study,
    e.g. SmolLM2) reach prepare_warm_start.py, one value per flag, and the rest of the env's warm start is
    WARM_START's."""
    commands = []
    monkeypatch.setattr(learning_curve, "run_child", lambda cmd, log=None, env=None: commands.append(cmd) or 0)
    bare = "--gradient-checkpointing"
    valued = [f for f in flags if f != bare]
    given = dict(zip(valued[::2], valued[1::2]))
    args = argparse.Namespace(base_model=given.get("--base-model"), sft_lr=float(given.get("--sft-lr", 0)) or None,
                              sft_epochs=int(given.get("--sft-epochs", 0)) or None,
                              sft_demos=int(given.get("--sft-demos", 0)) or None,
                              gradient_checkpointing=bare in flags)
    learning_curve.warm_start("textcraft", str(tmp_path / "study"), args)
    (cmd,) = commands
    pairs = flag_pairs(cmd[cmd.index("--out") + 2:])
    expected = dict(zip(learning_curve.WARM_START["textcraft"][::2], learning_curve.WARM_START["textcraft"][1::2]))
    assert sorted(pairs) == sorted(f"{k} {v}" if v else k for k, v in {**expected, **changed}.items())


@pytest.mark.parametrize("flags, message", [
    (["--base-model", "no/such/dir"], "--base-model no/such/dir: no config.json there"),
    (["--sft-lr", "0"], "--sft-lr must be > 0, and --sft-epochs and --sft-demos >= 1"),
    (["--sft-epochs", "0"], "--sft-lr must be > 0, and --sft-epochs and --sft-demos >= 1"),
    (["--sft-demos", "0"], "--sft-lr must be > 0, and --sft-epochs and --sft-demos >= 1")])
def test_a_base_model_that_is_not_a_checkpoint_is_refused_before_anything_starts(tmp_path, flags, message, capsys):
    with pytest.raises(SystemExit):
        learning_curve.main(["--envs", "textcraft", "--out", str(tmp_path), *flags])
    assert message in capsys.readouterr().err


def test_sigterm_stops_the_study_and_what_it_started(tmp_path):
    """A scheduler's SIGTERM used to kill the study alone: its warm start (or trainer) and their env servers ran on."""
    import psutil

    from tests.env_server_proc import check_sigterm_stops, require_venv

    require_venv("babyai")
    with open(tmp_path / "study.log", "w") as log:
        study = subprocess.Popen([sys.executable, "benchmarks/learning_curve.py", "--envs", "babyai",
                                  "--configs", "grpo", "--seeds", "0", "--out", str(tmp_path / "out")],
                                 cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    started: list = []
    try:
        deadline = time.monotonic() + 240
        while not any("env_gateway.servers.babyai" in " ".join(p.cmdline()) for p in started):
            assert study.poll() is None and time.monotonic() < deadline, (tmp_path / "study.log").read_text()[-3000:]
            time.sleep(0.2)
            with contextlib.suppress(psutil.NoSuchProcess):
                started = psutil.Process(study.pid).children(recursive=True)  # the warm start and its env server
    finally:
        check_sigterm_stops(study, started)
