"""scripts/make_itemids.py: prompt-dataset files per env and split, deterministic, test never overlapping train."""

import json
import os
import subprocess
import sys

import pytest

from tests.env_server_proc import ROOT, venv_python

pytestmark = pytest.mark.timeout(300)
ENVS = ["babyai", "textcraft", "searchqa", "sciworld", "alfworld"]


# ALFWorld's games come from $ALFWORLD_DATA (a download): the small games the project ships stand in for it here
DATA = {"alfworld": {"ALFWORLD_DATA": os.path.join(ROOT, "tests", "fixtures", "alfworld")}}


def make(env: str, splits: list[str], out: str) -> dict[str, list[dict]]:
    # Run from the trainer's interpreter: the script re-runs itself in .venvs/<env> when the env package is missing.
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_itemids.py"), "--env", env,
                           "--split", *splits, "--out", out], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, **DATA.get(env, {})})
    assert done.returncode == 0, done.stderr
    rows = {}
    for split in splits:
        with open(os.path.join(out, f"{env}_{split}.jsonl")) as f:
            rows[split] = [json.loads(line) for line in f]
    return rows


@pytest.mark.parametrize("env", ENVS)
def test_splits_are_disjoint_deterministic_prompt_datasets(env, tmp_path):
    if not os.path.exists(os.path.join(ROOT, "env_gateway", "servers", f"{env}.py")) or \
            not os.path.exists(venv_python(env)):
        pytest.skip(f"env_gateway/servers/{env}.py or .venvs/{env} is missing (bash scripts/setup_env.sh {env})")
    rows = make(env, ["train", "dev", "test"], str(tmp_path / "a"))
    if not any(rows.values()):
        pytest.skip(f"{env} lists no items here (its benchmark data is not installed on this machine)")
    assert rows["train"] and rows["test"]
    for lines in rows.values():
        for row in lines:
            assert row == {"prompt": f"{env}/{row['label']}", "label": row["label"]}
    ids = {split: {row["label"] for row in lines} for split, lines in rows.items()}
    assert not ids["train"] & ids["test"] and not ids["dev"] & ids["test"] and not ids["train"] & ids["dev"]
    assert make(env, ["test"], str(tmp_path / "b"))["test"] == rows["test"]  # a fresh process: same ids


def test_unknown_env_is_a_clear_error(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_itemids.py"), "--env", "nosuchenv",
                           "--split", "train", "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "no server module env_gateway/servers/nosuchenv.py" in done.stderr
