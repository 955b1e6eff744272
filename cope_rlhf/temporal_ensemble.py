"""Temporal ensembling: distil earlier forecasts of an action into the policy (upstream CoPE's full-vocabulary form).

Members of turn t: the forecasts issued at earlier turns s < t whose slot is turn t, i.e.
pi^k(. | h_s, plan-ahead, a_s ... a_{t-1}) under the frozen (pre-update) policy. A slot covers the trajectory's
tokens when its token ids occur verbatim inside turn t's action tokens (last occurrence); its j-th token is aligned
with the j-th covered token. A slot longer than ``MAX_SLOT_TOKENS`` (16) is no member at all, and at most
``MAX_COVERED_PER_TRAJECTORY`` (128) tokens of a trajectory get members. TE's forecast samples always use the
``list`` layout; a fraction ``TE_TRAJ_SUBSAMPLE`` of each batch's trajectories is scored. With
``ACTION_FORECAST_SKIP_INVALID`` (on by default, as upstream) actions the env rejected are neither members nor
targets.

Per covered token, with the members' top-M distributions (M = ``TOP_M``, 64):

    q^F = top-M of ( mean over members of their top-M distributions )   (total mass  mass_topM <= 1)
    q   = ((1 - eta) * pi_frozen(. | h_t) + eta * q^F) / Z,      Z = (1 - eta) + eta * mass_topM
    KL_tok = sum_v [ q_v - p_v - p_v * log(q_v / p_v) ],          p = pi_theta

The summand is the low-variance (k3) estimator (r - 1) - log r, r = q/p, in expectation over v ~ p: with normalised q
it equals KL(pi_theta || q) exactly. eta < 1. The loss, per optimizer step (``trajectory_means``; the policy actor
adds it to OpenRLHF's loss with OpenRLHF's per-sample normaliser):

    L_TE = lambda * (1 / N_rows) * sum over trajectories of ( mean over its covered tokens of KL_tok )

N_rows = the step's trajectories in the loss, those without members included (they add 0). lambda is 0 while the
global step, counted from 1, is below ``TE_WARMUP_STEPS``; and, with ``TE_HOLD_BELOW`` > 0, while the members' mean
probability of the action taken (``cope/te_member_prob_valid``) is below it (``cope/te_held`` = 1).

Metrics (``te_status``): ``cope/te_slots`` (member slots), ``cope/te_slot_coverage`` (the share that covers
trajectory tokens), ``cope/te_member_first_token_prob`` (the member's probability of the first token of the action
taken, over covered slots), ``cope/te_member_prob_valid`` (the same over covered slots whose action the env
accepted: whether the members know the action) and ``cope/te_invalid_target_frac`` (member slots whose action the env
rejected; 0 under skip-invalid).

The members' logits come from one packed row per trajectory, its forecast samples as branches off it
(``member_requests``, run by ``cope_rlhf.frozen_signals``); the per-sample forwards they equal are the reference in
``cope_rlhf/signal_references.py``. Why these rules, and what TE does in this project's runs: docs/METHOD.md.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from cope_rlhf.branches import RowRequest
from cope_rlhf.config import CoPEConfig
from cope_rlhf.forecast import ForecastSample, branch_columns, trajectory_branches
from cope_rlhf.turns import Turn

TOP_M = 64
MAX_SLOT_TOKENS = 16
MAX_COVERED_PER_TRAJECTORY = 128
# Per-batch sums behind the metrics (collect_members, te_status): member slots, covered ones, the members'
# first-token probability summed over covered slots; member slots the env rejected, covered slots it accepted, their
# probability sum.
COUNTS = ("slots", "covered", "first_token_prob", "invalid_slots", "valid_covered", "valid_first_token_prob")


def te_lambda(config: CoPEConfig, global_step: int, held: bool = False) -> float:
    """lambda at ``global_step`` (1 = the first PPO update); 0 while warming up or ``held``."""
    return config.te_lambda if config.te_enable and global_step >= config.te_warmup_steps and not held else 0.0


def locate(tokens: Sequence[int], turn: Turn, target: Sequence[int]) -> int:
    """Sequence position where ``target`` starts inside the turn's action tokens (last match), or -1."""
    target = list(target)
    for start in range(turn.action_end - len(target), turn.action_start - 1, -1):
        if list(tokens[start : start + len(target)]) == target:
            return start
    return -1


def mixture_top_m(members: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                  top_m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """q^F at one token: the mean of the members' top-M distributions ``(probs, ids)``, cut back to its own top-M
    (probabilities not renormalised)."""
    ids = torch.cat([i for _, i in members])
    unique, where = ids.unique(return_inverse=True)
    mean = torch.zeros(len(unique)).scatter_add_(0, where, torch.cat([p for p, _ in members]).float()) / len(members)
    probs, top = mean.topk(min(top_m, len(unique)))
    return probs, unique[top]


def collect_members(
    samples: Sequence[ForecastSample],
    forecast_logits: Sequence[torch.Tensor],
    trajectories: Dict[int, Tuple[Sequence[int], Sequence[Turn]]],
    rejected: Optional[Dict[int, Sequence[bool]]] = None,
    top_m: int = TOP_M,
) -> Tuple[List[Tuple[int, int]], torch.Tensor, torch.Tensor, Dict[str, float]]:
    """The members' mixture q^F per covered trajectory token.

    ``forecast_logits[i]`` are the frozen policy's logits on ``samples[i].input_ids`` (L_i, V);
    ``trajectories[row] = (tokens, turns)``; ``rejected[row][t]``: the env rejected turn t's action (None: none
    was). Returns ``targets`` [(row, sequence position)], q^F's top-M probabilities and token ids (N, M), and the
    ``COUNTS``. The policy's logits for target ``(row, p)`` sit at position ``p - 1`` of that trajectory."""
    members: Dict[Tuple[int, int], List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    per_trajectory: Dict[int, int] = {}
    counts = dict.fromkeys(COUNTS, 0.0)
    for sample, logits in zip(samples, forecast_logits):
        tokens, turns = trajectories[sample.row]
        for t, start, end in sample.slots:
            if t <= sample.turn:
                continue  # the forecast of the current action is not an ensemble member
            invalid = bool(rejected and rejected[sample.row][t])
            counts["slots"] += 1
            counts["invalid_slots"] += invalid
            at = locate(tokens, turns[t], sample.input_ids[start:end])
            if at < 0 or end - start > MAX_SLOT_TOKENS:
                continue
            full = torch.softmax(logits[start - 1 : end - 1].float(), dim=-1)
            first = float(full[0, tokens[at]])
            probs, ids = full.topk(top_m, dim=-1)
            counts["covered"] += 1
            counts["first_token_prob"] += first
            if not invalid:
                counts["valid_covered"] += 1
                counts["valid_first_token_prob"] += first
            for j in range(end - start):
                key = (sample.row, at + j)
                if key not in members:
                    if per_trajectory.get(sample.row, 0) >= MAX_COVERED_PER_TRAJECTORY:
                        continue
                    per_trajectory[sample.row] = per_trajectory.get(sample.row, 0) + 1
                members.setdefault(key, []).append((probs[j], ids[j]))
    targets = sorted(members)
    forecast_probs = torch.zeros(len(targets), top_m)
    forecast_ids = torch.zeros(len(targets), top_m, dtype=torch.long)
    for i, key in enumerate(targets):
        probs, ids = mixture_top_m(members[key], top_m)
        forecast_probs[i, : len(probs)], forecast_ids[i, : len(ids)] = probs, ids
    return targets, forecast_probs, forecast_ids, counts


def te_status(counts: Dict[str, float]) -> Dict[str, float]:
    """The TE metrics (module docstring) from ``COUNTS`` summed over rows, batches and ranks."""
    def ratio(num: str, den: str) -> float:
        return counts[num] / counts[den] if counts[den] else 0.0

    return {"cope/te_slots": counts["slots"], "cope/te_slot_coverage": ratio("covered", "slots"),
            "cope/te_member_first_token_prob": ratio("first_token_prob", "covered"),
            "cope/te_member_prob_valid": ratio("valid_first_token_prob", "valid_covered"),
            "cope/te_invalid_target_frac": ratio("invalid_slots", "slots")}


def mixture_target(frozen_logits: torch.Tensor, forecast_probs: torch.Tensor, forecast_ids: torch.Tensor,
                   eta: float) -> torch.Tensor:
    """q (N, V) from the frozen policy's logits (N, V) at the covered tokens and their q^F's top-M (N, M)."""
    pi = torch.softmax(frozen_logits.float(), dim=-1)
    forecast = torch.zeros_like(pi).scatter_add_(1, forecast_ids, forecast_probs.float())
    return ((1 - eta) * pi + eta * forecast) / ((1 - eta) + eta * forecast_probs.float().sum(-1, keepdim=True))


def te_kl(policy_logits: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per token sum_v [q - p - p log(q/p)] (= KL(p || q) for normalised q); p = softmax(policy_logits)."""
    log_p = torch.log_softmax(policy_logits.float(), dim=-1)
    p = log_p.exp()
    log_q = torch.log(q.clamp_min(torch.finfo(q.dtype).tiny))
    return (q - p - p * (log_q - log_p)).sum(-1)


def trajectory_means(token_kl: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """(n_rows,): each trajectory's mean of ``token_kl`` over its covered tokens (``rows[i]``: token i's
    trajectory); 0 for a trajectory without any."""
    total = token_kl.new_zeros(n_rows).index_add(0, rows, token_kl)
    count = torch.zeros(n_rows, device=token_kl.device).index_add_(0, rows, torch.ones_like(token_kl))
    return total / count.clamp_min(1)


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


def member_requests(kept: Sequence[ForecastSample], cuts: Sequence[Tuple[int, int]]) -> List[RowRequest]:
    """Branch packing (``branches.run_requests``), one request per trajectory: the longest of its samples' prefixes
    as trunk, each sample's ``input_ids[prefix_len:end]`` as a branch at positions ``prefix_len, ...``; reads each
    sample's ``[first, end)`` columns, sample after sample."""
    requests = []
    for members, trunk, branches in trajectory_branches(kept, [end for _, end in cuts]):

        def columns(starts: List[int], members=members) -> torch.Tensor:
            return torch.cat([branch_columns(start, kept[i].prefix_len, torch.arange(*cuts[i]))
                              for i, start in zip(members, starts)])

        requests.append(RowRequest(trunk, branches, columns))
    return requests


def split_members(cuts: Sequence[Tuple[int, int]], logits: torch.Tensor) -> List[torch.Tensor]:
    """One trajectory's logits from its request (``member_requests``) cut back into its samples' (cpu, float32)."""
    return list(logits.float().cpu().split([end - first for first, end in cuts]))
