"""Parity: the built-in TextCraft server against AgentGym's own (agentenv-textcraft at 3ef9235), item for item.

For 272 data_idx (every second one of AgentGym's 544 goals) both servers are reset and driven with the same actions:

- first observation: equal after the normalisation below;
- a fixed script of valid, failing, unrecognised and garbage actions (``script``): equal observation, reward and done
  at every step;
- the built-in expert's actions (GET /expert), stepped on both: equal replies at every step, reward 1 and done at the
  end on AgentGym's server, and one more step after done equal too.

Normalisation (AgentGym's output is not deterministic; each point is also in the server's docstring):

1. AgentGym reads its recipe files in ``os.listdir`` order, which on ext4 is a hash order fixed per file system
   (on this machine data_idx 0 is "light blue dye"; in name order it is "acacia planks"). The load order decides the
   goal list's order, which recipe of a cycle is dropped and the distractor pool. The reference runs with its listing
   in name order (``NAME_ORDER``, a sitecustomize on its PYTHONPATH), the order the built-in server uses everywhere.
2. The recipe lines of the first observation come from Python sets, so their order and, when the pool holds more
   than 10, the choice of the 10 distractors depend on the process's string-hash seed. An observation is compared
   as: the goal line; the set of required recipe lines; the count of the other lines and whether each is in the
   item's distractor pool. The required lines and the pool come from AgentGym's own package (``ORACLE``: its
   ``create_recipe_set`` after the seed its ``reset`` sets), and AgentGym's server observation is checked against
   them too.

Exceptions (none among the compared items): actions over the built-in's 1024 characters and lone surrogates are the
built-in's invalid actions (AgentGym parses them); the scripts never send them. Match rates print with ``-s``:
0/272 on every check with the built-in server before it followed AgentGym (its own goal list and texts), 272/272
after (the odd ids too, checked once).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import subprocess
import threading
import time
from unittest import mock

import pytest

from tests.agentgym_proc import AGENTGYM_DIR, AgentGymServer, compare_in_threads, match_report, require_agentgym
from tests.env_server_proc import server_fixture, venv_python

pytestmark = pytest.mark.timeout(300)

ITEMS = list(range(0, 544, 2))  # AgentGym's 544 goals (depth >= 1), every second one
MAX_EXPERT_TURNS = 100
THREADS = 4
REFERENCE_RESET = threading.Lock()
builtin = server_fixture("textcraft")
quick_closing = server_fixture("textcraft", "--read-timeout", "1")  # closes a connection idle for 1 s

NAME_ORDER = "import os\n_listdir = os.listdir\nos.listdir = lambda path='.': sorted(_listdir(path))\n"

ORACLE = """
import json, random, sys
from agentenv_textcraft.crafting_tree import CraftingTree
from agentenv_textcraft.environment import TextCraftEnv
from agentenv_textcraft.utils import item_id_to_str
tree = CraftingTree("agentenv_textcraft/")
env = TextCraftEnv(tree, None, None)
out = {}
for idx in json.loads(sys.argv[1]):
    env.reset(data_idx=idx)
    random.seed(42)  # the seed reset() sets before it draws the distractors
    recipes, distractors = tree.create_recipe_set(env.goal)
    needed = {r.recipe_str for r in recipes}
    out[idx] = {"goal": item_id_to_str(env.goal), "needed": sorted(needed),
                "pool": sorted({d.recipe_str for d in distractors} - needed)}
print(json.dumps(out))
"""


def script(goal: str) -> list[str]:
    """Valid, failing, unrecognised and garbage actions; the comments say what AgentGym answers."""
    return [
        "inventory",                              # empty inventory
        f"get 1 {goal}",                          # craftable: Could not find
        f"craft 1 {goal} using 1 stick",          # Could not find enough items
        "get 2 oak logs",                         # Got 2 oak logs
        "get 1 planks",                           # a tag: Could not find
        "get 3 unobtainium",                      # unknown item
        "craft 4 oak planks using 1 oak logs",    # Crafted 4 minecraft:oak_planks
        "craft 4 planks using 1 oak logs",        # a tag as output
        "craft 4 stick using 2 planks",           # a tag as ingredient
        "craft 1 stick using 2 oak planks",       # the count crafted is the recipe's
        "craft 9 stick using 1 oak logs",         # items in stock, no such recipe
        "craft stick using oak planks",           # Wrong item format
        "inventory please",                       # a prefix is enough
        "get 1 oak logs\nget 5 stick",            # only the first line counts
        "get 0 dirt",                             # a zero count is kept in the inventory
        "dance around", "", " inventory", "Inventory", "get one oak logs", "craft 1 x using", "get 1 ",
        "inventory",
    ]


@pytest.fixture(scope="module")
def name_order(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("name_order")
    (folder / "sitecustomize.py").write_text(NAME_ORDER)
    return str(folder)


@pytest.fixture(scope="module")
def reference(name_order):
    require_agentgym("textcraft")
    with contextlib.ExitStack() as stack:
        with mock.patch.dict(os.environ, {"PYTHONPATH": name_order}):
            server = stack.enter_context(AgentGymServer("textcraft"))
        yield server


@pytest.fixture(scope="module")
def oracle(name_order) -> dict[int, dict]:
    require_agentgym("textcraft")
    out = subprocess.run([venv_python("agentgym-textcraft"), "-c", ORACLE, json.dumps(ITEMS)],
                         cwd=os.path.join(AGENTGYM_DIR, "agentenv-textcraft"), capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": name_order})
    assert out.returncode == 0, out.stderr[-3000:]
    return {int(k): v for k, v in json.loads(out.stdout.splitlines()[-1]).items()}


def normalise(observation: str, ref: dict) -> tuple:
    """(goal line, required lines present, how many other lines, all of them from the pool, no line twice)."""
    head, _, goal = observation.rpartition("\n\n")
    lines = head.removeprefix("Crafting commands:\n").split("\n")
    needed = set(ref["needed"])
    others = [line for line in lines if line not in needed]
    return (goal, sorted(set(lines) & needed), len(others), set(others) <= set(ref["pool"]),
            len(set(lines)) == len(lines))


def reply(result: dict) -> tuple:
    return result.get("observation"), result.get("reward"), result.get("done")


class Client:
    """A keep-alive JSON client for one server (``call`` opens a connection per request: too slow for ~30K).

    A connection idle for ``reuse_within`` seconds or more is closed and a new one opened for the next request: a
    server closes an idle connection after its keep-alive time (uvicorn, AgentGym's: 5 s; the built-in servers: their
    read timeout, 10 s), and a request sent on it then is lost (ConnectionResetError). A thread of this test can wait
    that long for the reference's reset lock on a busy machine."""

    def __init__(self, url: str, reuse_within: float = 2.0):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.reuse_within = reuse_within
        self.last_answer = time.monotonic()

    def ok(self, method: str, path: str, body: dict | None = None):
        if time.monotonic() - self.last_answer >= self.reuse_within:
            self.conn.close()  # the next request opens a new connection
        self.conn.request(method, path, None if body is None else json.dumps(body),
                          {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        data = json.loads(resp.read())
        self.last_answer = time.monotonic()
        # AgentGym's server answers a failure with 200 and {"error": ...}
        assert resp.status == 200 and not (isinstance(data, dict) and "error" in data), \
            f"{method} {path} {body}: {resp.status} {data}"
        return data


class Pair:
    """One session on each server; ``step`` sends an action to both. AgentGym's reset reseeds the global ``random``
    and then draws from it, so resets on its server never overlap (``REFERENCE_RESET``)."""

    def __init__(self, builtin, reference):
        self.builtin, self.reference = Client(builtin.url), Client(reference.url)
        self.b_id = self.builtin.ok("POST", "/create", {})["id"]
        self.r_id = self.reference.ok("POST", "/create", {})["id"]

    def reset(self, data_idx: int) -> tuple[str, str]:
        b = self.builtin.ok("POST", "/reset", {"id": self.b_id, "data_idx": data_idx})
        with REFERENCE_RESET:
            r = self.reference.ok("POST", "/reset", {"id": self.r_id, "data_idx": data_idx})
        return b["observation"], r["observation"]

    def step(self, action: str) -> tuple[tuple, tuple]:
        b = self.builtin.ok("POST", "/step", {"id": self.b_id, "action": action})
        r = self.reference.ok("POST", "/step", {"id": self.r_id, "action": action})
        return reply(b), reply(r)

    def expert(self) -> str:
        return self.builtin.ok("GET", f"/expert?id={self.b_id}")["action"]

    def close(self) -> None:
        self.builtin.ok("POST", "/close", {"id": self.b_id})
        self.reference.ok("POST", "/close", {"id": self.r_id})


def compare_item(pair: Pair, data_idx: int, ref: dict) -> dict[str, str | None]:
    """Per check: None when the servers agree, else what differed first."""
    found: dict[str, str | None] = {}
    b_obs, r_obs = pair.reset(data_idx)
    expected = (f"Goal: craft {ref['goal']}.", ref["needed"], min(10, len(ref["pool"])), True, True)
    found["goal"] = None if b_obs.rpartition("\n\n")[2] == expected[0] else b_obs.rpartition("\n\n")[2]
    if normalise(r_obs, ref) != expected:
        found["first observation"] = f"AgentGym's own observation is off the oracle: {normalise(r_obs, ref)}"
    else:
        found["first observation"] = None if normalise(b_obs, ref) == expected else repr(normalise(b_obs, ref))
    found["script"] = None
    for action in script(ref["goal"]):
        b, r = pair.step(action)
        if b != r:
            found["script"] = f"{action!r}: built-in {b}, AgentGym {r}"
            break
    found["expert"], (b_done, r_reward) = None, (False, 0)
    pair.reset(data_idx)
    for _ in range(MAX_EXPERT_TURNS):
        action = pair.expert()
        b, r = pair.step(action)
        if b != r:
            found["expert"] = f"{action!r}: built-in {b}, AgentGym {r}"
            break
        b_done, r_reward = b[2], r[1]
        if b_done:
            after = pair.step("inventory")  # AgentGym keeps the episode going after done
            if after[0] != after[1]:
                found["expert"] = f"'inventory' after done: built-in {after[0]}, AgentGym {after[1]}"
            break
    if found["expert"] is None and not (b_done and r_reward == 1):
        found["expert"] = f"no reward 1 on AgentGym's server in {MAX_EXPERT_TURNS} expert turns"
    return found


def test_builtin_server_reproduces_agentgym(builtin, reference, oracle):
    results = compare_in_threads(lambda: Pair(builtin, reference),
                                 lambda pair, idx: compare_item(pair, idx, oracle[idx]), ITEMS, THREADS)
    differences = match_report("TextCraft parity (built-in vs AgentGym 3ef9235)", results,
                               ["goal", "first observation", "script", "expert"])
    assert not differences, "first differences:\n" + "\n".join(differences[:12])


def test_the_client_opens_a_new_connection_after_the_server_closed_the_idle_one(quick_closing):
    kept = Client(quick_closing.url, reuse_within=math.inf)
    kept.ok("GET", "/")
    time.sleep(1.5)
    with pytest.raises(ConnectionError):  # the server closed it: a request sent on it is lost
        kept.ok("GET", "/")
    client = Client(quick_closing.url, reuse_within=0.5)
    client.ok("GET", "/")
    time.sleep(1.5)
    assert client.ok("GET", "/")
