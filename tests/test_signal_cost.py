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
