"""The additive claim: with every CoPE flag off, cope_rlhf.advantage gives exactly OpenRLHF's GRPO.

The reference is OpenRLHF's real `RemoteExperienceMaker.compute_advantages_and_returns` (group_norm),
run on real `Experience` objects that OpenRLHF's own `SamplesGenerator._process_response_into_experience`
builds from multi-turn agent responses and `split_rollout_samples` pads into micro-batches.
"""

import copy
import random
from types import SimpleNamespace

import pytest
import torch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from cope_rlhf.advantage import add_info_gated_advantage, cope_advantages, filter_degenerate_groups
from cope_rlhf.config import CoPEConfig

N_SAMPLES = 4
PAD_ID = 0


def make_args(kl_in_reward: bool):
    return SimpleNamespace(
        algo=SimpleNamespace(
            advantage=SimpleNamespace(estimator="group_norm", gamma=1.0, lambd=1.0, no_std_norm=False),
            kl=SimpleNamespace(use_loss=not kl_in_reward, estimator="k1"),
            dynamic_filtering_enable=False,
        ),
        rollout=SimpleNamespace(n_samples_per_prompt=N_SAMPLES, micro_batch_size=3, max_new_tokens=None),
        reward=SimpleNamespace(clip_range=None, overlong_buffer_len=None, stop_properly_penalty_coef=None),
        train=SimpleNamespace(dynamic_batch_enable=False),
        data=SimpleNamespace(max_len=64),
    )


def make_maker(kl_in_reward: bool, kl_coef: float) -> RemoteExperienceMaker:
    args = make_args(kl_in_reward)
    strategy = SimpleNamespace(args=args)
    tokenizer = SimpleNamespace(pad_token_id=PAD_ID)
    return RemoteExperienceMaker(None, None, None, None, SimpleNamespace(value=kl_coef), strategy, tokenizer)


def multi_turn_response(rng: random.Random, reward: float) -> dict:
    """The dict `MultiTurnAgentExecutor.execute` returns: prompt, then (action, feedback) turns."""
    tokens = [rng.randrange(1, 50) for _ in range(rng.randrange(3, 8))]
    ranges = []
    for _ in range(rng.randrange(1, 4)):
        start = len(tokens)
        tokens += [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
        ranges.append((start, len(tokens)))
        tokens += [rng.randrange(1, 50) for _ in range(rng.randrange(2, 5))]
    return {
        "prompt": "p", "label": "l", "observation_tokens": tokens, "action_ranges": ranges,
        "reward": reward, "scores": reward, "rollout_log_probs": None, "truncated": False, "extra_logs": {},
    }


def make_batch(seed: int, kl_in_reward: bool, degenerate_groups=(1,), groups: int = 4):
    """Micro-batched experiences (right-padded, some truncated at max_len=40) with kl set as
    `make_experience` leaves it. Groups in `degenerate_groups` get one reward for all samples."""
    rng = random.Random(seed)
    generator = object.__new__(SamplesGenerator)
    samples = []
    for g in range(groups):
        same = rng.choice([0.0, 1.0])
        for _ in range(N_SAMPLES):
            reward = same if g in degenerate_groups else rng.choice([0.0, 0.3, 1.0])
            samples.append(generator._process_response_into_experience(multi_turn_response(rng, reward), max_len=40))
    maker = make_maker(kl_in_reward, 0.0)
    batches = maker.split_rollout_samples(samples)
    torch.manual_seed(seed)
    for b in batches:
        b.kl = torch.randn(b.action_mask.shape) * 0.1 if kl_in_reward else torch.zeros(b.action_mask.shape)
    return batches


def assert_same(ours, stock):
    for a, b in zip(ours, stock):
        assert torch.equal(a.advantages, b.advantages)
        assert torch.equal(a.returns, b.returns)
        assert torch.equal(a.info["return"], b.info["return"])
        assert torch.equal(a.info["group_reward_std"], b.info["group_reward_std"])
        assert torch.equal(a.action_mask, b.action_mask)


def stock_grpo(batches, kl_in_reward, kl_coef):
    return make_maker(kl_in_reward, kl_coef).compute_advantages_and_returns(copy.deepcopy(batches))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_flags_off_equals_openrlhf_grpo(seed, kl_in_reward):
    kl_coef = 0.05 if kl_in_reward else 0.0
    batches = make_batch(seed, kl_in_reward)
    assert len(batches) > 1 and any((b.attention_mask == 0).any() for b in batches), "test needs padding"
    stock = stock_grpo(batches, kl_in_reward, kl_coef)
    ours = copy.deepcopy(batches)
    metrics = cope_advantages(ours, CoPEConfig(), N_SAMPLES, kl_coef=kl_coef)
    assert metrics == {}
    assert_same(ours, stock)
    # Padding (and anything after the last action token) carries zero advantage.
    for e in ours:
        for row in range(len(e.action_mask)):
            last = int(e.action_mask[row].nonzero().max())
            assert (e.advantages[row, last + 1 :] == 0).all()
    assert any(e.advantages.abs().sum() > 0 for e in ours)


def intrinsic_like(batches, seed):
    torch.manual_seed(seed + 100)
    return [torch.rand(b.action_mask.shape) * b.action_mask for b in batches]


@pytest.mark.parametrize("seed", range(5))
def test_info_weight_changes_advantages_on_action_tokens_only(seed):
    batches = make_batch(seed, kl_in_reward=False)
    stock = stock_grpo(batches, False, 0.0)
    ours = copy.deepcopy(batches)
    metrics = cope_advantages(ours, CoPEConfig(info_intrinsic_weight=0.1), N_SAMPLES, intrinsic_like(batches, seed))
    assert metrics["cope/info_beta_mean"] > 0 and metrics["cope/info_reward_mean"] > 0
    changed = False
    for a, b in zip(ours, stock):
        assert torch.equal(a.returns, b.returns)
        mask = b.action_mask.bool()
        assert torch.equal(a.advantages[~mask], b.advantages[~mask])  # padding and observations untouched
        changed |= not torch.equal(a.advantages[mask], b.advantages[mask])
    assert changed


@pytest.mark.parametrize("seed", range(5))
def test_filter_zeroes_exactly_the_degenerate_groups(seed):
    batches = make_batch(seed, kl_in_reward=False, degenerate_groups=(0, 2))
    stock = stock_grpo(batches, False, 0.0)
    ours = copy.deepcopy(batches)
    metrics = cope_advantages(ours, CoPEConfig(grpo_filter_degenerate=True), N_SAMPLES)
    assert metrics["cope/filtered_frac"] == 0.5
    for a, b in zip(ours, stock):
        for row, position in enumerate(a.index):
            degenerate = position // N_SAMPLES in (0, 2)
            if degenerate:
                assert not a.action_mask[row].any() and not a.advantages[row].any() and not a.returns[row].any()
            else:
                assert torch.equal(a.action_mask[row], b.action_mask[row])
                assert torch.equal(a.advantages[row], b.advantages[row])
        assert any(a.action_mask[row].any() for row in range(len(a.index))) or all(
            p // N_SAMPLES in (0, 2) for p in a.index
        )


def test_post_steps_on_top_of_stock_output():
    """How the experience maker wires it: OpenRLHF's own GRPO first, then the CoPE steps on its output."""
    batches = make_batch(7, kl_in_reward=False, degenerate_groups=(3,))
    stock = stock_grpo(batches, False, 0.0)
    ours = stock_grpo(batches, False, 0.0)
    filter_degenerate_groups(ours, N_SAMPLES)
    metrics = add_info_gated_advantage(ours, intrinsic_like(batches, 7), N_SAMPLES, weight=0.1, gate_temp=0.05)
    # beta is w*exp(-sigma/T): w for the degenerate group, smaller elsewhere.
    assert 0 < metrics["cope/info_beta_mean"] <= 0.1
    for a, b in zip(ours, stock):
        for row, position in enumerate(a.index):
            if position // N_SAMPLES == 3:
                assert not a.advantages[row].any()  # filtered before the info term: stays out
            else:
                assert not torch.equal(a.advantages[row], b.advantages[row])


def test_beta_gate_formula():
    batches = make_batch(3, kl_in_reward=False, degenerate_groups=(0,))
    grpo = stock_grpo(batches, False, 0.0)
    intrinsic = intrinsic_like(batches, 3)
    ours = copy.deepcopy(grpo)
    add_info_gated_advantage(ours, intrinsic, N_SAMPLES, weight=0.2, gate_temp=0.5)
    values = torch.cat([x[m.bool()] for x, m in zip(intrinsic, (b.action_mask for b in batches))])
    mean, std = values.mean(), values.std(unbiased=False)
    for a, b, x in zip(ours, grpo, intrinsic):
        for row in range(len(a.index)):
            beta = 0.2 * torch.exp(-b.info["group_reward_std"][row] / 0.5)
            m = b.action_mask[row].bool()
            expected = b.advantages[row][m] + beta * (x[row][m] - mean) / std
            torch.testing.assert_close(a.advantages[row][m], expected)


def test_single_sample_groups_rejected():
    batches = make_batch(0, kl_in_reward=False)
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        cope_advantages(batches, CoPEConfig(), 1)
