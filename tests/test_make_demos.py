"""scripts/make_demos.py: expert demos in the agent funcs' chat format that replay to success on a fresh server."""

import json
import os
import subprocess
import sys

import pytest

from agent_funcs.instructions import ACKNOWLEDGEMENT, INSTRUCTIONS
from tests.env_server_proc import ROOT, EnvServerProcess, replay, require_venv

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("env", ["babyai", "textcraft", "searchqa"])
def test_demos_replay_to_success(env, tmp_path):
    require_venv(env)
    out = tmp_path / f"{env}.jsonl"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_demos.py"), "--env", env, "--n", "4",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    demos = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(demos) == 4 and all(d["success"] for d in demos)
    with EnvServerProcess(env) as server:
        for demo in demos:
            msgs = demo["messages"]
            assert [m["role"] for m in msgs] == ["user", "assistant"] + ["user", "assistant"] * demo["turns"] + ["user"]
            assert msgs[0]["content"] == INSTRUCTIONS[env] and msgs[1]["content"] == ACKNOWLEDGEMENT
            actions = []
            for m in msgs[3::2]:
                assert m["content"].startswith("Thought:\n") and "\n\nAction:\n" in m["content"]
                actions.append(m["content"].rsplit("Action:\n", 1)[1])
            replies = replay(server, int(demo["item_id"]), actions)
            assert [r["observation"] for r in replies] == [m["content"] for m in msgs[2::2]]
            assert replies[-1]["done"] and replies[-1]["reward"] > 0
            assert sum(r["reward"] for r in replies) == pytest.approx(demo["reward"])
