"""GRPO advantages, the info-gated advantage, and the degenerate-group filter, on OpenRLHF ``Experience`` lists.

Groups: OpenRLHF sets ``experience.index`` to the samples' positions in the rollout; position ``i`` belongs
to prompt group ``i // n`` (``n = rollout.n_samples_per_prompt``).

GRPO itself is OpenRLHF's (``RemoteExperienceMaker.compute_advantages_and_returns``, ``group_norm``), run before
anything here:
    r'_i = (r_i - mean_g r) / (std_g r + 1e-9)           (std unbiased, over the group's n samples)
    per-token reward = r'_i at the sample's last action token, minus kl_coef * kl (OpenRLHF's compute_reward)
    returns_t = sum_{t' >= t} action_mask_t' * reward_t'  (gamma = 1);  advantages = returns

Info-gated advantage, on action tokens only (``info_gates`` in the experience maker, ``add_info_bonus`` in the
policy actor, once the batch's intrinsic rewards are known on every rank):
    A = A_GRPO + beta_g * Â_intr,   beta_g = w * exp(-sigma_g / T),   sigma_g = std_g r
    Â_intr = (x - mean x) / std x over every action token of the batch (x = per-token intrinsic reward)
The gate opens fully where a group's samples all scored the same, i.e. where GRPO gives no gradient.

Rounding in stock group_norm: a group of equal rewards that are not exact in binary (BabyAI's 1 - 0.9 * steps /
max_steps) can have a float32 mean one rounding step off the value while std_g r is 0 or ~1e-8, so every sample of
the group gets the same advantage of up to +-60. ``rounding_noise_frac`` finds those groups (the experience maker
warns about them when the filter below is off); the filter zeroes them.

Degenerate-group filter: samples of groups with std_g r <= 1e-6 get action_mask, advantages and returns
zeroed, so they leave the numerator and the denominator of the token-mean loss (advantages and returns in the
experience maker, the action mask in the policy actor, after it has built their forecast samples). Unless fewer than
max(2, 10% of the batch's groups) survive (upstream's rule): then the whole batch stays in the loss, the degenerate
groups with advantages and returns zeroed (their exact GRPO advantage) and their action mask kept, so that one
surviving group is averaged with the batch instead of taking a full optimizer step on its own (OpenRLHF normalizes
the loss by the rows left in it: one group of 8 would weigh as much as a batch of 64). With
information gain on too, the filter removes only the extrinsic term of those groups: advantages and returns are
zeroed (OpenRLHF's group_norm would leave rounding noise there, e.g. +-0.83 for eight equal rewards of 0.1), the
action mask stays, and the info term, whose gate beta_g = w is fully open exactly there, is their whole advantage. (Zeroing the
mask as well would switch information gain off: in the groups that survive a binary reward, sigma_g >= 0.35,
so beta_g <= w * e^-7.)
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Sequence, Tuple

import torch

DEGENERATE_STD = 1e-6


def _grouped_rewards(experiences: Sequence, n: int) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
    """Rewards as (groups, n) in rollout order, the flat index of each experience row, rows per experience."""
    if n < 2:
        raise ValueError(f"group statistics need n_samples_per_prompt >= 2, got {n}")
    sizes = [len(e.index) for e in experiences]
    index = torch.tensor(list(itertools.chain.from_iterable(e.index for e in experiences)))
    flat = torch.cat([e.rewards for e in experiences])
    if flat.numel() % n:
        raise ValueError(f"{flat.numel()} samples do not split into groups of n_samples_per_prompt={n}")
    ordered = torch.empty_like(flat)
    ordered[index] = flat
    return ordered.reshape(-1, n), index, sizes


def group_reward_std(experiences: Sequence, n: int) -> List[torch.Tensor]:
    """sigma_g of each sample's group, split like the experiences."""
    grouped, index, sizes = _grouped_rewards(experiences, n)
    return list(grouped.std(-1, keepdim=True).expand(-1, n).reshape(-1)[index].split(sizes))


def rounding_noise_frac(experiences: Sequence, n: int) -> float:
    """Fraction of groups whose rewards are equal (std <= 1e-6) yet differ from their float32 group mean: where
    OpenRLHF's group_norm turns rounding into a full-size advantage."""
    grouped, _, _ = _grouped_rewards(experiences, n)
    noisy = (grouped.std(-1) <= DEGENERATE_STD) & (grouped != grouped.mean(-1, keepdim=True)).any(-1)
    return float(noisy.float().mean())


@torch.no_grad()
def filter_degenerate_groups(experiences: Sequence, n: int) -> Tuple[List[torch.Tensor], Dict[str, float]]:
    """Zeroes advantages/returns (where set) of samples in groups with std <= 1e-6; returns which samples leave the
    loss (a bool per sample, split like the experiences: those samples, or none when fewer than max(2, 10%) of the
    groups survive) and ``cope/filtered_frac`` (the share that leaves the loss),
    ``cope/degenerate_frac`` (the share in degenerate groups) and ``cope/filter_kept_batch`` (1 when the batch was
    kept whole). The action mask of the leaving samples is the caller's to zero: without information gain the policy
    actor does (``zero_action_mask``) once it has built their forecast samples; with it, it stays."""
    degenerate = [std <= DEGENERATE_STD for std in group_reward_std(experiences, n)]
    flat = torch.cat(degenerate)
    groups = flat.numel() // n
    kept_whole = groups - int(flat.sum()) // n < max(2.0, 0.1 * groups)  # surviving groups below upstream's floor
    for e, drop in zip(experiences, degenerate):
        keep = (~drop).unsqueeze(1)
        for name in ("advantages", "returns"):
            if getattr(e, name) is not None:
                setattr(e, name, getattr(e, name) * keep.to(getattr(e, name).dtype))
    drops = [torch.zeros_like(d) for d in degenerate] if kept_whole else degenerate
    degenerate_frac = float(flat.float().mean()) if flat.numel() else 0.0
    return drops, {"cope/filtered_frac": 0.0 if kept_whole else degenerate_frac,
                   "cope/degenerate_frac": degenerate_frac, "cope/filter_kept_batch": float(kept_whole)}


def zero_action_mask(action_mask: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """The action mask with the rows ``drop`` marks zeroed: they leave the token-mean loss's numerator and
    denominator."""
    return action_mask * (~drop.bool()).unsqueeze(1).to(action_mask.dtype)


def info_gates(experiences: Sequence, n: int, weight: float, gate_temp: float) -> List[torch.Tensor]:
    """beta_g = w * exp(-sigma_g / T) of each sample's group, split like the experiences."""
    return [weight * torch.exp(-s.float() / gate_temp) for s in group_reward_std(experiences, n)]


@torch.no_grad()
def add_info_bonus(advantages: torch.Tensor, intrinsic: torch.Tensor, action_mask: torch.Tensor, beta: torch.Tensor,
                   mean: float, std: float) -> torch.Tensor:
    """``advantages + beta * (x - mean) / std`` on action tokens (``std`` floored at 1e-8): one sample's info term,
    ``mean`` and ``std`` those of the intrinsic reward over every action token of the batch."""
    bonus = beta * (intrinsic.float() - mean) / max(std, 1e-8) * action_mask.bool()
    return advantages + bonus.to(advantages.dtype)
