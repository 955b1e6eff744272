"""The forecast loss on a policy rank (``ForecastTraining``, mixed into ``CoPEActorPPOTrainer``), in one of two modes
(``ACTION_FORECAST_MODE``):

    L_AF = ACTION_FORECAST_COEF * sum_i w_i sum_target -log pi_theta(y | prefix) / N_target

over this rank's forecast samples (built on append for the rows the experience maker weighed; with group norm their
weights are rescaled to mean 1 over all ranks at the start of ``ppo_train``: ``_rescale_forecast_weights``).

- ``separate`` (default, as upstream CoPE): after the PPO update, a supervised pass with its own optimizer steps
  (``cope_forecast_step``), one per SFT mini-batch of ``SFT_MINI_BATCH_SIZE`` samples over all ranks (0: the PPO
  mini-batch), at the actor's learning rate times ``ACTION_FORECAST_LR_SCALE``; N_target is the mini-batch's
  target-token count over all ranks. The optimizer's state carries over, so with Adam the first forecast step replays
  most of the PPO step (its momentum) whatever the coefficient (tests/test_actor.py pins it). The pass runs the same
  number of forwards on every rank (a zero-weight stand-in where a rank has none left) and must start on a fresh
  accumulation window (it refuses a PPO pass that did not fill whole windows).
- ``joint``: the loss joins the PPO loss inside OpenRLHF's accumulation windows, with no optimizer step and no forward
  of its own: in the first PPO epoch each micro-step's training forward runs every row with its samples as branches
  after it (``_forecast_in_forward``: one packed row per trajectory under a block mask; the trunk columns are the
  logits OpenRLHF reads, unchanged), adding that micro-batch's share (``_joint_share``; N_target over the whole
  rollout and all ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Iterator, List, Tuple

import torch

from cope_rlhf.actor_forwards import _device
from cope_rlhf.branches import contiguous_span
from cope_rlhf.forecast import (ForecastSample, forecast_loss, kept_logit_columns, pack_forecast_samples,
                               packed_forecast_nll)

STAND_IN = ForecastSample([0, 0], [0, 1], row=-1, turn=0, weight=0.0)  # a forecast forward with no weight


class ForecastTraining:
    """Needs ``self.actor``, ``self.strategy``, ``self.cope``, ``self.actor_optim`` and ``CoPEActorMethods``."""

    @contextlib.contextmanager
    def _forecast_in_forward(self, forecast: List[List[ForecastSample]]) -> Iterator[Dict[str, object]]:
        """Joint mode: the policy's forward inside this block (OpenRLHF's training forward, one per micro-step)
        also runs the forecast. Row b of the micro-batch (right-padded, as OpenRLHF collates) becomes the trunk of a
        packed row with ``forecast[b]``'s samples as branches after it (``forecast.pack_forecast_samples``), under
        ``_cope_attention``; the model sees the packed rows, runs its LM head at the trunk columns [0, T) and the
        columns that predict a target only (``forecast.kept_logit_columns``), and hands back the trunk columns as
        the logits OpenRLHF reads (the same values: a trunk token sees only the trunk). Yields a dict that gets ``nll``
        (coef * sum w nll / this micro-batch's target tokens, with gradient) and ``targets`` (their count)."""
        model, found = self.actor.model, {}
        own_forward = model.__dict__.get("forward")
        run = model.forward
        rows = [[dataclasses.replace(s, row=b) for s in samples] for b, samples in enumerate(forecast)]
        temperature = getattr(self.actor, "temperature", 1.0)

        def forward(input_ids, attention_mask=None, position_ids=None, **kwargs):
            if attention_mask is None or attention_mask.dim() != 2 or len(rows) != input_ids.shape[0]:
                raise ValueError("joint forecast: the training forward must get the micro-batch's padded rows and "
                                 "their 2D attention mask (not --ds.packing_samples)")
            trunks = []
            for b in range(input_ids.shape[0]):
                first, end = contiguous_span(attention_mask[b])
                if first:
                    raise ValueError("joint forecast: the micro-batch's rows must be right-padded, as OpenRLHF "
                                     f"collates them; row {b} starts at column {first}")
                trunks.append(input_ids[b, :end].tolist())
            width = input_ids.shape[1]
            # the LM head at OpenRLHF's trunk columns and the target-predicting ones only: no loss reads the other
            # branch columns, whose full-vocabulary logits would set the joint step's peak memory at a real vocabulary
            keep, packed = kept_logit_columns(
                pack_forecast_samples([s for row in rows for s in row], trunks, width), trunk_width=width)
            mask = build(packed.rows)
            out = run(packed.rows.input_ids.to(input_ids.device),
                      attention_mask=mask.to(input_ids.device) if isinstance(mask, torch.Tensor) else mask,
                      position_ids=packed.rows.position_ids.to(input_ids.device),
                      logits_to_keep=keep.to(input_ids.device), **kwargs)
            found["nll"] = packed_forecast_nll(out["logits"], packed, self.cope.action_forecast_coef, temperature)
            found["targets"] = len(packed.labels)
            out["logits"] = out["logits"][:, :width]
            return out

        with self._cope_attention() as build:
            model.forward = forward
            try:
                yield found
            finally:
                if own_forward is None:
                    del model.forward
                else:
                    model.forward = own_forward

    def _joint_share(self, found: Dict[str, object], forecast: List[List[ForecastSample]]) -> torch.Tensor:
        """Joint mode: this micro-step's forecast loss, ``found``'s nll (a mean over the micro-batch's targets) made a
        sum over the rollout's and scaled for OpenRLHF's backward (DeepSpeed divides every loss by gas and averages
        gradients over ranks); counted into ``cope_joint_loss`` / ``cope_joint_trained`` for the log."""
        nll, targets = found.pop("nll"), found.pop("targets")
        share = nll * (targets / self.cope_joint_targets) * self._dp_size() * getattr(
            self.strategy, "accumulated_gradient", 1)
        self.cope_joint_loss += float(share.detach())
        self.cope_joint_trained += sum(len(row) for row in forecast)
        return share

    def _rescale_forecast_weights(self) -> float:
        """With group norm, every rank's forecast samples' weights scaled so that their mean over all ranks is 1
        (``forecast.forecast_weights``); returns how many samples the ranks hold (``cope/forecast_samples``)."""
        samples = self.__dict__.get("cope_forecast_samples", [])
        count, total = self._all_reduce(torch.tensor([float(len(samples)), float(sum(s.weight for s in samples))],
                                                     dtype=torch.float64), "sum").tolist()
        if self.cope.action_forecast_group_norm and total > 0:
            for s in samples:
                s.weight *= count / total
        return count

    def _forecast_parts_with_targets(self, count: int, per_window: int) -> List[Tuple[List[ForecastSample], float]]:
        """This rank's forecast samples (then forgotten) cut into ``count`` parts, each with the target-token count
        of its window of ``per_window`` consecutive parts over all ranks (its normaliser N_target). The cuts fall
        between trajectories, so that a trajectory's samples share one packed row."""
        samples = self.__dict__.pop("cope_forecast_samples", [])
        if count == 0:
            return []
        units: Dict[int, List[ForecastSample]] = {}
        for s in samples:
            units.setdefault(s.row, []).append(s)
        units = list(units.values())
        chunk = -(-len(units) // count)
        parts = [[s for unit in units[c * chunk : (c + 1) * chunk] for s in unit] for c in range(count)]
        targets = torch.tensor([float(sum(sum(s.loss_mask[1:]) for s in part)) for part in parts])
        windows = self._all_reduce(targets.reshape(-1, per_window).sum(-1), "sum")
        return [(part, float(windows[c // per_window])) for c, part in enumerate(parts)]

    def _forecast_share(self, samples: List[ForecastSample], n_target: float) -> torch.Tensor:
        """One forecast micro-step's loss, coef * sum_i w_i sum_target nll / n_target, scaled for OpenRLHF's
        backward (times dp_size * gas: DeepSpeed divides every loss by gas and averages gradients over ranks).
        Runs one forward even for an empty part (a zero-weight stand-in), so that every rank runs as many."""
        real = bool(samples) and n_target > 0
        part = samples if real else [STAND_IN]
        self.actor.train()
        with self._cope_attention() as build:
            nll = forecast_loss(self._cope_logits, part, self.cope.action_forecast_coef, build,
                                _device(self.actor.model))
        targets = sum(sum(s.loss_mask[1:]) for s in part)
        # nll is a mean over this part's targets: make it a sum over n_target
        share = nll * (targets / n_target) if real else nll * 0.0
        return share * self._dp_size() * getattr(self.strategy, "accumulated_gradient", 1)

    def _forecast_status(self, total: float, windows: int) -> Dict[str, float]:
        """``cope/forecast_loss``: L_AF per optimizer window (mean over the SFT mini-batches), from the sum of
        this rank's scaled shares (``_forecast_share``)."""
        gas_dp = self._dp_size() * getattr(self.strategy, "accumulated_gradient", 1)
        return {"cope/forecast_loss": float(self._all_reduce(torch.tensor([total / gas_dp]), "sum")[0]) / windows}

    def cope_forecast_step(self) -> Dict[str, float]:
        """Separate mode: the supervised forecast pass over this rank's samples, with its own optimizer steps.

        DeepSpeed steps the optimizer every ``gas`` micro-steps: the samples are cut into ``steps * gas``
        micro-batches, ``steps`` = SFT mini-batches (the most any rank needs), the same on every rank, so the PPO
        accumulation count stays aligned. The learning rate is scaled by ``ACTION_FORECAST_LR_SCALE`` for the
        pass, and the PPO schedule is left where it is.

        Raises RuntimeError when the PPO micro-steps since the last forecast step do not fill whole accumulation
        windows: DeepSpeed counts micro-steps across calls, so the forecast's first micro-batches would join the
        PPO pass's open window and the PPO optimizer step would land inside the forecast pass."""
        gas = getattr(self.strategy, "accumulated_gradient", 1)
        ppo_micro_steps = self.__dict__.pop("cope_ppo_micro_steps", 0)
        if ppo_micro_steps % gas:
            raise RuntimeError(
                f"the separate forecast step needs the PPO pass to fill whole gradient-accumulation windows; it ran "
                f"{ppo_micro_steps} micro-steps on this rank, not a multiple of the window ({gas} = train.batch_size / "
                f"(train.micro_batch_size x ranks)), so the PPO optimizer step would take in forecast gradients: make "
                f"rollout.batch_size x rollout.n_samples_per_prompt a multiple of train.batch_size, or use "
                f"--cope.action_forecast_mode joint")
        count = len(self.__dict__.get("cope_forecast_samples", []))
        dp_size = self._dp_size()
        mini = self.cope.sft_mini_batch_size or getattr(self.args.train, "batch_size", None) or 0
        per_rank = -(-mini // dp_size) if mini else max(count, 1)
        steps = int(self._all_reduce(torch.tensor([float(-(-count // per_rank))]), "max")[0])
        trained = float(self._all_reduce(torch.tensor([float(count)]), "sum")[0])
        if steps == 0:
            self.__dict__.pop("cope_forecast_samples", None)
            return {"cope/forecast_loss": 0.0, "cope/forecast_samples_trained": 0.0,
                    "cope/forecast_optimizer_steps": 0.0}
        parts = self._forecast_parts_with_targets(steps * gas, gas)
        engine = self.actor.model
        schedule = getattr(engine, "lr_scheduler", None)
        if schedule is not None:
            engine.lr_scheduler = None
        groups = self.actor_optim.param_groups
        learning_rates = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * self.cope.action_forecast_lr_scale
        total = 0.0
        try:
            for samples, n_target in parts:
                share = self._forecast_share(samples, n_target)
                self.strategy.backward(share, self.actor, self.actor_optim)
                self.strategy.optimizer_step(self.actor_optim, self.actor, None, name="actor")
                total += float(share.detach())
        finally:
            for group, lr in zip(groups, learning_rates):
                group["lr"] = lr
            if schedule is not None:
                engine.lr_scheduler = schedule
        return {**self._forecast_status(total, steps), "cope/forecast_samples_trained": trained,
                "cope/forecast_optimizer_steps": float(steps)}
