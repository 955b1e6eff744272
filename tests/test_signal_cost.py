"""The signal-cost benchmark (run by hand) still runs: a tiny model, one turn count, two paired repeats.

Guards the script against rot: every cell ((a) GRPO step, (b) the signals with the separate forecast step, (c) the
GRPO step with the forecast in its forward, through the actor's own ``_forecast_in_forward``) runs, the ratios are
medians over the repeats, and the packed path under ``block_attention`` agrees with a dense mask.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_tiny_benchmark_runs_every_cell(tmp_path):
    out = tmp_path / "cost.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "signal_cost.py"), "--turns", "3", "--hidden", "64",
         "--layers", "1", "--repeats", "2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    for cell in ("grpo", "signals", "joint"):
        assert row[f"{cell}_wall_s"] > 0 and row[f"{cell}_cpu_s"] > 0, (cell, row)
    assert row["signals_over_grpo_wall_min"] <= row["signals_over_grpo_wall"] <= row["signals_over_grpo_wall_max"]
    assert row["joint_over_grpo_wall"] > 0 and row["signals_joint_over_grpo_wall"] > 0
    assert row["max_abs_d_info_gain"] < 1e-4 and row["abs_d_forecast_loss"] < 1e-4
    assert "medians of 2 [min-max]" in proc.stdout and "jnt/a" in proc.stdout


def test_the_benchmarks_batches_are_openrlhfs_own():
    """The benchmark builds its batches without OpenRLHF (so that scripts/gpu_smoke.sh's stage 1 runs it on a host
    without the training stack): the same tensors as OpenRLHF's response -> Experience conversion and
    ``Experience.concat_experiences``; and the tokenizer text is ``make_tiny_model.trainer_text()`` either way."""
    import importlib.util

    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    spec = importlib.util.spec_from_file_location("signal_cost_under_test", os.path.join(ROOT, "benchmarks",
                                                                                          "signal_cost.py"))
    sc = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sc
    spec.loader.exec_module(sc)
    tok = sc.benchmark_tokenizer()
    ours, theirs = [], []
    for turns, seed in ((1, 0), (4, 1), (2, 2)):
        row = sc.trajectory(tok, turns, seed)
        ranges, start = [], None  # the action ranges back from the mask (it covers sequences[1:])
        for j, on in enumerate([0] + row.action_mask[0].tolist() + [0]):
            if on and start is None:
                start = j
            elif not on and start is not None:
                ranges.append((start, j))
                start = None
        response = {"prompt": "", "label": "", "observation_tokens": row.sequences[0].tolist(), "action_ranges": ranges,
                    "reward": 0.0, "scores": 0.0, "rollout_log_probs": None, "truncated": False, "extra_logs": {}}
        theirs.append(object.__new__(SamplesGenerator)._process_response_into_experience(response, max_len=1 << 20))
        ours.append(row)
        assert len(ranges) == turns
    want = Experience.concat_experiences(theirs, pad_token_id=tok.pad_token_id)
    got = sc.concat(ours, tok.pad_token_id)
    for name in ("sequences", "attention_mask", "action_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    from scripts.make_tiny_model import trainer_text

    text = trainer_text()
    assert sc.trainer_words() == text
    real = sys.modules.pop("agent_funcs.base")
    sys.modules["agent_funcs.base"] = None  # as on a host without OpenRLHF: agent_funcs does not import
    try:
        assert sc.trainer_words() == text
    finally:
        sys.modules["agent_funcs.base"] = real
