"""CPU stand-ins for OpenRLHF's DeepSpeed model actors, so that the experience maker runs for real on CPU.

Why stand-ins: OpenRLHF's ``PolicyModelActor`` / ``ReferenceModelActor`` need CUDA (``DeepspeedStrategy.
setup_distributed`` sets a CUDA device and builds a "cuda" device mesh), so they cannot start here.

- ``StandInStrategy``: stands in for ``DeepspeedStrategy``: the real hierarchical ``args`` (parsed by the CoPE
  CLI's parser), ``is_rank_0``, and backward / optimizer step with a plain torch optimizer (one rank, gas 1).
- ``CPUStandInModelActor``: a Ray actor over OpenRLHF's own ``Actor`` wrapper of a local HF checkpoint, with the
  surface the experience maker calls: ``forward`` (as ``PolicyModelActor.forward``, minus CUDA),
  ``execute_batch`` (OpenRLHF's ``BaseModelActor``), ``empty_cache``, and CoPE's remote methods, inherited from
  ``cope_rlhf.actor_forwards.CoPEActorMethods`` — the same code the CoPE policy actor runs.
- ``cpu_groups``: OpenRLHF's real ``RayActorGroup``s of one such actor each, with zero GPUs.
"""

from __future__ import annotations

from types import SimpleNamespace

import ray
import torch
from openrlhf.models import Actor
from openrlhf.trainer.ray.launcher import BaseModelActor, RayActorGroup
from transformers import AutoModelForCausalLM

from cope_rlhf.actor_forwards import CoPEActorMethods


class StandInStrategy:
    """Stand-in for OpenRLHF's DeepspeedStrategy (which needs CUDA): one rank, plain torch optimizer."""

    ring_attn_group = None
    accumulated_gradient = 1

    def __init__(self, args: SimpleNamespace):
        self.args = args

    def is_rank_0(self) -> bool:
        return True

    def print(self, *args) -> None:
        pass

    def backward(self, loss, model, optimizer) -> None:
        loss.backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model") -> None:
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()

    def get_grad_norm(self, model) -> float:
        return 0.0

    def all_reduce(self, data, op="mean"):
        return data


def load_actor(model_dir: str, temperature: float = 1.0) -> Actor:
    """OpenRLHF's ``Actor`` around a float32 HF model (``Actor(path)`` would load bf16/fp16 only)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="sdpa")
    actor = Actor(model, temperature=temperature)
    actor.packing_samples = False  # Actor sets it only when it loads the checkpoint itself
    return actor


@ray.remote
class CPUStandInModelActor(CoPEActorMethods, BaseModelActor):
    """Stand-in for PolicyModelActor / ReferenceModelActor on CPU (see the module docstring)."""

    def init_model_from_pretrained(self, strategy: StandInStrategy, model_dir: str):
        self.strategy = strategy
        self.actor = load_actor(model_dir, strategy.args.rollout.temperature).eval()

    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                mm_train_inputs_list=None):
        with torch.no_grad():
            return self.actor(sequences, action_mask, attention_mask).to("cpu")

    def empty_cache(self) -> None:
        pass

    def classes_in_use(self) -> dict:
        """Which classes OpenRLHF's modules hold in this worker process (the patch test asks)."""
        import openrlhf.trainer.ppo_trainer as trainer_module
        import openrlhf.trainer.ray.ppo_actor as actor_module

        return {
            "RemoteExperienceMaker": trainer_module.RemoteExperienceMaker.__qualname__,
            "ActorPPOTrainer": actor_module.ActorPPOTrainer.__qualname__,
            "PolicyModelActor": actor_module.PolicyModelActor.__ray_actor_class__.__qualname__,
        }


def cpu_groups(strategy: StandInStrategy, *model_dirs: str) -> list:
    """One group per checkpoint, started in parallel."""
    groups = [RayActorGroup(1, 1, CPUStandInModelActor, num_gpus_per_actor=0) for _ in model_dirs]
    ray.get([ref for g, d in zip(groups, model_dirs) for ref in g.async_init_model_from_pretrained(strategy, d)])
    return groups
