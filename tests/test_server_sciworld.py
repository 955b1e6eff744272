"""The ScienceWorld server, run for real from .venvs/sciworld (Java 17) on 127.0.0.1. Its parity with AgentGym's own
SciWorld server (commit 3ef9235) is tests/test_parity_sciworld.py; the AgentGym behaviours checked here too, without
AgentGym installed: the first look's score in the reset reply, rewards counted from it, a step after done refused.

ScienceWorld lists the contents of a room in an order that is not reproducible (it follows the JVM's identity hash
codes: the same item, even as the first reset of a fresh server, can list three paint cups in different orders),
so observations are compared as multisets of lines; task, variation and task description exactly.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.env_server_proc import EnvServerProcess, check_crafted_actions, require_venv, server_fixture, venv_python

pytestmark = pytest.mark.timeout(180)

# data_idx 2936 is task 4-1 (find-living-thing) variation 0, a train item with a 6-action gold path.
FIND_LIVING_THING = 2936
# data_idx 4243 is task 7-1 (lifespan-longest-lived) variation 3: the agent starts outside, where the task wants it,
# so the first look already scores 50.
STARTS_SCORED = 4243
UNKNOWN_ACTION = "No known action matches that input."

server = server_fixture("sciworld", "--jvms", "2")


def lines(observation: str) -> list[str]:
    return sorted(line.strip() for line in observation.splitlines() if line.strip())


def test_expert_reaches_full_score_and_garbage_is_an_invalid_action(server):
    env_id = server.ok("POST", "/create")["id"]
    reset = server.ok("POST", "/reset", {"id": env_id, "data_idx": FIND_LIVING_THING})
    assert (reset["task_name"], reset["var_num"], reset["reward"], reset["score"], reset["deleted"], reset["done"]) \
        == ("find-living-thing", 0, 0, 0, False, False)
    assert "living thing" in reset["task_description"] and reset["observation"].startswith("This ")

    garbage = server.ok("POST", "/step", {"id": env_id, "action": "xyzzy plugh"})
    assert garbage == {"observation": UNKNOWN_ACTION, "reward": 0, "score": 0, "done": False}

    rewards, result = [], None
    for _ in range(30):
        action = server.ok("GET", f"/expert?id={env_id}")["action"]
        result = server.ok("POST", "/step", {"id": env_id, "action": action})
        rewards.append(result["reward"])
        if result["done"]:
            break
    assert result["done"] and result["score"] == 100
    assert sum(rewards) == 100 and all(r >= 0 for r in rewards)  # reward is the score delta
    assert server.ok("GET", f"/observation?id={env_id}")["observation"] == result["observation"]
    for action in ("look around", "look " * 300):  # after done no step is played, valid or not (as AgentGym's)
        status, body = server.call("POST", "/step", {"id": env_id, "action": action})
        assert status == 409 and body["error"] == "episode_done"
    assert server.ok("POST", "/close", {"id": env_id}) == {"closed": env_id}
    assert server.call("POST", "/step", {"id": env_id, "action": "look around"})[0] == 404


def test_a_first_look_that_scores_is_in_the_reset_reply_and_rewards_count_from_it(server):
    env_id = server.ok("POST", "/create")["id"]
    reset = server.ok("POST", "/reset", {"id": env_id, "data_idx": STARTS_SCORED})
    assert (reset["task_name"], reset["var_num"], reset["reward"], reset["score"]) == ("lifespan-longest-lived", 3,
                                                                                         50, 50)
    assert server.ok("POST", "/step", {"id": env_id, "action": "look around"}) | {"observation": ""} == \
        {"observation": "", "reward": 0, "score": 50, "done": False}
    server.ok("POST", "/close", {"id": env_id})


def test_non_text_and_overlong_actions_are_invalid_actions_not_a_dead_session(server):
    """"look \\ud800" made the JVM bridge throw (Py4JError, a 500 that ended the session at the gateway); an action
    over max_action_chars (1024) is not sent to the JVM either. Both: an invalid action, score kept."""
    replies = check_crafted_actions(server, {"data_idx": FIND_LIVING_THING}, ["look \ud800", "look " * 13000])
    assert replies[0]["observation"].startswith("Invalid action: the action holds a lone surrogate at position 5")
    assert replies[1]["observation"].startswith("Invalid action: the action is 65000 characters long, over the 1024")
    assert all(r["reward"] == 0 and r["score"] == 0 and r["done"] is False for r in replies)


def test_valid_actions_endpoint_and_bad_requests(server):
    env_id = server.ok("POST", "/create")["id"]
    assert server.call("GET", f"/valid_actions?id={env_id}")[0] == 409  # not reset yet
    assert server.call("POST", "/step", {"id": env_id, "action": "look around"})[0] == 409
    n_items = sum(len(server.ok("GET", f"/items?split={s}")["item_ids"]) for s in ("train", "dev", "test"))
    status, body = server.call("POST", "/reset", {"id": env_id, "data_idx": n_items})
    assert status == 400 and body["error"] == "bad_data_idx"
    server.ok("POST", "/reset", {"id": env_id, "data_idx": FIND_LIVING_THING})
    actions = server.ok("GET", f"/valid_actions?id={env_id}")["valid_actions"]
    assert "look around" in actions and any(a.startswith("focus on ") for a in actions)
    server.ok("POST", "/close", {"id": env_id})


# Each split's size as ScienceWorld itself lists it: its variation lists per task, over the tasks AgentGym serves
# (all but 5-1, 5-2 and topics 9, 10), run in the server's venv.
PACKAGE_SPLIT_SIZES = """
import json
from scienceworld import ScienceWorldEnv
from scienceworld.constants import ID2TASK
env, sizes = ScienceWorldEnv("", envStepLimit=10), {"train": 0, "dev": 0, "test": 0}
for task_id, task in ID2TASK.items():
    if task_id not in ("5-1", "5-2") and task_id.split("-")[0] not in ("9", "10"):
        env.load(task, 0, "")
        for split, variations in (("train", env.get_variations_train()), ("dev", env.get_variations_dev()),
                                  ("test", env.get_variations_test())):
            sizes[split] += len(variations)
env.close()
print(json.dumps(sizes))
"""


def test_item_splits_follow_the_package_variations(server):
    splits = {s: server.ok("GET", f"/items?split={s}")["item_ids"] for s in ("train", "dev", "test")}
    done = subprocess.run([venv_python("sciworld"), "-c", PACKAGE_SPLIT_SIZES], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    assert {s: len(ids) for s, ids in splits.items()} == sizes
    everything = splits["train"] + splits["dev"] + splits["test"]
    assert sorted(everything) == list(range(sum(sizes.values())))  # disjoint, and every item is in one split
    assert server.call("GET", "/items?split=valid")[0] == 400
    # 4-1 variation 0 is a train variation; the first dev item is boil variation 14 (the package's split).
    assert FIND_LIVING_THING in splits["train"] and splits["dev"][0] == 14


def test_fifty_concurrent_sessions_share_two_jvms_without_cross_talk(server):
    """All 50 sessions are reset before any steps (a pinned JVM per session would deadlock here), then all
    step at once; every observation must be the one its own item gives when played alone."""
    items = [0, 35, 130, 700, 1500, 2940, 3300, 4000, 4500, 4630]
    actions = ["look around", "inventory", "look around"]

    def play_alone(item):
        env_id = server.ok("POST", "/create")["id"]
        first = server.ok("POST", "/reset", {"id": env_id, "data_idx": item})["observation"]
        rest = [server.ok("POST", "/step", {"id": env_id, "action": a})["observation"] for a in actions]
        server.ok("POST", "/close", {"id": env_id})
        return [lines(o) for o in [first, *rest]]

    reference = {item: play_alone(item) for item in items}
    assert len({str(ref[0]) for ref in reference.values()}) > 5  # the items really differ

    ids = [server.ok("POST", "/create")["id"] for _ in range(50)]
    with ThreadPoolExecutor(50) as pool:
        firsts = list(pool.map(lambda k: server.ok("POST", "/reset", {"id": ids[k], "data_idx": items[k % 10]},
                                                   timeout=120)["observation"], range(50)))
        seen = [[lines(o)] for o in firsts]
        for action in actions:
            steps = list(pool.map(lambda k: server.ok("POST", "/step", {"id": ids[k], "action": action},
                                                      timeout=120), range(50)))
            for k, step in enumerate(steps):
                seen[k].append(lines(step["observation"]))
        list(pool.map(lambda k: server.ok("POST", "/close", {"id": ids[k]}), range(50)))
    for k in range(50):
        assert seen[k] == reference[items[k % 10]], f"session {k} (item {items[k % 10]}) saw another item's text"
    assert server.ok("GET", "/")["instances"] == 0


def test_same_item_same_first_observation_across_restarts():
    require_venv("sciworld")
    item = 130  # use-thermometer variation 10, in the art studio
    firsts = []
    for _ in range(2):
        with EnvServerProcess("sciworld", "--jvms", "1") as fresh:
            env_id = fresh.ok("POST", "/create")["id"]
            firsts.append(fresh.ok("POST", "/reset", {"id": env_id, "data_idx": item}))
    a, b = ({**f, "observation": lines(f["observation"])} for f in firsts)
    assert a == b and a["task_name"] == "use-thermometer" and a["var_num"] == 10


def test_a_jvm_warning_on_stdout_does_not_stop_the_server(monkeypatch):
    """py4j reads a JVM's first stdout line as its port: a JVM warning there (seen under load: "Cannot use file
    /tmp/hsperfdata_root/<pid> because it is locked") made the server exit at start. -XX:+UseLargePages on a machine
    without large pages makes every JVM print such a warning."""
    require_venv("sciworld")
    probe = subprocess.run(["java", "-XX:+UseLargePages", "-version"], capture_output=True, text=True, timeout=60)
    if "warning" not in probe.stdout:
        pytest.skip("this machine's JVM prints no stdout warning for -XX:+UseLargePages (it has large pages)")
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-XX:+UseLargePages")
    with EnvServerProcess("sciworld", "--jvms", "1") as fresh:
        env_id = fresh.ok("POST", "/create")["id"]
        first = fresh.ok("POST", "/reset", {"id": env_id, "data_idx": FIND_LIVING_THING})
    assert first["task_name"] == "find-living-thing" and first["var_num"] == 0
