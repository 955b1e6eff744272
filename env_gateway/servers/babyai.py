"""BabyAI (minigrid) as an AgentGym-protocol server: AgentGym's tasks, with AgentGym's text or a compact one.

Tasks (both modes): AgentGym's (agentenv-babyai at 3ef9235). ``data_idx`` -> level ``LEVELS[data_idx % 40]``
(AgentGym's level ``data_idx % 40 + 1``, in its order), seed ``data_idx // 40``; the goal is minigrid's mission with
"then" and "after you" read as "and", as AgentGym writes it. The env is minigrid 3.2.0, which generates the same
grids as AgentGym's minigrid 2.3.1 except in two places, both undone here: 2.3.1's "BabyAI-GoToObjS6-v0" (a
registry slip: room size 4) is 3.2.0's "BabyAI-GoToObjS4-v0", and 2.3.1's LevelGen kept ``locked_room`` from one
generated mission to the next (3.2.0 clears it), which changes some Synth*/Boss missions; like AgentGym, every
reset seeds the env twice (its env resets once when built and once more on /reset), which matters only through
that kept room. Every ``data_idx`` >= 0 is served, as AgentGym serves it (any seed; a negative one, which minigrid
cannot seed, is a 400). Splits (GET /items; by seed, so every split holds all 40 levels): test = seeds 0-9 (ids
0-399), dev = seeds 10-19 (400-799), train = seeds 20-999.

Text (``--text``):
- ``agentgym``: AgentGym's server, reply for reply: the first observation ("Your goal: ...", the view "In front of
  you in this room, you can see several objects: There is a blue key 1 1 steps in front of you and 1 steps to your
  right. ...", walls, what is carried, ``Available actions: [...]``), its action vocabulary ("pickup red ball 1",
  "go to blue closed door 1", "toggle and go through ...", "go through ...", "toggle", "drop", "check available
  actions"), its feedback for actions it refuses or does not know, and its reward and done: a high-level action
  runs its primitives until one leaves the egocentric image unchanged; reward and done are the last primitive's
  (truncation is ignored); a success worth <= 0.5 says "The task is completed." yet is not done; a refused action
  repeats the previous reward (``score`` sums the replies' rewards, as AgentGym's does). Paths come from AgentGym's
  breadth-first search (doors passable, keys/balls/boxes/walls not, within the view's bounding box).
- ``compact``: "You see: a grey key 1 (1 step forward and 1 step left); ...", "pick up ...", reward summed over an
  action's primitives, invalid actions say so. Shorter (median first observation 324 characters against 495 over
  data_idx 0-399); the CPU quickstart and learning study (``scripts/quickstart.sh``, ``benchmarks/learning_curve.py``)
  and the tests' tiny models were tuned on it, so they set ``BABYAI_TEXT=compact``.
The default is ``agentgym`` (what AgentGym-RL's and CoPE's numbers are measured on), or ``$BABYAI_TEXT`` when set:
the variable reaches servers that a gateway or trainer starts, which take no per-server flags.

Expert (GET /expert, both modes): ``minigrid.utils.baby_ai_bot.BabyAIBot``'s next moves, rolled out on a copy of
the env, written as the longest available action whose primitives are exactly a prefix of them, so in ``agentgym``
mode only actions AgentGym lists. No expert (404) on KeyInBox and PutNextS7N4Carrying, which the bot cannot solve
(nor can AgentGym's actions open a box), and UnlockToUnlock, where its search can run without end.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import load_env_creator
import numpy as np
from minigrid.core.actions import Actions  # importing minigrid registers the BabyAI-* env ids
from minigrid.core.constants import DIR_TO_VEC, IDX_TO_COLOR, IDX_TO_OBJECT, STATE_TO_IDX
from minigrid.envs.babyai.core.levelgen import LevelGen
from minigrid.utils.baby_ai_bot import BabyAIBot

from env_gateway.servers._base import EnvServer, RequestError, serve

# AgentGym's 40 levels, in its order (its level number is the index + 1).
LEVELS = (
    "BabyAI-GoToRedBallGrey-v0", "BabyAI-GoToRedBall-v0", "BabyAI-GoToRedBallNoDists-v0", "BabyAI-GoToObjS6-v0",
    "BabyAI-GoToLocalS8N7-v0", "BabyAI-GoToObjMazeS7-v0", "BabyAI-GoToImpUnlock-v0", "BabyAI-GoToSeqS5R2-v0",
    "BabyAI-GoToRedBlueBall-v0", "BabyAI-GoToDoor-v0", "BabyAI-GoToObjDoor-v0", "BabyAI-Open-v0",
    "BabyAI-OpenRedDoor-v0", "BabyAI-OpenDoorLoc-v0", "BabyAI-OpenRedBlueDoorsDebug-v0",
    "BabyAI-OpenDoorsOrderN4Debug-v0", "BabyAI-Pickup-v0", "BabyAI-UnblockPickup-v0", "BabyAI-PickupLoc-v0",
    "BabyAI-PickupDistDebug-v0", "BabyAI-PickupAbove-v0", "BabyAI-PutNextLocalS6N4-v0",
    "BabyAI-PutNextS7N4Carrying-v0", "BabyAI-Unlock-v0", "BabyAI-UnlockLocalDist-v0", "BabyAI-KeyInBox-v0",
    "BabyAI-UnlockPickupDist-v0", "BabyAI-BlockedUnlockPickup-v0", "BabyAI-UnlockToUnlock-v0",
    "BabyAI-ActionObjDoor-v0", "BabyAI-FindObjS7-v0", "BabyAI-KeyCorridorS6R3-v0", "BabyAI-OneRoomS20-v0",
    "BabyAI-MoveTwoAcrossS8N9-v0", "BabyAI-SynthS5R2-v0", "BabyAI-SynthLoc-v0", "BabyAI-SynthSeq-v0",
    "BabyAI-MiniBossLevel-v0", "BabyAI-BossLevel-v0", "BabyAI-BossLevelNoUnlock-v0",
)
# minigrid 3 retired GoToObjS6-v0, whose room size was 4 by mistake: GoToObjS4-v0 is that env.
REGISTERED = {"BabyAI-GoToObjS6-v0": "BabyAI-GoToObjS4-v0"}
# Levels BabyAIBot cannot do: it fails on KeyInBox and PutNext*Carrying and can search without end on UnlockToUnlock.
NO_EXPERT = ("BabyAI-KeyInBox-v0", "BabyAI-PutNextS7N4Carrying-v0", "BabyAI-UnlockToUnlock-v0")
SEEDS = 1000  # the seeds the splits list; /reset serves any seed
SPLIT_SEEDS = {"test": range(0, 10), "dev": range(10, 20), "train": range(20, SEEDS)}
TEXTS = ("compact", "agentgym")


def level_and_seed(data_idx: int) -> tuple[str, int]:
    return LEVELS[data_idx % len(LEVELS)], data_idx // len(LEVELS)


def item_ids(split: str) -> list[int]:
    if split not in SPLIT_SEEDS:
        raise RequestError(400, "bad_split", f"split must be one of {sorted(SPLIT_SEEDS)}, got {split!r}")
    seeds = SPLIT_SEEDS[split]
    return list(range(seeds.start * len(LEVELS), seeds.stop * len(LEVELS)))


class _KeptLockedRoom:
    """minigrid 2.3.1's LevelGen: ``locked_room`` is only ever set to a room, never cleared between missions."""

    @property
    def locked_room(self):
        return self.__dict__.get("_kept_locked_room")

    @locked_room.setter
    def locked_room(self, room) -> None:
        if room is not None:
            self.__dict__["_kept_locked_room"] = room


@functools.cache
def _env_class(entry_point: str) -> type:
    cls = load_env_creator(entry_point)
    return type(cls.__name__, (_KeptLockedRoom, cls), {}) if issubclass(cls, LevelGen) else cls


def make_env(level: str, seed: int) -> tuple[Any, dict]:
    """The minigrid env of AgentGym's (level, seed), generated as minigrid 2.3.1 does (no gym wrappers), and the
    observation its reset returned."""
    spec = gym.spec(REGISTERED.get(level, level))
    env = _env_class(spec.entry_point)(**spec.kwargs)
    env.reset(seed=seed)
    return env, env.reset(seed=seed)[0]


def _steps(n: int, word: str) -> str:
    return f"{n} step{'s' if n != 1 else ''} {word}"


# ---- AgentGym's text view -----------------------------------------------------------------------------------
IDX_TO_STATE = {i: state for state, i in STATE_TO_IDX.items()}
BLOCKING = ("wall", "box", "lava", "ball", "key")  # what AgentGym's paths go around and drop cannot land on
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE = (int(a) for a in (Actions.left, Actions.right, Actions.forward,
                                                                Actions.pickup, Actions.drop, Actions.toggle))


@dataclass
class Thing:
    type: str
    name: str  # "blue key", "red closed door", "grey wall"
    pos: tuple[int, int]
    dist: int  # Manhattan distance from the agent


def _find_path(start: tuple, start_dir: int, goal: tuple, blocked: set, xs: range, ys: range,
               arrive: bool) -> list[int] | None:
    """AgentGym's breadth-first search over (cell, direction): actions tried forward, left, right; a state is marked
    seen when taken from the queue, and a state queued twice keeps the parent that queued it last (which can make
    the path differ from other shortest paths, so it is kept). Ends on the goal cell (``arrive``) or facing it."""
    parent: dict = {}
    seen: set = set()
    queue = deque([(start, start_dir)])
    while queue:
        state = queue.popleft()
        seen.add(state)
        pos, d = state
        vec = DIR_TO_VEC[d]
        if (pos == goal) if arrive else (goal[0] - pos[0] == vec[0] and goal[1] - pos[1] == vec[1]):
            path = []
            while state != (start, start_dir):
                state, action = parent[state]
                path.append(action)
            return path[::-1]
        for action in (FORWARD, LEFT, RIGHT):
            nxt = ((pos[0] + int(vec[0]), pos[1] + int(vec[1])), d) if action == FORWARD else \
                (pos, (d - 1) % 4 if action == LEFT else (d + 1) % 4)
            if nxt[0][0] in xs and nxt[0][1] in ys and nxt not in seen and nxt[0] not in blocked:
                queue.append(nxt)
                parent[nxt] = (state, action)
    return None


def agentgym_view(env, image: np.ndarray) -> tuple[str, dict[str, list[int]], dict[str, str]]:
    """AgentGym's description of the view, its actions (text -> primitives, in its order) and its messages for
    actions it names but refuses. ``image`` is the last observation's, as AgentGym reads objects from it: after
    reset in PutNext*Carrying it still shows the carried object on the floor."""
    size, pos, d = env.agent_view_size, tuple(int(v) for v in env.agent_pos), int(env.agent_dir)
    f_vec, r_vec = DIR_TO_VEC[d], DIR_TO_VEC[(d + 1) % 4]
    top_left = np.array(pos) + f_vec * (size - 1) - r_vec * (size // 2)
    corner = top_left + size * (r_vec - f_vec)
    # The view's bounding box as AgentGym computes it (one cell wider behind the agent in some directions).
    xs, ys = (range(c, t + 1) if c < t else range(t, c) for c, t in zip(corner.tolist(), top_left.tolist()))

    def offsets(t: Thing) -> tuple[int, int]:
        rel = (t.pos[0] - pos[0], t.pos[1] - pos[1])
        return int(rel[0] * f_vec[0] + rel[1] * f_vec[1]), int(rel[0] * r_vec[0] + rel[1] * r_vec[1])

    things, barriers = [], []  # barriers: walls and boxes straight ahead, (distance, type)
    for j in range(size):  # far row first, then left to right: the tie order of the stable sort below
        for i in range(size):
            x, y = (int(v) for v in top_left - f_vec * j + r_vec * i)
            dist = abs(pos[0] - x) + abs(pos[1] - y)
            if x < 0 or y < 0 or dist == 0:
                continue
            kind, color, state = IDX_TO_OBJECT[image[i, j, 0]], IDX_TO_COLOR[image[i, j, 1]], int(image[i, j, 2])
            # AgentGym also knows goal squares and lava ("go to goal"); no BabyAI level has them.
            if kind not in ("door", "key", "ball", "box", "goal", "lava", "wall"):
                continue
            name = f"{color} {IDX_TO_STATE[state]} door" if kind == "door" else f"{color} {kind}"
            things.append(Thing(kind, name, (x, y), dist))
            ahead, right = offsets(things[-1])
            if kind in ("box", "wall") and right == 0:
                barriers.append((ahead, kind))
    things.sort(key=lambda t: t.dist)
    barriers.sort(key=lambda b: b[0])
    blocked = {t.pos for t in things if t.type in BLOCKING}
    carrying = env.carrying

    def path(t: Thing, arrive: bool = False) -> list[int] | None:
        return _find_path(pos, d, t.pos, blocked, xs, ys, arrive)

    # ---- description
    if things:
        text, seen = "In front of you in this room, you can see several objects: ", Counter()
        for t in things:
            if t.type == "wall":
                continue
            ahead, right = offsets(t)
            side = "right" if right > 0 else "left"
            where = (f"right in front of you {ahead} steps away. " if right == 0 else
                     f"{ahead} steps in front of you and {abs(right)} steps to your {side}. ")
            seen[t.name] += 1
            text += f"There is a {t.name} {seen[t.name]} {where} "
    else:
        text = "You cannot see any objects within sight."
    text += "The room has walls around you. "
    if barriers:
        text += f"You are facing a {barriers[0][1]} {barriers[0][0]} steps away. "
    text += f"You are carrying a {carrying.color} {carrying.type}." if carrying else "You are not carrying anything."

    # ---- actions, and the messages for the ones refused here
    actions: dict[str, list[int]] = {"turn left": [LEFT], "turn right": [RIGHT]}
    errors: dict[str, str] = {}
    if not barriers or barriers[0][0] > 1:
        actions["move forward"] = [FORWARD]
    else:
        errors["move forward"] = "There is a barrier in front of you, you can't move forward."

    def numbered(verb: str, t: Thing, steps: list[int] | None, counts: Counter, extra: list[int]) -> None:
        # Numbers count only the reachable objects of a name (unlike the description's).
        key = f"{verb} {t.name} {counts[t.name] + 1}"
        if steps is None:
            errors[key] = f"You cannot {verb} {t.name} {counts[t.name] + 1}, as there is no path leading to it."
        else:
            counts[t.name] += 1
            actions[key] = steps + extra

    if carrying is None:
        picked = Counter()
        for t in things:
            if t.type not in ("wall", "door", "goal"):
                numbered("pickup", t, path(t), picked, [PICKUP])
        errors["drop"] = "You cannot drop the object, as you are not carrying anything."
    else:
        front = (pos[0] + int(f_vec[0]), pos[1] + int(f_vec[1]))
        if front in blocked:
            errors["drop"] = "You cannot drop the object, as there is already an object in front of you."
        else:
            actions["drop"] = [DROP]

    doors = Counter()
    for t in things:
        if t.type != "door":
            continue
        doors[t.name] += 1
        label = f"{t.name} {doors[t.name]}"
        state = t.name.split(" ")[1]
        if state == "open":
            steps = path(t, arrive=True)
            if steps is None:
                errors[f"go through {label}"] = f"You cannot go through {label}, as there is no path leading to it."
            else:
                actions[f"go through {label}"] = steps
            continue
        if state == "locked":
            why = ("you are not carrying a key" if carrying is None or carrying.type != "key" else
                   "the color of the key you are carrying does not match the color of door"
                   if carrying.color != t.name.split(" ")[0] else "")
            if why:
                errors[f"toggle and go through {label}"] = f"You cannot toggle and go through {label}, as {why}."
                continue
        steps = path(t)
        if steps is None:
            # AgentGym writes its whole door tally here, not the number.
            errors[f"toggle and go through {label}"] = (f"You cannot toggle and go through {t.name} {dict(doors)}, "
                                                        "as there is no path leading to it.")
        else:
            actions[f"toggle and go through {label}"] = steps + [TOGGLE, FORWARD]
        if steps == []:
            actions["toggle"] = [TOGGLE]
        if state == "closed":
            errors[f"go through {label}"] = (f"You cannot go through {label}, as it is closed. "
                                             "You should toggle it first.")

    reached = Counter()
    for t in things:
        if t.type not in ("wall", "goal"):
            numbered("go to", t, path(t), reached, [])
    actions["check available actions"] = []
    return text, actions, errors


def action_list(actions: dict) -> str:
    return "\nAvailable actions: [" + ", ".join(f'"{a}"' for a in actions) + "]"


@dataclass
class Episode:
    env: object = None  # the unwrapped minigrid env
    level: str = ""
    mission: str = ""
    score: float = 0.0
    done: bool = False
    bot: BabyAIBot | None = None
    bot_action: int | None = None  # the bot's suggestion for the current state
    names: dict = field(default_factory=dict)  # object name -> world position, for the current view (compact)
    actions: dict = field(default_factory=dict)  # action text -> list of primitive actions
    # agentgym text only:
    state: str = ""  # the last feedback or description, as AgentGym's states[-1]
    errors: dict = field(default_factory=dict)  # refused action -> AgentGym's message
    reward: float = 0.0  # AgentGym's current reward: the last executed action's, repeated by refused ones
    image: Any = None  # the last observation's egocentric image, against which a primitive's effect is judged


class BabyAIServer(EnvServer):
    name = "babyai"
    max_action_chars = 256  # the longest action ("pick up the purple ball 2" and the like) is ~30 characters

    def __init__(self, max_instances: int = 256, workers: int = 8, text: str = "agentgym"):
        super().__init__(max_instances, workers)
        if text not in TEXTS:  # argparse leaves a default (from BABYAI_TEXT) unchecked
            raise SystemExit(f"babyai: unknown text {text!r} (from --text or BABYAI_TEXT): use one of {list(TEXTS)}")
        self.text = text

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--text", choices=TEXTS, default=os.environ.get("BABYAI_TEXT", "agentgym"),
                            help="agentgym (default, or $BABYAI_TEXT): AgentGym's observations, actions, feedback "
                                 "and rewards; compact: the shorter text the CPU quickstart is tuned on (see the "
                                 "module docstring)")

    def new_env(self) -> Episode:
        return Episode()

    def num_items(self) -> None:
        return None  # unbounded, as AgentGym's: data_idx // 40 is any seed (only a negative data_idx is refused)

    def item_ids(self, split: str) -> list[int]:
        return item_ids(split)

    # ---- the text view and the action table --------------------------------------------------------
    def _view(self, ep: Episode) -> str:
        """Describe the current view and rebuild ep.names / ep.actions for it."""
        env = ep.env
        _, vis = env.gen_obs_grid()
        size = env.agent_view_size
        pos, f_vec, r_vec = env.agent_pos, env.dir_vec, env.right_vec
        visible, objects = set(), []
        for i in range(size):
            for j in range(size):
                if not vis[i, j]:
                    continue
                fwd, right = size - 1 - j, i - size // 2
                x, y = (int(v) for v in pos + f_vec * fwd + r_vec * right)
                if not (0 <= x < env.width and 0 <= y < env.height):
                    continue
                visible.add((x, y))
                cell = env.grid.get(x, y)
                if cell is not None and cell.type != "wall" and (fwd or right):
                    objects.append((fwd + abs(right), fwd, right, (x, y), cell))
        objects.sort(key=lambda o: o[:3])
        plans = self._plans(env, visible)

        counts: dict[tuple, int] = {}
        ep.names, described = {}, []
        actions = {"turn left": [Actions.left], "turn right": [Actions.right]}
        front = env.grid.get(*env.front_pos)
        if front is None or front.can_overlap():
            actions["move forward"] = [Actions.forward]
        for _, fwd, right, xy, cell in objects:
            key = (cell.color, cell.type)
            counts[key] = counts.get(key, 0) + 1
            name = f"{cell.color} {cell.type} {counts[key]}"
            ep.names[name] = xy
            where = [_steps(fwd, "forward")] if fwd else []
            if right:
                where.append(_steps(abs(right), "right" if right > 0 else "left"))
            state = ""
            if cell.type == "door":
                state = "open " if cell.is_open else "locked " if cell.is_locked else "closed "
            described.append(f"{'an' if state.startswith('o') else 'a'} {state}{name} ({' and '.join(where)})")
            path = plans.get(xy)
            if path is None:
                continue
            actions[f"go to {name}"] = path
            if cell.can_pickup() and env.carrying is None:
                actions[f"pick up {name}"] = path + [Actions.pickup]
            if cell.type == "door":
                through = [Actions.forward, Actions.forward]
                if cell.is_open:
                    actions[f"go through {name}"] = path + through
                elif not cell.is_locked or (env.carrying is not None and env.carrying.type == "key"
                                            and env.carrying.color == cell.color):
                    actions[f"toggle and go through {name}"] = path + [Actions.toggle] + through
        if front is not None and front.type in ("door", "box"):
            actions["toggle"] = [Actions.toggle]
        if env.carrying is not None and front is None:
            actions["drop"] = [Actions.drop]
        ep.actions = actions

        front_xy = tuple(int(v) for v in env.front_pos)
        if front is None:
            ahead = "nothing: the way is clear"
        elif front.type == "wall":
            ahead = "a wall"
        else:
            ahead = "the " + next((n for n, xy in ep.names.items() if xy == front_xy), front.type)
        carrying = f"a {env.carrying.color} {env.carrying.type}" if env.carrying else "nothing"
        return (f"You see: {'; '.join(described) if described else 'no objects'}.\n"
                f"In front of you: {ahead}.\nYou are carrying: {carrying}.\n"
                f"Available actions: {json.dumps(list(actions))}")

    @staticmethod
    def _plans(env, visible: set) -> dict:
        """Shortest primitive-action paths, inside the view, to a state facing each visible cell."""
        def free(xy):
            cell = env.grid.get(*xy)
            return xy in visible and (cell is None or cell.can_overlap())

        start = (tuple(int(v) for v in env.agent_pos), int(env.agent_dir))
        parent = {start: None}
        queue, plans = deque([start]), {}
        while queue:
            state = queue.popleft()
            (x, y), d = state
            facing = (x + int(DIR_TO_VEC[d][0]), y + int(DIR_TO_VEC[d][1]))
            if facing not in plans:
                path, s = [], state
                while parent[s] is not None:
                    s, a = parent[s]
                    path.append(a)
                plans[facing] = path[::-1]
            nxt = [(((x, y), (d - 1) % 4), Actions.left), (((x, y), (d + 1) % 4), Actions.right)]
            if free(facing):
                nxt.append(((facing, d), Actions.forward))
            for s, a in nxt:
                if s not in parent:
                    parent[s] = (state, a)
                    queue.append(s)
        return plans

    # ---- protocol ----------------------------------------------------------------------------------
    def reset(self, ep: Episode, data_idx: int) -> dict:
        level, seed = level_and_seed(data_idx)
        if ep.env is not None:
            ep.env.close()
        (ep.env, obs), ep.level = make_env(level, seed), level
        ep.score, ep.done, ep.bot, ep.bot_action = 0.0, False, None, None
        ep.mission = ep.env.mission.replace("then", "and").replace("after you", "and")  # AgentGym's goal text
        if self.text == "agentgym":
            ep.image, ep.reward = obs["image"], 0.0
            ep.state, ep.actions, ep.errors = agentgym_view(ep.env, ep.image)
        return {"observation": self.observation(ep), "reward": 0.0, "score": 0.0, "done": False,
                "level": level, "seed": seed}

    def observation(self, ep: Episode) -> str:
        if ep.env is None:
            raise RequestError(409, "not_reset", "this instance has not been reset: POST /reset first")
        if self.text == "agentgym":
            return f"Your goal: {ep.mission}\n{ep.state}{action_list(ep.actions)}"
        return f"Your goal: {ep.mission}\n{self._view(ep)}"

    def invalid_action(self, ep: Episode, reason: str) -> dict:
        if self.text == "agentgym":
            return self._agentgym_reply(ep, f"Invalid action: {reason}")
        view = "" if ep.done else f"\n{self._view(ep)}"
        return {"observation": f"Invalid action: {reason}{view}", "reward": 0.0, "score": ep.score, "done": ep.done}

    def step(self, ep: Episode, action: str) -> dict:
        if ep.done:
            return {"observation": "The episode is over: reset to start another.", "reward": 0.0,
                    "score": ep.score, "done": True}
        if self.text == "agentgym":
            return self._agentgym_step(ep, action)
        text = action.strip().strip(".").lower()
        if text not in ep.actions:
            return {"observation": f"Invalid action: {action.strip()!r} is not one of the available actions. "
                                   f"Answer with exactly one of them.\n{self._view(ep)}",
                    "reward": 0.0, "score": ep.score, "done": False}
        reward = 0.0
        for primitive in ep.actions[text]:
            _, r, terminated, truncated, _ = ep.env.step(primitive)
            reward += float(r)
            ep.done = bool(terminated or truncated)
            self._advance_bot(ep, primitive)
            if ep.done:
                break
        ep.score += reward
        if ep.done:
            outcome = "You completed the goal." if reward > 0 else "Out of steps: the goal was not reached."
            return {"observation": outcome, "reward": reward, "score": ep.score, "done": True}
        return {"observation": self._view(ep), "reward": reward, "score": ep.score, "done": False}

    def _agentgym_step(self, ep: Episode, action: str) -> dict:
        text = action.lower().strip()
        if "check" in text:  # AgentGym lists the actions for any text that holds "check"
            return self._agentgym_reply(ep, "You can take the following actions: " + ", ".join(ep.actions))
        if text not in ep.actions:
            return self._agentgym_reply(ep, "No change in state." if text == "" else ep.errors.get(
                text, "The action is not recognized. Please check valid actions."))
        primitives = ep.actions[text]
        if not primitives:  # "go to X" while facing X
            return self._agentgym_reply(ep, "No change in state.")
        for primitive in primitives:
            obs, reward, terminated, _, _ = ep.env.step(primitive)  # AgentGym ignores truncation
            self._advance_bot(ep, primitive)
            unchanged = (obs["image"] == ep.image).all()
            ep.image = obs["image"]
            if unchanged:  # the primitive changed nothing in view: stop, as AgentGym does
                break
        ep.state, ep.actions, ep.errors = agentgym_view(ep.env, ep.image)
        if terminated:
            ep.state += "\n The task is completed."
        # A success worth little (a failed instruction ends with reward 0 too) does not end AgentGym's episode.
        ep.reward, ep.done = float(reward), bool(terminated) and reward > 0.5
        return self._agentgym_reply(ep)

    @staticmethod
    def _agentgym_reply(ep: Episode, feedback: str | None = None) -> dict:
        """AgentGym's step reply: feedback (else the new view), the current reward again, score += reward."""
        if feedback is not None:
            ep.state = feedback
        ep.score += ep.reward
        return {"observation": ep.state + action_list(ep.actions), "reward": ep.reward, "score": ep.score,
                "done": ep.done}

    @staticmethod
    def _advance_bot(ep: Episode, primitive: int) -> None:
        # The bot must see every primitive step once it exists; a bot that breaks is rebuilt on the next /expert.
        if ep.bot is None or ep.done:
            return
        try:
            ep.bot_action = ep.bot.replan(primitive)
        except Exception:
            ep.bot, ep.bot_action = None, None

    def expert_action(self, ep: Episode) -> str:
        """The longest listed action whose primitives are a prefix of the bot's own next moves."""
        if ep.done:
            raise RequestError(409, "episode_over", "the episode is over: reset before asking the expert")
        if ep.level in NO_EXPERT:
            raise RequestError(404, "no_expert", f"the BabyAI bot cannot solve {ep.level}: no expert for it")
        if ep.bot is None:
            ep.bot = BabyAIBot(ep.env)
            ep.bot_action = ep.bot.replan()
        moves = self._bot_moves(ep, horizon=max(len(p) for p in ep.actions.values()))
        matches = [text for text, prims in ep.actions.items() if prims and list(prims) == moves[:len(prims)]]
        if not matches:
            raise RuntimeError(f"the BabyAI bot's move {moves[:1]} matches none of the available actions")
        return max(matches, key=lambda text: len(ep.actions[text]))

    @staticmethod
    def _bot_moves(ep: Episode, horizon: int) -> list[int]:
        """The bot's next primitive actions, rolled out on a copy of the env (and of the bot that watches it)."""
        moves = [ep.bot_action]
        if horizon <= 1:
            return moves
        env, bot = copy.deepcopy((ep.env, ep.bot))
        try:
            while len(moves) < horizon:
                _, _, terminated, truncated, _ = env.step(moves[-1])
                if terminated or truncated:
                    break
                moves.append(bot.replan(moves[-1]))
        except Exception:  # the bot gave up on the copy: the moves so far still hold
            pass
        return moves

    def close_env(self, ep: Episode) -> None:
        if ep.env is not None:
            ep.env.close()


if __name__ == "__main__":
    serve(BabyAIServer)
