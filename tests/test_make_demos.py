"""scripts/make_demos.py: expert demos in the agent funcs' chat format that replay to success on a fresh server."""

import json
import os
import subprocess
import sys

import pytest

from agent_funcs.instructions import ACKNOWLEDGEMENT, INSTRUCTIONS
from tests.env_server_proc import ROOT, EnvServerProcess, replay, require_venv

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("env, policy", [("babyai", "expert"), ("textcraft", "expert"), ("searchqa", "expert"),
                                         ("babyai", "view"), ("babyai", "view-random"),
                                         ("babyai", "view-hesitant")])
def test_demos_replay_to_success(env, policy, tmp_path):
    require_venv(env)
    out = tmp_path / f"{env}.jsonl"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_demos.py"), "--env", env, "--n", "4",
                           "--policy", policy, "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
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


def _babyai_view(goal_line: str, available: list) -> str:
    return f"{goal_line}You see: a grey box 1 (2 steps forward).\nAvailable actions: {json.dumps(available)}"


def test_view_only_demonstrator_acts_on_the_goal_in_view_and_searches_otherwise():
    from scripts.make_demos import view_only_action
    first = _babyai_view("Your goal: go to the red ball\n", ["turn left", "turn right", "go to grey box 1"])
    blind = "You see: a grey box 1 (2 steps forward).\nAvailable actions: " + json.dumps(
        ["turn left", "turn right", "move forward", "go to grey box 1", "go to red key 1"])
    seen = blind.replace('"go to red key 1"', '"go to red ball 2", "go to red ball 1"')
    assert view_only_action(first, blind) == "turn left"  # a red key is not the red ball
    assert view_only_action(first, seen) == "go to red ball 1"  # the nearest red ball
    pick = _babyai_view("Your goal: pick up a blue key\n", ["turn left", "pick up blue key 1", "go to blue key 1"])
    assert view_only_action(pick, pick) == "pick up blue key 1"
    agentgym = _babyai_view("Your goal: pick up a blue key\n", ["turn left", "pickup blue key 1", "go to blue key 1"])
    assert view_only_action(agentgym, agentgym) == "pickup blue key 1"  # AgentGym's text writes "pickup"


def test_random_search_picks_listed_moves_and_repeats_per_item():
    from scripts.make_demos import SEARCH_MOVES, demo_policy
    first = _babyai_view("Your goal: go to the red ball\n", ["turn left"])
    walled = "You see: no objects.\nAvailable actions: " + json.dumps(["turn left", "turn right", "go to grey box 1"])
    open_view = walled.replace('"turn right"', '"turn right", "move forward"')
    search = demo_policy("view-random", 7)
    picks = [search(first, walled) for _ in range(40)]
    assert set(picks) == {"turn left", "turn right"}  # never an unlisted "move forward", never a distractor
    draw = demo_policy("view-random", 7)
    moves = [draw(first, open_view) for _ in range(60)]
    assert set(moves) == set(SEARCH_MOVES)
    again = demo_policy("view-random", 7)
    assert [again(first, open_view) for _ in range(60)] == moves  # seeded by the item id: demos are reproducible
    seen = open_view.replace('"go to grey box 1"', '"go to red ball 1"')
    assert draw(first, seen) == "go to red ball 1"


def test_hesitant_demonstrator_passes_over_the_goal_in_view_half_of_the_time():
    """view-hesitant: a listed goal is taken with probability 1 - HESITATION, else a listed search move; the ball
    out of view is searched for as view-random does; seeded by the item id."""
    from scripts.make_demos import HESITATION, SEARCH_MOVES, demo_policy
    first = _babyai_view("Your goal: go to the red ball\n", ["turn left"])
    seen = "You see: a red ball 1.\nAvailable actions: " + json.dumps(
        ["turn left", "turn right", "move forward", "go to red ball 1", "go to grey box 1"])
    hesitant = demo_policy("view-hesitant", 3)
    picks = [hesitant(first, seen) for _ in range(400)]
    assert set(picks) == {"go to red ball 1", *SEARCH_MOVES}  # never the distractor
    taken = picks.count("go to red ball 1") / len(picks)
    assert HESITATION == 0.5 and 0.42 < taken < 0.58  # 400 draws: 4 standard errors either side
    again = demo_policy("view-hesitant", 3)
    assert [again(first, seen) for _ in range(400)] == picks
    blind = seen.replace('"go to red ball 1", ', "")
    assert {hesitant(first, blind) for _ in range(60)} == set(SEARCH_MOVES)


def test_view_only_demonstrator_refuses_missions_it_does_not_cover():
    from scripts.make_demos import view_only_action
    door = _babyai_view("Your goal: open the red door\n", ["turn left", "toggle"])
    with pytest.raises(ValueError, match="go-to and pick-up levels only"):
        view_only_action(door, door)


def test_view_policy_is_babyais_only():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_demos.py"), "--env", "textcraft",
                           "--n", "1", "--policy", "view", "--out", "unused.jsonl"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--policy view is BabyAI's" in done.stderr
