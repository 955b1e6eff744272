"""``CoPEExperienceMaker``: OpenRLHF's ``RemoteExperienceMaker`` plus the CoPE signals, added after it.

``make_experience_batch`` = OpenRLHF's own (split, actor/ref forwards, GRPO advantages), then, each only when
its switch is on, in this order:

1. forecast weights (``ACTION_FORECAST_ENABLE``): gate the trajectories and weigh them (``forecast.forecast_weights``,
   with the env's action format from the agent func, ``load_action_format``) into ``info[FORECAST_WEIGHT_KEY]``;
   the policy actor builds the samples of the rows of weight > 0.
2. degenerate-group filter (``GRPO_FILTER_DEGENERATE``): ``advantage.filter_degenerate_groups`` zeroes those groups'
   advantages and returns and marks them (``info[FILTERED_KEY]``); the policy actor gives them no TE term and,
   without information gain, zeroes their action mask after building their forecast samples (so that groups where
   every trajectory won still teach the forecast); with information gain the mask stays (their whole advantage is
   the intrinsic term). When fewer than max(2, 10%) of the groups survive, it marks none: the batch stays whole
   (upstream's rule).
3. information gain's gate (``INFO_INTRINSIC_WEIGHT > 0``): ``beta_g = w * exp(-sigma_g / T)`` per sample
   (``advantage.info_gates``, from the whole batch's group rewards) into ``info[INFO_BETA_KEY]``. The intrinsic
   reward itself and the term ``beta_g * Â_intr`` are the policy actor's (``CoPEActorPPOTrainer``): it computes the
   frozen signals of the experiences it is handed (info gain and TE members in one packed forward per trajectory)
   and adds the term to their advantages before its update.

Metrics are batch scalars broadcast to per-sample tensors in ``info`` (``cope/filtered_frac``,
``cope/degenerate_frac``, ``cope/filter_kept_batch``, ``cope/info_beta_mean``, ``cope/forecast_kept_frac``):
OpenRLHF's actor averages every per-sample ``info`` tensor into its status, which reaches TensorBoard. With every
switch off this is exactly OpenRLHF's method; the one addition is a warning (``advantage.rounding_noise_frac``, once
per run) when stock group_norm meets equal rewards that it turns into rounding-made advantages, pointing to
``--cope.grpo_filter_degenerate``. With the filter on (and information gain off), a warning when every group was
degenerate in ``ALL_FILTERED_WARN`` batches in a row (then every 10th): such steps have no policy-gradient term, and
a policy that plays every prompt deterministically stays so.

``cope/kl_all_rows`` (the filter on, the KL as a loss): the mean over every row of the batch of its token-mean
KL(rollout policy || reference), by the loss's estimator. ``train/kl`` is the loss's KL, averaged over the rows left
in the loss; the filter takes the degenerate groups out of it (unless information gain keeps their masks or the
batch stays whole), so under the filter ``train/kl`` is the drift of the mixed groups only. This metric is the whole
batch's, the population ``train/kl`` has without the filter.
"""

from __future__ import annotations

import logging
from typing import Dict

import torch
from openrlhf.models.utils import compute_approx_kl
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from cope_rlhf.batch_keys import FILTERED_KEY, FORECAST_WEIGHT_KEY, INFO_BETA_KEY
from cope_rlhf.advantage import filter_degenerate_groups, info_gates, rounding_noise_frac
from cope_rlhf.config import CoPEConfig
from cope_rlhf.forecast import forecast_weights, load_action_format

logger = logging.getLogger(__name__)
# Batches in a row that the filter empties before the maker warns (then every 10th): one or two can be luck.
ALL_FILTERED_WARN = 3


class CoPEExperienceMaker(RemoteExperienceMaker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cope = CoPEConfig.from_args(self.args)
        self.cope_rounding_warned = False
        self.cope_all_filtered = 0  # batches in a row in which every group was degenerate
        self.action_format = (load_action_format(self.args.train.agent_func_path)
                              if self.cope.action_forecast_enable else None)

    @torch.no_grad()
    def make_experience_batch(self, rollout_samples):
        experiences = super().make_experience_batch(rollout_samples)
        n = self.args.rollout.n_samples_per_prompt
        if (self.args.algo.advantage.estimator == "group_norm" and n > 1 and not self.cope.grpo_filter_degenerate
                and not self.cope_rounding_warned):
            noisy = rounding_noise_frac(experiences, n)
            if noisy:
                self.cope_rounding_warned = True
                logger.warning(
                    "group_norm: in %.0f%% of this batch's groups the rewards are all equal, but their float32 mean "
                    "is not, so OpenRLHF's (r - mean) / (std + 1e-9) gives the whole group one advantage made of "
                    "rounding (up to +-60). Turn on --cope.grpo_filter_degenerate (zeroes such groups) or use "
                    "--algo.advantage.estimator dr_grpo. (Warned once per run.)", 100 * noisy)
        if not self.cope.any_enabled:
            return experiences
        metrics: Dict[str, float] = {}
        if self.cope.action_forecast_enable:
            weights, found = forecast_weights(experiences, self.tokenizer, self.cope, n, self.action_format)
            metrics.update(found)
            for e, weight in zip(experiences, weights):
                e.info[FORECAST_WEIGHT_KEY] = weight
        if self.cope.grpo_filter_degenerate:
            drops, found = filter_degenerate_groups(experiences, n)
            metrics.update(found)
            # train/kl then averages only the rows the filter leaves in the loss; no reference model (KL coef 0): no KL
            if self.args.algo.kl.use_loss and all(e.base_action_log_probs is not None for e in experiences):
                kl = [compute_approx_kl(e.action_log_probs, e.base_action_log_probs,
                                        kl_estimator=self.args.algo.kl.estimator) * e.action_mask for e in experiences]
                tokens = torch.cat([e.action_mask.sum(-1) for e in experiences])
                rows = torch.cat([k.sum(-1) for k in kl])[tokens > 0] / tokens[tokens > 0]
                metrics["cope/kl_all_rows"] = float(rows.mean()) if rows.numel() else 0.0
            for e, drop in zip(experiences, drops):
                e.info[FILTERED_KEY] = drop
            if not self.cope.info_gain_enable:
                self.cope_all_filtered = self.cope_all_filtered + 1 if found["cope/degenerate_frac"] == 1.0 else 0
                if self.cope_all_filtered == ALL_FILTERED_WARN or (self.cope_all_filtered
                                                                   and self.cope_all_filtered % 10 == 0):
                    logger.warning(
                        "grpo_filter_degenerate: in the last %d batches every group's rewards were all equal, so "
                        "those steps had no policy-gradient term (the filter keeps such a batch whole: only the KL, "
                        "forecast and TE terms trained). The policy plays each prompt the same way every time and "
                        "cannot leave that state by itself; see train/cope/degenerate_frac. Lower --cope.te_lambda "
                        "or --actor.adam.lr, or raise --rollout.n_samples_per_prompt or the sampling temperature.",
                        self.cope_all_filtered)
        if self.cope.info_gain_enable:
            betas = info_gates(experiences, n, self.cope.info_intrinsic_weight, self.cope.info_gate_temp)
            for e, beta in zip(experiences, betas):
                e.info[INFO_BETA_KEY] = beta
            metrics["cope/info_beta_mean"] = float(torch.cat(betas).mean())
        for e in experiences:
            for key, value in metrics.items():
                e.info[key] = torch.full((len(e.index),), float(value))
        return experiences
