"""Action forecast: realized actions, forecast samples, the trajectory gate, group-norm weights, the NLL.

Realized action of a turn = the first non-empty line after the last ``Action:`` of the decoded action text
(text on the same line as ``Action:`` counts); with no ``Action:``, the last non-empty line. With
skip-invalid, a turn whose following observation says the action failed (``INVALID_PHRASES``) is dropped:
it neither issues a forecast nor appears in one.

For kept turn t with j kept actions left, k = min(K, j); the forecast sample is token ids (the trajectory's
own tokens are reused as sampled, never re-tokenized):

    prefix  = sequence[: start of action t] without the trailing assistant header (so it ends with
              observation t's message), + user message PLAN_AHEAD(k) + assistant header
    list    : target = one assistant message "a_t\\n a_t+1 ... \\n a_t+k-1" (no spaces: one per line)
    turns   : target = a_t as an assistant message, then for each next action a user message
              NEXT_ACTION + assistant header + a_t+i as an assistant message
    loss_mask = 1 on target tokens (the assistant message bodies and their end-of-turn markers)

Gate over trajectories (win = reward > threshold): ``wins`` keeps winners, ``all`` keeps all, ``mixed``
keeps winners of groups holding both a win and a loss. Group norm: a kept trajectory of group g weighs
1/m_g (m_g = kept in g), rescaled so the mean weight over kept trajectories is 1; otherwise every weight is 1.

    L_AF = coef * sum_i w_i * sum_{target tokens} -log pi_theta(y | prefix) / N_target_tokens

Branch packing (``forecast_loss(..., branch_pack=True)``, ``pack_forecast_samples``): a sample is its
trajectory's first ``prefix_len`` tokens plus a short branch (plan-ahead message and target), so a trajectory's
samples run as one row, the trajectory once and each sample's branch after it (``cope_rlhf.branches``); the
loss and its gradient are the per-sample path's.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from cope_rlhf.branches import BlockMaskFn, Branch, PackedRows, dense_mask, logit_columns, pack_rows
from cope_rlhf.config import CoPEConfig
from cope_rlhf.turns import Turn, unpadded_trajectories

PLAN_AHEAD = (
    "Plan ahead: list the next {k} actions you will take, starting with the action you take right now, "
    "one action per line"
)
NEXT_ACTION = "Next action?"
INVALID_PHRASES = ("invalid action", "nothing happens", "not a valid action", "is not valid", "unknown action")
_SENTINEL = "\x00COPE\x00"


def realized_action(text: str) -> str:
    head, sep, tail = text.rpartition("Action:")
    if sep:
        for line in tail.splitlines():
            if line.strip():
                return line.strip()
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def is_invalid(observation: str, phrases: Sequence[str] = INVALID_PHRASES) -> bool:
    lowered = observation.lower()
    return any(p in lowered for p in phrases)


@dataclass(frozen=True)
class ChatPieces:
    """Token ids of the chat template's pieces, found by rendering the template around a sentinel."""

    header: Tuple[int, ...]  # what add_generation_prompt appends (e.g. "<|im_start|>assistant\n")
    user_open: str
    user_close: str
    body_open: str
    body_close: str  # end-of-turn marker after assistant content (e.g. "<|im_end|>\n")


@functools.lru_cache(maxsize=8)
def chat_pieces(tokenizer) -> ChatPieces:
    def render(messages, generation=False):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    def delta(longer: str, shorter: str, what: str) -> str:
        if not longer.startswith(shorter):
            raise ValueError(f"the tokenizer's chat template does not render {what} as an appended suffix")
        return longer[len(shorter) :]

    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    user_text = delta(render(base + [{"role": "user", "content": _SENTINEL}]), render(base), "a user message")
    asked = base + [{"role": "user", "content": "z"}]
    header = delta(render(asked, True), render(asked), "the generation prompt")
    reply = delta(render(asked + [{"role": "assistant", "content": _SENTINEL}]), render(asked), "a reply")
    body = delta(reply, header, "an assistant message after the generation prompt")
    user_open, _, user_close = user_text.partition(_SENTINEL)
    body_open, _, body_close = body.partition(_SENTINEL)
    return ChatPieces(tuple(_encode(tokenizer, header)), user_open, user_close, body_open, body_close)


def _encode(tokenizer, text: str) -> List[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


@dataclass
class ForecastSample:
    input_ids: List[int]
    loss_mask: List[int]
    row: int  # trajectory (rollout position)
    turn: int  # turn s that issues the forecast (index into the trajectory's turns)
    # (turn t, start, end): the tokens of realized action a_t inside input_ids, t >= s
    slots: List[Tuple[int, int, int]] = field(default_factory=list)
    weight: float = 1.0
    prefix_len: int = 0  # input_ids[:prefix_len] are the trajectory's own tokens (shared with it)


def trajectory_actions(
    tokens: Sequence[int], turns: Sequence[Turn], tokenizer, skip_invalid: bool
) -> List[Tuple[int, str]]:
    """(turn index, realized action) of the turns that are kept."""
    kept = []
    for t, turn in enumerate(turns):
        text = tokenizer.decode(tokens[turn.action_start : turn.action_end], skip_special_tokens=True)
        action = realized_action(text)
        if not action:
            continue
        if skip_invalid:
            feedback = tokenizer.decode(tokens[turn.action_end : turn.next_obs_end], skip_special_tokens=True)
            if is_invalid(feedback):
                continue
        kept.append((t, action))
    return kept


def build_forecast_samples(
    tokens: Sequence[int],
    turns: Sequence[Turn],
    tokenizer,
    k: int,
    layout: str = "list",
    skip_invalid: bool = False,
    row: int = 0,
    weight: float = 1.0,
) -> List[ForecastSample]:
    """Forecast samples of one trajectory; ``tokens`` are its unpadded ids, ``turns`` from ``turn_spans``."""
    if layout not in ("list", "turns"):
        raise ValueError(f"layout={layout!r}; allowed: list, turns")
    pieces = chat_pieces(tokenizer)
    header = list(pieces.header)
    tokens = list(tokens)
    kept = trajectory_actions(tokens, turns, tokenizer, skip_invalid)
    newline = _encode(tokenizer, "\n")
    samples = []
    for j, (t, _) in enumerate(kept):
        upcoming = kept[j : j + k]
        prefix = tokens[: turns[t].action_start]
        if prefix[len(prefix) - len(header) :] != header:
            raise ValueError(
                f"the tokens before turn {t} of trajectory {row} do not end with the chat template's assistant "
                f"header {tokenizer.decode(header)!r}; forecast samples need the agent's prompts rendered with "
                "the tokenizer's chat template"
            )
        plan = PLAN_AHEAD.format(k=len(upcoming))
        shared = len(prefix) - len(header)
        ids = prefix[:shared] + _encode(tokenizer, pieces.user_open + plan + pieces.user_close)
        mask = [0] * len(ids)
        slots = []

        def add(piece: List[int], target: int):
            ids.extend(piece)
            mask.extend([target] * len(piece))

        for i, (slot_turn, action) in enumerate(upcoming):
            if layout == "turns" and i > 0:
                add(_encode(tokenizer, pieces.user_open + NEXT_ACTION + pieces.user_close), 0)
            if layout == "turns" or i == 0:
                add(header, 0)
                add(_encode(tokenizer, pieces.body_open), 1)
            elif layout == "list":
                add(newline, 1)
            start = len(ids)
            add(_encode(tokenizer, action), 1)
            slots.append((slot_turn, start, len(ids)))
            if layout == "turns" or i == len(upcoming) - 1:
                add(_encode(tokenizer, pieces.body_close), 1)
        samples.append(ForecastSample(ids, mask, row, t, slots, weight, shared))
    return samples


def trajectory_gate(rewards: torch.Tensor, n: int, gate: str, threshold: float) -> torch.Tensor:
    """Which trajectories train the forecast; ``rewards`` (N,) in rollout order, groups of ``n``."""
    wins = rewards > threshold
    if gate == "all":
        return torch.ones_like(wins)
    if gate == "wins":
        return wins
    if gate == "mixed":
        grouped = wins.reshape(-1, n)
        mixed = grouped.any(-1, keepdim=True) & ~grouped.all(-1, keepdim=True)
        return (grouped & mixed).reshape(-1)
    raise ValueError(f"gate={gate!r}; allowed: wins, all, mixed")


def group_norm_weights(keep: torch.Tensor, n: int) -> torch.Tensor:
    """w = 1/m_g for kept trajectories (0 for the rest), rescaled to mean 1 over kept ones."""
    grouped = keep.reshape(-1, n).float()
    per_group = grouped.sum(-1, keepdim=True)
    weights = (grouped / per_group.clamp_min(1)).reshape(-1)
    kept = keep.sum()
    return weights * kept / weights.sum() if kept > 0 else weights


def forecast_samples_from_experiences(
    experiences: Sequence, tokenizer, config: CoPEConfig, n: int
) -> Tuple[List[ForecastSample], Dict[str, float]]:
    """Gate, weigh and build the forecast samples of a rollout (OpenRLHF experiences with ``index`` set)."""
    rows = unpadded_trajectories(experiences)
    rewards = torch.tensor([float(r) for e in experiences for r in e.rewards])[
        torch.tensor([p for e in experiences for p in e.index]).argsort()
    ]
    keep = trajectory_gate(rewards, n, config.action_forecast_gate, config.action_forecast_success_threshold)
    weights = group_norm_weights(keep, n) if config.action_forecast_group_norm else keep.float()
    samples = []
    for position in keep.nonzero().flatten().tolist():
        tokens, turns = rows[position]
        samples += build_forecast_samples(
            tokens, turns, tokenizer, config.action_forecast_k, config.action_forecast_layout,
            config.action_forecast_skip_invalid, row=position, weight=float(weights[position]),
        )
    metrics = {"cope/forecast_samples": len(samples), "cope/forecast_kept_frac": float(keep.float().mean())}
    return samples, metrics


def collate_forecast_samples(
    samples: Sequence[ForecastSample], pad_token_id: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids, attention_mask, loss_mask`` (S, L) and ``weights`` (S,)."""
    length = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), length), dtype=torch.long)
    for i, s in enumerate(samples):
        input_ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
        attention_mask[i, : len(s.input_ids)] = 1
        loss_mask[i, : len(s.loss_mask)] = torch.tensor(s.loss_mask)
    return input_ids, attention_mask, loss_mask, torch.tensor([s.weight for s in samples])


def forecast_nll(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, weights: torch.Tensor, coef: float = 1.0
) -> torch.Tensor:
    """L_AF from the model's logits on collated samples (logits at j predict input_ids at j+1)."""
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_nll = -log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = loss_mask[:, 1:].float()
    total = mask.sum()
    if total == 0:
        return logits.sum() * 0.0
    return coef * (weights.float().unsqueeze(1) * token_nll * mask).sum() / total


def trajectory_branches(
    samples: Sequence[ForecastSample], ends: Optional[Sequence[int]] = None
) -> List[Tuple[List[int], List[int], List[Branch]]]:
    """Branch packing of forecast samples, per trajectory (``sample.row``): the indices of its samples, its trunk
    (the longest ``input_ids[:prefix_len]`` among them, the trajectory's own tokens) and one branch per sample,
    ``input_ids[prefix_len:end]`` at positions ``prefix_len, ...``, seeing the trunk's first ``prefix_len``
    tokens. ``ends[i]`` cuts sample i (default: its length)."""
    groups: Dict[int, List[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.row, []).append(i)
    out = []
    for members in groups.values():
        longest = max(members, key=lambda i: samples[i].prefix_len)
        trunk = samples[longest].input_ids[: samples[longest].prefix_len]
        branches = []
        for i in members:
            s = samples[i]
            if s.input_ids[: s.prefix_len] != trunk[: s.prefix_len]:
                raise ValueError(
                    f"forecast samples of trajectory {s.row} do not share its tokens (input_ids[:prefix_len]); "
                    "give each trajectory its own row number"
                )
            end = len(s.input_ids) if ends is None else ends[i]
            branches.append(Branch(s.input_ids[s.prefix_len : max(end, s.prefix_len)], s.prefix_len, s.prefix_len))
        out.append((members, trunk, branches))
    return out


def branch_columns(start: int, prefix_len: int, js: torch.Tensor) -> torch.Tensor:
    """Columns holding positions ``js`` of a sample whose branch starts at column ``start`` (its prefix is the
    trunk's start)."""
    return torch.where(js < prefix_len, js, start + js - prefix_len)


@dataclass
class PackedForecast:
    rows: PackedRows
    logit_index: torch.Tensor  # (N, 2): (row, column) of the logits predicting each target token
    labels: torch.Tensor  # (N,) the target tokens
    weights: torch.Tensor  # (N,) their sample's weight


def pack_forecast_samples(samples: Sequence[ForecastSample]) -> PackedForecast:
    """Forecast samples as branches off their trajectories (``trajectory_branches``), one packed row per
    trajectory, with every target token's label, weight and the place of the logits that predict it."""
    groups = trajectory_branches(samples)
    rows = pack_rows([trunk for _, trunk, _ in groups], [branches for _, _, branches in groups])
    places = {i: (r, b) for r, (members, _, _) in enumerate(groups) for b, i in enumerate(members)}
    index, labels, weights = [], [], []
    for i, s in enumerate(samples):
        row, branch = places[i]
        mask = torch.as_tensor(s.loss_mask[1:], dtype=torch.bool)
        js = mask.nonzero().flatten()  # logits at j predict input_ids[j + 1]
        columns = branch_columns(rows.column(row, branch, 0), s.prefix_len, js)
        index.append(torch.stack([torch.full_like(js, row), columns], 1))
        labels.append(torch.as_tensor(s.input_ids[1:], dtype=torch.long)[mask])
        weights.append(torch.full((len(js),), float(s.weight)))
    cat = lambda parts, **kw: torch.cat(parts) if parts else torch.zeros((0,), **kw)  # noqa: E731
    index = cat(index, dtype=torch.long).reshape(-1, 2)
    return PackedForecast(rows, index, cat(labels, dtype=torch.long), cat(weights))


def packed_forecast_nll(logits: torch.Tensor, packed: PackedForecast, coef: float = 1.0) -> torch.Tensor:
    """L_AF from the logits of the packed rows; equals ``forecast_nll`` on the same samples collated."""
    if len(packed.labels) == 0:
        return logits.sum() * 0.0
    index = packed.logit_index.to(logits.device)
    log_probs = torch.log_softmax(logits[index[:, 0], index[:, 1]].float(), dim=-1)
    token_nll = -log_probs.gather(-1, packed.labels.to(logits.device).unsqueeze(-1)).squeeze(-1)
    return coef * (packed.weights.to(logits.device) * token_nll).sum() / len(packed.labels)


def forecast_loss(
    logits_fn: Callable,
    samples: Sequence[ForecastSample],
    coef: float = 1.0,
    pad_token_id: int = 0,
    branch_pack: bool = False,
    block_mask: BlockMaskFn = dense_mask,
    device=None,
) -> torch.Tensor:
    """L_AF of ``samples`` through ``logits_fn(input_ids, attention_mask, position_ids, keep)`` (with gradient,
    see ``info_gain.LogitsFn``): the samples collated and run one by one row (the reference, full logits), or,
    with ``branch_pack``, as branches off their trajectories, ``logits_fn`` getting ``block_mask(rows)`` as its
    attention mask and asked for the target-predicting columns only."""
    if not branch_pack:
        input_ids, attention_mask, loss_mask, weights = collate_forecast_samples(samples, pad_token_id)
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        logits = logits_fn(input_ids.to(device), attention_mask.to(device), position_ids.to(device), None)
        on = logits.device
        return forecast_nll(logits, input_ids.to(on), loss_mask.to(on), weights.to(on), coef)
    packed = pack_forecast_samples(samples)
    mask = block_mask(packed.rows)
    mask = mask.to(device) if isinstance(mask, torch.Tensor) else mask
    keep, packed = kept_logit_columns(packed)
    logits = logits_fn(packed.rows.input_ids.to(device), mask, packed.rows.position_ids.to(device), keep.to(device))
    return packed_forecast_nll(logits, packed, coef)


def kept_logit_columns(packed: PackedForecast) -> Tuple[torch.Tensor, PackedForecast]:
    """Only the columns that predict a target token need logits: (those columns, for ``logits_fn``'s ``keep``;
    the same samples with ``logit_index`` pointing into them)."""
    keep, where = logit_columns(packed.logit_index[:, 1], packed.rows.input_ids.shape[1])
    index = torch.stack([packed.logit_index[:, 0], where[packed.logit_index[:, 1]]], 1)
    return keep, dataclasses.replace(packed, logit_index=index)
