"""The additive claim on the single-machine path: with every CoPE flag off, ``LocalLoop.update`` (CoPE's experience
maker and actor trainer) gives exactly what OpenRLHF's stock ``RemoteExperienceMaker`` + ``ActorPPOTrainer``
give in the same loop — advantages, returns, the logged losses, and the updated weights (``torch.equal``) — with
the KL in the loss (reference model on) and in the reward; and a CoPE flag does change them.

Rollouts here are multi-turn agent responses converted by OpenRLHF's own SamplesGenerator conversion (no engine:
the update half is what differs between the two), on a tiny model built in-process (tests/tiny_hf.py).
Also: the local CLI's argument checks give clear errors.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

from tests.tiny_hf import agent_response, tiny_model, to_experience

N = 4
EPISODES = [
    (["Go to the red ball.", "You see a red ball 1.", "You completed the goal."],
     ["Thought:\nlook.\n\nAction:\nturn left", "Action:\ngo to red ball 1"]),
    (["Pick up the key.", "Invalid action.", "You see a blue key.", "Done."],
     ["Action:\npick key", "Action:\nlook around", "Action:\npick up key"]),
    (["Open the door.", "The door opens."], ["Action:\ntoggle and go through door"]),
]
# Prompt groups: mixed, all failed (degenerate), mixed.
REWARDS = [0.9, 0.0, 0.6, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.8, 0.8, 0.1]


def rollout(tok):
    return [to_experience(agent_response(tok, *EPISODES[(i // N + i) % len(EPISODES)], reward=r))
            for i, r in enumerate(REWARDS)]


def local_args(*extra):
    from cope_rlhf.local.trainer import parse_args

    return parse_args(["--env", "babyai", "--actor.model_name_or_path", "unused", "--data.prompt_dataset", "unused",
                       "--rollout.batch_size", "3", "--rollout.n_samples_per_prompt", str(N),
                       "--rollout.micro_batch_size", "4", "--train.micro_batch_size", "4", "--actor.adam.lr", "0.01",
                       "--local.device", "cpu", *extra])


def run_update(args, tok, model_dir, stock: bool):
    from cope_rlhf.local.trainer import LocalLoop

    kwargs = dict(maker_cls=RemoteExperienceMaker, trainer_cls=ActorPPOTrainer) if stock else {}
    loop = LocalLoop(args, tok, model_dir, **kwargs)
    torch.manual_seed(0)  # the replay buffer's DataLoader shuffles
    experiences, status = loop.update(rollout(tok))
    return experiences, status, loop.policy.actor.model.state_dict()


KL_SETTINGS = {
    "kl_in_loss": ["--algo.kl.init_coef", "0.01", "--algo.kl.use_loss", "--algo.kl.estimator", "k3"],
    "kl_in_reward": ["--algo.kl.init_coef", "0.01"],
    "no_kl": ["--algo.kl.init_coef", "0"],
}


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # InProcessGroup hands results via ray.put
    yield
    ray.shutdown()


@pytest.mark.parametrize("kl", sorted(KL_SETTINGS))
def test_flags_off_equals_stock_openrlhf(kl, tok, model_dir, ray_session):
    args = local_args(*KL_SETTINGS[kl])
    stock_exp, stock_status, stock_weights = run_update(copy.deepcopy(args), tok, model_dir, stock=True)
    cope_exp, cope_status, cope_weights = run_update(copy.deepcopy(args), tok, model_dir, stock=False)
    assert len(stock_exp) == len(cope_exp) == 3
    for s, c in zip(stock_exp, cope_exp):
        for name in ("advantages", "returns", "action_mask", "action_log_probs"):
            assert torch.equal(getattr(s, name), getattr(c, name)), name
    assert any(e.advantages.abs().sum() > 0 for e in stock_exp)  # not a comparison of zeros
    assert stock_status.keys() == cope_status.keys() and not any(k.startswith("cope/") for k in cope_status)
    for key in ("policy_loss", "kl", "actor_lr", "actor_grad_norm", "return"):
        assert stock_status[key] == cope_status[key], key
    assert all(torch.equal(stock_weights[k], cope_weights[k]) for k in stock_weights)
    initial = tiny_model(len(tok), layers=2).state_dict()
    assert any(not torch.equal(initial[k], stock_weights[k]) for k in initial)  # the update did move the weights


def test_a_flag_changes_the_update(tok, model_dir, ray_session):
    args = local_args(*KL_SETTINGS["no_kl"])
    stock_exp, _, stock_weights = run_update(copy.deepcopy(args), tok, model_dir, stock=True)
    on_exp, status, on_weights = run_update(local_args("--cope.info_intrinsic_weight", "0.1", "--algo.kl.init_coef", "0"),
                                            tok, model_dir, stock=False)
    assert status["cope/info_beta_mean"] > 0
    assert not all(torch.equal(s.advantages, c.advantages) for s, c in zip(stock_exp, on_exp))
    assert any(not torch.equal(stock_weights[k], on_weights[k]) for k in stock_weights)


def test_filter_everything_skips_ppo_but_trains_forecast(tok, model_dir, ray_session):
    """Every group degenerate + the filter: OpenRLHF's ppo_train would divide by zero action tokens; the loop
    skips the PPO step and still runs the forecast step."""
    from cope_rlhf.local.trainer import LocalLoop

    loop = LocalLoop(local_args("--cope.grpo_filter_degenerate", "--cope.action_forecast_enable",
                                "--cope.action_forecast_gate", "all", "--algo.kl.init_coef", "0"), tok, model_dir)
    samples = [to_experience(agent_response(tok, *EPISODES[i % len(EPISODES)], reward=0.0)) for i in range(12)]
    before = {k: v.clone() for k, v in loop.policy.actor.model.state_dict().items()}
    _, status = loop.update(samples)
    assert status["ppo_skipped"] == 1.0 and status["cope/filtered_frac"] == 1.0
    assert status["cope/forecast_samples_trained"] > 0
    after = loop.policy.actor.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("extra, message", [
    (["--algo.advantage.estimator", "gae"], "no critic"),
    (["--rollout.n_samples_per_prompt", "1"], "n_samples_per_prompt must be >= 2"),
    (["--train.batch_size", "5"], "must be a multiple"),
    (["--cope.te_enable", "--algo.advantage.estimator", "rloo"], "group_norm"),
])
def test_bad_flags_exit_with_a_clear_message(extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        local_args(*extra)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_filter_keeps_whole_accumulation_windows(tok, model_dir, ray_session):
    """The filter drops one group of three (8 samples left, micro-batch 4): one optimizer step over the two
    micro-batches that remain, PPO and forecast both run."""
    from cope_rlhf.local.trainer import LocalLoop

    loop = LocalLoop(local_args("--cope.grpo_filter_degenerate", "--cope.action_forecast_enable",
                                "--cope.action_forecast_gate", "all", "--algo.kl.init_coef", "0"), tok, model_dir)
    steps = []
    step = loop.optimizer.step
    loop.optimizer.step = lambda *a, **k: steps.append(1) or step(*a, **k)
    _, status = loop.update(rollout(tok))
    assert loop.strategy.accumulated_gradient == 2 and "ppo_skipped" not in status
    assert status["cope/filtered_frac"] == pytest.approx(4 / 12) and torch.isfinite(torch.tensor(status["policy_loss"]))
    # one PPO step, then one forecast step per SFT mini-batch (default: train.batch_size samples)
    forecast_steps = math.ceil(status["cope/forecast_samples_trained"] / loop.args.train.batch_size)
    assert status["cope/forecast_optimizer_steps"] == forecast_steps >= 1 and len(steps) == 1 + forecast_steps
