"""Seeded sampling: the same command gives the same rollouts on the same machine, and two configs of one study see
the same random draws (their comparisons are paired by construction).

vLLM samples each request with its own generator when ``SamplingParams.seed`` is set. The seeds:

    request seed = H(train.seed, phase, step, prompt, label, occurrence)   driver, one per dispatched prompt
    turn seed    = H(request seed, episode, turn)                          rollout engine, one per generate call

phase is "rollout" (step = the training step being rolled out) or "eval" (step = the step evaluated); occurrence
counts repeats of one (prompt, label) within a dispatch; episode is the episode's place among the
``n_samples_per_prompt`` episodes of its request (0 ... n-1, in the order the engine starts them) and turn its
generate call within the episode. H = the first 4 bytes of SHA-256 of the parts' text, below 2**31.

The request seed is set by ``cope_rlhf.ppo_trainer.SeededSamplesGenerator`` (which also returns a batch's episodes
in the order their prompts were dispatched), the turn seed by the agent func (``agent_funcs.base``);
``scripts/eval.py`` seeds its episodes the same way from ``--seed``.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any


def derive_seed(*parts: Any) -> int:
    """H(parts): a seed in [0, 2**31) from the parts' text."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def with_seed(sampling_params: Any, seed: int) -> Any:
    """A copy of ``sampling_params`` with ``seed`` (the caller's object stays as it was)."""
    params = copy.copy(sampling_params)
    params.seed = seed
    return params
