"""``CoPEExperienceMaker``: OpenRLHF's ``RemoteExperienceMaker`` plus the CoPE signals, added after it.

``make_experience_batch`` = OpenRLHF's own (split, actor/ref forwards, GRPO advantages), then, each only when
its switch is on, in this order:

1. forecast samples (``ACTION_FORECAST_ENABLE``): gate, weigh and build them for the kept trajectories
   (``forecast.forecast_samples_from_experiences``, with the environment's action format from the agent func,
   ``forecast.load_action_format``); each sample's list goes into ``info[FORECAST_KEY]``, which
   ``CoPEPolicyModelActor.append`` takes out before the replay buffer. Built before the filter, so that
   groups where every trajectory won still teach the forecast.
2. degenerate-group filter (``GRPO_FILTER_DEGENERATE``): ``advantage.filter_degenerate_groups``; with
   information gain on, it removes those groups' extrinsic term only and keeps their action mask.
3. information gain (``INFO_INTRINSIC_WEIGHT > 0``) and temporal-ensemble members (``TE_ENABLE``), both under
   the pre-update weights, no gradient, in one ``cope_frozen_signals`` call per experience on the actor group
   (batched like OpenRLHF's forwards; branch-packed, a trajectory's counterfactual probes and its forecast
   samples share one packed row). Info gain: ``A = A_GRPO + beta_g * Â_intr`` by
   ``advantage.add_info_gated_advantage``. TE: list-layout forecast samples of a ``TE_TRAJ_SUBSAMPLE`` fraction
   of the trajectories (drawn from ``random.Random((train.seed, batch number))``); the top-M members of each
   covered action token go into ``info[TE_KEY]`` (positions, probs, ids, valid), read by
   ``CoPEActorPPOTrainer.training_step``.

Metrics are batch scalars broadcast to per-sample tensors in ``info`` (``cope/filtered_frac``,
``cope/info_reward_mean``, ``cope/info_beta_mean``, ``cope/info_turns_scored``, ``cope/forecast_samples``,
``cope/forecast_kept_frac``, ``cope/te_slots``, ``cope/te_slot_coverage``, ``cope/te_member_first_token_prob``):
OpenRLHF's actor averages every per-sample ``info`` tensor into its status, which reaches TensorBoard. With every
switch off this is exactly OpenRLHF's method; the one addition is a warning (``advantage.rounding_noise_frac``, once
per run) when stock group_norm meets equal rewards that it turns into rounding-made advantages, pointing to
``--cope.grpo_filter_degenerate``.
"""

from __future__ import annotations

import logging
import random
from typing import Dict, List, Tuple

import ray
import torch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from cope_rlhf.actor import FORECAST_KEY, TE_KEY
from cope_rlhf.advantage import add_info_gated_advantage, filter_degenerate_groups, rounding_noise_frac
from cope_rlhf.config import CoPEConfig
from cope_rlhf.forecast import build_forecast_samples, forecast_samples_from_experiences, load_action_format
from cope_rlhf.turns import unpadded_trajectories

logger = logging.getLogger(__name__)


class CoPEExperienceMaker(RemoteExperienceMaker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cope = CoPEConfig.from_args(self.args)
        self.cope_batches = 0  # rollout batches made so far: seeds TE_TRAJ_SUBSAMPLE's draw
        self.cope_rounding_warned = False
        needs_format = self.cope.action_forecast_enable or self.cope.te_enable
        self.action_format = load_action_format(self.args.train.agent_func_path) if needs_format else None

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
            samples, found = forecast_samples_from_experiences(experiences, self.tokenizer, self.cope, n,
                                                               self.action_format)
            metrics.update(found)
            by_row: Dict[int, list] = {}
            for s in samples:
                by_row.setdefault(s.row, []).append(s)
            for e in experiences:
                e.info[FORECAST_KEY] = [by_row.get(position, []) for position in e.index]
        if self.cope.grpo_filter_degenerate:
            metrics.update(filter_degenerate_groups(experiences, n, keep_action_mask=self.cope.info_gain_enable))
        if self.cope.info_gain_enable or self.cope.te_enable:
            intrinsic, found = self._frozen_signals(experiences)
            metrics.update(found)
            if self.cope.info_gain_enable:
                metrics.update(add_info_gated_advantage(
                    experiences, intrinsic, n, self.cope.info_intrinsic_weight, self.cope.info_gate_temp
                ))
        for e in experiences:
            for key, value in metrics.items():
                e.info[key] = torch.full((len(e.index),), float(value))
        return experiences

    def _run_on_actors(self, method_name: str, **batched) -> list:
        args = self.strategy.args
        refs = self.actor_model_group.async_run_method_batch(method_name=method_name, **batched)
        results = self._flatten_results(refs, args.ds.ring_attn_size * args.ds.tensor_parallel_size)
        if args.train.colocate_all or args.train.colocate_actor_ref:
            ray.get(self.actor_model_group.async_run_method(method_name="empty_cache"))
        return results

    def _frozen_signals(self, experiences) -> Tuple[List[torch.Tensor], Dict[str, float]]:
        """One ``cope_frozen_signals`` call per experience: the info-gain token rewards (returned, one tensor per
        experience, when info gain is on) and the TE members (into ``info[TE_KEY]``, when TE is on)."""
        te = self.cope.te_enable
        rows = unpadded_trajectories(experiences) if te else {}
        self.cope_batches += 1
        positions = sorted(rows)
        draw = random.Random(f"{self.args.train.seed}-{self.cope_batches}")
        chosen = set(draw.sample(positions, max(1, round(self.cope.te_traj_subsample * len(positions))))) if te else ()
        samples = [
            [build_forecast_samples(*rows[p], self.tokenizer, self.cope.action_forecast_k, "list",
                                    self.cope.action_forecast_skip_invalid, row=p, action_format=self.action_format,
                                    max_length=self.cope.action_forecast_max_length) if p in chosen else []
             for p in e.index] if te else None
            for e in experiences
        ]
        results = self._run_on_actors(
            "cope_frozen_signals",
            sequences=[e.sequences for e in experiences],
            attention_mask=[e.attention_mask for e in experiences],
            action_mask=[e.action_mask for e in experiences],
            samples=samples,
            trajectories=[[rows[p] for p in e.index] if te else None for e in experiences],
            info_gain=[self.cope.info_gain_enable] * len(experiences),
        )
        metrics: Dict[str, float] = {}
        if self.cope.info_gain_enable:
            metrics["cope/info_turns_scored"] = sum(m["cope/info_turns_scored"] for (_, m), _ in results)
        if te:
            for e, (_, members) in zip(experiences, results):
                e.info[TE_KEY] = [r for r, _ in members]
            found = [m for _, members in results for _, m in members]
            slots = sum(m["cope/te_slots"] for m in found)
            covered = [m["cope/te_slots"] * m["cope/te_slot_coverage"] for m in found]
            hit = sum(c * m["cope/te_member_first_token_prob"] for c, m in zip(covered, found))
            metrics.update({"cope/te_slots": slots, "cope/te_slot_coverage": sum(covered) / slots if slots else 0.0,
                            "cope/te_member_first_token_prob": hit / sum(covered) if sum(covered) else 0.0})
        return [gain for (gain, _), _ in results] if self.cope.info_gain_enable else [], metrics
