"""Parity: the built-in BabyAI server (``--text agentgym``) against AgentGym's own (agentenv-babyai at 3ef9235).

200 data_idx, every one of the 40 levels at 5 seeds spread over the 1000 (``ITEMS``), are reset on both servers and
driven with the same actions:

- goal: the first line of the first observation ("Your goal: ...") equal;
- first observation: equal, whole (AgentGym's text is deterministic for a given env: objects sort by distance, ties
  in view order, so no normalisation is needed);
- script: a fixed list of valid, refused, unrecognised and garbage actions (``SCRIPT``; "$go" and "$pickup" stand for
  the first such action the observation lists): equal observation, reward, score and done at every step;
- expert: the built-in's expert actions (GET /expert, up to ``MAX_EXPERT_TURNS``), stepped on both: equal replies at
  every step, so equal rewards.

Exceptions: none among the compared items. Known limits, not compared: after ``done`` AgentGym answers
``{"error": ...}`` where the built-in says the episode is over; actions over the built-in's 256 characters and lone
surrogates are the built-in's invalid actions (AgentGym parses them). The bot behind the expert cannot solve
KeyInBox and PutNextS7N4Carrying, and stops early (500) on some items; the replies up to there are still compared.
The default ``--text compact`` keeps its own text but has AgentGym's tasks: its goal lines are checked too.

Match rates print with ``-s``; before the built-in followed AgentGym (its own level list and text): goal 17/200,
first observation 0/200, script 0/200, expert 0/200; after: 200/200 on every check, compact goal 200/200.
"""

from __future__ import annotations

import itertools
import json

import pytest

from tests.agentgym_proc import agentgym_fixture, compare_in_threads, match_report
from tests.env_server_proc import server_fixture

pytestmark = pytest.mark.timeout(240)

LEVELS = 40
SEEDS = (0, 7, 123, 512, 999)
ITEMS = [seed * LEVELS + level for seed in SEEDS for level in range(LEVELS)]
SCRIPT = ("check available actions", "", "fly to the moon", "drop", "toggle", "go through red open door 1",
          "pickup grey ball 9", "$go", "TURN LEFT ", "move forward", "$pickup", "turn right", "move forward", "drop",
          "check", "go to purple box 3")
MAX_EXPERT_TURNS = 30
THREADS = 4
FIELDS = ("observation", "reward", "score", "done")

builtin = server_fixture("babyai", "--text", "agentgym")
compact = server_fixture("babyai")
reference = agentgym_fixture("babyai")


class Session:
    """One instance on each server, reset per item (both servers allow reset after done)."""

    def __init__(self, builtin, reference):
        self.servers = (builtin, reference)
        self.ids = [s.ok("POST", "/create", {})["id"] for s in self.servers]

    def call(self, path: str, **body) -> tuple[dict, dict]:
        a, b = (s.ok("POST", path, {"id": i, **body}) for s, i in zip(self.servers, self.ids))
        return {k: a.get(k) for k in FIELDS}, {k: b.get(k) for k in FIELDS}

    def expert(self) -> str | None:
        status, body = self.servers[0].call("GET", f"/expert?id={self.ids[0]}")
        return body["action"] if status == 200 else None

    def close(self) -> None:
        for s, i in zip(self.servers, self.ids):
            s.call("POST", "/close", {"id": i})


def _available(observation: str) -> list[str]:
    return json.loads(observation.rsplit("Available actions: ", 1)[1])


def _drive(session: Session, next_action, observation: str = "") -> str | None:
    """Step both servers with ``next_action(turn, AgentGym's last observation)`` until it says None or ``done``: None
    when every reply was equal, else the first difference."""
    for turn in itertools.count():
        action = next_action(turn, observation)
        if action is None:
            return None
        ours, theirs = session.call("/step", action=action)
        if ours != theirs:
            return f"turn {turn}, {action!r}: {ours} vs {theirs}"
        if ours["done"]:
            return None
        observation = theirs["observation"]


def _check_item(session: Session, data_idx: int) -> dict[str, str | None]:
    """Every check of one item: None when equal, else the first difference."""
    out: dict[str, str | None] = {}
    ours, theirs = session.call("/reset", data_idx=data_idx)
    out["goal"] = None if ours["observation"].split("\n")[0] == theirs["observation"].split("\n")[0] else \
        f"{ours['observation'].splitlines()[0]!r} vs {theirs['observation'].splitlines()[0]!r}"
    out["first observation"] = None if ours == theirs else f"{ours} vs {theirs}"

    def scripted(turn: int, observation: str) -> str | None:
        if turn == len(SCRIPT):
            return None
        action = SCRIPT[turn]
        if action.startswith("$"):
            return next((a for a in _available(observation) if a.startswith(action[1:] + " ")), "")
        return action

    out["script"] = _drive(session, scripted, theirs["observation"])
    session.call("/reset", data_idx=data_idx)
    out["expert"] = _drive(session, lambda turn, _: session.expert() if turn < MAX_EXPERT_TURNS else None)
    return out


def test_builtin_server_matches_agentgyms_item_for_item(builtin, reference):
    results = compare_in_threads(lambda: Session(builtin, reference), _check_item, ITEMS, THREADS)
    differences = match_report("BabyAI parity, built-in (--text agentgym) vs AgentGym", results,
                               ["goal", "first observation", "script", "expert"])
    assert not differences, "\n".join(differences[:12])


def test_compact_text_has_agentgyms_goals(compact, reference):
    goals = []
    for server in (compact, reference):
        env_id = server.ok("POST", "/create", {})["id"]
        goals.append([server.ok("POST", "/reset", {"id": env_id, "data_idx": i})["observation"].split("\n")[0]
                      for i in ITEMS])
        server.call("POST", "/close", {"id": env_id})
    bad = [(i, ours, theirs) for i, ours, theirs in zip(ITEMS, *goals) if ours != theirs]
    report = f"compact goal: {len(ITEMS) - len(bad)}/{len(ITEMS)}" + (f" (first mismatch: {bad[0]})" if bad else "")
    print("\n" + report)
    assert not bad, report


def test_item_ids_past_40000_match_agentgyms(builtin, reference):
    """AgentGym serves any data_idx >= 0 (seed data_idx // 40, past the 1000 seeds of the splits): the same items,
    the same first observation (the built-in refused them: "'data_idx' 92400 is out of range [0, 40000)")."""
    session = Session(builtin, reference)
    try:
        for data_idx in (40_000, 92_400, 123_457):
            ours, theirs = session.call("/reset", data_idx=data_idx)
            assert ours == theirs, (data_idx, ours, theirs)
    finally:
        session.close()
