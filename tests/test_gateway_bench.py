"""The gateway benchmark (run by hand) still runs: a tiny configuration, every method, two paired runs.

Guards the script itself against rot: the real gateway, the bare reference proxy and the fake backend start
as processes, every method completes its episodes with the backend's call counts matching, and the ratios are
printed as medians over the paired runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("gateway", "direct", "requests", "fresh", "bare")


@pytest.mark.timeout(180)
def test_tiny_benchmark_runs_every_method_twice(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gateway_bench.py"), "--concurrency", "2", "--waves", "1",
         "--min-episodes", "4", "--steps", "3", "--delays", "0", "--repeats", "2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted((r["method"], r["rep"]) for r in rows) == sorted((m, rep) for m in METHODS for rep in (0, 1))
    for r in rows:
        assert r["episodes"] == 4 and r["eps_per_s"] > 0 and r["p50_ms"] > 0, r
    assert all(r["gw_overhead_p50_ms"] > 0 for r in rows if r["method"] == "gateway")
    ratios = next(line for line in proc.stdout.splitlines() if "conc=   2:" in line)
    for label in ("a/b", "a/c", "a/d", "a/e"):
        assert f"{label} = " in ratios and "[" in ratios, ratios  # median [min-max] over the two runs
    assert "no request lost or duplicated" in proc.stdout
