"""cope_rlhf.advantage on small hand-computed batches (after OpenRLHF's own GRPO), and fed by info_gain on a real
model."""

import math

import pytest
import torch
from openrlhf.trainer.ppo_utils.experience import Experience

from cope_rlhf.advantage import (add_info_bonus, filter_degenerate_groups, group_reward_std, info_gates,
                                 rounding_noise_frac, zero_action_mask)
from cope_rlhf.config import CoPEConfig
from cope_rlhf.frozen_signals import frozen_signals
from cope_rlhf.signal_references import add_info_gated_advantage
from tests.tiny_hf import agent_response, hf_logits_fn, stock_grpo, tiny_model, tiny_tokenizer, to_experience


def hand_batch():
    """Two groups of 2, stored out of rollout order: rows are rollout positions [2, 0] and [1, 3]."""
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    first = Experience(action_mask=mask, rewards=torch.tensor([0.0, 1.0]), kl=torch.zeros(2, 4))
    second = Experience(action_mask=mask.flip(0), rewards=torch.tensor([0.0, 0.0]), kl=torch.zeros(2, 4))
    first.index, second.index = [2, 0], [1, 3]
    return [first, second]


def test_grpo_hand_computed():
    batch = hand_batch()
    stock_grpo(batch, n=2)
    # group 0 = positions (0, 1) = rewards (1, 0): std = sqrt(0.5), advantages +-0.5/sqrt(0.5) = +-0.7071
    # group 1 = positions (2, 3) = rewards (0, 0): 0
    a = 0.5 / math.sqrt(0.5)
    assert torch.allclose(batch[0].advantages, torch.tensor([[0, 0, 0, 0], [a, a, 0, 0]]), atol=1e-6)
    assert torch.allclose(batch[1].advantages, torch.tensor([[-a, -a, 0, 0], [0, 0, 0, 0]]), atol=1e-6)
    assert torch.equal(batch[0].returns, batch[0].advantages)
    assert [s.tolist() for s in group_reward_std(batch, 2)] == [[0.0, pytest.approx(math.sqrt(0.5))],
                                                                 [pytest.approx(math.sqrt(0.5)), 0.0]]


def test_filter_hand_computed():
    """hand_batch plus a third group (positions 4, 5: rewards 1, 0): two of three groups survive, so the degenerate
    one (positions 1, 3) leaves the loss."""
    batch = hand_batch()
    third = Experience(action_mask=torch.ones(2, 4, dtype=torch.long), rewards=torch.tensor([1.0, 0.0]),
                       kl=torch.zeros(2, 4))
    third.index = [4, 5]
    batch.append(third)
    stock_grpo(batch, n=2)
    drops, metrics = filter_degenerate_groups(batch, 2)
    assert metrics == {"cope/filtered_frac": pytest.approx(1 / 3), "cope/degenerate_frac": pytest.approx(1 / 3),
                       "cope/filter_kept_batch": 0.0}
    assert [d.tolist() for d in drops] == [[True, False], [False, True], [False, False]]
    # the action mask is the policy actor's to zero (after it has built the forecast samples): zero_action_mask
    masks = [zero_action_mask(e.action_mask, d) for e, d in zip(batch, drops)]
    assert masks[0].tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    assert masks[1].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert masks[2].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]


def test_with_one_surviving_group_the_filter_keeps_the_batch_whole():
    """hand_batch: one of two groups survives, fewer than max(2, 10%): no sample leaves the loss (the survivor is
    averaged with the batch instead of taking a full step alone), and the degenerate group's advantages are still
    zeroed (its exact GRPO advantage)."""
    batch = hand_batch()
    stock_grpo(batch, n=2)
    drops, metrics = filter_degenerate_groups(batch, 2)
    assert metrics == {"cope/filtered_frac": 0.0, "cope/degenerate_frac": 0.5, "cope/filter_kept_batch": 1.0}
    assert [d.tolist() for d in drops] == [[False, False], [False, False]]
    assert not batch[0].advantages[0].any() and not batch[1].advantages[1].any()
    assert batch[0].advantages[1].abs().sum() > 0 and batch[1].advantages[0].abs().sum() > 0


@pytest.mark.parametrize("groups,surviving,kept_whole", [(8, 0, True), (8, 1, True), (8, 2, False), (8, 8, False),
                                                         (30, 2, True), (30, 3, False), (64, 6, True), (64, 7, False)])
def test_the_filter_keeps_the_whole_batch_when_fewer_than_max_2_or_10_percent_of_the_groups_survive(
        groups, surviving, kept_whole):
    n = 4
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0] if g < surviving else [1.0] * n for g in range(groups)]).reshape(-1)
    batch = [Experience(action_mask=torch.ones(groups * n, 2, dtype=torch.long), rewards=rewards,
                        kl=torch.zeros(groups * n, 2))]
    batch[0].index = list(range(groups * n))
    stock_grpo(batch, n=n)
    drops, metrics = filter_degenerate_groups(batch, n)
    degenerate = (groups - surviving) / groups
    assert metrics == {"cope/filtered_frac": pytest.approx(0.0 if kept_whole else degenerate),
                       "cope/degenerate_frac": pytest.approx(degenerate), "cope/filter_kept_batch": float(kept_whole)}
    assert int(drops[0].sum()) == (0 if kept_whole else (groups - surviving) * n)
    assert not batch[0].advantages[surviving * n:].any()  # degenerate groups: advantage 0 either way


def test_stock_group_norm_turns_equal_babyai_wins_into_a_full_scale_advantage_and_the_filter_removes_it():
    """BabyAI pays 1 - 0.9 * steps / max_steps for a win, so eight winners of one item that took the same path
    score the same non-dyadic float (0.951 = 1 - 0.9 * 3.5 / 64 is one). OpenRLHF's group_norm divides float32
    rounding (mean - r ~ 1e-8) by std + 1e-9 (~1e-8): every one of the eight gets the same advantage of about
    -0.93 (the sign is fixed by the reward value), a full-scale push against the winning behaviour. The
    degenerate-group filter (std <= 1e-6) zeroes it (docs/METHOD.md, "Degenerate-group filter")."""
    mask = torch.ones(8, 3, dtype=torch.long)
    for reward, sign in ((0.951, -1), (0.9325, +1)):
        batch = [Experience(action_mask=mask.clone(), rewards=torch.full((8,), reward), kl=torch.zeros(8, 3))]
        batch[0].index = list(range(8))
        stock_grpo(batch, n=8)
        assert torch.allclose(batch[0].advantages, torch.full((8, 3), sign * 0.93), atol=0.01)  # not 0
        assert rounding_noise_frac(batch, 8) == 1.0
        drops, metrics = filter_degenerate_groups(batch, 8)
        assert metrics["cope/degenerate_frac"] == 1.0 and not batch[0].advantages.any()
        assert metrics["cope/filter_kept_batch"] == 1.0 and not drops[0].any()  # no group survives: the batch stays


def test_in_the_studys_batch_a_group_of_equal_wins_gets_the_clip_bound_and_moves_the_mean_return_by_1_25():
    """The study's batch is 8 items x 8 samples. Row-wise in that (8, 8) layout float32 gives eight equal wins of
    0.915625 (a reward the warm start scores on BabyAI) a std of exactly 0 and a mean one rounding step off, so
    group_norm's advantage is -2**-24 / 1e-9 = -59.6; OpenRLHF's default ``--reward.clip_range`` (-10, 10) cuts it
    to -10 for each of the eight. The other groups' advantages sum to 0, so the batch's mean return (what
    ``train/return`` logs) is -10 * 8 / 64 = -1.25: the steps of 1.25 that every config's curve moves in
    (docs/results/learning_curve_babyai_signals.md). The filter zeroes the group."""
    generator = torch.Generator().manual_seed(0)
    rewards = (torch.rand(8, 8, generator=generator) < 0.5).float() * 0.9
    rewards[:, 0], rewards[:, 1] = 0.0, 0.9  # every other group has a win and a loss: std > 0, advantages sum to 0
    rewards[3] = 0.915625
    batch = [Experience(action_mask=torch.ones(64, 3, dtype=torch.long), rewards=rewards.reshape(-1),
                        kl=torch.zeros(64, 3))]
    batch[0].index = list(range(64))
    stock_grpo(batch, n=8, reward_clip=(-10, 10))
    returns = batch[0].info["return"]
    assert returns[24:32].tolist() == [-10.0] * 8  # the clip bound, not a group's ~0.9
    assert returns.abs().max().item() == 10.0 and (returns.abs() < 2.7).sum().item() == 56
    assert returns.mean().item() == pytest.approx(-1.25, abs=1e-5)
    filter_degenerate_groups(batch, 8)
    assert not batch[0].advantages[24:32].any()


def test_rounding_noise_frac_counts_only_equal_groups_with_an_inexact_mean():
    rewards = [0.951] * 8 + [1.0] * 8 + [0.0] * 7 + [1.0] + [0.25] * 8  # rounding, exact, mixed, exact (dyadic)
    batch = [Experience(action_mask=torch.ones(32, 2, dtype=torch.long), rewards=torch.tensor(rewards))]
    batch[0].index = list(range(32))
    assert rounding_noise_frac(batch, 8) == 0.25


def test_filter_with_info_gain_removes_the_extrinsic_term_only():
    """With the KL in the reward, a degenerate group still has non-zero returns and advantages (-kl_coef * kl); the
    filter zeroes them but keeps the action mask, so that the intrinsic term can train the group."""
    batch = hand_batch()
    for e in batch:
        e.kl = torch.full((2, 4), 0.5)
    stock_grpo(batch, n=2, kl_coef=0.1)
    assert batch[0].advantages[0].abs().sum() > 0  # position 2: degenerate group 1, KL only
    masks = [e.action_mask.clone() for e in batch]
    assert filter_degenerate_groups(batch, 2)[1]["cope/degenerate_frac"] == 0.5
    assert [e.action_mask.tolist() for e in batch] == [m.tolist() for m in masks]  # the maker leaves the masks
    assert not batch[0].advantages[0].any() and not batch[1].advantages[1].any() and not batch[0].returns[0].any()
    assert batch[0].advantages[1].abs().sum() > 0  # the mixed group keeps its GRPO advantage


def test_info_gate_opens_where_grpo_is_silent():
    batch = hand_batch()
    stock_grpo(batch, n=2)
    intrinsic = [torch.tensor([[0, 1.0, 3.0, 0], [2.0, 2.0, 0, 0]]), torch.tensor([[1.0, 0.0, 0, 0], [0, 0, 0, 0]])]
    reference = [Experience(action_mask=e.action_mask, advantages=e.advantages.clone()) for e in batch]
    # the trainer's split: the gates from the maker, the bonus per sample in the actor with the batch's mean and std
    values = torch.tensor([1.0, 3.0, 2.0, 2.0, 1.0, 0.0, 0.0, 0.0])  # the 8 action tokens
    betas = info_gates(batch, 2, weight=0.1, gate_temp=0.05)
    for e, x, beta in zip(batch, intrinsic, betas):
        for b in range(len(x)):
            e.advantages[b] = add_info_bonus(e.advantages[b], x[b], e.action_mask[b], beta[b], float(values.mean()),
                                             float(values.std(unbiased=False)))
    normed = lambda x: (x - values.mean()) / values.std(unbiased=False)  # noqa: E731
    # degenerate group (std 0): beta = w; the other: w * exp(-0.7071 / 0.05), about 7e-8
    assert batch[0].advantages[0, 1].item() == pytest.approx(0.1 * normed(1.0).item(), abs=1e-6)
    assert batch[0].advantages[0, 0].item() == 0.0 and batch[0].advantages[0, 3].item() == 0.0
    small = 0.1 * math.exp(-math.sqrt(0.5) / 0.05)
    assert float(torch.cat(betas).mean()) == pytest.approx((0.1 + small) / 2, rel=1e-5)
    # the whole-batch reference (cope_rlhf/signal_references.py) gives the same advantages
    for r, e in zip(reference, batch):
        r.rewards, r.index = e.rewards, e.index
    metrics = add_info_gated_advantage(reference, intrinsic, 2, weight=0.1, gate_temp=0.05)
    for r, e in zip(reference, batch):
        torch.testing.assert_close(r.advantages, e.advantages)
    assert metrics["cope/info_reward_mean"] == pytest.approx(float(values.mean()))


def test_bad_inputs_are_explained():
    batch = hand_batch()
    stock_grpo(batch, 2)
    with pytest.raises(ValueError, match="does not match action_mask"):
        add_info_gated_advantage(batch, [torch.zeros(2, 3), torch.zeros(2, 3)], 2, 0.1, 0.05)
    with pytest.raises(ValueError, match=r"^4 samples do not split into groups of n_samples_per_prompt=3$"):
        group_reward_std(hand_batch(), 3)
    with pytest.raises(ValueError, match=r"^group statistics need n_samples_per_prompt >= 2, got 1$"):
        group_reward_std(hand_batch(), 1)


# float32 rewards [0, AT_THRESHOLD] have an unbiased std of exactly float32(1e-6)
AT_THRESHOLD = 1.4142135569272796e-06


def test_the_filter_drops_groups_up_to_a_std_of_1e_6_and_keeps_the_rest():
    """The threshold is std_g r <= 1e-6 (unbiased std of the group's rewards): [0, 1e-6] has std 7.1e-7 and goes,
    [0, AT_THRESHOLD] has std 1e-6 and goes, [0, 2e-6] has std 1.4e-6 and stays, as does [0, 1]. ``rounding_noise_frac``
    counts a group with the same bound."""
    rewards = torch.tensor([0.0, 1e-6, 0.0, AT_THRESHOLD, 0.0, 2e-6, 0.0, 1.0])
    assert float(rewards[2:4].std()) == float(torch.tensor(1e-6))
    batch = [Experience(action_mask=torch.ones(8, 2, dtype=torch.long), rewards=rewards, kl=torch.zeros(8, 2))]
    batch[0].index = list(range(8))
    assert rounding_noise_frac(batch, 2) == pytest.approx(2 / 4)  # the first two: equal within 1e-6, not to the mean
    stock_grpo(batch, n=2)
    drops, metrics = filter_degenerate_groups(batch, 2)
    assert drops[0].tolist() == [True] * 4 + [False] * 4 and metrics["cope/filtered_frac"] == pytest.approx(0.5)
    assert batch[0].advantages[4:6].abs().sum() > 0 and batch[0].advantages[:4].abs().sum() == 0


def test_advantage_edits_build_no_autograd_graph():
    """The filter and the info bonus change experience tensors in place of OpenRLHF's: no graph is kept on them
    (tensors that require grad in, plain tensors out)."""
    batch = hand_batch()
    stock_grpo(batch, 2)
    for e in batch:
        e.advantages.requires_grad_(True)
    filter_degenerate_groups(batch, 2)
    assert not any(e.advantages.requires_grad for e in batch)
    advantages = torch.zeros(2, 4, requires_grad=True)
    out = add_info_bonus(advantages, torch.ones(2, 4), torch.ones(2, 4), torch.ones(2, 1), 0.0, 1.0)
    assert not out.requires_grad and out.sum() == 8


def test_intrinsic_from_info_gain_end_to_end():
    tok = tiny_tokenizer()
    obs = ["Go to the red ball.", "You see a door.", "The door opens.", "Done."]
    acts = ["Action:\nlook around", "Action:\nopen door", "Action:\ngo to red ball 1"]
    episodes = [to_experience(agent_response(tok, obs[: 2 + i % 2], acts[: 1 + i % 2], reward=1.0)) for i in range(4)]
    batch = Experience.concat_experiences(episodes, tok.pad_token_id)
    batch.index, batch.kl = [0, 1, 2, 3], torch.zeros(batch.action_mask.shape)
    (intrinsic, _, info_metrics), _ = frozen_signals(
        hf_logits_fn(tiny_model(len(tok))), batch.sequences, batch.attention_mask, batch.action_mask, CoPEConfig(),
        info_gain=True,
    )
    assert info_metrics["cope/info_turns_scored"] == 2
    stock_grpo([batch], 2)
    metrics = add_info_gated_advantage([batch], [intrinsic], 2, weight=0.1, gate_temp=0.05)
    # all rewards equal: GRPO gives zero, the info term alone moves the action tokens
    assert metrics["cope/info_beta_mean"] == pytest.approx(0.1)
    mask = batch.action_mask.bool()
    assert batch.advantages[mask].abs().min() > 0 and not batch.advantages[~mask].any()
