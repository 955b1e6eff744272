"""The BabyAI server, run for real from .venvs/babyai: AgentGym's tasks, AgentGym's text (the default) and the
compact one (``--text compact``, or BABYAI_TEXT=compact as tests/conftest.py sets for the tests' servers), high-level
actions, bot expert, sessions. Parity with AgentGym's own server:
tests/test_parity_babyai.py."""

import json
import subprocess
import time

import pytest

from tests.env_server_proc import (ROOT, EnvServerProcess, check_crafted_actions, check_no_cross_talk,
                                   expert_episode, require_venv, runs_in_own_venv, server_fixture, venv_python)

pytestmark = pytest.mark.timeout(120)
server = server_fixture("babyai")
agentgym_text = server_fixture("babyai", "--text", "agentgym")
LEVELS = 40
NO_EXPERT = {22: "BabyAI-PutNextS7N4Carrying-v0", 25: "BabyAI-KeyInBox-v0", 28: "BabyAI-UnlockToUnlock-v0"}
# OpenDoorsOrderN4Debug, seed 0 ("open the purple door, then open the red door"): the bot opens the red door on its
# way to the purple one, and a Debug level ends a wrong order at once, reward 0.
BOT_FAILS = {15: "BabyAI-OpenDoorsOrderN4Debug-v0"}


def test_expert_solves_every_level_through_the_high_level_actions(server):
    # item ids 0..39: seed 0 of each of AgentGym's 40 levels, in its order; the reply names the level it loaded.
    levels = set()
    for data_idx in range(LEVELS):
        if data_idx in NO_EXPERT:  # the bot cannot solve these: no expert, said so
            env_id = server.ok("POST", "/create")["id"]
            levels.add(server.ok("POST", "/reset", {"id": env_id, "data_idx": data_idx})["level"])
            status, body = server.call("GET", f"/expert?id={env_id}")
            assert (status, body["error"]) == (404, "no_expert") and NO_EXPERT[data_idx] in body["detail"]
            server.ok("POST", "/close", {"id": env_id})
            continue
        first, steps = expert_episode(server, data_idx, max_turns=200)
        levels.add(first["level"])
        assert first["observation"].startswith("Your goal: ")
        assert "Available actions: [" in first["observation"]
        action, last = steps[-1]
        assert last["done"], f"{first['level']}: not done after {len(steps)} expert actions"
        if data_idx in BOT_FAILS:
            assert first["level"] == BOT_FAILS[data_idx] and last["reward"] == 0
            continue
        assert 0 < last["reward"] <= 1, f"{first['level']}: success reward must be 1 - 0.9 * steps / max_steps"
        assert last["score"] == pytest.approx(sum(r["reward"] for _, r in steps))
        assert all(r["reward"] == 0 and not r["done"] for _, r in steps[:-1])
    assert len(levels) == LEVELS


def test_go_to_ends_facing_the_object_and_pick_up_carries_it(server):
    env_id = server.ok("POST", "/create")["id"]
    first = server.ok("POST", "/reset", {"id": env_id, "data_idx": 18})
    assert first["level"] == "BabyAI-PickupLoc-v0" and first["seed"] == 0
    obs = first["observation"]
    goto = next(a for a in _available(obs) if a.startswith("go to ") and "door" not in a)
    target = goto[len("go to "):].rsplit(" ", 1)[0]  # "red ball 1" -> "red ball"
    after = server.ok("POST", "/step", {"id": env_id, "action": goto})
    if not after["done"]:
        assert f"In front of you: the {target} " in after["observation"]
        pick = next(a for a in _available(after["observation"]) if a.startswith(f"pick up {target}"))
        after = server.ok("POST", "/step", {"id": env_id, "action": pick})
        assert after["done"] or f"You are carrying: a {target}." in after["observation"]
    server.ok("POST", "/close", {"id": env_id})


def test_garbage_action_is_an_invalid_action_not_an_error(server):
    env_id = server.ok("POST", "/create")["id"]
    first = server.ok("POST", "/reset", {"id": env_id, "data_idx": 1})
    reply = server.ok("POST", "/step", {"id": env_id, "action": "fly to the moon"})
    assert reply["observation"].startswith("Invalid action: 'fly to the moon'")
    assert reply["reward"] == 0 and reply["done"] is False
    # nothing moved: the view is the one from reset
    assert server.ok("GET", f"/observation?id={env_id}")["observation"] == first["observation"]
    assert server.ok("POST", "/close", {"id": env_id}) == {"closed": env_id}
    status, body = server.call("POST", "/step", {"id": env_id, "action": "turn left"})
    assert status == 404 and body["error"] == "unknown_id"


def test_overlong_and_non_text_actions_are_invalid_actions_that_change_nothing(server):
    """An action over max_action_chars (256) is not parsed, even when stripping would leave a valid one; a lone
    surrogate is not text. Both: invalid action, the view as it was, the session alive."""
    env_id = server.ok("POST", "/create")["id"]
    view = server.ok("POST", "/reset", {"id": env_id, "data_idx": 1})["observation"].split("\n", 1)[1]
    server.ok("POST", "/close", {"id": env_id})
    padded, surrogate = "turn left" + " " * 300, "turn left \ud800"
    replies = check_crafted_actions(server, {"data_idx": 1}, [padded, surrogate])
    assert replies[0]["observation"] == ("Invalid action: the action is 309 characters long, over the 256 this babyai "
                                         f"server takes. Answer with one short command.\n{view}")
    assert replies[1]["observation"].startswith("Invalid action: the action holds a lone surrogate at position 10")
    assert replies[1]["observation"].endswith(view)
    assert all(r["reward"] == 0 and r["score"] == 0 and r["done"] is False for r in replies)


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("path, body, content_type, error", [
    ("/step", b'{"id": true, "action": "turn left"}', None, "bad_id"),  # was: instance 1
    ("/step", b'{"id": {id}.9, "action": "turn left"}', None, "bad_id"),  # was: this instance
    ("/step", b'{"id": Infinity, "action": "turn left"}', None, "bad_json"),  # was: 500 (OverflowError)
    ("/reset", b'{"id": {id}, "data_idx": Infinity}', None, "bad_json"),  # was: 500
    ("/reset", b'{"id": {id}, "data_idx": 1.5}', None, "bad_data_idx"),  # was: item 1
    ("/step", b'{"id": {id}, "action": ' + DEEP + b"}", None, "bad_json"),  # was: 500 (RecursionError)
    ("/step", b'{"id": "' + b"7" * 200_000 + b'x", "action": "turn left"}', None, "bad_id"),  # was: echoed whole
    ("/step", b'{"id": {id}, "action": "turn left"}', "application/json; charset=klingon", None),  # was: 500
], ids=["id-true", "id-float", "id-infinity", "data_idx-infinity", "data_idx-float", "deep-json", "huge-id",
        "unknown-charset"])
def test_bad_json_and_loose_types_are_4xx_with_short_answers(server, path, body, content_type, error):
    env_id = server.ok("POST", "/create")["id"]
    server.ok("POST", "/reset", {"id": env_id, "data_idx": 1})
    status, answer = server.call("POST", path, body.replace(b"{id}", str(env_id).encode()),
                                 content_type=content_type or "application/json")
    if error is None:
        assert status == 200 and answer["observation"], answer
    else:
        assert (status, answer["error"]) == (400, error), answer
        assert len(answer["detail"]) < 300
    assert server.ok("POST", "/step", {"id": env_id, "action": "turn left"})["reward"] == 0  # the server is fine
    server.ok("POST", "/close", {"id": env_id})


def test_instances_untouched_past_the_ttl_are_closed_by_the_server():
    """A client that dies (a SIGKILLed gateway) used to leave its instances open for good, counting against
    --max-instances. Here: two idle instances are reaped after --instance-ttl 1; one in use is kept."""
    require_venv("babyai")
    with EnvServerProcess("babyai", "--instance-ttl", "1") as proc:
        idle = [proc.ok("POST", "/create")["id"] for _ in range(2)]
        busy = proc.ok("POST", "/create")["id"]
        proc.ok("POST", "/reset", {"id": busy, "data_idx": 1})
        for _ in range(10):  # 2.5 s, touching one instance every 0.25 s
            proc.ok("POST", "/step", {"id": busy, "action": "turn left"})
            time.sleep(0.25)
        assert proc.ok("GET", "/")["instances"] == 1
        status, answer = proc.call("POST", "/reset", {"id": idle[0], "data_idx": 1})
        assert status == 404 and "untouched for 1s" in answer["detail"]
        assert proc.ok("POST", "/close", {"id": busy}) == {"closed": busy}
        assert proc.call("GET", "/")[1]["instances"] == 0
    assert "closing instance 0, untouched for" in proc.output()


def test_fifty_concurrent_sessions_follow_their_own_items(server):
    check_no_cross_talk(server, [i for i in range(53) if i % LEVELS not in NO_EXPERT], steps=3)


def test_agentgym_text_first_observation_feedback_and_expert(agentgym_text):
    """AgentGym's words, checked here without AgentGym (the parity test compares against its server): data_idx 3
    is AgentGym's level 4 (GoToObjS6-v0, a 4x4 room) at seed 0."""
    server = agentgym_text
    env_id = server.ok("POST", "/create")["id"]
    first = server.ok("POST", "/reset", {"id": env_id, "data_idx": 3})
    actions = '["turn left", "turn right", "move forward", "pickup blue key 1", "go to blue key 1", ' \
              '"check available actions"]'
    assert first["observation"] == (
        "Your goal: go to the blue key\nIn front of you in this room, you can see several objects: There is a blue "
        "key 1 1 steps in front of you and 1 steps to your right.  The room has walls around you. You are facing a "
        f"wall 2 steps away. You are not carrying anything.\nAvailable actions: {actions}")
    assert first["level"] == "BabyAI-GoToObjS6-v0"
    for action, feedback in [("fly to the moon", "The action is not recognized. Please check valid actions."),
                             ("drop", "You cannot drop the object, as you are not carrying anything."),
                             ("", "No change in state.")]:
        reply = server.ok("POST", "/step", {"id": env_id, "action": action})
        assert reply == {"observation": f"{feedback}\nAvailable actions: {actions}", "reward": 0, "score": 0,
                         "done": False}
    while not reply["done"]:
        action = server.ok("GET", f"/expert?id={env_id}")["action"]
        assert action in _available(reply["observation"])
        reply = server.ok("POST", "/step", {"id": env_id, "action": action})
    assert reply["reward"] > 0.5 and reply["observation"].startswith("In front of you")
    assert "\n The task is completed.\nAvailable actions: [" in reply["observation"]
    server.ok("POST", "/close", {"id": env_id})


def test_agentgym_text_answers_an_action_it_does_not_parse_with_the_reason(agentgym_text):
    """An action the built-in does not parse (over max_action_chars; AgentGym would parse it) is an invalid action in
    AgentGym's text too: its reason in place of AgentGym's feedback, then the action list, nothing moved."""
    server = agentgym_text
    env_id = server.ok("POST", "/create")["id"]
    first = server.ok("POST", "/reset", {"id": env_id, "data_idx": 3})
    reply = server.ok("POST", "/step", {"id": env_id, "action": "turn left" + " " * 300})
    actions = first["observation"][first["observation"].index("\nAvailable actions: "):]
    reason = "the action is 309 characters long, over the 256 this babyai server takes. Answer with one short command."
    assert reply == {"observation": f"Invalid action: {reason}{actions}", "reward": 0, "score": 0, "done": False}
    server.ok("POST", "/close", {"id": env_id})


def test_same_item_same_first_observation_across_restarts(server):
    require_venv("babyai")
    ids = [0, 57, 1234]
    firsts = [expert_episode(server, i, max_turns=0)[0] for i in ids]
    with EnvServerProcess("babyai") as other:
        assert [expert_episode(other, i, max_turns=0)[0] for i in ids] == firsts
    assert firsts[0]["observation"] != firsts[1]["observation"]


def test_agentgyms_text_is_the_default(agentgym_text, monkeypatch):
    require_venv("babyai")
    monkeypatch.delenv("BABYAI_TEXT")
    expected = expert_episode(agentgym_text, 5, max_turns=0)[0]
    with EnvServerProcess("babyai") as default:
        assert expert_episode(default, 5, max_turns=0)[0] == expected


def test_an_unknown_text_is_refused_with_the_choices(monkeypatch):
    """BABYAI_TEXT is argparse's default, which argparse leaves unchecked: the server refuses it itself. Run by
    .venvs/babyai, the constructor is called here; otherwise the server's command is."""
    require_venv("babyai")
    if runs_in_own_venv("babyai"):
        from env_gateway.servers.babyai import BabyAIServer

        with pytest.raises(SystemExit) as refused:
            BabyAIServer(text="fancy")
        message = str(refused.value)
    else:
        monkeypatch.setenv("BABYAI_TEXT", "fancy")
        bad = subprocess.run([venv_python("babyai"), "-m", "env_gateway.servers.babyai", "--port", "0"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0
        message = bad.stderr
    assert "babyai: unknown text 'fancy' (from --text or BABYAI_TEXT): use one of ['compact', 'agentgym']" in message


def test_item_splits_are_disjoint_and_bad_ids_are_rejected(server):
    splits = {s: set(server.ok("GET", f"/items?split={s}")["item_ids"]) for s in ("train", "dev", "test")}
    assert splits["test"] and not splits["test"] & splits["train"] and not splits["dev"] & splits["train"]
    env_id = server.ok("POST", "/create")["id"]
    status, body = server.call("POST", "/reset", {"id": env_id, "data_idx": -1})  # AgentGym: a seed of -1, a crash
    assert status == 400 and "out of range" in body["detail"]
    server.ok("POST", "/close", {"id": env_id})


def test_item_ids_past_40000_are_served_as_agentgym_serves_them(server):
    """AgentGym serves every data_idx >= 0 (level data_idx % 40 + 1, seed data_idx // 40); the server refused
    "'data_idx' 92400 is out of range [0, 40000)"."""
    env_id = server.ok("POST", "/create")["id"]
    for data_idx in (39_999, 40_000, 92_400, 10 ** 9 + 7):
        level = server.ok("POST", "/reset", {"id": env_id, "data_idx": data_idx % LEVELS})["level"]
        first = server.ok("POST", "/reset", {"id": env_id, "data_idx": data_idx})
        assert (first["level"], first["seed"]) == (level, data_idx // LEVELS)
        assert first["observation"].startswith("Your goal: ")
    server.ok("POST", "/close", {"id": env_id})


def _available(observation: str) -> list[str]:
    return json.loads(observation.rsplit("Available actions: ", 1)[1])


def test_protocol_refusals_say_what_to_do(server):
    """An unknown split, an instance not reset yet, and a finished episode (its step and its expert) each get their
    own answer: the split's choices, a 409 saying to reset, the score kept."""
    status, body = server.call("GET", "/items?split=bogus")
    assert (status, body) == (400, {"error": "bad_split",
                                     "detail": "split must be one of ['dev', 'test', 'train'], got 'bogus'"})
    env_id = server.ok("POST", "/create")["id"]
    status, body = server.call("GET", f"/observation?id={env_id}")
    assert (status, body) == (409, {"error": "not_reset", "detail": "this instance has not been reset: POST /reset first"})
    _, steps = expert_episode(server, 0)
    server.ok("POST", "/reset", {"id": env_id, "data_idx": 0})
    for action, _ in steps:
        last = server.ok("POST", "/step", {"id": env_id, "action": action})
    # GoToRedBallGrey seed 0, two actions (the expert's shortest paths): 1 - 0.9 * 8 / 64 primitive steps
    assert [a for a, _ in steps] == ["move forward", "go to red ball 1"] and last["reward"] == 0.8875
    assert server.ok("POST", "/step", {"id": env_id, "action": "turn left"}) == {
        "observation": "The episode is over: reset to start another.", "reward": 0.0, "score": 0.8875, "done": True}
    status, body = server.call("GET", f"/expert?id={env_id}")
    assert (status, body) == (409, {"error": "episode_over",
                                    "detail": "the episode is over: reset before asking the expert"})
    server.ok("POST", "/close", {"id": env_id})


def test_an_episode_out_of_steps_ends_with_no_reward(server):
    env_id = server.ok("POST", "/create")["id"]
    server.ok("POST", "/reset", {"id": env_id, "data_idx": 0})  # GoToRedBallGrey: 64 primitive steps at most
    replies = [server.ok("POST", "/step", {"id": env_id, "action": "turn left"}) for _ in range(64)]
    assert not any(r["done"] for r in replies[:-1])
    assert replies[-1] == {"observation": "Out of steps: the goal was not reached.", "reward": 0.0, "score": 0.0,
                           "done": True}
    server.ok("POST", "/close", {"id": env_id})


def test_a_locked_door_opens_only_with_its_own_key(server):
    """UnlockLocalDist seed 0 (data_idx 24), along the expert's way: the purple door is described as locked and offers
    no "toggle and go through" until the purple key is carried; then it does, and toggling it wins."""
    env_id = server.ok("POST", "/create")["id"]
    reply = server.ok("POST", "/reset", {"id": env_id, "data_idx": 24})
    seen_locked = False
    while not reply["done"]:
        observation = reply["observation"]
        if "a locked purple door 1 (" in observation:
            seen_locked = True
            carrying_key = "You are carrying: a purple key." in observation
            assert ("toggle and go through purple door 1" in _available(observation)) == carrying_key, observation
        action = server.ok("GET", f"/expert?id={env_id}")["action"]
        reply = server.ok("POST", "/step", {"id": env_id, "action": action})
    assert seen_locked and carrying_key and action == "toggle" and reply["reward"] > 0
    server.ok("POST", "/close", {"id": env_id})


def test_agentgym_text_check_go_to_where_you_face_and_a_failed_ending(agentgym_text):
    """AgentGym's replies to "check ...", to "go to X" while already facing X, and to an episode that terminates
    without success (OpenDoorsOrderN4Debug, seed 0, data_idx 15: the bot opens the doors in the wrong order): the
    reward 0, "The task is completed." appended as AgentGym appends it, and the episode not done."""
    server = agentgym_text
    env_id = server.ok("POST", "/create")["id"]
    first = server.ok("POST", "/reset", {"id": env_id, "data_idx": 0})
    actions = _available(first["observation"])
    assert server.ok("POST", "/step", {"id": env_id, "action": "Check the actions please"})["observation"] == (
        "You can take the following actions: " + ", ".join(actions) + "\nAvailable actions: " + json.dumps(actions))
    goto = next(a for a in actions if a.startswith("go to "))
    facing = server.ok("POST", "/step", {"id": env_id, "action": goto})
    assert not facing["done"] and goto in _available(facing["observation"])
    again = server.ok("POST", "/step", {"id": env_id, "action": goto})
    assert again["observation"] == "No change in state.\nAvailable actions: " + json.dumps(
        _available(facing["observation"]))
    server.ok("POST", "/reset", {"id": env_id, "data_idx": 15})
    for _ in range(40):
        action = server.ok("GET", f"/expert?id={env_id}")["action"]
        reply = server.ok("POST", "/step", {"id": env_id, "action": action})
        if "The task is completed." in reply["observation"]:
            break
    assert (reply["reward"], reply["done"]) == (0, False), reply
    server.ok("POST", "/close", {"id": env_id})


def test_agentgym_text_go_through_an_open_door_walks_into_the_doorway(agentgym_text):
    """GoToObjMazeS7 seed 0 (data_idx 5): the expert's way passes beside an open yellow door; "go through" it ends
    on the door's cell (a path that arrives there, where "go to" stops facing it), so the view is the next room's."""
    server = agentgym_text
    env_id = server.ok("POST", "/create")["id"]
    reply = server.ok("POST", "/reset", {"id": env_id, "data_idx": 5})
    for _ in range(10):
        if "go through yellow open door 1" in _available(reply["observation"]):
            break
        reply = server.ok("POST", "/step", {"id": env_id, "action": server.ok("GET", f"/expert?id={env_id}")["action"]})
    assert "There is a yellow open door 1 0 steps in front of you and 1 steps to your right." in reply["observation"]
    after = server.ok("POST", "/step", {"id": env_id, "action": "go through yellow open door 1"})["observation"]
    assert after.startswith("In front of you in this room, you can see several objects: There is a red closed door 1 "
                            "4 steps in front of you and 1 steps to your right.  There is a yellow closed door 1 "
                            "right in front of you 6 steps away."), after
    server.ok("POST", "/close", {"id": env_id})


def test_agentgym_text_stops_an_action_at_the_first_primitive_that_changes_nothing(agentgym_text):
    """SynthS5R2 seed 0 (data_idx 34): AgentGym's path to the blue door runs through a wall outside the view; its
    fifth primitive (forward into that wall) changes nothing, and there the action stops, as AgentGym's does: the
    view is the one four single actions reach."""
    server = agentgym_text
    env_id = server.ok("POST", "/create")["id"]
    server.ok("POST", "/reset", {"id": env_id, "data_idx": 34})
    stopped = server.ok("POST", "/step", {"id": env_id, "action": "go to blue closed door 1"})
    server.ok("POST", "/reset", {"id": env_id, "data_idx": 34})
    for action in ("turn right", "turn right", "move forward", "turn right"):
        by_hand = server.ok("POST", "/step", {"id": env_id, "action": action})
    assert stopped == by_hand
    assert "You are facing a wall 1 steps away." in stopped["observation"]
    server.ok("POST", "/close", {"id": env_id})


def test_the_expert_is_told_the_actions_the_agent_took_instead(server):
    """The bot advises (minigrid's BabyAIBot.replan(action_taken)): each primitive the agent took reaches it, its
    own suggestion or not. GoToRedBallGrey seed 0 (data_idx 0): after one expert step the agent picks up a grey
    key the bot never planned; told so, the bot puts the key down before going on (a bot told nothing assumes
    its own plan ran and heads for the ball with the key in hand)."""
    env_id = server.ok("POST", "/create")["id"]
    server.ok("POST", "/reset", {"id": env_id, "data_idx": 0})
    first = server.ok("GET", f"/expert?id={env_id}")["action"]
    reply = server.ok("POST", "/step", {"id": env_id, "action": first})
    assert first == "move forward" and "pick up grey key 1" in _available(reply["observation"])
    server.ok("POST", "/step", {"id": env_id, "action": "pick up grey key 1"})
    advice = []
    while not reply["done"] and len(advice) < 6:
        advice.append(server.ok("GET", f"/expert?id={env_id}")["action"])
        reply = server.ok("POST", "/step", {"id": env_id, "action": advice[-1]})
    assert advice == ["drop", "turn right", "go to red ball 1"] and reply["reward"] == 0.83125
    server.ok("POST", "/close", {"id": env_id})
