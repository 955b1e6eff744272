"""The model forwards the CoPE signals run on a policy rank (``CoPEActorMethods``, shared by the Ray policy actor and
the CPU stand-in the tests use).

- ``_cope_logits``: the signal modules' ``logits_fn`` (``info_gain.LogitsFn``): the actor's model, its logits divided by
  the rollout temperature as OpenRLHF's ``Actor.forward`` does, the LM head only at the columns read
  (``logits_to_keep``).
- ``_cope_attention``: ``branches.block_attention`` on the model, an attention that takes the packed rows' block mask
  (flash attention cannot), for the whole call, backward included. Ring attention is refused (a rank holds a slice of
  each row, so no block mask can be built).
- ``_same_forward_count``: every data-parallel rank runs as many forwards as the busiest one (one-token dummies for the
  others): under ZeRO-3 each forward all-gathers parameters, and uneven counts hang.
- ``cope_frozen_signals``: the pre-update signals of a batch (``frozen_signals.frozen_signals``: information gain's
  token rewards and TE's members, one packed forward per trajectory), with no gradient, the model in eval mode.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from cope_rlhf.branches import BlockMaskFn, block_attention
from cope_rlhf.config import CoPEConfig
from cope_rlhf.frozen_signals import frozen_signals


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


class CoPEActorMethods:
    """Methods that need only ``self.actor`` (OpenRLHF ``Actor``) and ``self.strategy``: shared by the Ray
    policy actor and the CPU stand-in used in tests."""

    def _dp_size(self) -> int:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1  # DP only (CLI)

    def _all_reduce(self, values: torch.Tensor, op: str) -> torch.Tensor:
        return self.strategy.all_reduce(values, op) if self._dp_size() > 1 else values

    @contextlib.contextmanager
    def _same_forward_count(self) -> Iterator[None]:
        """Every data-parallel rank runs as many model forwards inside this block as the rank that runs the most.

        Why: under ZeRO-3 every forward all-gathers each layer's parameters from all ranks, so a rank that runs one
        forward more than another waits for a partner that never comes, until the process-group timeout. How many
        forwards a CoPE call runs depends on the rank's rows (turns with probes, forecast samples) and is known only
        as they run, so the ranks agree forward by forward: before each forward of ``_cope_logits`` a rank all-reduces
        MAX of 1 ("one more"); a rank whose work is done all-reduces 0 instead and, each time the answer is 1, runs a
        one-token dummy forward (output discarded), until the answer is 0 (no rank has any left). Every rank then
        runs max-over-ranks forwards and max + 1 scalar all-reduces. With one rank nothing extra runs. In nested
        blocks the outermost one counts. If the body raises, no dummies run (the other ranks then wait: the error
        raised here is the one to read)."""
        if self._dp_size() == 1 or self.__dict__.get("_cope_lockstep"):
            yield
            return
        self._cope_lockstep = True
        try:
            yield
        finally:
            self._cope_lockstep = False
        one_token = torch.zeros((1, 1), dtype=torch.long)
        with torch.no_grad():
            while self._all_reduce(torch.zeros(1), "max")[0] > 0:
                self._cope_logits(one_token, torch.ones_like(one_token), one_token, 1)

    def _cope_logits(self, input_ids, attention_mask, position_ids, keep=None) -> torch.Tensor:
        """The ``logits_fn`` of the signal modules (``info_gain.LogitsFn``): ``keep`` (column indices, or a count
        of last columns) becomes HF's ``logits_to_keep``, so the LM head runs only where logits are read."""
        if self.__dict__.get("_cope_lockstep"):
            self._all_reduce(torch.ones(1), "max")  # "one more forward here" (see _same_forward_count)
        device = _device(self.actor.model)
        if isinstance(attention_mask, torch.Tensor):  # a flex-attention BlockMask is built on the device already
            attention_mask = attention_mask.to(device)
        if isinstance(keep, torch.Tensor):
            keep = keep.to(device)
        out = self.actor.model(
            input_ids.to(device), attention_mask=attention_mask, position_ids=position_ids.to(device),
            logits_to_keep=0 if keep is None else keep,
        )
        return out["logits"].float() / getattr(self.actor, "temperature", 1.0)

    def _cope_attention(self):
        """``block_attention`` on the actor's model: an attention implementation that takes the packed rows' block
        mask (yields its builder)."""
        if self.strategy.args.ds.ring_attn_size > 1:
            raise ValueError("the CoPE signals do not support ring attention (a rank holds a slice of each row, so no "
                             "block mask can be built for it): use --ds.ring_attn_size 1")
        return block_attention(self.actor.model)

    @contextlib.contextmanager
    def _pre_update_forwards(self) -> Iterator[BlockMaskFn]:
        """The setting of the no-gradient CoPE forwards: the model in eval mode under ``_cope_attention`` (yields its
        mask builder), and the same forward count on every data-parallel rank."""
        was_training = self.actor.training
        with self._same_forward_count():
            self.actor.eval()
            try:
                with self._cope_attention() as build:
                    yield build
            finally:
                self.actor.train(was_training)

    @torch.no_grad()
    def cope_frozen_signals(self, sequences, attention_mask, action_mask, samples=None, trajectories=None,
                            rejected=None, info_gain: bool = True):
        """The pre-update signals of one batch (``frozen_signals.frozen_signals``): (information gain as (token
        rewards (B, A) on CPU, metrics), or None when ``info_gain`` is off; TE members per row, or None when
        ``samples`` is None). ``samples[i]``, ``trajectories[i]`` = (tokens, turns) and ``rejected[i]`` (per turn:
        the env rejected its action) are row i's."""
        config = CoPEConfig.from_args(self.strategy.args)
        with self._pre_update_forwards() as build:
            gain, members = frozen_signals(self._cope_logits, sequences, attention_mask, action_mask, config,
                                           info_gain, samples, trajectories, rejected, build,
                                           _device(self.actor.model))
        if gain is not None:
            rewards, _, metrics = gain
            gain = rewards.cpu(), metrics
        return gain, members
