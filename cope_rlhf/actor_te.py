"""TE's term in the PPO loss on a policy rank (``TETerm``, mixed into ``CoPEActorPPOTrainer``): the formulas are
``cope_rlhf.temporal_ensemble``'s.

Per micro-step, with the members attached on append (``attach_frozen_signals``) and OpenRLHF's loss normalisers:

    term = lambda * sum over the micro-batch's rows in the loss of trajectory_mean(KL_tok) / global_batch_size * dp_size

global_batch_size is OpenRLHF's per-sample normaliser (the window's rows in the loss, all ranks, / gas), so that after
DeepSpeed divides by gas and averages over ranks the step's term is lambda times the mean over its trajectories
(upstream's scale; rows without members add 0). pi_frozen in q is the micro-batch's own logits, detached: exactly the
pre-update policy in the usual set-up of one optimizer step per rollout batch, the stop-gradient current policy
otherwise. With lambda 0 the KL is computed without gradient, for the log (``cope/te_kl``: the mean over the
micro-batch's rows in the loss of their trajectory means).
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch

from cope_rlhf.temporal_ensemble import mixture_target, te_kl, trajectory_means


class TETerm:
    """Needs ``self.actor`` and ``self.cope``."""

    def _te_term(self, logits: torch.Tensor, members: Sequence[dict], experience, loss_kwargs: Dict,
                 lam: float) -> torch.Tensor:
        """lambda x this micro-step's share of L_TE (module docstring); logs ``cope/te_kl`` into the experience."""
        with torch.set_grad_enabled(lam > 0):
            rows = self._te_kl(logits, members, experience.attention_mask)
        in_loss = experience.action_mask.any(dim=1).to(rows.device)
        experience.info["cope/te_kl"] = (rows * in_loss).sum().detach() / in_loss.sum().clamp_min(1)
        return lam * (rows * in_loss).sum() / loss_kwargs["global_batch_size"] * loss_kwargs["dp_size"]

    def _te_kl(self, logits: torch.Tensor, members: Sequence[dict], attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,): each row's mean KL(pi_theta || q) over its covered tokens (0 without); ``logits`` of the training
        forward: (B, T, V), or with ``--ds.packing_samples`` (1, N, V) over the rows' valid tokens one row after
        another (OpenRLHF unpads row-major; ring attention, which would also slice the stream, is refused by the
        CLI)."""
        rows = torch.cat([torch.full_like(m["positions"], b) for b, m in enumerate(members)]).to(logits.device)
        positions = torch.cat([m["positions"] for m in members]).to(logits.device)
        if positions.numel() == 0:
            return logits.sum() * 0.0 + logits.new_zeros(len(members))
        if getattr(self.actor, "packing_samples", False):
            stream = attention_mask.to(logits.device).flatten().cumsum(0) - 1  # (b, t) -> its place in the stream
            policy = logits[0, stream[rows * attention_mask.shape[1] + positions - 1]]
        else:
            policy = logits[rows, positions - 1]  # the logits that predict the covered token
        probs, ids = (torch.cat([m[key] for m in members]).to(logits.device) for key in ("probs", "ids"))
        q = mixture_target(policy.detach(), probs, ids, self.cope.te_eta)
        return trajectory_means(te_kl(policy, q), rows, len(members))
