"""The additive claim, on the production path: with every CoPE flag off, ``CoPEExperienceMaker`` followed by
``CoPEActorPPOTrainer`` (through ``CoPEPolicyModelActor.append`` and OpenRLHF's own ``ppo_train``) gives
experiences, advantages, returns, losses and updated weights ``torch.equal`` to stock OpenRLHF's
``RemoteExperienceMaker`` followed by ``ActorPPOTrainer``, over several seeds, with the KL in the loss and in the
reward. A non-zero information-gain weight changes advantages and weights.

What runs: OpenRLHF's real experience maker against OpenRLHF's ``RayActorGroup`` of CPU stand-in model actors
(tests/ray_cpu_groups.py: DeepSpeed cannot start without CUDA), on multi-turn experiences made by OpenRLHF's own
``SamplesGenerator``; then OpenRLHF's real ``ppo_train`` / ``training_step`` / ``PolicyLoss`` / replay buffer with a
stand-in strategy (plain torch SGD, one rank).
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
from openrlhf.utils.config import hierarchize

from cope_rlhf.actor import CoPEActorPPOTrainer, CoPEPolicyModelActor
from cope_rlhf.cli.args import build_parser
from cope_rlhf.experience_maker import CoPEExperienceMaker
from tests.conftest import ROOT
from tests.ray_cpu_groups import StandInStrategy
from tests.test_actor import make_trainer, params
from tests.test_experience_maker import EPISODES, assert_same_experiences
from tests.tiny_hf import agent_response, to_experience

N = 4
GROUPS = 3
KL_COEF = 0.01
KL_MODES = {"kl_in_reward": ["--algo.kl.init_coef", str(KL_COEF)],
            "kl_in_loss": ["--algo.kl.init_coef", str(KL_COEF), "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]}

pytestmark = pytest.mark.timeout(600)


def cli_args(kl_mode: str, *cope: str):
    args = hierarchize(build_parser().parse_args(
        ["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(N),
         "--rollout.micro_batch_size", "4", "--train.micro_batch_size", "4",
         "--train.agent_func_path", os.path.join(ROOT, "agent_funcs", "babyai.py"), *KL_MODES[kl_mode], *cope]))
    args.actor.eps_clip_low_high = (args.actor.eps_clip, args.actor.eps_clip)  # as OpenRLHF's CLI sets it
    return args


@pytest.fixture(scope="module")
def group_args():
    return cli_args("kl_in_reward")


@pytest.fixture
def on_cpu(monkeypatch):
    """ppo_train moves batches to torch.cuda.current_device(); here that is the CPU."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def rollout(tok, seed: int) -> list:
    """GROUPS prompt groups of N fresh Experiences; group 1 degenerate (all failed), the others mixed."""
    rng = random.Random(seed)
    out = []
    for g in range(GROUPS):
        rewards = [0.0] * N if g == 1 else rng.sample([1.0, 0.0] + [rng.choice([0.0, 1.0]) for _ in range(N - 2)], N)
        for r in rewards:
            out.append(to_experience(agent_response(tok, *rng.choice(EPISODES), reward=r)))
    return out


def run(maker_cls, trainer_cls, groups, tok, model_dir, args, seed, monkeypatch):
    """One production step: the maker's experiences, then the actor's PPO update on them; also the replay buffer's items
    it trained on (the info term joins their advantages in the actor)."""
    actor_group, ref_group = groups
    maker = maker_cls(actor_group, None, None, ref_group, FixedKLController(KL_COEF), StandInStrategy(args), tok)
    experiences = maker.make_experience_batch(rollout(tok, seed))
    trainer = make_trainer(trainer_cls, args, model_dir, tok, monkeypatch)
    for e in copy.deepcopy(experiences):  # PolicyModelActor.append (CoPE's takes its samples out first)
        if trainer_cls is CoPEActorPPOTrainer:
            holder = object.__new__(CoPEPolicyModelActor.__ray_actor_class__)
            holder.trainer = trainer
            holder.append(e)
        else:
            trainer.replay_buffer.append(e)
    torch.manual_seed(seed)  # the replay buffer's DataLoader shuffles
    status = trainer.ppo_train(KL_COEF if args.algo.kl.use_loss else 0.0)
    return experiences, status, params(trainer), trainer.replay_buffer.items


@pytest.mark.parametrize("kl_mode", sorted(KL_MODES))
@pytest.mark.parametrize("seed", range(3))
def test_flags_off_is_stock_grpo_end_to_end(groups, checkpoints, tok, monkeypatch, on_cpu, seed, kl_mode):
    args = cli_args(kl_mode)
    stock = run(RemoteExperienceMaker, ActorPPOTrainer, groups, tok, checkpoints[0], args, seed, monkeypatch)
    cope = run(CoPEExperienceMaker, CoPEActorPPOTrainer, groups, tok, checkpoints[0], args, seed, monkeypatch)
    assert_same_experiences(cope[0], stock[0])  # sequences, masks, log-probs, advantages, returns, info
    assert cope[1] == stock[1]  # every loss and metric ppo_train reports
    assert stock[1]["policy_loss"] != 0 and (kl_mode == "kl_in_reward" or stock[1]["kl"] != 0)
    assert all(torch.equal(cope[2][k], v) for k, v in stock[2].items())  # updated weights
    before = params(make_trainer(ActorPPOTrainer, args, checkpoints[0], tok, monkeypatch))
    assert any(not torch.equal(before[k], v) for k, v in stock[2].items())  # the update did move the weights
    assert any(e.advantages.abs().sum() > 0 for e in stock[0])  # not a comparison of zeros
    for e in cope[0]:  # padding, and anything after the last action token, carries no advantage
        for row in range(len(e.action_mask)):
            assert not e.advantages[row, int(e.action_mask[row].nonzero().max()) + 1 :].any()


@pytest.mark.parametrize("seed", range(2))
def test_info_gain_weight_changes_advantages_and_weights(groups, checkpoints, tok, monkeypatch, on_cpu, seed):
    stock = run(RemoteExperienceMaker, ActorPPOTrainer, groups, tok, checkpoints[0], cli_args("kl_in_loss"), seed,
                monkeypatch)
    args = cli_args("kl_in_loss", "--cope.info_intrinsic_weight", "0.1")
    cope = run(CoPEExperienceMaker, CoPEActorPPOTrainer, groups, tok, checkpoints[0], args, seed, monkeypatch)
    # the info term joins the advantages in the policy actor (start of ppo_train): compare what it trained on
    assert len(cope[3]) == len(stock[3]) > 0
    for got, want in zip(cope[3], stock[3]):
        mask = want.action_mask.bool()
        assert torch.equal(got.returns, want.returns)
        assert torch.equal(got.advantages[~mask], want.advantages[~mask])  # only action tokens move
    assert not all(torch.equal(g.advantages, w.advantages) for g, w in zip(cope[3], stock[3]))
    assert any(not torch.equal(cope[2][k], v) for k, v in stock[2].items())
