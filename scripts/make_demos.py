"""Expert demonstrations from a real environment server, in the agent funcs' chat format.

    python scripts/make_demos.py --env NAME --n N --out FILE.jsonl [--split train] [--offset 0] [--url URL]

Starts ``.venvs/NAME/bin/python -m env_gateway.servers.NAME`` on a free 127.0.0.1 port (or uses ``--url``),
takes the first N item ids of the split (after ``--offset``) from ``GET /items``, and for each: POST /create,
POST /reset, then GET /expert -> POST /step until done (or ``--max-turns``), then POST /close. One JSON line per
episode: ``{"env", "item_id", "reward" (summed), "success", "turns", "messages"}`` where messages are
user: INSTRUCTIONS[env], assistant: ACKNOWLEDGEMENT, user: first observation, then per expert step
assistant: "Thought:\\n<sentence>\\n\\nAction:\\n<action>" and user: the observation.
Success: SciWorld needs a final score of 100; every other env a positive reward on the final, done step.

``--policy view`` (BabyAI go-to / pick-up missions only) replaces the server's expert with ``view_only_action``:
act on the goal object when the view lists it, else turn left. BabyAIBot's own moves in states where the goal is
out of view depend on the map it knows, so from the text they look random and a policy trained on them cannot
learn when to search; the view-only demonstrator's moves are a function of the text alone. ``--policy
view-random`` searches at random instead (turn left, turn right or move forward, uniformly among those listed; a
generator seeded with the item id): a weaker demonstrator, so that RL has something to improve on (turning one
way finds the goal in at most three turns; a random search often does not). ``--policy view-hesitant`` searches at
random too, and passes over a listed goal with probability HESITATION (searching on instead): a warm start that
imitates it leaves RL the plainest thing to learn, going to the goal when it is in view (the quickstart's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
from contextlib import nullcontext
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agent_funcs.instructions import ACKNOWLEDGEMENT, INSTRUCTIONS  # noqa: E402
from env_gateway.process import EnvServerProcess, call  # noqa: E402


def thought(action: str) -> str:
    """A short reason for an expert action, from its form only (the expert gives no reasons)."""
    words = action.split()
    if action.startswith("<search>"):
        return "I should look up the facts this question needs."
    if action.startswith("<answer>"):
        return "The retrieved passages contain the answer."
    if words[:1] == ["get"]:
        return f"I need {' '.join(words[2:])} as a basic ingredient."
    if words[:1] == ["craft"]:
        return f"I have what the recipe needs, so I craft {action.split(' using ')[0].split(' ', 2)[-1]}."
    return f"The next step toward the goal is to {action}."


BABYAI_GOAL = re.compile(r"Your goal: (go to|pick up) (?:the|a) (\w+) (\w+)\n")


SEARCH_MOVES = ("turn left", "turn right", "move forward")
POLICIES = ["expert", "view", "view-random", "view-hesitant"]
HESITATION = 0.5  # view-hesitant: the chance of searching on although the view lists the goal


def view_only_action(first_observation: str, observation: str, search: random.Random | None = None,
                     hesitation: float = 0.0) -> str:
    """BabyAI: the listed "<verb> <color> <type> 1" for the goal object named in the episode's first observation
    (1 = the nearest of its kind) when the current view lists it, else "turn left" (three turns see the room), or
    with ``search`` a uniform choice among the listed SEARCH_MOVES. With ``search`` and ``hesitation`` h, a listed
    goal is passed over (searched on) with probability h."""
    goal = BABYAI_GOAL.search(first_observation)
    if goal is None:
        raise ValueError("view_only_action: the first observation has no 'Your goal: go to / pick up the <color> "
                         "<type>' line; --policy view covers BabyAI's go-to and pick-up levels only. "
                         f"Got: {first_observation[:200]!r}")
    available = json.loads(observation.rsplit("Available actions: ", 1)[1].splitlines()[0])
    verb, color, kind = goal.groups()
    # "pick up" in the compact text, "pickup" in AgentGym's
    act = next((a for a in (f"{verb} {color} {kind} 1", f"{verb.replace(' ', '')} {color} {kind} 1")
                if a in available), None)
    if act is not None and not (search and search.random() < hesitation):
        return act
    return search.choice([m for m in SEARCH_MOVES if m in available]) if search else "turn left"


def demo_policy(name: str, item_id: int) -> Callable[[str, str], str] | None:
    """The ``--policy`` NAME for one episode: None (the server's expert) or a view-only demonstrator."""
    if name == "view":
        return view_only_action
    if name in ("view-random", "view-hesitant"):
        rng = random.Random(item_id)
        hesitation = HESITATION if name == "view-hesitant" else 0.0
        return lambda first, observation: view_only_action(first, observation, rng, hesitation)
    return None


def succeeded(env: str, last: dict) -> bool:
    if env == "sciworld":
        return bool(last.get("done")) and last.get("score") == 100
    return bool(last.get("done")) and float(last.get("reward", 0)) > 0


def ok(url: str, method: str, path: str, body: dict | None = None) -> dict:
    status, out = call(url, method, path, body, timeout=120)
    if status != 200:
        raise RuntimeError(f"{method} {path} {body} -> HTTP {status}: {out}")
    return out


def episode(url: str, env: str, item_id: int, max_turns: int,
            policy: Callable[[str, str], str] | None = None) -> dict:
    """One demo; ``policy(first observation, observation) -> action`` instead of the server's expert when given."""
    env_id = ok(url, "POST", "/create")["id"]
    try:
        first = ok(url, "POST", "/reset", {"id": env_id, "data_idx": item_id})
        messages = [{"role": "user", "content": INSTRUCTIONS[env]},
                    {"role": "assistant", "content": ACKNOWLEDGEMENT},
                    {"role": "user", "content": first["observation"]}]
        last, total, turns = first, 0.0, 0
        while not last.get("done") and turns < max_turns:
            action = (policy(first["observation"], last["observation"]) if policy
                      else ok(url, "GET", f"/expert?id={env_id}")["action"])
            last = ok(url, "POST", "/step", {"id": env_id, "action": action})
            total += float(last.get("reward", 0))
            turns += 1
            messages.append({"role": "assistant", "content": f"Thought:\n{thought(action)}\n\nAction:\n{action}"})
            messages.append({"role": "user", "content": last["observation"]})
        return {"env": env, "item_id": str(item_id), "reward": total, "success": succeeded(env, last),
                "turns": turns, "messages": messages}
    finally:
        call(url, "POST", "/close", {"id": env_id}, timeout=30)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", required=True, choices=sorted(INSTRUCTIONS))
    parser.add_argument("--n", type=int, required=True, help="number of episodes")
    parser.add_argument("--out", required=True, help="output JSONL file")
    parser.add_argument("--split", default="train", choices=["train", "dev", "test"])
    parser.add_argument("--offset", type=int, default=0, help="skip this many ids of the split first")
    parser.add_argument("--url", help="a running server (default: start one from .venvs/<env>)")
    parser.add_argument("--max-turns", type=int, default=200)
    parser.add_argument("--policy", default="expert", choices=POLICIES,
                        help="expert: the server's GET /expert; view / view-random / view-hesitant: view_only_action, "
                             "searching by turning left / at random / at random and passing over the goal in view "
                             "half of the time (BabyAI go-to and pick-up levels)")
    args = parser.parse_args(argv)
    if args.policy != "expert" and args.env != "babyai":
        parser.error(f"--policy {args.policy} is BabyAI's (it reads BabyAI's goal line and action list)")

    with (nullcontext() if args.url else EnvServerProcess(args.env)) as proc:
        url = args.url or proc.url
        ids = ok(url, "GET", f"/items?split={args.split}")["item_ids"][args.offset:args.offset + args.n]
        if len(ids) < args.n:
            print(f"make_demos: the {args.split} split has only {len(ids)} ids after offset {args.offset}",
                  file=sys.stderr)
        demos = [episode(url, args.env, item_id, args.max_turns, demo_policy(args.policy, item_id)) for item_id in ids]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for demo in demos:
            f.write(json.dumps(demo) + "\n")
    wins = sum(d["success"] for d in demos)
    print(f"make_demos: {args.env}: {wins}/{len(demos)} successful demos, "
          f"{sum(d['turns'] for d in demos)} expert turns -> {args.out}")
    return demos


if __name__ == "__main__":
    main()
