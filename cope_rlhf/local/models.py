"""The policy and reference models of the single-machine path, in the trainer's own process.

OpenRLHF's experience maker talks to its models through ``RayActorGroup``s: ``async_run_method_batch(name, **lists)``
and ``async_run_method(name, ...)`` return lists of Ray object refs, one per model actor. ``InProcessGroup`` gives
that surface over one ``LocalModel`` living in this process (results are ``ray.put`` so that the experience
maker's ``ray.get`` reads them), so the experience forwards, CoPE's counterfactual and forecast forwards, and the
PPO update all use the same model object, and the only weight transfer is into the vLLM engine.

``LocalModel`` holds OpenRLHF's own ``Actor`` wrapper (log-probs of the action tokens, the rollout temperature
applied to the logits) and answers the calls a ``PolicyModelActor`` / ``ReferenceModelActor`` answers:
``forward`` (no gradient, eval mode, results on the CPU), ``empty_cache``, and CoPE's ``cope_frozen_signals``
(``CoPEActorMethods``, the code the cluster's policy actor runs).
"""

from __future__ import annotations

from typing import Any, List

import ray
import torch
from openrlhf.models import Actor
from transformers import AutoModelForCausalLM

from cope_rlhf.actor import CoPEActorMethods


def load_actor(model_dir: str, temperature: float, device: str) -> Actor:
    """OpenRLHF's ``Actor`` around a float32 HF model on ``device`` (``Actor(path)`` loads bf16/fp16 only)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="sdpa")
    actor = Actor(model.to(device), temperature=temperature)
    actor.packing_samples = False  # Actor sets it only when it loads the checkpoint itself
    return actor


class LocalModel(CoPEActorMethods):
    def __init__(self, actor: Actor, strategy: Any):
        self.actor, self.strategy = actor, strategy

    @property
    def device(self) -> torch.device:
        return next(self.actor.parameters()).device

    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                mm_train_inputs_list=None) -> torch.Tensor:
        was_training = self.actor.training
        self.actor.eval()
        try:
            with torch.no_grad():
                return self.actor(sequences.to(self.device), action_mask.to(self.device),
                                  attention_mask.to(self.device)).to("cpu")
        finally:
            self.actor.train(was_training)

    def empty_cache(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class InProcessGroup:
    """``RayActorGroup``'s calling surface over one in-process ``LocalModel`` (see the module docstring)."""

    def __init__(self, model: LocalModel):
        self.model = model

    def async_run_method(self, method_name: str, *args, **kwargs) -> List[ray.ObjectRef]:
        return [ray.put(getattr(self.model, method_name)(*args, **kwargs))]

    def async_run_method_batch(self, method_name: str, **kwargs) -> List[ray.ObjectRef]:
        lengths = {len(v) for v in kwargs.values()}
        if len(lengths) != 1:
            raise ValueError(f"{method_name}: every batched argument needs the same length, got {lengths}")
        method = getattr(self.model, method_name)
        return [ray.put([method(**{k: v[i] for k, v in kwargs.items()}) for i in range(lengths.pop())])]
