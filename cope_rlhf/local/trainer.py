"""``python -m cope_rlhf.local train``: GRPO (+ the CoPE signals) on one machine, from OpenRLHF's own pieces.

One training step:

    samples     = SamplesGenerator.generate_samples()           rollout.batch_size prompts x n_samples_per_prompt
                  (OpenRLHF's RolloutRayActor + vLLM, agent_funcs/<env>.py through the gateway; rollout.py)
    experiences = CoPEExperienceMaker.make_experience_batch()   OpenRLHF's forwards + advantages, then CoPE's
    status      = CoPEActorPPOTrainer.ppo_train()               OpenRLHF's PPO update (+ TE term), then the forecast
                                                                step; plain torch optimizer (strategy.py)
    engine.load_weights(policy)                                 the new weights into vLLM (weight_sync.py)

With every ``--cope.*`` switch off, each CoPE class returns what its OpenRLHF base returns (the additive claim;
tests/test_local_additive.py runs ``LocalLoop.update`` with both). Flags are OpenRLHF's ``train_ppo_ray`` flags
(same names and meanings, defaults sized for a small CPU run, see ``LOCAL_DEFAULTS``) plus the ``--cope.*`` group
and a few ``--local.*`` ones. Logged to TensorBoard each step: ``rollout/*`` (reward, success_rate,
episode_length, invalid_action_rate = replies with no parsable action, rejected_action_rate = actions the env
refused, ...), ``train/*`` (policy_loss, kl, actor_lr, actor_grad_norm, ...), every
``cope/*`` metric, ``eval/*`` on the held-out items (before training, every ``eval.steps``, and at the end).
``--ckpt.load_enable`` resumes from the newest checkpoint under ``ckpt.path`` with the same step counter,
optimizer and schedule state, prompt position and RNG state (checkpoint.py). Every held-out episode is also
appended to ``<ckpt.path>/eval_episodes.jsonl`` (step, item_id, success, reward). At the end: the policy in
``ckpt.output_dir`` and ``<ckpt.path>/summary.json`` (held-out success before/after, TensorBoard folder).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Optional

import numpy as np
import ray
import torch
from openrlhf.models import PolicyLoss
from openrlhf.trainer.ppo_utils import NaiveReplayBuffer
from openrlhf.trainer.ppo_utils.kl_controller import AdaptiveKLController, FixedKLController
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from openrlhf.utils.config import hierarchize
from tqdm import tqdm
from transformers import AutoTokenizer, get_scheduler

from cope_rlhf.actor import CoPEActorPPOTrainer
from cope_rlhf.cli.train_ppo_ray import build_parser as build_cli_parser, combination_error
from cope_rlhf.experience_maker import CoPEExperienceMaker
from cope_rlhf.local import checkpoint
from cope_rlhf.local.env_stack import EnvStack
from cope_rlhf.local.models import InProcessGroup, LocalModel, load_actor
from cope_rlhf.local.rollout import PromptStream, engine_env, read_prompts, start_engine, start_ray
from cope_rlhf.local.strategy import LocalStrategy, cuda_device_as_cpu
from cope_rlhf.local.weight_sync import state_dict_blob

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# OpenRLHF flags whose defaults suit a GPU cluster; here: a few-minute run of a small model on CPU.
LOCAL_DEFAULTS = {
    "algo.advantage.estimator": "group_norm", "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4,
    "rollout.micro_batch_size": 4, "train.micro_batch_size": 4, "train.batch_size": None,
    "actor.adam.lr": 1e-4, "actor.lr_warmup_ratio": 0.0, "actor.lr_scheduler": "constant_with_warmup",
    "algo.kl.init_coef": 0.0, "data.max_len": 2048, "rollout.max_new_tokens": 64, "eval.temperature": 0.0,
    "eval.n_samples_per_prompt": 1, "ckpt.path": "./ckpt/local", "ckpt.output_dir": "./ckpt/local_final",
}
ESTIMATORS = ("group_norm", "reinforce_baseline", "rloo", "dr_grpo", "reinforce")


@functools.lru_cache(maxsize=1)  # building OpenRLHF's parser imports its whole CLI (seconds); parsing reuses it
def build_parser() -> argparse.ArgumentParser:
    parser = build_cli_parser()  # OpenRLHF's train_ppo_ray flags + --cope.*
    parser.prog = "python -m cope_rlhf.local train"
    parser.description = __doc__.split("\n\n")[0]
    parser.set_defaults(**LOCAL_DEFAULTS)
    local = parser.add_argument_group("single machine", "the local path's own settings")
    local.add_argument("--env", required=True, help="environment: agent_funcs/<env>.py and env_gateway.servers.<env>")
    local.add_argument("--local.steps", dest="local.steps", type=int, default=10, help="training steps (rollout batches)")
    local.add_argument("--local.gateway_url", dest="local.gateway_url", default=None,
                       help="use this running gateway instead of starting one with the env server")
    local.add_argument("--local.env_replicas", dest="local.env_replicas", type=int, default=1)
    local.add_argument("--local.max_turns", dest="local.max_turns", type=int, default=None,
                       help="actions per episode (the agent func's MAX_TURNS; default: the env's own)")
    local.add_argument("--local.eval_batch_size", dest="local.eval_batch_size", type=int, default=128,
                       help="held-out prompts whose episodes run at once (each holds an env instance: keep it under "
                            "the env server's --max-instances)")
    local.add_argument("--local.num_cpus", dest="local.num_cpus", type=int, default=os.cpu_count() or 2,
                       help="CPUs Ray may use (the rollout engine takes one)")
    local.add_argument("--local.device", dest="local.device", default="cuda" if torch.cuda.is_available() else "cpu",
                       choices=["cpu", "cuda"], help="where the trainer's models live")
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and check, with OpenRLHF's own post-processing of its flags; errors exit with code 2."""
    parser = build_parser()
    flat = parser.parse_args(argv)
    agent = os.path.join(ROOT, "agent_funcs", f"{flat.env}.py")
    if getattr(flat, "train.agent_func_path") is None:
        if not os.path.exists(agent):
            parser.error(f"--env {flat.env}: there is no agent func agent_funcs/{flat.env}.py")
        setattr(flat, "train.agent_func_path", agent)
    for flag in ("actor.model_name_or_path", "data.prompt_dataset"):
        if not getattr(flat, flag):
            parser.error(f"--{flag} is required")
    estimator = getattr(flat, "algo.advantage.estimator")
    if estimator not in ESTIMATORS:
        parser.error(f"--algo.advantage.estimator {estimator}: the single-machine path has no critic; use one of "
                     f"{', '.join(ESTIMATORS)} (group_norm = GRPO)")
    problem = combination_error(flat)
    if problem:
        parser.error(problem)
    args = hierarchize(flat)
    n, rollout = args.rollout.n_samples_per_prompt, args.rollout.batch_size
    if estimator != "reinforce" and n < 2:
        parser.error(f"{estimator} compares samples of one prompt: --rollout.n_samples_per_prompt must be >= 2")
    args.train.batch_size = args.train.batch_size or rollout * n  # one optimizer step per rollout batch
    if (rollout * n) % args.train.batch_size or args.train.batch_size % args.train.micro_batch_size:
        parser.error(f"rollout.batch_size x n_samples_per_prompt ({rollout * n}) must be a multiple of "
                     f"train.batch_size ({args.train.batch_size}), and that of train.micro_batch_size "
                     f"({args.train.micro_batch_size})")
    if args.local.steps < 1 or args.local.eval_batch_size < 1:
        parser.error("--local.steps and --local.eval_batch_size must be >= 1")
    if args.train.dynamic_batch_enable or args.ds.packing_samples:
        parser.error("--train.dynamic_batch_enable / --ds.packing_samples are not supported on the single-machine path")
    # OpenRLHF's own post-processing of these flags (cli/train_ppo_ray.py)
    if args.actor.eps_clip_low_high is None:
        args.actor.eps_clip_low_high = (args.actor.eps_clip, args.actor.eps_clip)
    args.reward.remote_url = ["agent"]
    if len(args.algo.advantage.is_correction_threshold) == 1:
        args.algo.advantage.is_correction_threshold.insert(0, 0.0)
    return args


def make_actor_trainer(cls, strategy: LocalStrategy, actor, optimizer, scheduler, tokenizer):
    """OpenRLHF's ``ActorPPOTrainer`` (or CoPE's subclass) with the fields its ``__init__`` sets, minus the NCCL
    weight-sync group and the CUDA barrier that ``__init__`` also sets up (weights reach vLLM through
    ``weight_sync`` here)."""
    args = strategy.args
    trainer = object.__new__(cls)
    trainer.strategy, trainer.args, trainer.tokenizer = strategy, args, tokenizer
    trainer.generate_kwargs, trainer.dataloader_pin_memory = {}, False
    trainer.micro_train_batch_size, trainer.ema_beta = args.train.micro_batch_size, args.train.ema_beta
    trainer.actor, trainer.ema_model, trainer.actor_optim, trainer.actor_scheduler = actor, None, optimizer, scheduler
    trainer.vllm_engines, trainer.max_epochs, trainer.use_cuda_ipc = None, args.train.max_epochs, False
    trainer.actor_loss_fn = PolicyLoss(
        clip_eps_low=args.actor.eps_clip_low_high[0], clip_eps_high=args.actor.eps_clip_low_high[1],
        dual_clip=args.actor.dual_clip, token_level_loss=args.actor.loss_agg_mode == "token-mean",
        policy_loss_type=args.actor.policy_loss_type, is_correction_level=args.algo.advantage.is_correction_level,
        is_correction_mode=args.algo.advantage.is_correction_mode,
        is_correction_gating=args.algo.advantage.is_correction_gating,
        is_correction_threshold=args.algo.advantage.is_correction_threshold,
    )
    trainer.aux_loss = args.actor.aux_loss_coef > 1e-8
    with cuda_device_as_cpu(0):  # the buffer only records a device name at construction
        trainer.replay_buffer = NaiveReplayBuffer(args.train.micro_batch_size, 0, True, False, False)
    return trainer


def optimizer_steps(args) -> int:
    per_rollout = args.rollout.batch_size * args.rollout.n_samples_per_prompt // args.train.batch_size
    return args.local.steps * per_rollout * args.train.max_epochs


class LocalLoop:
    """The update half of a step: experiences and advantages, then the policy update. No rollout engine inside,
    so tests can feed it samples directly."""

    def __init__(self, args, tokenizer, model_dir: str, reference_dir: Optional[str] = None,
                 maker_cls=CoPEExperienceMaker, trainer_cls=CoPEActorPPOTrainer):
        self.args, self.tokenizer = args, tokenizer
        self.strategy = LocalStrategy(args)
        device = args.local.device
        self.policy = LocalModel(load_actor(model_dir, args.rollout.temperature, device), self.strategy)
        kl = args.algo.kl
        self.reference = (LocalModel(load_actor(reference_dir or model_dir, args.rollout.temperature, device).eval(),
                                     self.strategy) if kl.init_coef > 0 else None)
        adam = args.actor.adam
        self.optimizer = torch.optim.AdamW(self.policy.actor.parameters(), lr=adam.lr, betas=tuple(adam.betas),
                                           eps=adam.eps, weight_decay=adam.weight_decay)
        steps = optimizer_steps(args)
        self.scheduler = get_scheduler(
            args.actor.lr_scheduler, self.optimizer, num_warmup_steps=math.ceil(steps * args.actor.lr_warmup_ratio),
            num_training_steps=steps, scheduler_specific_kwargs=(
                {"min_lr_rate": args.actor.min_lr_ratio}
                if args.actor.lr_scheduler in ("cosine_with_min_lr", "cosine_warmup_with_min_lr") else {}),
        )
        self.kl_ctl = (AdaptiveKLController(kl.init_coef, kl.target, kl.horizon) if kl.target
                       else FixedKLController(kl.init_coef))
        self.maker = maker_cls(InProcessGroup(self.policy), None, None,
                               InProcessGroup(self.reference) if self.reference else None, self.kl_ctl,
                               self.strategy, tokenizer)
        self.trainer = make_actor_trainer(trainer_cls, self.strategy, self.policy.actor, self.optimizer,
                                          self.scheduler, tokenizer)
        # CoPE's forecast step asks the model engine for DeepSpeed's accumulation count, to cut its samples into
        # that many micro-batches (one optimizer step); here the count is the strategy's.
        self.policy.actor.model.gradient_accumulation_steps = lambda: self.strategy.accumulated_gradient

    def update(self, samples) -> tuple:
        """(experiences, ppo status) for one rollout batch; the policy is updated in place."""
        experiences = self.maker.make_experience_batch(samples)
        for e in experiences:  # what PolicyModelActor.append does (CoPE's takes the forecast samples first)
            if hasattr(self.trainer, "take_forecast_samples"):
                self.trainer.take_forecast_samples(e)
            self.trainer.replay_buffer.append(e)
        buffer = self.trainer.replay_buffer
        if getattr(getattr(self.trainer, "cope", None), "grpo_filter_degenerate", False):
            # Filtered samples (action mask all zero) carry no loss: leaving them out saves their forward and
            # backward. (The Ray path keeps them, for equal micro-steps on every rank, and relies on
            # CoPEActorPPOTrainer.training_step to keep those steps finite; when everything is filtered it takes a
            # zero-gradient optimizer step where this path takes none.)
            buffer.items = [item for item in buffer.items if item.action_mask.any()]
        self.policy.actor.train()
        micro_batches = len(buffer.items) // self.args.train.micro_batch_size  # ppo_train drops a last partial one
        if micro_batches:
            rollout = self.args.rollout.batch_size * self.args.rollout.n_samples_per_prompt
            self.strategy.set_window(micro_batches, rollout // self.args.train.batch_size)
            with cuda_device_as_cpu():
                status = self.trainer.ppo_train(self.kl_ctl.value)
        else:  # every group filtered out: no PPO step
            status = self.skip_ppo(experiences)
        buffer.clear()
        if "kl" in status:
            self.kl_ctl.update(status["kl"], self.args.rollout.batch_size * self.args.rollout.n_samples_per_prompt)
        return experiences, status

    def skip_ppo(self, experiences) -> Dict[str, float]:
        """No PPO step; the batch's metrics as ppo_train would report them, and the forecast step (its samples
        come from trajectories that the filter keeps for the forecast)."""
        status = {"ppo_skipped": 1.0}
        for key in experiences[0].info:
            values = [e.info[key] for e in experiences if isinstance(e.info.get(key), torch.Tensor)]
            if values:
                status[key] = float(torch.cat([v.float().flatten() for v in values]).mean())
        if isinstance(self.trainer, CoPEActorPPOTrainer):
            self.trainer.cope_updates = getattr(self.trainer, "cope_updates", 0) + 1
            if self.trainer.cope.action_forecast_enable:
                status.update(self.trainer.cope_forecast_step())
        return status

    def state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "kl_coef": self.kl_ctl.value,
                "cope_updates": getattr(self.trainer, "cope_updates", 0)}

    def load_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_ctl.value = state["kl_coef"]
        self.trainer.cope_updates = state["cope_updates"]


def episode_metrics(samples) -> Dict[str, float]:
    """Means over episodes (one ``Experience`` each, as SamplesGenerator yields them) of the agent funcs' logs."""
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


def write_step_file(path: str, step: int) -> None:
    """The agent funcs' COPE_TRAIN_STEP_FILE (horizon schedules): written through a temporary name."""
    with open(path + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(path + ".tmp", path)


class Run:
    """A whole local run: env stack, Ray + engine, the loop, logging, eval and checkpoints."""

    def __init__(self, args):
        self.args = args
        self.generate_kwargs = dict(do_sample=True, max_len=args.data.max_len,
                                    max_new_tokens=args.rollout.max_new_tokens,
                                    temperature=args.rollout.temperature, top_p=args.rollout.top_p)

    def log(self, step: int, metrics: Dict[str, float], prefix: str) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(float(value)):
                tag = key if key.startswith("cope/") else f"{prefix}/{key}"
                self.writer.add_scalar(tag, float(value), step)
        self.writer.flush()

    def evaluate(self, step: int) -> Dict[str, float]:
        args = self.args
        if not args.eval.dataset:
            return {}
        self.generator.eval_dataloader = PromptStream(self.eval_rows, 0, shuffle=False, endless=False)
        kwargs = dict(self.generate_kwargs, temperature=args.eval.temperature,
                      n_samples_per_prompt=args.eval.n_samples_per_prompt)
        # OpenRLHF's eval dispatches rollout.batch_size prompts at a time, one batch after the other; on a small
        # machine vLLM then idles between turns. The local path dispatches local.eval_batch_size at a time.
        train_batch, args.rollout.batch_size = args.rollout.batch_size, args.local.eval_batch_size
        try:
            samples = self.generator.generate_eval_samples(**kwargs)
        finally:
            args.rollout.batch_size = train_batch
        with open(os.path.join(args.ckpt.path, "eval_episodes.jsonl"), "a") as f:  # per item: paired intervals
            for s in samples:
                f.write(json.dumps({"step": step, "item_id": s.labels[0], "success": float(s.info["success"][0]),
                                    "reward": float(s.info["reward"][0])}) + "\n")
        metrics = episode_metrics(samples)
        self.log(step, metrics, "eval")
        return metrics

    def sync_weights(self) -> None:
        ray.get(self.engine.load_weights.remote(state_dict_blob(self.loop.policy.actor.model)), timeout=600)

    def save(self, step: int) -> str:
        state = {**self.loop.state(), "prompt_position": self.stream.position}
        return checkpoint.save(self.args.ckpt.path, step, self.loop.policy.actor.model, self.tokenizer, state,
                               self.args.ckpt.max_num)

    def restore(self) -> int:
        """Seeds, tokenizer, prompts and the loop, from the newest checkpoint with ``--ckpt.load_enable``; returns
        the step to start from."""
        args = self.args
        random.seed(args.train.seed)
        np.random.seed(args.train.seed)
        torch.manual_seed(args.train.seed)
        model_dir = args.actor.model_name_or_path
        self.resumed = checkpoint.latest(args.ckpt.path) if args.ckpt.load_enable else None
        if args.ckpt.load_enable and self.resumed is None:
            print(f"[local] --ckpt.load_enable: no checkpoint under {args.ckpt.path}; starting from {model_dir}")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rows = read_prompts(args.data.prompt_dataset)
        self.eval_rows = read_prompts(args.eval.dataset) if args.eval.dataset else []
        policy_dir = os.path.join(self.resumed, "model") if self.resumed else model_dir
        self.loop = LocalLoop(args, self.tokenizer, policy_dir, model_dir)
        start, position = 0, 0
        if self.resumed:
            state = checkpoint.load(self.resumed)  # also restores the RNG states
            self.loop.load_state(state)
            start, position = state["step"], state["prompt_position"]
            print(f"[local] resumed from {self.resumed}: step {start}")
        self.stream = PromptStream(rows, args.train.seed, position)
        return start

    def __call__(self) -> Dict[str, float]:
        args = self.args
        start = self.restore()
        self.step_file = os.path.join(tempfile.mkdtemp(prefix="cope-local-"), "train_step")
        write_step_file(self.step_file, start)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(args.logger.tensorboard_dir or os.path.join(args.ckpt.path, "tensorboard"))
        try:
            with EnvStack(args.env, args.local.gateway_url, args.local.env_replicas) as stack:
                env_vars = {"COPE_GATEWAY_URL": stack.url, "COPE_TRAIN_STEP_FILE": self.step_file,
                            **engine_env(args.local.device == "cuda")}
                if args.local.max_turns:
                    env_vars["MAX_TURNS"] = str(args.local.max_turns)
                start_ray(args.local.num_cpus, env_vars)
                try:
                    return self.train(start)
                finally:
                    ray.shutdown()
        finally:
            self.writer.close()
            shutil.rmtree(os.path.dirname(self.step_file), ignore_errors=True)

    def train(self, start: int) -> Dict[str, float]:
        args = self.args
        t0 = time.time()
        self.engine = start_engine(args.actor.model_name_or_path, args.train.agent_func_path, args.data.max_len, args.train.seed,
                                   args.vllm.enable_prefix_caching, gpu=args.local.device == "cuda")
        print(f"[local] rollout engine up in {time.time() - t0:.0f} s")
        if self.resumed:
            self.sync_weights()
        self.generator = SamplesGenerator(self.loop.strategy, self.stream, None, self.tokenizer, [self.engine])
        summary = {}
        os.makedirs(args.ckpt.path, exist_ok=True)
        if start == 0:  # a fresh run's held-out episodes replace an earlier run's (as its summary.json does)
            open(os.path.join(args.ckpt.path, "eval_episodes.jsonl"), "w").close()
        if start == 0 and args.eval.dataset:
            summary["eval_before"] = self.evaluate(0)["success_rate"]
        bar = tqdm(range(start, args.local.steps), initial=start, total=args.local.steps, desc="train steps")
        for step in bar:
            write_step_file(self.step_file, step)
            t = time.time()
            samples, *_ = self.generator.generate_samples(**self.generate_kwargs)
            rollout = {**episode_metrics(samples), "time_s": time.time() - t}
            t = time.time()
            _, status = self.loop.update(samples)
            self.sync_weights()
            status["time_s"] = time.time() - t
            self.log(step + 1, rollout, "rollout")
            self.log(step + 1, status, "train")
            bar.set_postfix(reward=f"{rollout['reward']:.3f}", success=f"{rollout['success_rate']:.2f}",
                            loss=f"{status.get('policy_loss', 0.0):.4f}")
            done = step + 1
            if args.eval.steps > 0 and done % args.eval.steps == 0 and done < args.local.steps:
                self.evaluate(done)
            if args.ckpt.save_steps > 0 and done % args.ckpt.save_steps == 0:
                self.save(done)
        if args.eval.dataset:
            summary["eval_after"] = self.evaluate(args.local.steps)["success_rate"]
        if not (args.ckpt.save_steps > 0 and args.local.steps % args.ckpt.save_steps == 0):
            self.save(args.local.steps)  # the last step is always checkpointed (once)
        self.loop.policy.actor.model.save_pretrained(args.ckpt.output_dir)
        self.tokenizer.save_pretrained(args.ckpt.output_dir)
        summary.update(steps=args.local.steps, tensorboard_dir=self.writer.log_dir, model=args.ckpt.output_dir)
        with open(os.path.join(args.ckpt.path, "summary.json"), "w") as f:
            json.dump(summary, f)
        print("[local] summary " + json.dumps(summary))
        return summary


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    return Run(parse_args(argv))()


if __name__ == "__main__":
    main(sys.argv[1:])
