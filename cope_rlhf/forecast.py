"""Action forecast: realized actions, forecast samples, the trajectory gate, group-norm weights, the NLL.

Realized action of a turn = ``action_format.realized_action(reply)``, where ``action_format`` is the
environment's own rule, declared by its agent func (``load_action_format``; ``agent_funcs/<env>.py``): in
general the action the env received (``chat_format.realized_action``: the first non-empty line after the last
``Action:``; an empty action: ""; a reply without ``Action:``: its last non-empty line), AppWorld the last fenced
code block, τ² the literal ``<tool_call>...</tool_call>`` span.
``action_format.is_invalid(feedback)`` reads the env's own words for a failed action (SciWorld "No known action
matches that input", ALFWorld "Nothing happens", AppWorld "Execution failed", τ² "Error..."). An agent func
without an ``action_format`` gets ``ReActFormat``.

Every turn t issues one forecast sample. Its window is turns t ... t+K-1 (fewer at the end); actions that are
empty, and with skip-invalid those whose following feedback ``is_invalid``, are dropped from it; a window left
empty issues nothing. With the k actions left (slots), the sample is token ids (the trajectory's own tokens are
reused as sampled, never re-tokenized):

    prefix  = sequence[: start of action t] without the trailing assistant header (so it ends with
              observation t's message), + user message PLAN_AHEAD(k) (turns: PLAN_AHEAD_TURNS(k)) + header
    list    : target = one assistant message "a_1\n a_2 ... \n a_k" (no spaces: one per line)
    turns   : target = a_1 as an assistant message, then for each next action a user message
              NEXT_ACTION + assistant header + a_i as an assistant message
    loss_mask = 1 on target tokens (the assistant message bodies and their end-of-turn markers)

A sample longer than ``max_length`` (``ACTION_FORECAST_MAX_LENGTH``) loses tokens from the left of its prefix
(never of the plan-ahead message or the target) and starts again at position 0, as a re-tokenized truncated
prompt would.

Gate over trajectories (win = reward > threshold; ``forecast_weights``, in the experience maker, which sees every
group): ``wins`` keeps winners, ``all`` keeps all, ``mixed``
keeps winners of groups holding both a win and a loss; ``all`` together with group norm keeps winners only (as
upstream CoPE does). Group norm: every sample of group g weighs 1/m_g, m_g = the trajectories of g that produced
samples, rescaled so that the mean weight over all samples is 1; otherwise every weight is 1.

    L_AF = coef * sum_i w_i * sum_{target tokens} -log pi_theta(y | prefix) / N_target_tokens

The loss runs branch-packed (``forecast_loss``, ``pack_forecast_samples``): a sample is its trajectory's first
``prefix_len`` tokens plus a short branch (plan-ahead message and target), so a trajectory's samples run as one row,
the trajectory once and each sample's branch after it (``cope_rlhf.branches``), the LM head only at the columns that
predict a target token. A truncated sample shares nothing (``prefix_len`` 0). The loss and its gradient equal the
per-sample computation (one collated row per sample), the reference in ``cope_rlhf/signal_references.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from cope_rlhf.branches import BlockMaskFn, Branch, PackedRows, dense_mask, logit_columns, pack_rows
from cope_rlhf.chat_format import chat_pieces, encode, realized_action
from cope_rlhf.config import CoPEConfig
from cope_rlhf.turns import Turn, unpadded_trajectories

PLAN_AHEAD = (
    "Plan ahead: list the next {k} actions you will take to make progress on the task, starting with the action "
    "you take right now, one action per line."
)
PLAN_AHEAD_TURNS = (
    "Plan ahead: give the next {k} actions you will take to make progress on the task, one action per reply, "
    "starting with the action you take right now. Reply with the action only."
)
NEXT_ACTION = "Next action?"


class ActionFormat(Protocol):
    """An environment's reading of its turns (agent funcs declare it: ``AgentExecutor.action_format()``)."""

    def realized_action(self, reply: str) -> str: ...

    def is_invalid(self, observation: str) -> bool: ...


class ReActFormat:
    """For agent funcs that declare no format: the first non-empty line after the last ``Action:`` (else the
    reply's last non-empty line); invalid = the feedback says "invalid action"."""

    realized_action = staticmethod(realized_action)

    @staticmethod
    def is_invalid(observation: str) -> bool:
        return "invalid action" in observation.lower()


@functools.lru_cache(maxsize=16)
def load_action_format(agent_func_path: Optional[str]) -> ActionFormat:
    """The action format that the agent func at ``agent_func_path`` declares (its ``AgentExecutor.action_format()``),
    loaded by path as OpenRLHF loads the file; ``ReActFormat`` when it declares none or no path is given."""
    if not agent_func_path:
        return ReActFormat()
    if not os.path.isfile(agent_func_path):
        raise FileNotFoundError(f"--train.agent_func_path {agent_func_path!r} is not a file: the CoPE forecast reads "
                                "the environment's action format from the agent func")
    spec = importlib.util.spec_from_file_location(f"cope_agent_func_{abs(hash(agent_func_path))}", agent_func_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    declared = getattr(getattr(module, "AgentExecutor", None), "action_format", None)
    return declared() if callable(declared) else ReActFormat()


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


def rejected_turns(tokens: Sequence[int], turns: Sequence[Turn], tokenizer, action_format: ActionFormat) -> List[bool]:
    """Per turn, whether the feedback after its action says the env rejected it (``action_format.is_invalid``)."""
    return [action_format.is_invalid(tokenizer.decode(tokens[turn.action_end : turn.next_obs_end],
                                                      skip_special_tokens=True)) for turn in turns]


def trajectory_actions(
    tokens: Sequence[int], turns: Sequence[Turn], tokenizer, action_format: ActionFormat, skip_invalid: bool
) -> List[Optional[str]]:
    """Per turn, its realized action, or None where it leaves the forecast (empty; rejected with skip-invalid)."""
    rejected = rejected_turns(tokens, turns, tokenizer, action_format) if skip_invalid else [False] * len(turns)
    actions = []
    for turn, refused in zip(turns, rejected):
        text = tokenizer.decode(tokens[turn.action_start : turn.action_end], skip_special_tokens=True)
        actions.append(None if refused else action_format.realized_action(text) or None)
    return actions


def build_forecast_samples(
    tokens: Sequence[int],
    turns: Sequence[Turn],
    tokenizer,
    k: int,
    layout: str = "list",
    skip_invalid: bool = False,
    row: int = 0,
    weight: float = 1.0,
    action_format: ActionFormat = ReActFormat(),
    max_length: Optional[int] = None,
) -> List[ForecastSample]:
    """Forecast samples of one trajectory; ``tokens`` are its unpadded ids, ``turns`` from ``turn_spans``."""
    if layout not in ("list", "turns"):
        raise ValueError(f"layout={layout!r}; allowed: list, turns")
    pieces = chat_pieces(tokenizer)
    header = list(pieces.header)
    tokens = list(tokens)
    actions = trajectory_actions(tokens, turns, tokenizer, action_format, skip_invalid)
    newline = encode(tokenizer, "\n")
    samples = []
    for t in range(len(turns)):
        upcoming = [(u, actions[u]) for u in range(t, min(t + k, len(turns))) if actions[u] is not None]
        if not upcoming:
            continue
        prefix = tokens[: turns[t].action_start]
        if prefix[len(prefix) - len(header) :] != header:
            raise ValueError(
                f"the tokens before turn {t} of trajectory {row} do not end with the chat template's assistant "
                f"header {tokenizer.decode(header)!r}; forecast samples need the agent's prompts rendered with "
                "the tokenizer's chat template"
            )
        plan = (PLAN_AHEAD if layout == "list" else PLAN_AHEAD_TURNS).format(k=len(upcoming))
        shared = len(prefix) - len(header)
        ids = prefix[:shared] + encode(tokenizer, pieces.user_open + plan + pieces.user_close)
        mask = [0] * len(ids)
        slots = []

        def add(piece: List[int], target: int):
            ids.extend(piece)
            mask.extend([target] * len(piece))

        for i, (slot_turn, action) in enumerate(upcoming):
            if layout == "turns" and i > 0:
                add(encode(tokenizer, pieces.user_open + NEXT_ACTION + pieces.user_close), 0)
            if layout == "turns" or i == 0:
                add(header, 0)
                add(encode(tokenizer, pieces.body_open), 1)
            elif layout == "list":
                add(newline, 1)
            start = len(ids)
            add(encode(tokenizer, action), 1)
            slots.append((slot_turn, start, len(ids)))
            if layout == "turns" or i == len(upcoming) - 1:
                add(encode(tokenizer, pieces.body_close), 1)
        cut = min(len(ids) - max_length, shared) if max_length is not None else 0
        if cut > 0:  # left-truncate the prefix; the sample no longer shares the trajectory's positions
            ids, mask, shared = ids[cut:], mask[cut:], 0
            slots = [(u, a - cut, b - cut) for u, a, b in slots]
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
        return (grouped & ~grouped.all(-1, keepdim=True)).reshape(-1)  # a winner of a group that also lost
    raise ValueError(f"gate={gate!r}; allowed: wins, all, mixed")


def rollout_gate(experiences: Sequence, config: CoPEConfig, n: int) -> torch.Tensor:
    """``trajectory_gate`` over a rollout's experiences (``index`` set): a bool per rollout position, with the
    config's gate (``all`` under group norm counts as ``wins``, as upstream's group norm counts winners only)."""
    rewards = torch.tensor([float(r) for e in experiences for r in e.rewards])[
        torch.tensor([p for e in experiences for p in e.index]).argsort()
    ]
    gate = config.action_forecast_gate
    if gate == "all" and config.action_forecast_group_norm:
        gate = "wins"
    return trajectory_gate(rewards, n, gate, config.action_forecast_success_threshold)


def forecast_weights(
    experiences: Sequence, tokenizer, config: CoPEConfig, n: int, action_format: ActionFormat = ReActFormat()
) -> Tuple[List[torch.Tensor], Dict[str, float]]:
    """Per sample of each experience (``index`` set), the weight its forecast samples get before the batch-wide
    rescale: 0 for a trajectory the gate leaves out or that issues no sample (every action dropped); else 1, or with
    group norm 1/m_g, m_g = the trajectories of its group that issue samples. The policy actor builds the samples
    (``build_forecast_samples``, rows of weight > 0) and, with group norm, rescales the weights of all ranks'
    samples to mean 1. And ``cope/forecast_kept_frac``."""
    rows = unpadded_trajectories(experiences)
    keep = rollout_gate(experiences, config, n)
    issuing = [p for p in keep.nonzero().flatten().tolist()
               if any(a is not None for a in trajectory_actions(*rows[p], tokenizer, action_format,
                                                                config.action_forecast_skip_invalid))]
    producers: Dict[int, int] = {}
    for p in issuing:
        producers[p // n] = producers.get(p // n, 0) + 1
    weight = {p: 1.0 / producers[p // n] if config.action_forecast_group_norm else 1.0 for p in issuing}
    return ([torch.tensor([weight.get(p, 0.0) for p in e.index]) for e in experiences],
            {"cope/forecast_kept_frac": float(keep.float().mean())})


def trajectory_branches(
    samples: Sequence[ForecastSample], ends: Optional[Sequence[int]] = None,
    trunks: Optional[Sequence[Sequence[int]]] = None,
) -> List[Tuple[List[int], List[int], List[Branch]]]:
    """Branch packing of forecast samples, per trajectory (``sample.row``): the indices of its samples, its trunk
    (the longest ``input_ids[:prefix_len]`` among them, the trajectory's own tokens; or, given ``trunks``, trunk
    ``sample.row`` of them, one group per trunk in their order, with or without samples) and one branch per sample,
    ``input_ids[prefix_len:end]`` at positions ``prefix_len, ...``, seeing the trunk's first ``prefix_len``
    tokens. ``ends[i]`` cuts sample i (default: its length)."""
    groups: Dict[int, List[int]] = {r: [] for r in range(len(trunks))} if trunks is not None else {}
    for i, s in enumerate(samples):
        groups.setdefault(s.row, []).append(i)
    out = []
    for row, members in groups.items():
        if trunks is not None:
            trunk = list(trunks[row])
        else:
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


def pack_forecast_samples(samples: Sequence[ForecastSample], trunks: Optional[Sequence[Sequence[int]]] = None,
                          width: int = 0) -> PackedForecast:
    """Forecast samples as branches off their trajectories (``trajectory_branches``; with ``trunks``, off row
    ``sample.row`` of them: joint mode's PPO micro-batch), one packed row per trajectory, at least ``width``
    columns wide, with every target token's label, weight and the place of the logits that predict it."""
    groups = trajectory_branches(samples, trunks=trunks)
    rows = pack_rows([trunk for _, trunk, _ in groups], [branches for _, _, branches in groups], width=width)
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


def packed_forecast_nll(logits: torch.Tensor, packed: PackedForecast, coef: float,
                        temperature: float = 1.0) -> torch.Tensor:
    """L_AF from the logits of the packed rows (``logit_index`` points at the logits that predict each label),
    divided by the rollout ``temperature`` (as OpenRLHF's ``Actor.forward`` divides the policy's)."""
    if len(packed.labels) == 0:
        return logits.sum() * 0.0
    index = packed.logit_index.to(logits.device)
    log_probs = torch.log_softmax(logits[index[:, 0], index[:, 1]].float() / temperature, dim=-1)
    token_nll = -log_probs.gather(-1, packed.labels.to(logits.device).unsqueeze(-1)).squeeze(-1)
    return coef * (packed.weights.to(logits.device) * token_nll).sum() / len(packed.labels)


def forecast_loss(
    logits_fn: Callable,
    samples: Sequence[ForecastSample],
    coef: float,
    block_mask: BlockMaskFn = dense_mask,
    device=None,
) -> torch.Tensor:
    """L_AF of ``samples`` (with gradient), as branches off their trajectories, through ``logits_fn(input_ids,
    block_mask(rows), position_ids, keep)`` (see ``info_gain.LogitsFn``), asked for the target-predicting columns
    only. What the actor trains (``CoPEActorPPOTrainer._forecast_share``)."""
    keep, packed = kept_logit_columns(pack_forecast_samples(samples))
    mask = block_mask(packed.rows)
    mask = mask.to(device) if isinstance(mask, torch.Tensor) else mask
    logits = logits_fn(packed.rows.input_ids.to(device), mask, packed.rows.position_ids.to(device), keep.to(device))
    return packed_forecast_nll(logits, packed, coef)


def kept_logit_columns(packed: PackedForecast, trunk_width: int = 0) -> Tuple[torch.Tensor, PackedForecast]:
    """Only the columns that predict a target token need logits, and columns [0, ``trunk_width``) (joint mode: the
    trunk logits OpenRLHF reads, which stay the first ``trunk_width`` kept): (those columns, for ``logits_fn``'s
    ``keep``; the same samples with ``logit_index`` pointing into them)."""
    columns = torch.cat([torch.arange(trunk_width), packed.logit_index[:, 1]])
    keep, where = logit_columns(columns, packed.rows.input_ids.shape[1])
    index = torch.stack([packed.logit_index[:, 0], where[packed.logit_index[:, 1]]], 1)
    return keep, dataclasses.replace(packed, logit_index=index)
