"""OpenRLHF's DeepSpeed side of ``train_ppo_ray`` on a host without CUDA: gloo ranks, CPU tensors, torch AdamW.

``patch.py`` swaps these in (``CPU_SWAPS``) only where ``torch.cuda.is_available()`` is False, in the driver and in
every Ray worker, when the OpenRLHF module they replace is imported; on a CUDA host nothing here is imported. What
each piece handles (OpenRLHF 0.11.2, DeepSpeed 0.19; DeepSpeed picks its CPU accelerator, hence gloo, by itself):

- ``deepspeed.ops``: its shared-memory all-reduce is marked not compatible, so that no rank JIT-compiles it.
- ``torch.cuda``: ``current_device()`` is called for a device in ~20 places (``.to(...)``, ``device=...``) and
  answers ``"cpu"`` here; ``synchronize`` / ``set_device`` (after every barrier, in ``setup_distributed``) do
  nothing; ``current_stream()`` (an argument of the weight broadcast) is ``None``. Importing this module installs
  them; they raise on CPU-only torch otherwise.
- ``cpu_device_mesh``: ``DeepspeedStrategy.setup_distributed`` builds its dp/sp/tp mesh on ``"cuda"``.
- ``convert_to_torch_dtype_with_fp32``: ``--ds.param_dtype fp32`` (the CLI accepts it on a host without CUDA), the
  model loaded in float32; DeepSpeed's config then enables neither bf16 nor fp16, so it trains in fp32. On a CPU
  without native bfloat16 (no AVX512-BF16 / AMX, e.g. AVX2-only EPYCs) torch multiplies bf16 matrices in a scalar
  fallback, several times slower than fp32 (``benchmarks/cpu_param_dtype.py`` measures it). The vLLM engine stays
  in bf16 (OpenRLHF starts it so); ``cpu_vllm`` casts the fp32 weights it receives, as a GPU engine gets bf16 copies
  of fp32 master weights.
- ``train_ds_config_with_torch_adam``: DeepSpeed builds FusedAdam (a JIT-compiled CUDA op) for an AdamW config
  unless ``torch_adam`` is set; with it, the optimizer is ``torch.optim.AdamW``. ``COPE_ZERO3_RELEASE_PARAMS=1``
  also makes ZeRO-3 release every parameter between forwards (tests: a tiny model would otherwise stay gathered).
- ``CPUReplayBuffer``: ``NaiveReplayBuffer`` formats ``f"cuda:{current_device()}"`` for its target device.
- ``gloo_broadcast_group``: the weight broadcast from DeepSpeed rank 0 to the vLLM engines. OpenRLHF's
  ``stateless_init_process_group`` builds a PyNccl communicator whatever ``--vllm.sync_backend`` says; here it is
  ``cpu_vllm.GlooBroadcastGroup``, whose receiving side is ``cpu_vllm.CPUWorkerWrap``.

The flags a CPU run needs besides these (attention, sync backend, no sleep modes, eager vLLM, no EMA, no packing)
are checked by ``cli.args.cpu_preset_error`` before anything starts.
"""

from __future__ import annotations

import os
from typing import Optional

import deepspeed.ops
import torch
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
from openrlhf.utils.deepspeed.deepspeed_utils import get_train_ds_config
from openrlhf.utils.utils import convert_to_torch_dtype
from torch.distributed.device_mesh import init_device_mesh


# One function per replaced name: torch._dynamo keys its rules by function object, and one object under two
# torch.cuda names with different rules fails its import.
def _current_device() -> str:
    return "cpu"


def _synchronize(device=None) -> None:
    return None


def _set_device(device) -> None:
    return None


def _current_stream(device=None) -> None:
    return None


if not torch.cuda.is_available():
    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    torch.cuda.set_device = _set_device
    torch.cuda.current_stream = _current_stream
    # Not compiled: DeepSpeed's shared-memory all-reduce (C++ JIT-built when the process group starts, ~80 s of both
    # cores the first time on a machine and again whenever the venv moves); only tensor-parallel inference uses it,
    # ZeRO's collectives go through gloo
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def convert_to_torch_dtype_with_fp32(param_dtype: str) -> torch.dtype:
    """OpenRLHF's ``--ds.param_dtype`` to a torch dtype, with ``"fp32"`` added (the CPU mode's default)."""
    return torch.float32 if param_dtype == "fp32" else convert_to_torch_dtype(param_dtype)


def cpu_device_mesh(device_type: str, *args, **kwargs):
    """``init_device_mesh`` on ``"cpu"`` whatever device type OpenRLHF asks for."""
    return init_device_mesh("cpu", *args, **kwargs)


def train_ds_config_with_torch_adam(*args, **kwargs) -> dict:
    """OpenRLHF's DeepSpeed training config, its Adam/AdamW optimizer as ``torch.optim`` (no FusedAdam build). With
    ``COPE_ZERO3_RELEASE_PARAMS=1``, ZeRO-3 keeps no parameter resident between forwards, as it must for a model
    too large to hold: a tiny model otherwise stays gathered and hides forward-count mismatches between ranks
    (tests/test_real_path.py)."""
    config = get_train_ds_config(*args, **kwargs)
    optimizer = config.get("optimizer")
    if optimizer and optimizer.get("type", "").lower() in ("adam", "adamw"):
        optimizer.setdefault("params", {})["torch_adam"] = True
    if os.environ.get("COPE_ZERO3_RELEASE_PARAMS") == "1":
        config["zero_optimization"].update(stage3_max_live_parameters=0, stage3_max_reuse_distance=0,
                                           stage3_param_persistence_threshold=0)
    return config


class CPUReplayBuffer(NaiveReplayBuffer):
    """``NaiveReplayBuffer`` whose target device is the CPU."""

    def __init__(self, *args, **kwargs):
        current_device, torch.cuda.current_device = torch.cuda.current_device, lambda: 0  # only formatted, not used
        try:
            super().__init__(*args, **kwargs)
        finally:
            torch.cuda.current_device = current_device
        self.target_device = torch.device("cpu")


def gloo_broadcast_group(master_address: str, master_port: int, rank: int, world_size: int,
                         device: Optional[object] = None):
    """Stands in for ``openrlhf.utils.distributed_util.stateless_init_process_group`` (same arguments): the sending
    side of ``cpu_vllm.GlooBroadcastGroup``, imported here because only DeepSpeed rank 0 needs it (and vLLM)."""
    from cope_rlhf.cpu_vllm import GlooBroadcastGroup

    return GlooBroadcastGroup(master_address, master_port, rank, world_size)
