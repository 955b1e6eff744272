"""``LocalStrategy``: the part of OpenRLHF's ``DeepspeedStrategy`` that its trainer code calls, for one process.

OpenRLHF's DeepSpeed strategy is CUDA-bound (``setup_distributed`` sets a CUDA device and builds a "cuda" device
mesh), so the single-machine path drives OpenRLHF's own ``ActorPPOTrainer.ppo_train`` / ``training_step`` with
this instead. It keeps DeepSpeed's contract, which OpenRLHF's loss normalisation relies on:

    backward(loss)      accumulates  grad += d(loss / gas)            (DeepSpeed scales every loss by 1/gas)
    optimizer_step()    every gas-th call: clip the global grad norm to ``actor.max_norm``, step, zero, schedule
    set_window()        per update: gas such that the update's micro-batches fill whole windows

with ``gas = train.batch_size / train.micro_batch_size`` (``accumulated_gradient``), one rank (``all_reduce`` is the
identity). ``cuda_device_as_cpu`` points ``torch.cuda.current_device`` at the CPU while OpenRLHF's trainer runs on a
host without CUDA (``ppo_train`` moves each micro-batch to that device; the replay buffer records it).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class LocalStrategy:
    ring_attn_group = None

    def __init__(self, args: Any):
        self.args = args
        self.accumulated_gradient = max(1, args.train.batch_size // args.train.micro_batch_size)
        self._micro_steps = 0
        self._grad_norm = 0.0

    def is_rank_0(self) -> bool:
        return True

    def print(self, *msg) -> None:
        print(*msg)

    def backward(self, loss: torch.Tensor, model, optimizer) -> None:
        (loss / self.accumulated_gradient).backward()

    def optimizer_step(self, optimizer, model, scheduler, name: str = "model") -> None:
        self._micro_steps += 1
        if self._micro_steps % self.accumulated_gradient:
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        max_norm = getattr(self.args.actor, "max_norm", 0.0) or float("inf")
        self._grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()

    def set_window(self, micro_batches: int, optimizer_steps: int) -> None:
        """gas for one update of ``micro_batches``: the configured one, unless the degenerate filter removed samples;
        then the smallest divisor of ``micro_batches`` that needs at most ``optimizer_steps`` steps, so that every
        accumulation window is complete (CoPE's forecast step then starts on a fresh window)."""
        low = -(-micro_batches // max(1, optimizer_steps))
        self.accumulated_gradient = next(d for d in range(low, micro_batches + 1) if micro_batches % d == 0)
        self._micro_steps = 0

    def get_grad_norm(self, model) -> float:
        return self._grad_norm

    def all_reduce(self, data, op: str = "mean"):
        return data


@contextlib.contextmanager
def cuda_device_as_cpu(value: Any = "cpu"):
    """Without CUDA, ``torch.cuda.current_device()`` returns ``value`` inside the block; with CUDA, nothing changes."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: value
    try:
        yield
    finally:
        torch.cuda.current_device = original
