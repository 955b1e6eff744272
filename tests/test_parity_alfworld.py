"""Parity: the built-in ALFWorld server (``--mapping``) against AgentGym's own (agentenv-alfworld at 3ef9235).

ALFWorld's 2620 games are not on this machine, so the test builds, in a temporary folder, a data folder laid out as
AgentGym's mapping files say for the 202 data_idx ``ITEMS`` (every 13th of 0..2619, so train and test items):
``json_2.1.1/train|valid_train/<task_type>/<task_id>`` is a link to one of the six games of tests/fixtures/alfworld,
cycling over them; the other 2418 mapped games are absent (the built-in serves the games a folder holds; AgentGym
only opens a game at reset). AgentGym's server reads its data from ``~/.cache/alfworld`` whatever ALFWORLD_DATA
says, so it runs with HOME pointing at the folder; at /create it opens ``logic/alfred.pddl`` and ``alfred.twl2``
(which ``alfworld-download`` puts there and no reset uses: every game file carries its domain and grammar): the
copies in its venv's alfworld package stand in. The built-in runs with ``--games <folder> --mapping <AgentGym's
configs>``. Each of the 202 items is reset on both servers; 12 (``DEEP``: each fixture game once among the train
items and once among the test ones) are driven further:

- reset: equal observation, available_actions and task_type (all 202: the mapping, data_idx -> game);
- script: a fixed list of valid (``$go to``/``$take``... stand for the first available action of that verb), refused
  (well-formed but not available), unrecognised and garbage actions (``SCRIPT``): equal observation, reward, done
  and available_actions at every step;
- expert: the built-in's expert actions (GET /expert, up to ``MAX_EXPERT_TURNS``), stepped on both from a fresh
  reset: equal replies at every step, so an equal final reward (1.0: every fixture game is won by its expert).

Exceptions: none among the compared items. Known limits, not compared: after ``done`` AgentGym answers
``{"error": ...}`` where the built-in steps on; actions over the built-in's 1024 characters and lone surrogates are
its invalid actions (AgentGym hands them to the engine); AgentGym takes world_type "Embody"/"Hybrid" and plays the
text world anyway, the built-in refuses them. The fixture games' grammar says "You arrive at <receptacle>.", so
the "You arrive at loc N. " cut of ALFWorld's released games is checked by tests/test_server_alfworld.py instead.
Runtime ~4.5 min on 2 busy cores: AgentGym's server answers one request at a time, ~0.85 s a reset (it builds a new
gym env and parses the game each time) and ~0.12 s a step.

Match rates print with ``-s``. Before (the server without --mapping, run as ``--games <folder> --test-split
valid_train``: its own game list, sorted folders, so data_idx past 186 out of range, and its own text: paragraphs
kept apart by a blank line, step text stripped): reset 0/202, script 0/12 (first at "help"), expert 6/12 (the test
items could not be reset); after: reset 202/202, script 12/12, expert 12/12.
"""

from __future__ import annotations

import glob
import json
import itertools
import os
import shutil

import pytest

from env_gateway.process import EnvServerProcess, venv_python
from tests.agentgym_proc import (AGENTGYM_DIR, AgentGymServer, compare_in_threads, match_report,
                                 require_agentgym)
from tests.env_server_proc import require_venv

pytestmark = pytest.mark.timeout(480)  # ~4.5 min on 2 loaded cores: 202 AgentGym resets at ~0.85 s, one at a time

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "alfworld")
CONFIGS = os.path.join(AGENTGYM_DIR, "agentenv-alfworld", "configs")
N_TRAIN, N_ITEMS = 2420, 2620  # AgentGym's mappings_train.json then mappings_test.json
ITEMS = list(range(0, N_ITEMS, 13))
FIXTURE_GAMES = 6  # ITEMS[k] is a link to the k % 6-th fixture game
# script and expert on 12 items, each fixture game once among the train items and once among the test ones: the
# items are links to 6 games, so more would replay the same games (and AgentGym's server, ~0.85 s a reset and ~0.12
# s a step, one request at a time, sets the test's pace)
DEEP = ITEMS[:FIXTURE_GAMES] + [i for i in ITEMS if i >= N_TRAIN][:FIXTURE_GAMES]
SCRIPT = ("look", "inventory", "$examine", "", "fly to the moon", "go to the moon 1", "take spoon 42 from bed 7",
          "$go to", "help", "$take", "LOOK", " look ", "!!@@##", "\u8d70", "put it down", "x" * 1000, "$open",
          "inventory", "go to")
MAX_EXPERT_TURNS = 40
THREADS = 2  # one request in flight on each server: AgentGym's handles one at a time
FIELDS = ("observation", "reward", "done", "available_actions")


def _mapping() -> list[tuple[str, str, str]]:
    """(split folder, task_type, task_id) of every data_idx, as AgentGym's two mapping files list them."""
    out = []
    for name, folder in (("mappings_train.json", "train"), ("mappings_test.json", "valid_train")):
        with open(os.path.join(CONFIGS, name)) as f:
            out += [(folder, e["task_type"], e["task_id"]) for e in json.load(f)]
    assert len(out) == N_ITEMS and len(out) - N_TRAIN == 200
    return out


@pytest.fixture(scope="module")
def data_home(tmp_path_factory) -> str:
    """A HOME whose .cache/alfworld holds ITEMS' games (links to the fixture games) and the logic files."""
    require_agentgym("alfworld")
    home = tmp_path_factory.mktemp("alfworld_home")
    root = home / ".cache" / "alfworld"
    fixture_trials = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(FIXTURES, "json_2.1.1", "*", "*", "*",
                                                                               "game.tw-pddl")))
    mapping = _mapping()
    for k, idx in enumerate(ITEMS):
        folder, task_type, task_id = mapping[idx]
        (root / "json_2.1.1" / folder / task_type).mkdir(parents=True, exist_ok=True)
        os.symlink(fixture_trials[k % len(fixture_trials)], root / "json_2.1.1" / folder / task_type / task_id)
    site = os.path.dirname(os.path.dirname(venv_python("agentgym-alfworld")))
    [data] = glob.glob(os.path.join(site, "lib", "python3*", "site-packages", "alfworld", "data"))
    (root / "logic").mkdir()
    for name in ("alfred.pddl", "alfred.twl2"):
        shutil.copy(os.path.join(data, name), root / "logic" / name)
    return str(home)


@pytest.fixture(scope="module")
def reference(data_home):
    with AgentGymServer("alfworld", environ={"HOME": data_home}) as proc:
        yield proc


@pytest.fixture(scope="module")
def builtin(data_home):
    require_venv("alfworld")
    root = os.path.join(data_home, ".cache", "alfworld")
    with EnvServerProcess("alfworld", "--games", root, "--mapping", CONFIGS) as proc:
        yield proc


class Session:
    """One instance on each server, reset per item (both servers allow a reset at any time)."""

    def __init__(self, builtin, reference):
        self.servers = (builtin, reference)
        self.ids = [s.ok("POST", "/create", {})["id"] for s in self.servers]

    def post(self, path: str, body: dict, keys: tuple[str, ...]) -> tuple[dict, dict]:
        """Both replies cut to ``keys``; a refused request (HTTP error, AgentGym's ``{"error"}``) as a whole dict,
        so it is a difference, not an exception that hides the other items' results."""
        out = []
        for server, env_id in zip(self.servers, self.ids):
            status, reply = server.call("POST", path, {"id": env_id, **body}, timeout=60)
            ok = status == 200 and isinstance(reply, dict) and "error" not in reply
            out.append({k: reply.get(k) for k in keys} if ok else {"http": status, "reply": reply})
        return out[0], out[1]

    def reset(self, data_idx: int) -> tuple[dict, dict]:
        # AgentGym's fields on both: the built-in takes them too
        return self.post("/reset", {"game": data_idx, "world_type": "Text"},
                         ("observation", "available_actions", "task_type"))

    def step(self, action: str) -> tuple[dict, dict]:
        return self.post("/step", {"action": action}, FIELDS)

    def expert(self) -> str | None:
        status, body = self.servers[0].call("GET", f"/expert?id={self.ids[0]}")
        return body["action"] if status == 200 else None

    def close(self) -> None:
        self.servers[0].call("POST", "/close", {"id": self.ids[0]})  # AgentGym's server has no /close


def _drive(session: Session, next_action, available: list[str]) -> tuple[str | None, dict | None]:
    """Step both servers with ``next_action(turn, AgentGym's available actions)`` until it says None or ``done``:
    (None when every reply was equal, else the first difference; the last reply)."""
    last = None
    for turn in itertools.count():
        action = next_action(turn, available)
        if action is None:
            return None, last
        ours, theirs = session.step(action)
        if ours != theirs:
            return f"turn {turn}, {action[:40]!r}: {ours} vs {theirs}", last
        last = ours
        if ours["done"]:
            return None, last
        available = theirs["available_actions"]


def _check_item(session: Session, data_idx: int) -> dict[str, str | None]:
    """Every check of one item: None when equal, else the first difference."""
    out: dict[str, str | None] = {}
    ours, theirs = session.reset(data_idx)
    out["reset"] = None if ours == theirs else f"{ours} vs {theirs}"
    if data_idx not in DEEP:
        return out
    if "http" in ours or "http" in theirs:
        return {**out, "script": "no reset", "expert": "no reset"}

    def scripted(turn: int, available: list[str]) -> str | None:
        if turn == len(SCRIPT):
            return None
        action = SCRIPT[turn]
        if action.startswith("$"):
            return next((a for a in available if a.startswith(action[1:] + " ")), "")
        return action

    out["script"], _ = _drive(session, scripted, theirs["available_actions"])
    ours, _ = session.reset(data_idx)
    out["expert"], last = _drive(session, lambda turn, _: session.expert() if turn < MAX_EXPERT_TURNS else None,
                                 ours["available_actions"])
    if out["expert"] is None and not (last and last["reward"] == 1.0 and last["done"]):
        out["expert"] = f"the expert did not win: last reply {last}"
    return out


def test_builtin_server_matches_agentgyms_item_for_item(builtin, reference):
    results = compare_in_threads(lambda: Session(builtin, reference), _check_item, ITEMS, THREADS)
    differences = match_report("ALFWorld parity, built-in (--mapping) vs AgentGym", results,
                               ["reset", "script", "expert"])
    assert sum("expert" in r for _, r in results) == len(DEEP)
    assert not differences, "\n".join(differences[:12])


def test_item_ids_follow_agentgyms_mapping(builtin):
    splits = {s: builtin.ok("GET", f"/items?split={s}")["item_ids"] for s in ("train", "dev", "test")}
    assert splits == {"train": list(range(N_TRAIN)), "test": list(range(N_TRAIN, N_ITEMS)), "dev": []}
