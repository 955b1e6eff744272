"""BabyAI (minigrid) as an AgentGym-protocol server, with a text view and high-level actions.

Item ids: ``data_idx`` -> level ``LEVELS[data_idx % 40]`` (level number ``data_idx % 40 + 1``), seed
``data_idx // 40``. Splits: test = seeds 0-9 (ids 0-399), dev = seeds 10-19 (400-799), train = seeds 20-999.

Observation: the egocentric 7x7 view in words. Every visible object gets a name ``<color> <type> <n>`` (n counts
objects of that color and type, nearest first) and its offset ("2 steps forward and 1 step left"), followed by
what is right in front, what the agent carries, and ``Available actions: [...]``.

Actions: "turn left", "turn right", "move forward", "go to <obj>", "pick up <obj>", "go through <door>",
"toggle and go through <door>", "toggle", "drop". A high-level action is expanded into minigrid's primitive
actions by a breadth-first search over (cell, direction) states restricted to cells currently in view. Text that
is not one of the listed actions is an invalid action: no env step, reward 0, the observation says so.

Reward: minigrid's, summed over the primitive steps of one action (``1 - 0.9 * steps / max_steps`` on the
success step, else 0); ``score`` is the episode's total so far; ``done`` = terminated or truncated.
Expert (GET /expert): ``minigrid.utils.baby_ai_bot.BabyAIBot``'s next moves, rolled out on a copy of the env,
written as the longest listed action whose primitives are exactly a prefix of them (a "go to"/"pick up"/"go
through" when the search's path agrees with the bot's, else the single primitive: "move forward", "toggle", ...).
"""

from __future__ import annotations

import copy
import json
from collections import deque
from dataclasses import dataclass, field

import gymnasium as gym
import minigrid  # noqa: F401  (registers the BabyAI-* env ids)
from minigrid.core.actions import Actions
from minigrid.core.constants import DIR_TO_VEC
from minigrid.utils.baby_ai_bot import BabyAIBot

from env_gateway.servers._base import EnvServer, RequestError, serve

# 40 levels, easy to hard; every one is solved by BabyAIBot (the bot cannot do KeyInBox and PutNext*Carrying).
LEVELS = (
    "BabyAI-GoToRedBallGrey-v0", "BabyAI-GoToRedBall-v0", "BabyAI-GoToRedBallNoDists-v0", "BabyAI-GoToObj-v0",
    "BabyAI-GoToObjS4-v0", "BabyAI-GoToObjS6-v1", "BabyAI-GoToLocal-v0", "BabyAI-GoToLocalS5N2-v0",
    "BabyAI-GoToLocalS6N3-v0", "BabyAI-GoToLocalS7N4-v0", "BabyAI-GoToLocalS8N5-v0", "BabyAI-GoToRedBlueBall-v0",
    "BabyAI-GoToDoor-v0", "BabyAI-GoToObjDoor-v0", "BabyAI-GoTo-v0", "BabyAI-GoToOpen-v0",
    "BabyAI-GoToObjMaze-v0", "BabyAI-GoToObjMazeOpen-v0", "BabyAI-GoToImpUnlock-v0", "BabyAI-GoToSeq-v0",
    "BabyAI-Open-v0", "BabyAI-OpenRedDoor-v0", "BabyAI-OpenDoor-v0", "BabyAI-OpenDoorColor-v0",
    "BabyAI-OpenDoorLoc-v0", "BabyAI-OpenTwoDoors-v0", "BabyAI-OpenDoorsOrderN2-v0", "BabyAI-Pickup-v0",
    "BabyAI-UnblockPickup-v0", "BabyAI-PickupLoc-v0", "BabyAI-PickupDist-v0", "BabyAI-PickupAbove-v0",
    "BabyAI-PutNextLocal-v0", "BabyAI-PutNextS4N1-v0", "BabyAI-Unlock-v0", "BabyAI-UnlockLocal-v0",
    "BabyAI-UnlockPickup-v0", "BabyAI-BlockedUnlockPickup-v0", "BabyAI-ActionObjDoor-v0", "BabyAI-FindObjS5-v0",
)
SEEDS = 1000
SPLIT_SEEDS = {"test": range(0, 10), "dev": range(10, 20), "train": range(20, SEEDS)}


def level_and_seed(data_idx: int) -> tuple[str, int]:
    return LEVELS[data_idx % len(LEVELS)], data_idx // len(LEVELS)


def item_ids(split: str) -> list[int]:
    if split not in SPLIT_SEEDS:
        raise RequestError(400, "bad_split", f"split must be one of {sorted(SPLIT_SEEDS)}, got {split!r}")
    seeds = SPLIT_SEEDS[split]
    return list(range(seeds.start * len(LEVELS), seeds.stop * len(LEVELS)))


def _steps(n: int, word: str) -> str:
    return f"{n} step{'s' if n != 1 else ''} {word}"


@dataclass
class Episode:
    env: object = None  # the unwrapped minigrid env
    mission: str = ""
    score: float = 0.0
    done: bool = False
    bot: BabyAIBot | None = None
    bot_action: int | None = None  # the bot's suggestion for the current state
    names: dict = field(default_factory=dict)  # object name -> world position, for the current view
    actions: dict = field(default_factory=dict)  # action text -> list of primitive actions


class BabyAIServer(EnvServer):
    name = "babyai"
    max_action_chars = 256  # the longest action ("pick up the purple ball 2" and the like) is ~30 characters

    def new_env(self) -> Episode:
        return Episode()

    def num_items(self) -> int:
        return len(LEVELS) * SEEDS

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
        ep.env = gym.make(level).unwrapped
        ep.env.reset(seed=seed)
        ep.mission, ep.score, ep.done, ep.bot, ep.bot_action = ep.env.mission, 0.0, False, None, None
        return {"observation": self.observation(ep), "reward": 0.0, "score": 0.0, "done": False,
                "level": level, "seed": seed}

    def observation(self, ep: Episode) -> str:
        if ep.env is None:
            raise RequestError(409, "not_reset", "this instance has not been reset: POST /reset first")
        return f"Your goal: {ep.mission}\n{self._view(ep)}"

    def invalid_action(self, ep: Episode, reason: str) -> dict:
        view = "" if ep.done else f"\n{self._view(ep)}"
        return {"observation": f"Invalid action: {reason}{view}", "reward": 0.0, "score": ep.score, "done": ep.done}

    def step(self, ep: Episode, action: str) -> dict:
        text = action.strip().strip(".").lower()
        if ep.done:
            return {"observation": "The episode is over: reset to start another.", "reward": 0.0,
                    "score": ep.score, "done": True}
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
