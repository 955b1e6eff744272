"""The CPU dtype benchmark (run by hand) still runs, at SmolLM2's shape: both dtypes load through the CPU swaps as
OpenRLHF's ``Actor`` and take a micro-step, and the ratio printed is of the times printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_the_benchmark_runs_at_smollm2s_shape():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cpu_param_dtype.py"), "--shape", "smollm2",
                           "--batch", "1", "--length", "16", "--actions", "4", "--repeats", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"CPU bfloat16 support: .+; torch CPU capability", proc.stdout)
    assert "model: LlamaForCausalLM, 134.5M parameters, 30 layers, vocabulary 49152" in proc.stdout
    times = {dtype: float(re.search(rf"^{dtype}: ([0-9.]+) s per micro-step", proc.stdout, re.M).group(1))
             for dtype in ("bf16", "fp32")}
    ratio = float(re.search(r"^bf16 / fp32: ([0-9.]+)x", proc.stdout, re.M).group(1))
    assert all(t > 0 for t in times.values())
    assert ratio == pytest.approx(times["bf16"] / times["fp32"], abs=0.01)  # one repeat: the ratio of the two times
