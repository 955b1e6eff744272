"""Checkpoints of a local run: enough to continue it exactly where it stopped.

    <ckpt.path>/step_<N>/model/          the policy (save_pretrained, with the tokenizer): loadable on its own
    <ckpt.path>/step_<N>/state.pt        optimizer, LR schedule, step N, prompt-stream position, KL coefficient,
                                         CoPE's update counter, and the RNG states (python, numpy, torch)

``latest`` finds the highest complete step (``state.pt`` is written last, through a temporary name, so a run
killed mid-save leaves the previous checkpoint as the latest). ``save`` keeps the newest ``max_num``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from typing import Optional

import numpy as np
import torch

STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def latest(path: str) -> Optional[str]:
    if not os.path.isdir(path):
        return None
    steps = [(int(m.group(1)), name) for name in os.listdir(path) if (m := STEP_DIR.match(name))
             and os.path.exists(os.path.join(path, name, "state.pt"))]
    return os.path.join(path, max(steps)[1]) if steps else None


def save(path: str, step: int, model, tokenizer, state: dict, max_num: int) -> str:
    out = os.path.join(path, f"step_{step}")
    model.save_pretrained(os.path.join(out, "model"))
    tokenizer.save_pretrained(os.path.join(out, "model"))
    torch.save({**state, "step": step, "rng": rng_state()}, os.path.join(out, "state.pt.tmp"))
    os.replace(os.path.join(out, "state.pt.tmp"), os.path.join(out, "state.pt"))
    done = sorted(int(m.group(1)) for name in os.listdir(path) if (m := STEP_DIR.match(name)))
    for old in done[:-max_num] if max_num > 0 else []:
        shutil.rmtree(os.path.join(path, f"step_{old}"), ignore_errors=True)
    return out


def load(ckpt_dir: str) -> dict:
    """The saved state (RNG restored as a side effect); the weights are ``<ckpt_dir>/model``."""
    state = torch.load(os.path.join(ckpt_dir, "state.pt"), weights_only=False)
    set_rng_state(state["rng"])
    return state
