"""scripts/test_under_load.sh: the suite runs RUNS times while stress keeps the cores busy, stops at the first failing
run, and leaves no stress worker behind either way."""

import os
import shutil
import subprocess

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(shutil.which("stress") is None,
                                reason="needs stress (scripts/setup.sh installs it with apt-get where it is root)")

# A run's test sees the load: stress's workers are up while it runs (the script's stress is the only one here).
SEES_THE_LOAD = """
import psutil

def test_stress_is_running():
    assert [p for p in psutil.process_iter(["name"]) if p.info["name"] == "stress"]
"""


def stress_pids() -> set:
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "stress"}


def under_load(tmp_path, test_file: str, runs: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUNS": str(runs), "LOAD_CPUS": "1", "LOAD_LOGS": str(tmp_path / "logs")}
    return subprocess.run(["bash", "scripts/test_under_load.sh", test_file, "-p", "no:cacheprovider"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def test_each_run_passes_under_stress_and_the_stress_stops(tmp_path):
    before = stress_pids()
    test_file = tmp_path / "test_loaded.py"
    test_file.write_text(SEES_THE_LOAD)
    done = under_load(tmp_path, str(test_file), runs=2)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "run 1 of 2: passed" in done.stdout and "run 2 of 2: passed" in done.stdout
    assert "2 of 2 runs passed under stress --cpu 1" in done.stdout
    assert "1 passed" in (tmp_path / "logs" / "run2.log").read_text()
    assert stress_pids() <= before


def test_a_failing_run_stops_the_loop_and_the_stress(tmp_path):
    before = stress_pids()
    test_file = tmp_path / "test_fails.py"
    test_file.write_text("def test_fails():\n    assert False\n")
    done = under_load(tmp_path, str(test_file), runs=3)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "run 1 of 3: failed" in done.stdout and "run 2 of 3" not in done.stdout
    assert "stopped at run 1" in done.stderr
    assert not (tmp_path / "logs" / "run2.log").exists()
    assert stress_pids() <= before


def test_bad_settings_are_refused_before_any_load(tmp_path):
    env = {**os.environ, "RUNS": "five"}
    done = subprocess.run(["bash", "scripts/test_under_load.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "RUNS and LOAD_CPUS must be positive integers, got RUNS=five" in done.stderr
