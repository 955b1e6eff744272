"""Temporal ensembling: distil earlier forecasts of an action into the policy.

Members of action token y of turn t: the forecasts issued at earlier turns s < t whose slot is turn t,
i.e. pi^k(y | h_s, plan-ahead, a_s ... a_{t-1}) under the frozen (pre-update) policy, each kept as its
top-M tokens (probabilities not renormalised). A forecast slot covers a trajectory token when the slot's
token ids occur verbatim inside turn t's action tokens (last occurrence); members are aligned token by token
(the slot's j-th token with the j-th covered token). At most ``MAX_SLOT_TOKENS`` (16) tokens of a slot and
``MAX_COVERED_PER_TRAJECTORY`` (128) covered tokens of a trajectory get members (upstream CoPE's caps). TE's
forecast samples always use the ``list`` layout, whatever ``ACTION_FORECAST_LAYOUT`` says; a fraction
``TE_TRAJ_SUBSAMPLE`` of each batch's trajectories gets members.

``cope/te_member_first_token_prob``: the mean, over covered slots, of the member's probability of the first token
of the action actually taken. It says whether the members know what they distil: a warm start that never saw the
plan-ahead prompt gives ~0.001 there (its members expect "Thought"/"Action", the tokens that open its replies), and
distilling such members pulls the policy's first action token toward those format tokens
(docs/results/quickstart_diagnosis.md point 27). ``TE_WARMUP_STEPS`` exists to let the forecast loss train this up
first.

    q^F = mean over members of the top-M distributions          (total mass  mass_topM <= 1)
    q   = ((1 - eta) * pi_frozen(. | h_t) + eta * q^F) / Z,      Z = (1 - eta) + eta * mass_topM
    q   = pi_frozen                                              for tokens without members
    L_TE = lambda * mean over covered tokens of  sum_v [ q_v - p_v - p_v * log(q_v / p_v) ],   p = pi_theta

The summand is the low-variance (k3) KL estimator (r - 1) - log r, r = q/p, in expectation over v ~ p: with
normalised q it equals KL(pi_theta || q) exactly. eta < 1 (with eta = 1, q has no mass outside the members'
top-M and the KL explodes). lambda is 0 while the global step, counted from 1 as OpenRLHF's ``global_steps`` and
upstream CoPE count it, is below ``TE_WARMUP_STEPS``.

The members' logits come from one packed row per trajectory, its forecast samples as branches off it
(``member_requests``, run by ``cope_rlhf.frozen_signals``); the per-sample forwards they equal are the reference in
``tests/signal_references.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import torch

from cope_rlhf.config import CoPEConfig
from cope_rlhf.branches import RowRequest
from cope_rlhf.forecast import ForecastSample, branch_columns, trajectory_branches
from cope_rlhf.turns import Turn

TOP_M = 64
MAX_SLOT_TOKENS = 16
MAX_COVERED_PER_TRAJECTORY = 128


def te_lambda(config: CoPEConfig, global_step: int) -> float:
    """lambda at ``global_step`` (1 = the first PPO update)."""
    return config.te_lambda if config.te_enable and global_step >= config.te_warmup_steps else 0.0


def locate(tokens: Sequence[int], turn: Turn, target: Sequence[int]) -> int:
    """Sequence position where ``target`` starts inside the turn's action tokens (last match), or -1."""
    target = list(target)
    for start in range(turn.action_end - len(target), turn.action_start - 1, -1):
        if list(tokens[start : start + len(target)]) == target:
            return start
    return -1


def collect_members(
    samples: Sequence[ForecastSample],
    forecast_logits: Sequence[torch.Tensor],
    trajectories: Dict[int, Tuple[Sequence[int], Sequence[Turn]]],
    top_m: int = TOP_M,
) -> Tuple[List[Tuple[int, int]], torch.Tensor, torch.Tensor, torch.Tensor, Dict[str, float]]:
    """Member distributions per covered trajectory token.

    ``forecast_logits[i]`` are the frozen policy's logits on ``samples[i].input_ids`` (L_i, V);
    ``trajectories[row] = (tokens, turns)``. Returns ``targets`` [(row, sequence position)], member
    probabilities and token ids (N, K, M) and a validity mask (N, K), and coverage metrics. The policy's
    logits for target ``(row, p)`` sit at position ``p - 1`` of that trajectory."""
    members: Dict[Tuple[int, int], List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    per_trajectory: Dict[int, int] = {}
    slots = covered = 0
    first_token_prob = 0.0
    for sample, logits in zip(samples, forecast_logits):
        tokens, turns = trajectories[sample.row]
        for t, start, end in sample.slots:
            if t <= sample.turn:
                continue  # the forecast of the current action is not an ensemble member
            slots += 1
            at = locate(tokens, turns[t], sample.input_ids[start:end])
            if at < 0:
                continue
            covered += 1
            width = min(end - start, MAX_SLOT_TOKENS)
            probs, ids = torch.softmax(logits[start - 1 : start - 1 + width].float(), dim=-1).topk(top_m, dim=-1)
            first_token_prob += float(probs[0][ids[0] == tokens[at]].sum())
            for j in range(width):
                key = (sample.row, at + j)
                if key not in members:
                    if per_trajectory.get(sample.row, 0) >= MAX_COVERED_PER_TRAJECTORY:
                        continue
                    per_trajectory[sample.row] = per_trajectory.get(sample.row, 0) + 1
                members.setdefault(key, []).append((probs[j], ids[j]))
    targets = sorted(members)
    width = max((len(members[x]) for x in targets), default=0)
    member_probs = torch.zeros(len(targets), width, top_m)
    member_ids = torch.zeros(len(targets), width, top_m, dtype=torch.long)
    valid = torch.zeros(len(targets), width, dtype=torch.bool)
    for i, x in enumerate(targets):
        for k, (p, ids) in enumerate(members[x]):
            member_probs[i, k], member_ids[i, k], valid[i, k] = p, ids, True
    metrics = {"cope/te_slots": slots, "cope/te_slot_coverage": covered / slots if slots else 0.0,
               "cope/te_member_first_token_prob": first_token_prob / covered if covered else 0.0}
    return targets, member_probs, member_ids, valid, metrics


def mixture_target(
    frozen_logits: torch.Tensor, member_probs: torch.Tensor, member_ids: torch.Tensor, valid: torch.Tensor, eta: float
) -> torch.Tensor:
    """q (N, V) from the frozen policy's logits (N, V) at the covered tokens and their members."""
    pi = torch.softmax(frozen_logits.float(), dim=-1)
    count = valid.sum(-1, keepdim=True)
    forecast = torch.zeros_like(pi).scatter_add_(
        1, member_ids.flatten(1), (member_probs * valid.unsqueeze(-1)).flatten(1)
    ) / count.clamp_min(1)
    mass = forecast.sum(-1, keepdim=True)
    mixed = ((1 - eta) * pi + eta * forecast) / ((1 - eta) + eta * mass)
    return torch.where(count > 0, mixed, pi)


def te_kl(policy_logits: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per token sum_v [q - p - p log(q/p)] (= KL(p || q) for normalised q); p = softmax(policy_logits)."""
    log_p = torch.log_softmax(policy_logits.float(), dim=-1)
    p = log_p.exp()
    log_q = torch.log(q.clamp_min(torch.finfo(q.dtype).tiny))
    return (q - p - p * (log_q - log_p)).sum(-1)


def te_loss(policy_logits: torch.Tensor, q: torch.Tensor, lam: float) -> torch.Tensor:
    """lambda * mean over covered tokens of the KL; 0 (with a graph) when nothing is covered."""
    if policy_logits.shape[0] == 0:
        return policy_logits.sum() * 0.0
    return lam * te_kl(policy_logits, q).mean()


def later_forecasts(samples: Sequence[ForecastSample]):
    """The samples that forecast a later turn, their cut ``(first, end)`` around those slots (the columns whose
    logits ``collect_members`` reads), and the samples trimmed to the cut (slots shifted to match)."""
    kept, cuts = [], []
    for s in samples:
        later = [slot for slot in s.slots if slot[0] > s.turn]
        if later:
            kept.append(s)
            cuts.append((min(slot[1] for slot in later) - 1, max(slot[2] for slot in later)))
    trimmed = [
        dataclasses.replace(
            s, input_ids=s.input_ids[first:end], slots=[(t, a - first, b - first) for t, a, b in s.slots if t > s.turn]
        )
        for s, (first, end) in zip(kept, cuts)
    ]
    return kept, cuts, trimmed


def member_requests(kept: Sequence[ForecastSample], cuts: Sequence[Tuple[int, int]]):
    """Branch packing (``branches.run_requests``): per trajectory, the indices of its samples in ``kept`` and
    its request: the longest of their prefixes as trunk, each sample's ``input_ids[prefix_len:end]`` as a branch
    at positions ``prefix_len, ...``; reads each sample's ``[first, end)`` columns, sample after sample."""
    groups, requests = [], []
    for members, trunk, branches in trajectory_branches(kept, [end for _, end in cuts]):

        def columns(starts: List[int], members=members) -> torch.Tensor:
            return torch.cat([branch_columns(start, kept[i].prefix_len, torch.arange(*cuts[i]))
                              for i, start in zip(members, starts)])

        groups.append(members)
        requests.append(RowRequest(trunk, branches, columns))
    return groups, requests


def split_members(cuts: Sequence[Tuple[int, int]], logits: torch.Tensor) -> List[torch.Tensor]:
    """One trajectory's logits from its request (``member_requests``) cut back into its samples' (cpu, float32)."""
    return list(logits.float().cpu().split([end - first for first, end in cuts]))
