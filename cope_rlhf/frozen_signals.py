"""The frozen (pre-update, no gradient) signals of a batch, information gain and TE members, in one packed row per
trajectory.

A trajectory's row (``cope_rlhf.branches``) holds its tokens once, as the trunk, then short branches off it:

- information gain (``info_gain.probe_requests``), per scored turn t: the P tokens from the last token of the
  feedback block before turn t on, seeing the trunk *before* that block: the masked-feedback counterfactual.
  r_t = KL(real || counterfactual) over those P positions, real from the trunk's own columns (``info_gain``);
- TE members (``temporal_ensemble.member_requests``), per forecast sample that forecasts a later turn: its
  plan-ahead message and target, seeing the trunk's first ``prefix_len`` tokens; the logits at its later slots
  give the top-M members of the covered trajectory tokens (``temporal_ensemble.collect_members``).

With both signals on, the trunk runs once for the two. ``rows_per_forward`` trajectories share a forward
(``INFO_KL_BATCH``, ``TE_MICRO_BATCH_SIZE_PER_GPU``, the smaller when both are on); the LM head runs only at the
columns read. A row whose attention mask has holes cannot be packed and is refused (``branches.contiguous_span``);
OpenRLHF's experiences are left- or right-padded. The per-turn and per-sample computations these values equal
(float32, 1e-5) are the references in ``cope_rlhf/signal_references.py``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from cope_rlhf.branches import BlockMaskFn, dense_mask, run_requests
from cope_rlhf.config import CoPEConfig
from cope_rlhf.forecast import ForecastSample
from cope_rlhf.info_gain import LogitsFn, plan_probes, probe_requests, probe_values, spread_rewards
from cope_rlhf.temporal_ensemble import collect_members, later_forecasts, member_requests, split_members
from cope_rlhf.turns import Turn, turn_spans

InfoGain = Tuple[torch.Tensor, List[List[float]], Dict[str, float]]  # token rewards (B, A), r_t per turn, metrics
Members = Tuple[Dict[str, torch.Tensor], Dict[str, float]]  # positions, probs, ids of one row; its TE counts


@torch.no_grad()
def frozen_signals(
    logits_fn: LogitsFn,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask: torch.Tensor,
    config: CoPEConfig,
    info_gain: bool,
    samples: Optional[Sequence[Sequence[ForecastSample]]] = None,
    trajectories: Optional[Sequence[Tuple[Sequence[int], Sequence[Turn]]]] = None,
    rejected: Optional[Sequence[Sequence[bool]]] = None,
    block_mask: BlockMaskFn = dense_mask,
    device=None,
) -> Tuple[Optional[InfoGain], Optional[List[Members]]]:
    """(information gain or None when ``info_gain`` is off; TE members per row or None when ``samples`` is None).

    ``samples[i]`` are row i's forecast samples, ``trajectories[i]`` = (tokens, turns) its unpadded trajectory
    (``turns.unpadded_trajectories``) and ``rejected[i][t]`` whether the env rejected its turn t's action (None: no
    turn was). Info gain scores the last ``config.info_max_turns`` turns after feedback of every row over
    ``config.info_probe_tokens`` tokens, and puts r_t on every action token of turn t. A row's members are its
    covered positions (the policy's logits for position p sit at p - 1) with their members' mixture q^F as top-M
    probabilities and token ids ``(N, M)``, and the row's TE counts (``temporal_ensemble.COUNTS``)."""
    rows_per_forward = min([config.info_kl_batch] * info_gain + [config.te_micro_batch_size_per_gpu] *
                           (samples is not None), default=1)
    turns = turn_spans(action_mask, sequences.shape[1], attention_mask) if info_gain else []
    probes = plan_probes(turns, config.info_probe_tokens, config.info_max_turns)
    requests, probes_of, forecasts_of = {}, {}, {}
    for mine, request in zip(*probe_requests(sequences, attention_mask, probes)):
        probes_of[mine[0].row] = mine
        requests[mine[0].row] = [request]
    for i, row_samples in enumerate(samples or []):
        kept, cuts, trimmed = later_forecasts(row_samples)
        if kept:
            (request,) = member_requests(kept, cuts)  # one trajectory's samples: one request
            forecasts_of[i] = cuts, trimmed
            requests.setdefault(i, []).append(request)
    order = sorted(requests)
    out = dict(zip(order, run_requests(logits_fn, [requests[i] for i in order], block_mask, rows_per_forward,
                                       device)))
    gain = None
    if info_gain:
        values = {p: v for i, mine in probes_of.items() for p, v in zip(mine, probe_values(mine, out[i][0]))}
        gain = spread_rewards(turns, probes, [values[p] for p in probes], action_mask, sequences.shape[1])
    if samples is None:
        return gain, None
    members = []
    for i, (tokens, row_turns) in enumerate(trajectories):
        cuts, trimmed = forecasts_of.get(i, ([], []))
        logits = split_members(cuts, out[i][-1]) if trimmed else []
        row = {s.row for s in trimmed}
        targets, probs, ids, counts = collect_members(
            trimmed, logits, dict.fromkeys(row, (tokens, row_turns)),
            dict.fromkeys(row, rejected[i]) if rejected is not None else None)
        positions = torch.tensor([pos for _, pos in targets], dtype=torch.long)
        members.append(({"positions": positions, "probs": probs, "ids": ids}, counts))
    return gain, members
