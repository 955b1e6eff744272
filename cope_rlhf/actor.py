"""The CoPE policy actor: subclasses of OpenRLHF's Ray actor classes (installed by ``cope_rlhf.patch``).

``CoPEPolicyModelActor.append`` hands each experience to ``CoPEActorPPOTrainer.take_experience`` before the replay
buffer splits it. There, under the pre-update weights, the rank builds the forecast samples of the rows the experience
maker weighed (``info[FORECAST_WEIGHT_KEY]``), applies the degenerate filter's mark (``info[FILTERED_KEY]``: the row's
action mask zeroed unless information gain is on; no TE term either way), and computes the frozen signals of the batch
(``attach_frozen_signals``: information gain's token rewards and TE's members, one packed forward per trajectory). They
stay on the rank, each sample tagged with their id (``info[SIGNALS_KEY]``, the only thing the replay buffer carries).

``ppo_train`` then adds information gain's term to the advantages (``actor_info_gain``), logs the signals' metrics
and decides TE's hold (``_signals_status``), runs OpenRLHF's own ``ppo_train`` whose ``training_step`` adds TE's term
(``actor_te``) and, in joint mode, the forecast's share (``actor_forecast``) to each micro-step's loss, then in
separate mode the forecast's own pass (``actor_forecast``). ``policy_loss`` in the log keeps OpenRLHF's meaning.

With ``GRPO_FILTER_DEGENERATE`` on, filtered samples stay in the replay buffer so that every rank runs the same
micro-steps; ``training_step`` keeps OpenRLHF's step finite around them: a window with no action token gets loss 0
(normaliser 1 instead of 0/0), a micro-batch with none logs its token metrics as 0 with weight
``EMPTY_MICRO_BATCH_TOKENS``. A fully filtered window still takes its optimizer step, on a zero gradient, as stock GRPO
does on all-zero advantages. Every formula: the signal modules and docs/METHOD.md.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Dict, List, Optional

import ray
import torch
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer, PolicyModelActor
from openrlhf.utils.loss_utils import get_loss_batch_info

from cope_rlhf.actor_forecast import ForecastTraining
from cope_rlhf.actor_forwards import CoPEActorMethods
from cope_rlhf.actor_info_gain import InfoGainBonus
from cope_rlhf.actor_te import TETerm
from cope_rlhf.advantage import zero_action_mask
from cope_rlhf.batch_keys import FILTERED_KEY, FORECAST_WEIGHT_KEY, INFO_BETA_KEY, SIGNALS_KEY
from cope_rlhf.config import CoPEConfig
from cope_rlhf.forecast import ForecastSample, build_forecast_samples, load_action_format, rejected_turns
from cope_rlhf.temporal_ensemble import COUNTS, te_lambda, te_status
from cope_rlhf.turns import unpadded_trajectories

UPDATES_STATE = "cope_updates"  # checkpoint client state: PPO updates so far (TE_WARMUP_STEPS counts them)
EMPTY_MICRO_BATCH_TOKENS = 1e-9  # ppo_train's token weight for a micro-batch the filter emptied (see training_step)


class CoPEActorPPOTrainer(ForecastTraining, TETerm, InfoGainBonus, CoPEActorMethods, ActorPPOTrainer):
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
            loss_batch_info = get_loss_batch_info(self.strategy, experience.action_mask,
                                                  replay_buffer=self.replay_buffer, step=step,
                                                  dynamic_batch=self.args.train.dynamic_batch_enable)
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
                extra = extra + self._te_term(output["logits"], members, experience, kwargs, lam)
            if any(forecast):
                extra = extra + self._joint_share(found, forecast)
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
