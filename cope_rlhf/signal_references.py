"""The CoPE signals computed the plain way, one forward per turn or per sample: the references that the production
path (one packed row per trajectory, ``cope_rlhf.frozen_signals`` and ``cope_rlhf.forecast.forecast_loss``) must
equal. The trainer never runs them: they cost one forward per turn (15x a GRPO step at 20 turns,
``benchmarks/signal_cost.py``); the tests and ``scripts/gpu_smoke_checks.py packed-signals`` compare against them.

- ``per_turn_info_gain``: the real rows, then one counterfactual row per scored turn with the feedback block removed
  from a 2D attention mask (``info_gain``'s formula); the same result tuple as ``frozen_signals``' info gain.
- ``per_sample_member_logits``: each forecast sample's own forward, cut around its later slots (what
  ``temporal_ensemble.collect_members`` reads).
- ``per_sample_forecast_loss``: the samples collated, right-padded, one row each, full logits (``forecast_nll``).
- ``forecast_samples_from_experiences``: a rollout's forecast samples gated, built and weighed in one process (the
  trainer splits it: gate and weights in the experience maker, ``forecast.forecast_weights``; samples and the
  rescale in each policy rank).
- ``add_info_gated_advantage``: the info-gated advantage of a whole batch in one process (the trainer splits it: the
  gates in the experience maker, the z-scored bonus in each policy rank, ``cope_rlhf.advantage``).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from cope_rlhf.advantage import group_reward_std
from cope_rlhf.branches import logit_columns
from cope_rlhf.config import CoPEConfig
from cope_rlhf.forecast import (ActionFormat, ForecastSample, ReActFormat, build_forecast_samples,
                                rollout_gate)
from cope_rlhf.info_gain import plan_probes, position_ids_for, probe_kl, spread_rewards
from cope_rlhf.temporal_ensemble import later_forecasts
from cope_rlhf.turns import turn_spans, unpadded_trajectories


def _probe_columns(probes) -> torch.Tensor:
    return torch.cat([torch.arange(p.positions[0], p.positions[1]) for p in probes])


@torch.no_grad()
def per_turn_info_gain(logits_fn, sequences, attention_mask, action_mask, probe_tokens: int = 16, max_turns: int = 8,
                       rows_per_forward: int = 16):
    """(token rewards (B, A), per-turn r_t, metrics), one counterfactual row per scored turn. Only the probe
    positions' logits are kept, so peak memory is one chunk's."""
    turns = turn_spans(action_mask, sequences.shape[1], attention_mask)
    probes = plan_probes(turns, probe_tokens, max_turns)
    position_ids = position_ids_for(attention_mask)
    real_logits = {}
    probed_rows = sorted({p.row for p in probes})
    for c in range(0, len(probed_rows), rows_per_forward):
        chunk = probed_rows[c : c + rows_per_forward]
        length = max(p.positions[1] for p in probes if p.row in chunk)
        keep, where = logit_columns(_probe_columns([p for p in probes if p.row in chunk]), length)
        logits = logits_fn(sequences[chunk, :length], attention_mask[chunk, :length], position_ids[chunk, :length],
                           keep.to(sequences.device))
        for i, row in enumerate(chunk):
            for p in probes:
                if p.row == row:
                    real_logits[p] = logits[i, where[p.positions[0] : p.positions[1]]].clone()
    values = []
    for c in range(0, len(probes), rows_per_forward):
        chunk = probes[c : c + rows_per_forward]
        rows = [p.row for p in chunk]
        length = max(p.positions[1] for p in chunk)
        masked_attention = attention_mask[rows, :length].clone()
        for i, p in enumerate(chunk):
            masked_attention[i, p.masked[0] : p.masked[1]] = 0
        keep, where = logit_columns(_probe_columns(chunk), length)
        masked_logits = logits_fn(sequences[rows, :length], masked_attention, position_ids[rows, :length],
                                  keep.to(sequences.device))
        for i, p in enumerate(chunk):
            a, b = p.positions
            values.append(float(probe_kl(real_logits[p], masked_logits[i, where[a:b]])))
    return spread_rewards(turns, probes, values, action_mask, sequences.shape[1])


@torch.no_grad()
def per_sample_member_logits(logits_fn, samples: Sequence[ForecastSample],
                             device=None) -> Tuple[List[ForecastSample], List[torch.Tensor]]:
    """The samples that forecast a later turn, trimmed to their later slots, and each one's logits there (cpu,
    float32) from a forward of its own ``input_ids[:end]``."""
    kept, cuts, trimmed = later_forecasts(samples)
    logits = []
    for s, (first, end) in zip(kept, cuts):
        ids = torch.tensor([s.input_ids[:end]], device=device)
        out = logits_fn(ids, torch.ones_like(ids), torch.arange(end, device=device)[None],
                        torch.arange(first, end, device=device))
        logits.append(out[0].float().cpu())
    return trimmed, logits


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


def forecast_nll(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, weights: torch.Tensor,
                 coef: float = 1.0) -> torch.Tensor:
    """L_AF from the model's logits on collated samples (logits at j predict input_ids at j+1)."""
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_nll = -log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = loss_mask[:, 1:].float()
    total = mask.sum()
    if total == 0:
        return logits.sum() * 0.0
    return coef * (weights.float().unsqueeze(1) * token_nll * mask).sum() / total


def per_sample_forecast_loss(logits_fn, samples: Sequence[ForecastSample], coef: float = 1.0, pad_token_id: int = 0,
                             device=None) -> torch.Tensor:
    """L_AF of ``samples`` (with gradient): collated, one row per sample, full logits."""
    input_ids, attention_mask, loss_mask, weights = collate_forecast_samples(samples, pad_token_id)
    logits = logits_fn(input_ids.to(device), attention_mask.to(device), position_ids_for(attention_mask).to(device),
                       None)
    on = logits.device
    return forecast_nll(logits, input_ids.to(on), loss_mask.to(on), weights.to(on), coef)


@torch.no_grad()
def add_info_gated_advantage(
    experiences: Sequence, intrinsic: Sequence[torch.Tensor], n: int, weight: float, gate_temp: float
) -> Dict[str, float]:
    """A += beta_g * Â_intr on action tokens; ``intrinsic[i]`` is aligned with ``experiences[i].action_mask``."""
    masks = [e.action_mask.bool() for e in experiences]
    for m, x in zip(masks, intrinsic):
        if x.shape != m.shape:
            raise ValueError(f"intrinsic reward shape {tuple(x.shape)} does not match action_mask {tuple(m.shape)}")
    values = torch.cat([x.float()[m] for x, m in zip(intrinsic, masks)])
    if values.numel() == 0:
        return {"cope/info_beta_mean": 0.0, "cope/info_reward_mean": 0.0}
    mean, std = values.mean(), values.std(unbiased=False)
    betas = [weight * torch.exp(-s.float() / gate_temp) for s in group_reward_std(experiences, n)]
    for e, x, m, beta in zip(experiences, intrinsic, masks, betas):
        bonus = beta.unsqueeze(1) * (x.float() - mean) / std.clamp_min(1e-8) * m
        e.advantages = e.advantages + bonus.to(e.advantages.dtype)
    return {"cope/info_beta_mean": float(torch.cat(betas).mean()), "cope/info_reward_mean": float(mean)}


def group_norm_weights(samples: Sequence[ForecastSample], n: int) -> List[float]:
    """Per sample 1/m_g, m_g = the trajectories of its group (rows ``row // n``) that produced samples, rescaled
    to mean 1 over the samples."""
    producers: Dict[int, set] = {}
    for s in samples:
        producers.setdefault(s.row // n, set()).add(s.row)
    raw = [1.0 / len(producers[s.row // n]) for s in samples]
    scale = len(raw) / sum(raw) if raw else 1.0
    return [w * scale for w in raw]


def forecast_samples_from_experiences(
    experiences: Sequence, tokenizer, config: CoPEConfig, n: int, action_format: ActionFormat = ReActFormat()
) -> Tuple[List[ForecastSample], Dict[str, float]]:
    """Gate, build and weigh the forecast samples of a rollout (OpenRLHF experiences with ``index`` set)."""
    rows = unpadded_trajectories(experiences)
    keep = rollout_gate(experiences, config, n)
    samples = []
    for position in keep.nonzero().flatten().tolist():
        tokens, turns = rows[position]
        samples += build_forecast_samples(
            tokens, turns, tokenizer, config.action_forecast_k, config.action_forecast_layout,
            config.action_forecast_skip_invalid, row=position, action_format=action_format,
            max_length=config.action_forecast_max_length,
        )
    if config.action_forecast_group_norm:
        for s, w in zip(samples, group_norm_weights(samples, n)):
            s.weight = w
    metrics = {"cope/forecast_samples": len(samples), "cope/forecast_kept_frac": float(keep.float().mean())}
    return samples, metrics


def assert_same_top_m(got_probs: torch.Tensor, got_ids: torch.Tensor, want_probs: torch.Tensor, want_ids: torch.Tensor,
                      atol: float = 1e-5) -> None:
    """Two (N, M) top-M distributions agree up to float noise: the same probabilities in order, and the same ids except
    where a probability ties the M-th one within ``atol`` (two such tokens may swap places, or one may be cut for the
    other, seen on an AVX2 CPU: 0.00180166715 and 0.00180166634)."""
    torch.testing.assert_close(got_probs.sort(-1).values, want_probs.sort(-1).values, atol=atol, rtol=0)
    for gp, gi, wp, wi in zip(got_probs, got_ids, want_probs, want_ids):
        near_cut = float(wp.min()) + atol
        firm = lambda p, i: {int(x) for x, y in zip(i, p) if float(y) > near_cut}  # noqa: E731
        assert firm(gp, gi) == firm(wp, wi)
        want = dict(zip(wi.tolist(), wp.tolist()))
        assert all(abs(want[x] - y) <= atol for x, y in zip(gi.tolist(), gp.tolist()) if x in want)
