"""The ALFWorld server, run for real from .venvs/alfworld on the hand-written games in tests/fixtures/alfworld.

The fixture folder is laid out like $ALFWORLD_DATA: three train games (pick-and-place, clean, heat), two in
valid_unseen (the test split: look-under-lamp, cool) and one in valid_seen (the dev split), so data_idx 0-2 are
train, 3-4 test, 5 dev. The ``--mapping`` tests write AgentGym-style mapping files and a data folder of links to
these games in tmp_path.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.env_server_proc import EnvServerProcess, check_crafted_actions, require_venv, server_fixture

pytestmark = pytest.mark.timeout(120)

GAMES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "alfworld")
TASKS = ["put a mug in coffeemachine", "put a clean plate in cabinet", "put a hot apple in countertop",
         "look at book under the desklamp", "put a cool tomato in diningtable", "put a cellphone in drawer"]

server = server_fixture("alfworld", "--games", GAMES)


def play_expert(proc: EnvServerProcess, env_id: int, max_steps: int = 40) -> list[dict]:
    steps = []
    while not (steps and steps[-1]["done"]) and len(steps) < max_steps:
        action = proc.ok("GET", f"/expert?id={env_id}")["action"]
        steps.append({"action": action, **proc.ok("POST", "/step", {"id": env_id, "action": action})})
    return steps


def test_items_follow_the_game_folders(server):
    splits = {s: server.ok("GET", f"/items?split={s}")["item_ids"] for s in ("train", "dev", "test")}
    assert splits == {"train": [0, 1, 2], "test": [3, 4], "dev": [5]}
    env_id = server.ok("POST", "/create")["id"]
    for idx in splits["test"]:
        task_type = server.ok("POST", "/reset", {"id": env_id, "data_idx": idx})["task_type"]
        assert task_type.split("-")[0] in ("look_at_obj_in_light", "pick_cool_then_place_in_recep")
    server.ok("POST", "/close", {"id": env_id})


@pytest.mark.parametrize("idx", range(6))
def test_planner_expert_wins_every_shipped_game(server, idx):
    env_id = server.ok("POST", "/create")["id"]
    reset = server.ok("POST", "/reset", {"id": env_id, "game": idx, "world_type": "Text"})  # AgentGym's fields
    assert reset["observation"].startswith("You are in the middle of a room.")
    assert reset["observation"].endswith(f"Your task is to: {TASKS[idx]}.") and "Welcome" not in reset["observation"]
    assert "look" in reset["available_actions"] and "inventory" in reset["available_actions"]

    garbage = server.ok("POST", "/step", {"id": env_id, "action": "fly to the moon"})
    assert garbage == {"observation": "Nothing happens.", "reward": 0.0,
                       "available_actions": reset["available_actions"], "done": False}

    steps = play_expert(server, env_id)
    assert steps[-1]["done"] and steps[-1]["reward"] == 1.0  # won
    assert all(s["reward"] == 0.0 and not s["done"] for s in steps[:-1])
    assert all(s["action"] in prev["available_actions"] for prev, s in zip([reset, *steps], steps))
    assert server.ok("GET", f"/observation?id={env_id}")["observation"] == steps[-1]["observation"]
    assert server.ok("POST", "/close", {"id": env_id}) == {"closed": env_id}


def test_bad_requests_get_clear_errors(server):
    env_id = server.ok("POST", "/create")["id"]
    status, body = server.call("POST", "/reset", {"id": env_id, "game": 0, "world_type": "Embody"})
    assert status == 400 and "Text" in body["detail"]
    assert server.call("POST", "/reset", {"id": env_id, "data_idx": 6})[1]["error"] == "bad_data_idx"
    assert server.call("POST", "/reset", {"id": env_id})[1]["error"] == "missing_field"
    assert server.call("POST", "/step", {"id": env_id, "action": "look"})[0] == 409  # not reset yet
    assert server.call("GET", "/items?split=valid")[0] == 400
    server.ok("POST", "/close", {"id": env_id})


def test_overlong_action_is_an_invalid_action_with_the_commands_still_listed(server):
    env_id = server.ok("POST", "/create")["id"]
    first = server.ok("POST", "/reset", {"id": env_id, "data_idx": 0})
    server.ok("POST", "/close", {"id": env_id})
    [reply] = check_crafted_actions(server, {"data_idx": 0}, ["go to " * 11000])
    assert reply["observation"].startswith("Invalid action: the action is 66000 characters long, over the 1024")
    assert reply["available_actions"] == first["available_actions"]
    assert reply["reward"] == 0 and reply["done"] is False


@pytest.mark.parametrize("n_steps", [pytest.param(3, id="first-3-steps"),
                                     pytest.param(None, id="whole-episodes", marks=pytest.mark.slow)])
def test_fifty_concurrent_sessions_without_cross_talk(server, n_steps):
    """50 sessions (each of the six games 8-9 times) at once, each stepping through its game's recorded expert
    actions (the first n_steps, or all of them); each must see exactly its own game's observations."""
    reference = {}
    for idx in range(6):
        env_id = server.ok("POST", "/create")["id"]
        first = server.ok("POST", "/reset", {"id": env_id, "data_idx": idx})["observation"]
        steps = play_expert(server, env_id)[:n_steps]
        reference[idx] = (first, [s["action"] for s in steps], [s["observation"] for s in steps], steps[-1])
        server.ok("POST", "/close", {"id": env_id})

    def episode(k: int) -> tuple[int, list[str], dict]:
        idx = k % 6
        env_id = server.ok("POST", "/create")["id"]
        seen = [server.ok("POST", "/reset", {"id": env_id, "data_idx": idx}, timeout=60)["observation"]]
        for action in reference[idx][1]:
            result = server.ok("POST", "/step", {"id": env_id, "action": action}, timeout=60)
            seen.append(result["observation"])
        server.ok("POST", "/close", {"id": env_id})
        return idx, seen, result

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(episode, range(50)))
    for idx, seen, last in results:
        first, _, observations, expected_last = reference[idx]
        assert seen == [first, *observations]
        assert (last["reward"], last["done"]) == (expected_last["reward"], expected_last["done"])
    assert server.ok("GET", "/")["instances"] == 0


def test_same_item_same_first_observation_across_restarts(server):
    require_venv("alfworld")
    with EnvServerProcess("alfworld", "--games", GAMES) as fresh:
        for proc_a, proc_b in [(server, fresh)]:
            for idx in range(6):
                a, b = proc_a.ok("POST", "/create")["id"], proc_b.ok("POST", "/create")["id"]
                assert proc_a.ok("POST", "/reset", {"id": a, "data_idx": idx}) == \
                    proc_b.ok("POST", "/reset", {"id": b, "data_idx": idx})
                proc_a.ok("POST", "/close", {"id": a})
                proc_b.ok("POST", "/close", {"id": b})


FIXTURE_TRIALS = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(GAMES, "json_2.1.1", "*", "*", "*",
                                                                           "game.tw-pddl")))


def task_of(trial: str) -> str:
    """The "Your task is to: ..." line of a fixture game (its grammar holds it)."""
    with open(os.path.join(trial, "game.tw-pddl")) as f:
        grammar = json.load(f)["grammar"]
    start = grammar.index("Your task is to: ")
    return grammar[start:grammar.index('"', start)]


def mapped_folder(tmp_path, train: list[int], test: list[int]) -> tuple[str, str]:
    """(games folder, mapping folder): AgentGym-style mapping files whose entries are fixture games (by index into
    FIXTURE_TRIALS, under made-up task/trial names), and a games folder with those games where the mapping says."""
    root, configs = tmp_path / "data", tmp_path / "configs"
    configs.mkdir()
    item_id = 0
    for name, folder, picks in (("mappings_train.json", "train", train), ("mappings_test.json", "valid_train", test)):
        entries = []
        for k in picks:
            task_type = f"{os.path.basename(os.path.dirname(FIXTURE_TRIALS[k]))}-{item_id}"
            entries.append({"item_id": item_id, "task_type": task_type, "task_id": f"trial_{item_id}"})
            (root / "json_2.1.1" / folder / task_type).mkdir(parents=True)
            os.symlink(FIXTURE_TRIALS[k], root / "json_2.1.1" / folder / task_type / f"trial_{item_id}")
            item_id += 1
        (configs / name).write_text(json.dumps(entries))
    return str(root), str(configs)


def test_mapping_orders_the_games_and_splits_as_agentgym(tmp_path):
    require_venv("alfworld")
    order = [4, 0, 2, 5, 1]  # train: 4, 0, 2; test: 5, 1
    root, configs = mapped_folder(tmp_path, order[:3], order[3:])
    with EnvServerProcess("alfworld", "--games", root, "--mapping", configs) as proc:
        splits = {s: proc.ok("GET", f"/items?split={s}")["item_ids"] for s in ("train", "dev", "test")}
        assert splits == {"train": [0, 1, 2], "test": [3, 4], "dev": []}
        env_id = proc.ok("POST", "/create")["id"]
        for idx, k in enumerate(order):
            reset = proc.ok("POST", "/reset", {"id": env_id, "game": idx, "world_type": "Text"})
            folder = "train" if idx < 3 else "valid_train"
            task_dir = f"{os.path.basename(os.path.dirname(FIXTURE_TRIALS[k]))}-{idx}"
            assert reset["task_type"] == f"{task_dir}/trial_{idx}"
            assert reset["observation"].endswith(task_of(FIXTURE_TRIALS[k]))
            assert os.path.isdir(os.path.join(root, "json_2.1.1", folder, task_dir))
        assert proc.call("POST", "/reset", {"id": env_id, "data_idx": 5})[1]["error"] == "bad_data_idx"
        proc.ok("POST", "/close", {"id": env_id})


def test_mapping_with_missing_games_serves_the_others(tmp_path):
    require_venv("alfworld")
    root, configs = mapped_folder(tmp_path, [0, 1], [3])
    shutil.rmtree(os.path.join(root, "json_2.1.1", "valid_train"))
    with EnvServerProcess("alfworld", "--games", root, "--mapping", configs) as proc:
        assert "1 of the 3 mapped games are missing" in proc.output()
        env_id = proc.ok("POST", "/create")["id"]
        assert proc.ok("POST", "/reset", {"id": env_id, "data_idx": 1})["task_type"].endswith("/trial_1")
        status, body = proc.call("POST", "/reset", {"id": env_id, "data_idx": 2})
        assert status == 404 and body["error"] == "missing_game"
        assert "json_2.1.1/valid_train/" in body["detail"] and "alfworld-download" in body["detail"]
        proc.ok("POST", "/close", {"id": env_id})


@pytest.mark.parametrize("case", ["no-file", "not-json", "not-a-list", "no-task-id", "item-id-order", "no-games"])
def test_unusable_mapping_stops_the_server_saying_why(tmp_path, case):
    require_venv("alfworld")
    root, configs = mapped_folder(tmp_path, [0, 1], [3])
    train = os.path.join(configs, "mappings_train.json")
    entries = json.load(open(train))
    expected = {"no-file": "cannot read the mapping file", "not-json": "is not JSON",
                "not-a-list": "must hold a non-empty JSON list", "no-task-id": 'string "task_type" and "task_id"',
                "item-id-order": "has item_id 1, but is data_idx 0", "no-games": "none of the 3 games"}[case]
    if case == "no-file":
        os.remove(os.path.join(configs, "mappings_test.json"))
    elif case == "not-json":
        open(train, "w").write("[{")
    elif case == "not-a-list":
        json.dump({"0": entries[0]}, open(train, "w"))
    elif case == "no-task-id":
        json.dump([{**entries[0], "task_id": None}, entries[1]], open(train, "w"))
    elif case == "item-id-order":
        json.dump(entries[::-1], open(train, "w"))
    else:
        shutil.rmtree(os.path.join(root, "json_2.1.1"))
    with pytest.raises(RuntimeError) as stopped:
        with EnvServerProcess("alfworld", "--games", root, "--mapping", configs):
            pass
    fix = "--games" if case == "no-games" else "agentenv-alfworld/configs"  # each message says what to do
    assert expected in str(stopped.value) and fix in str(stopped.value)


def test_step_text_drops_the_arrival_at_a_numbered_location(tmp_path):
    """ALFWorld's released games say "You arrive at loc 12. On the countertop 1, you see ..."; AgentGym's server (so
    this one) cuts the "You arrive at loc N. " (the fixture games' grammar names the receptacle instead)."""
    require_venv("alfworld")
    trial = tmp_path / "json_2.1.1" / "train" / "pick_and_place_simple-Mug-None-CoffeeMachine-901" / "trial_loc"
    shutil.copytree(FIXTURE_TRIALS[0], trial)
    with open(trial / "game.tw-pddl") as f:
        game = json.load(f)
    arrival = "You arrive at {r.name}. #examineReceptacle.feedback#"
    assert arrival in game["grammar"]
    game["grammar"] = game["grammar"].replace(arrival, "You arrive at loc 12. #examineReceptacle.feedback#")
    (trial / "game.tw-pddl").write_text(json.dumps(game))
    with EnvServerProcess("alfworld", "--games", str(tmp_path)) as proc:
        env_id = proc.ok("POST", "/create")["id"]
        reset = proc.ok("POST", "/reset", {"id": env_id, "data_idx": 0})
        go = next(a for a in reset["available_actions"] if a.startswith("go to "))
        place = go[len("go to "):]
        observation = proc.ok("POST", "/step", {"id": env_id, "action": go})["observation"]
        assert not observation.startswith("You arrive") and place in observation.split(".")[0]
        assert proc.ok("GET", f"/observation?id={env_id}")["observation"] == observation
