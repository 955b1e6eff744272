"""The driver's single controller: OpenRLHF's ``PPOTrainer`` (the Ray actor that rolls out, makes experiences and
calls the model groups) plus what an agent run reports. Training is untouched: ``train_step`` and ``fit`` run
OpenRLHF's own, and everything below only reads what they produce.

- ``rollout/<metric>`` per step, means over the step's episodes of what the agent funcs log (``episode_metrics``):
  reward, success_rate, episode_length, invalid_action_rate (replies with no parsable action, per turn),
  rejected_action_rate (actions the env refused, per turn), env_failed_rate, response_length, episodes. OpenRLHF's
  logger files them as ``train/rollout/<metric>``, next to its own ``train/rollout/reward_mean``.
- Each held-out eval also logs ``eval/<metric>`` (the same metrics over the held-out episodes) and appends one line
  per episode to ``<ckpt.path>/eval_episodes.jsonl``: ``{"step", "item_id", "success", "reward"}`` (paired
  intervals between two evals: scripts/run_report.py). A fresh run (step 0) starts the file anew.
- ``--cope.eval_first_and_last``: also evaluate before the first step (a fresh run) and after the last one (when
  ``eval.steps`` did not land on it), so that a run reports held-out success before and after training.
- ``--cope.eval_dispatch_size N``: held-out prompts whose episodes run at once (0: OpenRLHF's
  ``rollout.batch_size``); on a small machine the engine otherwise idles between turns of a few episodes.
- Seeds: every rollout and every held-out episode samples with seeds derived from (``train.seed``, the step, the
  prompt, the episode, the turn) (``cope_rlhf.seeds``): ``SeededSamplesGenerator`` (``patch`` puts it where
  OpenRLHF looks for ``SamplesGenerator``) seeds each prompt's request; this class tells it which step, and seeds
  the prompt order (H(train.seed, "prompt order") on torch's generator in this process, which the prompts dataloader
  shuffles with).
- ``COPE_TRAIN_STEP_FILE`` (environment): when set, the step being rolled out is written there (through a temporary
  name) before each rollout, for the agent funcs' horizon schedule (``HORIZON_SCHEDULE``). The file must be on a
  filesystem the rollout engines see.

``patch`` puts this class where OpenRLHF's ``train()`` looks for ``PPOTrainer`` (the synchronous trainer;
``--train.async_enable`` keeps OpenRLHF's own, without these additions).
"""

from __future__ import annotations

import collections
import json
import os
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import ray
import torch
from openrlhf.trainer.ppo_trainer import PPOTrainer, compute_eval_metrics
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from openrlhf.utils.logging_utils import init_logger

from cope_rlhf.config import CoPEConfig
from cope_rlhf.seeds import derive_seed, with_seed

logger = init_logger(__name__)
EVAL_EPISODES = "eval_episodes.jsonl"


def episode_metrics(samples) -> Dict[str, float]:
    """Means over episodes (one ``Experience`` each, as OpenRLHF's ``SamplesGenerator`` yields them) of the agent
    funcs' logs; the two action rates are per turn."""
    def mean(key):
        values = [float(s.info[key].float().mean()) for s in samples if key in s.info]
        return sum(values) / len(values) if values else 0.0

    turns = sum(float(s.info["turns"].sum()) for s in samples if "turns" in s.info)

    def per_turn(key):
        return sum(float(s.info[key].sum()) for s in samples if key in s.info) / turns if turns else 0.0

    return {"reward": mean("reward"), "success_rate": mean("success"), "episode_length": mean("turns"),
            "invalid_action_rate": per_turn("invalid_actions"), "rejected_action_rate": per_turn("rejected_actions"),
            "env_failed_rate": mean("env_failed"),
            "response_length": sum(float(s.response_length.float().mean()) for s in samples) / max(1, len(samples)),
            "episodes": float(len(samples))}


class _SeedingEngine:
    """A rollout engine's Ray handle as OpenRLHF's generator calls it, whose ``generate_responses.remote(...)`` puts
    the request seed into ``sampling_params``."""

    def __init__(self, engine: Any, generator: "SeededSamplesGenerator") -> None:
        self._engine, self._generator = engine, generator

    @property
    def generate_responses(self) -> SimpleNamespace:
        def remote(*args: Any, prompt: Any, label: Any, sampling_params: Any, **kwargs: Any) -> Any:
            params = with_seed(sampling_params, self._generator.request_seed(prompt, label))
            return self._engine.generate_responses.remote(*args, prompt=prompt, label=label, sampling_params=params,
                                                          **kwargs)

        return SimpleNamespace(remote=remote)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class SeededSamplesGenerator(SamplesGenerator):
    """OpenRLHF's generator, with a request seed (``cope_rlhf.seeds``) on the ``sampling_params`` each rollout
    engine gets, and a batch's episodes returned in the order their prompts were dispatched: OpenRLHF collects them
    as they finish, so the order of the groups in a batch, and with it every float sum of the update, varied from
    run to run. ``seed_phase`` ("rollout" or "eval", step) is set by ``CoPEPPOTrainer``."""

    def __init__(self, strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines: List) -> None:
        super().__init__(strategy, prompts_dataloader, eval_dataloader, tokenizer,
                         [_SeedingEngine(e, self) for e in vllm_engines or []])
        self.seed_base = strategy.args.train.seed
        self.seed_phase: Tuple[str, int] = ("rollout", 0)
        self._seen: Dict[Tuple[str, str], int] = collections.Counter()
        self._order: Dict[Tuple[str, str], int] = {}

    def request_seed(self, prompt: Any, label: Any) -> int:
        key = (str(prompt), str(label))
        occurrence = self._seen[key]
        self._seen[key] += 1
        return derive_seed(self.seed_base, *self.seed_phase, prompt, label, occurrence)

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        self._seen.clear()
        for key in zip(map(str, prompts), map(str, labels)):
            self._order.setdefault(key, len(self._order))
        return super()._dispatch_prompts_to_vllm(prompts, labels, images=images, **generate_kwargs)

    def _generate_vllm(self, dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs):
        self._order = {}
        experiences, consumed, exhausted = super()._generate_vllm(dataloader_iter, num_prompts, dynamic_filtering,
                                                                  **generate_kwargs)
        order = self._order
        experiences.sort(key=lambda e: order.get((str(e.prompts[0]), str(e.labels[0])), len(order)))
        return experiences, consumed, exhausted


def write_step_file(path: str, step: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(path + ".tmp", path)


class _CoPEPPOTrainer(PPOTrainer.__ray_actor_class__):
    def __init__(self, pretrain: str, strategy: Any, *args, **kwargs):
        # Not redundant: Ray ships the actor's __init__ to the worker. Without this one it ships OpenRLHF's, by value,
        # with its own copy of PPOTrainer in ``super()``, while this class (by reference) derives from the worker's
        # PPOTrainer: "super(type, obj): obj must be an instance or subtype of type".
        # The prompt order: this process has no torch process group, so OpenRLHF's prompts dataloader shuffles with
        # torch's global generator (not a DistributedSampler with the run's seed), which nothing else here seeds.
        torch.manual_seed(derive_seed(strategy.args.train.seed, "prompt order"))
        super().__init__(pretrain, strategy, *args, **kwargs)

    @property
    def cope(self) -> CoPEConfig:
        return CoPEConfig.from_args(self.args)

    def _announce_step(self, step: int) -> None:
        """``step`` is the one rolled out next: for its seeds (``SeededSamplesGenerator``) and the agent funcs' step
        file."""
        self.samples_generator.seed_phase = ("rollout", step)
        path = os.environ.get("COPE_TRAIN_STEP_FILE")
        if path:
            write_step_file(path, step)

    def fit(self, global_step: int = 0) -> None:
        states = self.init_checkpoint_states()
        start = states["global_step"] or global_step
        self._announce_step(start)
        if start == 0:
            os.makedirs(self.args.ckpt.path, exist_ok=True)
            open(os.path.join(self.args.ckpt.path, EVAL_EPISODES), "w").close()
        evaluating = self.cope.eval_first_and_last and self.eval_dataloader is not None
        if evaluating and start == 0:
            self.evaluate(0, **self._eval_kwargs())
        self.last_step, self.last_eval_step = start, None
        super().fit(global_step)
        if evaluating and self.last_step > start and self.last_eval_step != self.last_step:
            self.evaluate(self.last_step, **self._eval_kwargs())

    def _eval_kwargs(self) -> dict:
        """What OpenRLHF's ``fit`` passes to ``evaluate``."""
        return {**self.generate_kwargs, "temperature": self.args.eval.temperature,
                "n_samples_per_prompt": self.args.eval.n_samples_per_prompt}

    def train_step(self, rollout_samples, global_step: int):
        status, step = super().train_step(rollout_samples, global_step)
        status.update({f"rollout/{k}": v for k, v in episode_metrics(rollout_samples).items()})
        self.last_step = step
        self._announce_step(step)
        return status, step

    @torch.no_grad()
    def evaluate(self, global_step, **generate_kwargs) -> Dict[str, float]:
        """OpenRLHF's evaluation (its pass@k metrics, logged under ``eval/``), plus ``episode_metrics`` and one
        ``eval_episodes.jsonl`` line per held-out episode."""
        t0 = time.time()
        args = self.args
        train_batch, phase = args.rollout.batch_size, self.samples_generator.seed_phase
        args.rollout.batch_size = self.cope.eval_dispatch_size or train_batch  # generate_eval_samples' dispatch size
        self.samples_generator.seed_phase = ("eval", global_step)
        try:
            samples: List = self.samples_generator.generate_eval_samples(**generate_kwargs)
        finally:
            args.rollout.batch_size, self.samples_generator.seed_phase = train_batch, phase
        logs = compute_eval_metrics(self.eval_dataloader, samples, generate_kwargs["n_samples_per_prompt"])
        logs.update(episode_metrics(samples))
        with open(os.path.join(args.ckpt.path, EVAL_EPISODES), "a") as f:
            for s in samples:  # a run without an agent func has no "success" (and its reward only in s.rewards)
                reward = s.info["reward"][0] if "reward" in s.info else torch.as_tensor(s.rewards).flatten()[0]
                record = {"step": global_step, "item_id": s.labels[0], "reward": float(reward)}
                if "success" in s.info:
                    record["success"] = float(s.info["success"][0])
                f.write(json.dumps(record) + "\n")
        if self.wandb_logger:
            self.wandb_logger.log_eval(global_step, logs)
        if self.tensorboard_logger:
            self.tensorboard_logger.log_eval(global_step, logs)
            self.tensorboard_logger.writer.flush()
        self.last_eval_step = global_step
        logger.info(f"held-out eval at step {global_step} in {time.time() - t0:.0f} s: success "
                    f"{logs['success_rate']:.3f} over {len(samples)} episodes")
        return logs


CoPEPPOTrainer = ray.remote(_CoPEPPOTrainer)
