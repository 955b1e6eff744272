"""Turn-level information gain from a masked-feedback counterfactual.

For every turn t >= 1 of a sample (turn 0 follows the prompt, not environment feedback; it gets 0), only
the last ``max_turns`` such turns of the sample:

    r_t = 1/P_t * sum_{j < P_t} KL( pi(. | real)_j || pi(. | masked_t)_j )

over the first ``P_t = min(P, len(turn t))`` action tokens of turn t. ``real`` is the sequence as sampled;
``masked_t`` is the same sequence, same position ids, with the observation block before turn t removed
from attention (a 2D attention mask with zeros there). The block is the feedback between action t-1 and
action t *minus its last token*: that token's output is the distribution of turn t's first action token, so
it must stay a live query. Keeping it makes the counterfactual identical whether an attention backend
masks keys (eager, SDPA) or drops masked tokens (flash-attention's unpadding).

r_t is written on every action token of turn t (as upstream CoPE does: spreading r_t / len(turn t) would, after
the batch-wide z-score of the advantage, favour short turns); all other tokens get 0.

The counterfactual of turn t differs from the real sequence only from the block's last token on, so each turn needs
just the P tokens ``[action_start - 1, action_start - 1 + P)`` recomputed, as a branch off the trajectory that sees
it before the block (``probe_requests``; ``cope_rlhf.frozen_signals`` runs them, one packed row per trajectory): one
forward of the trajectory plus P tokens per scored turn, instead of one forward per turn. The per-turn computation
it equals is the reference in ``cope_rlhf/signal_references.py``.

Everything runs through ``logits_fn(sequences, attention_mask, position_ids, keep) -> logits``, so a HF model
and an OpenRLHF actor serve alike: ``(rows, L, V)``, or with ``keep`` (sorted column indices)
``(rows, len(keep), V)``, the LM head run at those columns only (HF's ``logits_to_keep``). Position ids follow
OpenRLHF's ``Actor.forward`` convention (``cumsum(attention_mask) - 1``, padding at 1; ``position_ids_for``).
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from cope_rlhf.branches import Branch, RowRequest, contiguous_span
from cope_rlhf.turns import Turn, action_offset

LogitsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


class Probe(NamedTuple):
    row: int  # sample in the batch
    turn: int  # index into turn_spans(...)[row]
    masked: Tuple[int, int]  # sequence positions removed from attention in the counterfactual
    positions: Tuple[int, int]  # logits positions predicting the first P action tokens


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 1)


def plan_probes(turns: List[List[Turn]], probe_tokens: int, max_turns: int) -> List[Probe]:
    """The counterfactuals to run: the last ``max_turns`` turns after feedback, per row."""
    probes = []
    for row, row_turns in enumerate(turns):
        for t in range(max(1, len(row_turns) - max_turns), len(row_turns)):
            turn = row_turns[t]
            n = min(probe_tokens, turn.action_end - turn.action_start)
            first = turn.action_start - 1
            probes.append(Probe(row, t, (turn.obs_start, turn.obs_end - 1), (first, first + n)))
    return probes


def probe_kl(real_logits: torch.Tensor, masked_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(softmax(real) || softmax(masked)); inputs (P, V)."""
    real = torch.log_softmax(real_logits.float(), dim=-1)
    masked = torch.log_softmax(masked_logits.float(), dim=-1)
    return (real.exp() * (real - masked)).sum(-1).mean()


def spread_rewards(turns: List[List[Turn]], probes: List[Probe], values: List[float], action_mask: torch.Tensor,
                   length: int) -> Tuple[torch.Tensor, List[List[float]], Dict[str, float]]:
    """(token rewards ``(B, A)`` aligned with ``action_mask``, per-turn r_t (0 for unscored turns), metrics) from
    each probe's r_t: r_t on every action token of the turn."""
    offset = action_offset(length, action_mask.shape[1])
    token_rewards = torch.zeros(action_mask.shape, dtype=torch.float32, device=action_mask.device)
    turn_rewards = [[0.0] * len(row_turns) for row_turns in turns]
    if not probes:
        return token_rewards, turn_rewards, {"cope/info_reward_mean": 0.0, "cope/info_turns_scored": 0}
    for p, value in zip(probes, values):
        turn = turns[p.row][p.turn]
        turn_rewards[p.row][p.turn] = value
        token_rewards[p.row, turn.action_start - offset : turn.action_end - offset] = value
    metrics = {"cope/info_reward_mean": sum(values) / len(values), "cope/info_turns_scored": len(values)}
    return token_rewards, turn_rewards, metrics


def probe_requests(sequences: torch.Tensor, attention_mask: torch.Tensor,
                   probes: List[Probe]) -> Tuple[List[List[Probe]], List[RowRequest]]:
    """Branch packing (``branches.run_requests``): per row with probes, its probes and its request: the trajectory
    up to its last probe as trunk (the real logits), then per probe a branch of the P tokens
    ``[action_start - 1, action_start - 1 + P)`` seeing the trunk before the masked block. Reads the probe columns
    of the trunk, then of each branch (``probe_values``).

    The counterfactual hides ``[obs_start, obs_end - 1)``; every token from ``obs_end - 1`` on changes (it no
    longer sees the block), and those are exactly the branch's tokens up to the last probe. Tokens before
    ``obs_start`` are untouched, so the branch reads them from the trunk."""
    by_row: Dict[int, List[Probe]] = {}
    for p in probes:
        by_row.setdefault(p.row, []).append(p)
    rows, requests = [], []
    for row in sorted(by_row):
        first, _ = contiguous_span(attention_mask[row])
        tokens, mine = sequences[row].tolist(), by_row[row]
        end = max(p.positions[1] for p in mine)

        def columns(starts: List[int], mine=mine, first=first) -> torch.Tensor:
            widths = [p.positions[1] - p.positions[0] for p in mine]
            real = [torch.arange(p.positions[0] - first, p.positions[1] - first) for p in mine]
            return torch.cat(real + [torch.arange(s, s + w) for s, w in zip(starts, widths)])

        rows.append(mine)
        requests.append(RowRequest(tokens[first:end], [Branch(tokens[a:b], a - first, p.masked[0] - first)
                                                       for p in mine for a, b in [p.positions]], columns))
    return rows, requests


def probe_values(probes: List[Probe], logits: torch.Tensor) -> List[float]:
    """One row's r_t from its request's logits (``probe_requests``): real probe columns, then the branches'."""
    values, at, half = [], 0, len(logits) // 2
    for p in probes:
        width = p.positions[1] - p.positions[0]
        values.append(float(probe_kl(logits[at : at + width], logits[half + at : half + at + width])))
        at += width
    return values
