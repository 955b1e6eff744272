"""CoPEPPOTrainer.evaluate on held-out samples as OpenRLHF's SamplesGenerator returns them, without Ray: one
``eval_episodes.jsonl`` line per episode, for agent runs and for runs without an agent func (no "success" key); and
SeededSamplesGenerator's seeds and episode order, on OpenRLHF's own dispatch with stand-in engine handles."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

import ray
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from cope_rlhf.ppo_trainer import EVAL_EPISODES, SeededSamplesGenerator, _CoPEPPOTrainer
from cope_rlhf.seeds import derive_seed


def trainer(tmp_path, samples, phases=None):
    t = object.__new__(_CoPEPPOTrainer)
    t.args = SimpleNamespace(rollout=SimpleNamespace(batch_size=2), ckpt=SimpleNamespace(path=str(tmp_path)))

    def generate_eval_samples(**kw):
        if phases is not None:
            phases.append(t.samples_generator.seed_phase)
        return samples

    t.samples_generator = SimpleNamespace(generate_eval_samples=generate_eval_samples, seed_phase=("rollout", 4))
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
    phases = []
    t = trainer(tmp_path, [agent, plain], phases)
    logs = t.evaluate(3, n_samples_per_prompt=1)
    assert phases == [("eval", 3)] and t.samples_generator.seed_phase == ("rollout", 4)  # eval seeds, then back
    rows = [json.loads(line) for line in open(tmp_path / EVAL_EPISODES)]
    assert rows == [{"step": 3, "item_id": "7", "reward": 0.5, "success": 1.0},
                    {"step": 3, "item_id": "8", "reward": 0.25}]
    assert logs["success_rate"] == 1.0 and "eval_d_pass1" in logs


class StandInEngine:
    """A rollout engine's Ray handle as SamplesGenerator calls it: records each ``generate_responses`` request."""

    def __init__(self, requests: list):
        self.requests = requests
        self.generate_responses = SimpleNamespace(remote=lambda **kw: requests.append(kw) or len(requests))
        self.get_num_unfinished_requests = SimpleNamespace(remote=lambda: 0)


def seeded_generator(seed: int, requests: list) -> SeededSamplesGenerator:
    strategy = SimpleNamespace(args=SimpleNamespace(train=SimpleNamespace(seed=seed), rollout=SimpleNamespace(
        n_samples_per_prompt=2), algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="off"))))
    return SeededSamplesGenerator(strategy, None, None, None, [StandInEngine(requests), StandInEngine(requests)])


def test_every_prompt_request_gets_a_seed_from_train_seed_phase_step_prompt_and_repeat(monkeypatch):
    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the pending counts of the stand-ins
    seeds = {}
    for train_seed, phase in ((42, ("rollout", 3)), (42, ("rollout", 3)), (42, ("rollout", 4)), (42, ("eval", 3)),
                              (7, ("rollout", 3))):
        requests = []
        generator = seeded_generator(train_seed, requests)
        generator.seed_phase = phase
        generator._dispatch_prompts_to_vllm(["babyai/1", "babyai/2", "babyai/1"], ["1", "2", "1"], max_new_tokens=8)
        got = [r["sampling_params"].seed for r in requests]
        assert got == [derive_seed(train_seed, *phase, p, label, k)
                       for p, label, k in (("babyai/1", "1", 0), ("babyai/2", "2", 0), ("babyai/1", "1", 1))]
        assert len(set(got)) == 3  # a repeated prompt is a new draw
        assert all(r["sampling_params"].temperature == 1.0 for r in requests)  # the rest of OpenRLHF's params kept
        seeds.setdefault((train_seed, phase), []).append(got)
    assert seeds[(42, ("rollout", 3))][0] == seeds[(42, ("rollout", 3))][1]  # the same command: the same seeds
    assert len({tuple(v[0]) for v in seeds.values()}) == 4  # another step, phase or train.seed: other seeds


def test_a_batch_comes_back_in_the_order_its_prompts_were_dispatched(monkeypatch):
    """OpenRLHF collects a batch's groups as they finish; the seeded generator restores the dispatch order (episodes
    of one group keep theirs)."""
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    episode = lambda prompt, label, k: SimpleNamespace(prompts=[prompt], labels=[label], k=k)  # noqa: E731

    def finished_in_any_order(self, dataloader_iter, num_prompts, dynamic_filtering, **kw):
        self._dispatch_prompts_to_vllm(["a", "b", "c"], ["1", "2", "3"])
        return [episode("c", "3", 0), episode("c", "3", 1), episode("a", "1", 0), episode("a", "1", 1),
                episode("b", "2", 0), episode("b", "2", 1)], 3, False

    monkeypatch.setattr(SamplesGenerator, "_generate_vllm", finished_in_any_order)
    experiences, consumed, exhausted = seeded_generator(0, [])._generate_vllm(None, 3, False)
    assert [(e.prompts[0], e.k) for e in experiences] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 1)]
    assert (consumed, exhausted) == (3, False)
