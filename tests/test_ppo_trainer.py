"""CoPEPPOTrainer.evaluate on held-out samples as OpenRLHF's SamplesGenerator returns them, without Ray: one
``eval_episodes.jsonl`` line per episode, for agent runs and for runs without an agent func (no "success" key)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from cope_rlhf.ppo_trainer import EVAL_EPISODES, _CoPEPPOTrainer


def trainer(tmp_path, samples):
    t = object.__new__(_CoPEPPOTrainer)
    t.args = SimpleNamespace(rollout=SimpleNamespace(batch_size=2), ckpt=SimpleNamespace(path=str(tmp_path)))
    t.samples_generator = SimpleNamespace(generate_eval_samples=lambda **kw: samples)
    t.eval_dataloader = [(["d"], [s.prompts[0]], [s.labels[0]], [None]) for s in samples]
    t.wandb_logger = t.tensorboard_logger = None
    return t


def sample(label: str, info: dict, reward: float):
    return SimpleNamespace(prompts=[f"p{label}"], labels=[label], rewards=[reward], info=info,
                           response_length=torch.tensor([3]), truncated=torch.tensor([False]))


def test_agent_and_reward_model_samples_both_get_records(tmp_path):
    info = {"success": torch.tensor([1.0]), "reward": torch.tensor([0.5]), "turns": torch.tensor([2])}
    agent = sample("7", info, 0.5)
    plain = sample("8", {}, 0.25)  # a run without an agent func: no success, reward only in .rewards
    logs = trainer(tmp_path, [agent, plain]).evaluate(3, n_samples_per_prompt=1)
    rows = [json.loads(line) for line in open(tmp_path / EVAL_EPISODES)]
    assert rows == [{"step": 3, "item_id": "7", "reward": 0.5, "success": 1.0},
                    {"step": 3, "item_id": "8", "reward": 0.25}]
    assert logs["success_rate"] == 1.0 and "eval_d_pass1" in logs
