"""Actor-side CoPE additions: subclasses of OpenRLHF's Ray actor classes (installed by ``cope_rlhf.patch``).

In the PPO loss, per micro-batch (``CoPEActorPPOTrainer.training_step``, around OpenRLHF's own method):

    loss = OpenRLHF's loss (PPO + KL + entropy ...)  +  lambda_step * L_TE
    L_TE = mean over the micro-batch's covered action tokens of sum_v [q - p - p log(q/p)],  p = pi_theta
    q    = temporal_ensemble.mixture_target(pi_frozen, members, eta),  lambda_step = te_lambda(config, step)

The frozen signals are the actor's own. ``CoPEPolicyModelActor.append`` computes them when an experience arrives,
before the update, so under the pre-update weights (``take_experience`` → ``attach_frozen_signals``: one ``cope_frozen_signals`` call, one
packed forward per trajectory serving both signals): information gain's per-token intrinsic reward, and the TE
members of the list-layout forecast samples of a ``TE_TRAJ_SUBSAMPLE`` fraction of the trajectories. They stay on
the rank, each sample tagged with their id (``info[SIGNALS_KEY]``, a per-sample tensor: the replay buffer carries
nothing else of them). At the start of ``ppo_train`` the information-gain term joins the advantages,

    A += beta_g * (x - mean x) / std x   on action tokens      (advantage.add_info_bonus)

with beta_g from the experience maker (``info[INFO_BETA_KEY]``) and mean, std over every action token of the batch,
all ranks (``cope/info_reward_mean``, ``cope/info_turns_scored``); ``training_step`` reads the members back by id,
and ``ppo_train`` logs their coverage (``cope/te_slots``, ``cope/te_slot_coverage``,
``cope/te_member_first_token_prob``, over all ranks) and forgets the signals. pi_frozen is taken
as the micro-batch's own logits, detached: it equals the pre-update policy exactly in the usual GRPO set-up
of one optimizer step per rollout batch (train batch = rollout batch x n, one epoch), and is the current
policy's stop-gradient otherwise (shipping the frozen full-vocabulary distribution would cost
covered tokens x vocabulary floats per sample). With lambda 0 the KL is computed without gradient, for the log.
The loss is added by wrapping ``actor_loss_fn`` for the duration of the call; ``policy_loss`` in the log keeps
OpenRLHF's meaning (the TE term is logged as ``cope/te_kl``).

With ``GRPO_FILTER_DEGENERATE`` on, filtered samples (action mask zeroed on append, ``info[FILTERED_KEY]``, after
their forecast samples are built) stay in the replay buffer, so that
every rank runs the same micro-steps; ``training_step`` keeps OpenRLHF's step finite around them: a window with no
action token gets loss 0 (normaliser 1 instead of 0/0), a micro-batch with none logs its token metrics as 0 with
weight ``EMPTY_MICRO_BATCH_TOKENS`` (OpenRLHF's ``ppo_train`` would divide by zero). A fully filtered window still
takes its optimizer step, on a zero gradient, as stock GRPO does on all-zero advantages.

The forecast loss, over this rank's forecast samples (built on append, ``take_experience``, for the rows the
experience maker weighed, ``info[FORECAST_WEIGHT_KEY]`` > 0; with group norm their weights are rescaled to mean 1
over all ranks at the start of ``ppo_train``), in one of two modes (``ACTION_FORECAST_MODE``):

    L_AF = ACTION_FORECAST_COEF * sum_i w_i sum_target -log pi_theta(y | prefix) / N_target

- ``separate`` (default, as upstream CoPE): after the PPO update (``ppo_train``), a supervised pass with its own
  optimizer steps, one per SFT mini-batch of ``SFT_MINI_BATCH_SIZE`` samples over all ranks (0: the PPO
  mini-batch, ``train.batch_size``), at the actor's learning rate times ``ACTION_FORECAST_LR_SCALE``; N_target is
  the mini-batch's target-token count over all ranks. Beware: the optimizer's state carries over, so with Adam
  the first forecast step replays most of the PPO step (its momentum) whatever the coefficient: turning the
  forecast on then nearly doubles the PPO update (tests/test_actor.py pins it).
- ``joint``: the forecast loss joins the PPO loss inside OpenRLHF's accumulation windows, no optimizer step of
  its own, and no forward of its own either: a row's forecast samples ride with it (under its id,
  ``info[SIGNALS_KEY]``), and in the first PPO epoch each micro-step's training forward runs every row with its
  samples as branches after it (``_forecast_in_forward``: one packed row per trajectory under a block mask; the
  trunk columns are the logits OpenRLHF reads, unchanged), adding that micro-batch's share (N_target over the whole
  rollout and all ranks). One trunk pass serves both losses (``benchmarks/signal_cost.py``, cell (c)).

The separate pass runs the same number of forecast forwards on every rank (a rank with nothing left runs a
zero-weight stand-in), as ZeRO-3's parameter gathering requires; joint mode adds no forward. The separate pass must
also start on a fresh accumulation window: ``cope_forecast_step`` counts the PPO pass's micro-steps and refuses a
count that is not a multiple of the window (DeepSpeed would otherwise take the PPO optimizer step inside the
forecast pass, on both gradients mixed).

``cope_frozen_signals`` (no gradient, pre-update weights) returns the information-gain token rewards and the TE
members of a batch, from ``frozen_signals.frozen_signals``: one packed forward per trajectory, its turns and
forecast samples as branches under a block mask (``cope_rlhf.branches``). The forecast loss is packed the same way
(``forecast.forecast_loss``). For both the model is switched by ``block_attention`` to an attention implementation
that takes a block mask (flash attention cannot), for the whole call, backward included (gradient checkpointing
re-runs the forward there). Ring attention (``ds.ring_attn_size > 1``,
the sequence split over ranks, so no rank holds a whole row to mask) is refused, as the CLI refuses it. All logits
here are the model's, divided by the rollout temperature as OpenRLHF's ``Actor.forward`` does. Each call runs as
many forwards on every data-parallel rank as the busiest rank needs (``_same_forward_count``: the others run
one-token dummies), although ranks hold different rows: under ZeRO-3 uneven counts would hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import ray
import torch
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer, PolicyModelActor
from openrlhf.utils.loss_utils import get_loss_batch_info

from cope_rlhf.advantage import add_info_bonus, zero_action_mask
from cope_rlhf.branches import BlockMaskFn, block_attention, contiguous_span
from cope_rlhf.config import CoPEConfig
from cope_rlhf.forecast import (ForecastSample, build_forecast_samples, forecast_loss, load_action_format,
                                pack_forecast_samples, packed_forecast_nll, rejected_turns)
from cope_rlhf.frozen_signals import frozen_signals
from cope_rlhf.temporal_ensemble import COUNTS, mixture_target, te_kl, te_lambda, te_status, trajectory_means
from cope_rlhf.turns import unpadded_trajectories

# Per-sample info tensors from the experience maker, taken out on append (they never reach the replay buffer):
FORECAST_WEIGHT_KEY = "cope_forecast_weight"  # its forecast samples' weight before the rescale; 0: none
FILTERED_KEY = "cope_filtered"  # the degenerate-group filter took it out: its action mask is zeroed here
INFO_BETA_KEY = "cope_info_beta"  # its group's information-gain gate beta_g
# ... and the one the replay buffer carries, popped in training_step:
SIGNALS_KEY = "cope_signals_id"  # the id of its frozen signals on this rank
UPDATES_STATE = "cope_updates"  # checkpoint client state: PPO updates so far (TE_WARMUP_STEPS counts them)
EMPTY_MICRO_BATCH_TOKENS = 1e-9  # ppo_train's token weight for a micro-batch the filter emptied (see training_step)
STAND_IN = ForecastSample([0, 0], [0, 1], row=-1, turn=0, weight=0.0)  # a forecast forward with no weight


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


class CoPEActorMethods:
    """Methods that need only ``self.actor`` (OpenRLHF ``Actor``) and ``self.strategy``: shared by the Ray
    policy actor and the CPU stand-in used in tests."""

    def _dp_size(self) -> int:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1  # DP only (CLI)

    def _all_reduce(self, values: torch.Tensor, op: str) -> torch.Tensor:
        return self.strategy.all_reduce(values, op) if self._dp_size() > 1 else values

    @contextlib.contextmanager
    def _same_forward_count(self) -> Iterator[None]:
        """Every data-parallel rank runs as many model forwards inside this block as the rank that runs the most.

        Why: under ZeRO-3 every forward all-gathers each layer's parameters from all ranks, so a rank that runs one
        forward more than another waits for a partner that never comes, until the process-group timeout. How many
        forwards a CoPE call runs depends on the rank's rows (turns with probes, forecast samples) and is known only
        as they run, so the ranks agree forward by forward: before each forward of ``_cope_logits`` a rank all-reduces
        MAX of 1 ("one more"); a rank whose work is done all-reduces 0 instead and, each time the answer is 1, runs a
        one-token dummy forward (output discarded), until the answer is 0 (no rank has any left). Every rank then
        runs max-over-ranks forwards and max + 1 scalar all-reduces. With one rank nothing extra runs. In nested
        blocks the outermost one counts. If the body raises, no dummies run (the other ranks then wait: the error
        raised here is the one to read)."""
        if self._dp_size() == 1 or self.__dict__.get("_cope_lockstep"):
            yield
            return
        self._cope_lockstep = True
        try:
            yield
        finally:
            self._cope_lockstep = False
        one_token = torch.zeros((1, 1), dtype=torch.long)
        with torch.no_grad():
            while self._all_reduce(torch.zeros(1), "max")[0] > 0:
                self._cope_logits(one_token, torch.ones_like(one_token), one_token, 1)

    def _cope_logits(self, input_ids, attention_mask, position_ids, keep=None) -> torch.Tensor:
        """The ``logits_fn`` of the signal modules (``info_gain.LogitsFn``): ``keep`` (column indices, or a count
        of last columns) becomes HF's ``logits_to_keep``, so the LM head runs only where logits are read."""
        if self.__dict__.get("_cope_lockstep"):
            self._all_reduce(torch.ones(1), "max")  # "one more forward here" (see _same_forward_count)
        device = _device(self.actor.model)
        if isinstance(attention_mask, torch.Tensor):  # a flex-attention BlockMask is built on the device already
            attention_mask = attention_mask.to(device)
        if isinstance(keep, torch.Tensor):
            keep = keep.to(device)
        out = self.actor.model(
            input_ids.to(device), attention_mask=attention_mask, position_ids=position_ids.to(device),
            logits_to_keep=0 if keep is None else keep,
        )
        return out["logits"].float() / getattr(self.actor, "temperature", 1.0)

    def _cope_attention(self):
        """``block_attention`` on the actor's model: an attention implementation that takes the packed rows' block
        mask (yields its builder)."""
        if self.strategy.args.ds.ring_attn_size > 1:
            raise ValueError("the CoPE signals do not support ring attention (a rank holds a slice of each row, so no "
                             "block mask can be built for it): use --ds.ring_attn_size 1")
        return block_attention(self.actor.model)

    @contextlib.contextmanager
    def _pre_update_forwards(self) -> Iterator[BlockMaskFn]:
        """The setting of the no-gradient CoPE forwards: the model in eval mode under ``_cope_attention`` (yields its
        mask builder), and the same forward count on every data-parallel rank."""
        was_training = self.actor.training
        with self._same_forward_count():
            self.actor.eval()
            try:
                with self._cope_attention() as build:
                    yield build
            finally:
                self.actor.train(was_training)

    @torch.no_grad()
    def cope_frozen_signals(self, sequences, attention_mask, action_mask, samples=None, trajectories=None,
                            rejected=None, info_gain: bool = True):
        """The pre-update signals of one batch (``frozen_signals.frozen_signals``): (information gain as (token
        rewards (B, A) on CPU, metrics), or None when ``info_gain`` is off; TE members per row, or None when
        ``samples`` is None). ``samples[i]``, ``trajectories[i]`` = (tokens, turns) and ``rejected[i]`` (per turn:
        the env rejected its action) are row i's."""
        config = CoPEConfig.from_args(self.strategy.args)
        with self._pre_update_forwards() as build:
            gain, members = frozen_signals(self._cope_logits, sequences, attention_mask, action_mask, config,
                                           info_gain, samples, trajectories, rejected, build,
                                           _device(self.actor.model))
        if gain is not None:
            rewards, _, metrics = gain
            gain = rewards.cpu(), metrics
        return gain, members


class CoPEActorPPOTrainer(CoPEActorMethods, ActorPPOTrainer):
    @property
    def cope(self) -> CoPEConfig:
        if "_cope" not in self.__dict__:
            self._cope = CoPEConfig.from_args(self.args)
        return self._cope

    def training_step(self, experience, kl_ctl: float, step: int, loss_batch_info: Optional[Dict] = None):
        self.cope_ppo_micro_steps = getattr(self, "cope_ppo_micro_steps", 0) + 1  # checked by cope_forecast_step
        if not self.cope.grpo_filter_degenerate:
            return self._cope_training_step(experience, kl_ctl, step, loss_batch_info)
        # The filter zeroes whole samples' action masks, and they stay in the replay buffer (every rank must run
        # the same number of micro-steps for DeepSpeed). OpenRLHF assumes action tokens everywhere: a window
        # with none divides the loss 0/0 (NaN gradients), a micro-batch with none logs masked means of 0/0, and
        # a micro-step with none on every rank divides by zero in ppo_train. So: an empty window's normaliser
        # becomes 1 (its loss is exactly 0: no gradient), an empty micro-batch's token metrics become 0 and weigh
        # EMPTY_MICRO_BATCH_TOKENS in ppo_train's token-weighted means (nothing next to one real token).
        if loss_batch_info is None:  # dynamic batching: OpenRLHF would compute it inside, as here
            loss_batch_info = get_loss_batch_info(self.strategy, experience.action_mask, replay_buffer=self.replay_buffer,
                                                  step=step, dynamic_batch=self.args.train.dynamic_batch_enable)
        loss_batch_info = {k: torch.where(v == 0, torch.ones_like(v), v) if isinstance(v, torch.Tensor) else v
                           for k, v in loss_batch_info.items()}
        status = self._cope_training_step(experience, kl_ctl, step, loss_batch_info)
        if not experience.action_mask.any():
            for key, weight in status["weights"].items():
                if weight == "token":
                    status["metrics"][key] = torch.zeros(())
            status["num_action_tokens"] = EMPTY_MICRO_BATCH_TOKENS
        return status

    def _cope_training_step(self, experience, kl_ctl: float, step: int, loss_batch_info: Optional[Dict]):
        """OpenRLHF's step, with the TE term and (joint mode) this micro-step's forecast share added to its loss."""
        ids = experience.info.pop(SIGNALS_KEY, None)
        signals = [self.cope_signals[int(i)] for i in ids] if ids is not None else []
        te = ids is not None and self.cope.te_enable
        members = [s["members"] for s in signals] if te else None
        # joint mode: this micro-batch's rows carry their forecast samples, popped (the first PPO epoch trains them)
        forecast = [s.pop("forecast", []) for s in signals] if "cope_joint_targets" in self.__dict__ else []
        if not te and not any(forecast):
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        lam = te_lambda(self.cope, getattr(self, "cope_updates", 0) + 1, self.__dict__.get("cope_te_held", False))
        captured = {}
        hook = self.actor.register_forward_hook(lambda module, args, out: captured.update(out=out))
        ppo_loss_fn = self.actor_loss_fn

        def loss_with_cope(*args, **kwargs):
            actor_loss, *rest = ppo_loss_fn(*args, **kwargs)
            _, output = captured.pop("out")
            extra = actor_loss.new_zeros(())
            if te:
                with torch.set_grad_enabled(lam > 0):
                    rows = self._te_kl(output["logits"], members, experience.attention_mask)
                # upstream's scale: the step's mean over its trajectories in the loss (those without members add 0),
                # with OpenRLHF's own per-sample normaliser (global_batch_size: the window's rows in the loss, all
                # ranks, / gas; dp_size undoes DeepSpeed's averaging over ranks)
                in_loss = experience.action_mask.any(dim=1).to(rows.device)
                kl = (rows * in_loss).sum() / kwargs["global_batch_size"] * kwargs["dp_size"]
                experience.info["cope/te_kl"] = (rows * in_loss).sum().detach() / in_loss.sum().clamp_min(1)
                extra = extra + lam * kl
            if any(forecast):
                # nll is a mean over this micro-batch's targets: made a sum over the rollout's, then scaled for
                # OpenRLHF's backward (DeepSpeed divides every loss by gas and averages gradients over ranks)
                nll, targets = found.pop("nll"), found.pop("targets")
                share = nll * (targets / self.cope_joint_targets) * self._dp_size() * getattr(
                    self.strategy, "accumulated_gradient", 1)
                self.cope_joint_loss += float(share.detach())
                self.cope_joint_trained += sum(len(row) for row in forecast)
                extra = extra + share
            captured["extra"] = extra
            return (actor_loss + extra, *rest)

        self.actor_loss_fn = loss_with_cope
        try:
            with contextlib.ExitStack() as stack:
                found = stack.enter_context(self._forecast_in_forward(forecast)) if any(forecast) else {}
                status = super().training_step(experience, kl_ctl, step, loss_batch_info)
        finally:
            hook.remove()
            self.actor_loss_fn = ppo_loss_fn
        if "extra" in captured:
            status["metrics"]["policy_loss"] = status["metrics"]["policy_loss"] - captured["extra"].detach()
        return status

    @contextlib.contextmanager
    def _forecast_in_forward(self, forecast: List[List[ForecastSample]]) -> Iterator[Dict[str, object]]:
        """Joint mode: the policy's forward inside this block (OpenRLHF's training forward, one per micro-step)
        also runs the forecast. Row b of the micro-batch (right-padded, as OpenRLHF collates) becomes the trunk of a
        packed row with ``forecast[b]``'s samples as branches after it (``forecast.pack_forecast_samples``), under
        ``_cope_attention``; the model sees the packed rows and hands back the trunk columns [0, T) as the logits
        OpenRLHF reads (the same values: a trunk token sees only the trunk). Yields a dict that gets ``nll``
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
            packed = pack_forecast_samples([s for row in rows for s in row], trunks, input_ids.shape[1])
            mask = build(packed.rows)
            out = run(packed.rows.input_ids.to(input_ids.device),
                      attention_mask=mask.to(input_ids.device) if isinstance(mask, torch.Tensor) else mask,
                      position_ids=packed.rows.position_ids.to(input_ids.device), **kwargs)
            found["nll"] = packed_forecast_nll(out["logits"], packed, self.cope.action_forecast_coef, temperature)
            found["targets"] = len(packed.labels)
            out["logits"] = out["logits"][:, : input_ids.shape[1]]
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

    def take_experience(self, experience) -> None:
        """What the CoPE signals need of an experience being appended, before the replay buffer splits it: its
        forecast samples (rows of ``info[FORECAST_WEIGHT_KEY]`` > 0, that weight each, into
        ``cope_forecast_samples``), the filter's action mask (rows of ``info[FILTERED_KEY]`` zeroed, after their
        forecast samples are built, unless information gain is on: then their advantage is its term alone), then its
        frozen signals (``attach_frozen_signals``; TE reuses the forecast samples of a row when they are list-layout
        ones; a filtered row gets no TE member, whether its mask stays or not)."""
        weights = experience.info.pop(FORECAST_WEIGHT_KEY, None)
        filtered = experience.info.pop(FILTERED_KEY, None)
        te = self.cope.te_enable
        rows = unpadded_trajectories([experience]) if weights is not None or te else {}
        built: Dict[int, List[ForecastSample]] = {}
        if weights is not None:
            action_format = load_action_format(self.args.train.agent_func_path)
            for p, weight in zip(experience.index, weights.tolist()):
                if weight > 0:
                    built[p] = build_forecast_samples(
                        *rows[p], self.tokenizer, self.cope.action_forecast_k, self.cope.action_forecast_layout,
                        self.cope.action_forecast_skip_invalid, row=p, weight=weight, action_format=action_format,
                        max_length=self.cope.action_forecast_max_length)
            self.__dict__.setdefault("cope_forecast_samples", []).extend(s for row in built.values() for s in row)
        if filtered is not None and not self.cope.info_gain_enable:
            experience.action_mask = zero_action_mask(experience.action_mask, filtered)
        joint = weights is not None and self.cope.action_forecast_mode == "joint"
        if not (te or self.cope.info_gain_enable or joint):
            return
        store = self.__dict__.setdefault("cope_signals", {})
        ids = torch.arange(len(store), len(store) + len(experience.index))
        for i, p in zip(ids.tolist(), experience.index):
            store[i] = {"forecast": built.get(p, [])} if joint else {}
        experience.info[SIGNALS_KEY] = ids
        if te or self.cope.info_gain_enable:
            self.attach_frozen_signals(experience, rows, built if self.cope.action_forecast_layout == "list" else {},
                                       filtered)

    def attach_frozen_signals(self, experience, rows: Dict[int, tuple], built: Dict[int, List[ForecastSample]],
                              filtered: Optional[torch.Tensor] = None) -> None:
        """The frozen signals of an experience being appended (module docstring): info gain's token rewards and the
        TE members of its drawn trajectories (a ``TE_TRAJ_SUBSAMPLE`` fraction, drawn from ``random.Random`` seeded
        by (train.seed, the updates so far, the experience's first rollout position), less the rows ``filtered``
        marks; list-layout samples, those in ``built`` reused), from one ``cope_frozen_signals`` call; kept in
        ``cope_signals`` with each row's gate (``info[INFO_BETA_KEY]``) under the row's id (``info[SIGNALS_KEY]``,
        given by ``take_experience``), their counts in ``cope_signal_counts``."""
        te, info_gain = self.cope.te_enable, self.cope.info_gain_enable
        positions = list(experience.index)
        samples = trajectories = rejected = None
        if te:  # rows: take_experience's unpadded trajectories of the experience, by rollout position
            draw = random.Random(f"{self.args.train.seed}-{getattr(self, 'cope_updates', 0)}-{positions[0]}")
            chosen = set(draw.sample(positions, max(1, round(self.cope.te_traj_subsample * len(positions)))))
            # a row whose group the filter found degenerate has no extrinsic signal: no TE term either (upstream
            # never combines the two; with information gain on, its action mask stays for the info term)
            if filtered is not None:
                chosen -= {p for p, out in zip(positions, filtered.tolist()) if out}
            action_format = load_action_format(self.args.train.agent_func_path)
            samples = [(built[p] if p in built else build_forecast_samples(
                *rows[p], self.tokenizer, self.cope.action_forecast_k, "list", self.cope.action_forecast_skip_invalid,
                row=p, action_format=action_format, max_length=self.cope.action_forecast_max_length))
                if p in chosen else [] for p in positions]
            trajectories = [rows[p] for p in positions]
            rejected = [rejected_turns(*rows[p], self.tokenizer, action_format) if p in chosen else []
                        for p in positions]
        gain, members = self.cope_frozen_signals(experience.sequences, experience.attention_mask,
                                                 experience.action_mask, samples, trajectories, rejected,
                                                 info_gain=info_gain)
        store = self.cope_signals
        counts = self.__dict__.setdefault("cope_signal_counts", dict.fromkeys(COUNTS + ("info_turns",), 0.0))
        betas = experience.info.pop(INFO_BETA_KEY, None)
        for b, i in enumerate(experience.info[SIGNALS_KEY].tolist()):
            if info_gain:
                store[i]["intrinsic"], store[i]["beta"] = gain[0][b], betas[b]
            if te:
                store[i]["members"], row_counts = members[b]
                for key in COUNTS:
                    counts[key] += row_counts[key]
        if info_gain:
            counts["info_turns"] += gain[1]["cope/info_turns_scored"]

    def _add_info_bonus(self) -> float:
        """A += beta_g * Â_intr on the action tokens of every replay-buffer item (``advantage.add_info_bonus``),
        Â_intr z-scored over the action tokens of the whole batch, all ranks; returns their mean intrinsic reward.
        The buffer's items are right-trimmed, so each one's intrinsic row is cut to its length."""
        items = self.replay_buffer.items
        signals = [self.cope_signals[int(item.info[SIGNALS_KEY])] for item in items]
        rows = [s.pop("intrinsic")[: len(item.action_mask)] for s, item in zip(signals, items)]
        values = torch.cat([x.double()[item.action_mask.bool()] for x, item in zip(rows, items)] +
                           [torch.zeros(0, dtype=torch.float64)])
        total, squares, count = self._all_reduce(
            torch.tensor([values.sum(), values.pow(2).sum(), values.numel()], dtype=torch.float64), "sum").tolist()
        mean = total / count if count else 0.0
        std = max(squares / count - mean * mean, 0.0) ** 0.5 if count else 0.0
        for x, s, item in zip(rows, signals, items):
            item.advantages = add_info_bonus(item.advantages, x, item.action_mask, s.pop("beta"), mean, std)
        return mean

    def _signals_status(self, info_mean: float) -> Dict[str, float]:
        """The frozen signals' metrics over this update's experiences (all appended by now), all ranks; with TE on,
        also whether ``TE_HOLD_BELOW`` holds lambda at 0 for this update (``cope_te_held``, ``cope/te_held``)."""
        names = COUNTS + ("info_turns",)
        counts = self.__dict__.pop("cope_signal_counts", dict.fromkeys(names, 0.0))
        counts = dict(zip(names, self._all_reduce(torch.tensor([counts[k] for k in names]), "sum").tolist()))
        status = {}
        if self.cope.te_enable:
            status.update(te_status(counts))
            hold = self.cope.te_hold_below
            self.cope_te_held = hold > 0 and status["cope/te_member_prob_valid"] < hold
            status["cope/te_held"] = float(self.cope_te_held)
        if self.cope.info_gain_enable:
            status.update({"cope/info_reward_mean": info_mean, "cope/info_turns_scored": counts["info_turns"]})
        return status

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

    def ppo_train(self, kl_ctl: float):
        info_mean = self._add_info_bonus() if self.cope.info_gain_enable else 0.0
        signals = self._signals_status(info_mean) if self.cope.te_enable or self.cope.info_gain_enable else {}
        forecast = self.cope.action_forecast_enable
        forecast_count = self._rescale_forecast_weights() if forecast else 0.0
        joint = forecast and self.cope.action_forecast_mode == "joint"
        if joint:  # the samples ride with their rows (_cope_training_step); N_target over the rollout, all ranks
            targets = sum(sum(s.loss_mask[1:]) for s in self.__dict__.pop("cope_forecast_samples", []))
            self.cope_joint_targets = max(float(self._all_reduce(torch.tensor([float(targets)]), "sum")[0]), 1.0)
            self.cope_joint_loss, self.cope_joint_trained = 0.0, 0
        try:
            status = super().ppo_train(kl_ctl)
        finally:
            self.__dict__.pop("cope_joint_targets", None)
        self.cope_updates = getattr(self, "cope_updates", 0) + 1
        if forecast:
            status["cope/forecast_samples"] = forecast_count
        status.update(signals)
        self.__dict__.pop("cope_signals", None)
        if joint:
            trained = float(self._all_reduce(torch.tensor([float(self.cope_joint_trained)]), "sum")[0])
            status.update({**self._forecast_status(self.cope_joint_loss, 1),
                           "cope/forecast_samples_trained": trained, "cope/forecast_optimizer_steps": 0.0})
        elif forecast:
            status.update(self.cope_forecast_step())
        return status

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


@ray.remote(num_gpus=1)
class CoPEPolicyModelActor(CoPEActorMethods, PolicyModelActor.__ray_actor_class__):
    def init_model_from_pretrained(self, *args, **kwargs):
        super().init_model_from_pretrained(*args, **kwargs)
        # TE's warm-up counts PPO updates: a resumed run continues the count its checkpoint saved
        self.trainer.cope_updates = int(self.checkpoint_states.get(UPDATES_STATE, 0))

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        client_states = {**(client_states or {}), UPDATES_STATE: getattr(self.trainer, "cope_updates", 0)}
        super().save_checkpoint(tag, client_states, metric_value=metric_value, metric_key=metric_key)

    def append(self, experience):
        self.trainer.take_experience(experience)
        super().append(experience)

    def fit(self, kl_ctl: float = 0):
        if torch.cuda.is_available():
            return super().fit(kl_ctl)
        # CPU mode: Ray grants each rank one logical CPU, so torch trains it on one thread (Ray sets
        # OMP_NUM_THREADS=1). The engines and the reference rank idle while the policy trains, so the PPO pass takes
        # the host's cores, shared among the policy ranks (WORLD_SIZE: all of them on one host).
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
        try:
            return super().fit(kl_ctl)
        finally:
            torch.set_num_threads(threads)
