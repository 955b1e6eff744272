"""Turn structure of multi-turn samples, read off OpenRLHF's ``action_mask``.

OpenRLHF (``SamplesGenerator._process_response_into_experience``) marks the policy's tokens with
``action_ranges`` and stores ``action_mask = mask[1:]``: it is shifted by one against ``sequences``.
In general (``Actor.forward`` takes ``log_probs[:, -A:]``) column ``j`` of a ``(B, A)`` action mask refers to
the token ``sequences[:, T - A + j]`` of a ``(B, T)`` batch, and the logits that predict that token sit at
position ``T - A + j - 1``. Batches are right-padded by ``Experience.concat_experiences``; left padding is
handled too when ``attention_mask`` is given.

For each row, a turn is one maximal run of action tokens, in sequence coordinates (half-open):

    [obs_start, obs_end)        the observation block before the action: the prompt for the first turn,
                                otherwise the environment feedback between the previous action and this one
    [action_start, action_end)  the action tokens (obs_end == action_start)
    [action_end, next_obs_end)  the feedback after the action (up to the next action, or the row's last token)
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch


class Turn(NamedTuple):
    obs_start: int
    obs_end: int
    action_start: int
    action_end: int
    next_obs_end: int


def action_offset(seq_len: int, action_len: int) -> int:
    """Sequence index of action-mask column 0 (1 for OpenRLHF's multi-turn samples)."""
    if not 0 < action_len <= seq_len:
        raise ValueError(f"action_mask has {action_len} columns, sequences {seq_len}: need 0 < A <= T")
    return seq_len - action_len


def turn_spans(
    action_mask: torch.Tensor, seq_len: Optional[int] = None, attention_mask: Optional[torch.Tensor] = None
) -> List[List[Turn]]:
    """Per row, the turns in order. ``seq_len`` defaults to ``attention_mask.shape[1]``, else ``A + 1``."""
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must be (batch, actions), got shape {tuple(action_mask.shape)}")
    if seq_len is None:
        seq_len = attention_mask.shape[1] if attention_mask is not None else action_mask.shape[1] + 1
    offset = action_offset(seq_len, action_mask.shape[1])
    mask = action_mask.bool().to("cpu")
    # Edges of runs of ones: +1 where a run starts, -1 one past where it ends.
    edges = torch.diff(torch.nn.functional.pad(mask.int(), (1, 1)), dim=1)
    result = []
    for row in range(mask.shape[0]):
        if attention_mask is not None:
            valid = attention_mask[row].nonzero().flatten()
            first, last = (int(valid[0]), int(valid[-1]) + 1) if len(valid) else (0, 0)
        else:
            first, last = 0, seq_len
        starts = (edges[row] == 1).nonzero().flatten().tolist()
        ends = (edges[row] == -1).nonzero().flatten().tolist()
        turns = []
        for i, (s, e) in enumerate(zip(starts, ends)):
            s, e = s + offset, e + offset
            obs_start = turns[-1].action_end if turns else first
            next_obs_end = starts[i + 1] + offset if i + 1 < len(starts) else max(last, e)
            turns.append(Turn(obs_start, s, s, e, next_obs_end))
        result.append(turns)
    return result


def unpadded_trajectories(experiences: Sequence) -> Dict[int, Tuple[List[int], List[Turn]]]:
    """``{rollout position: (token ids without padding, turns in those coordinates)}`` for OpenRLHF
    experiences (``experience.index`` holds each row's rollout position)."""
    rows = {}
    for e in experiences:
        spans = turn_spans(e.action_mask, e.sequences.shape[1], e.attention_mask)
        for b, position in enumerate(e.index):
            valid = e.attention_mask[b].bool()
            first = int(valid.nonzero()[0]) if valid.any() else 0
            rows[position] = (e.sequences[b][valid].tolist(), [Turn(*(x - first for x in t)) for t in spans[b]])
    return rows
