"""ALFWorld (``alfworld`` 0.4.2, TextWorld's PDDL engine) as an AgentGym-protocol server, with the planner expert.

Games: a games folder laid out like ALFWorld's data (``$ALFWORLD_DATA``, or ``--games DIR``):
``json_2.1.1/<split>/<task dir>/<trial>/game.tw-pddl`` next to ``traj_data.json``. The game list is every game
of ``train``, then of the test split (``--test-split``, default ``valid_unseen``: ALFWorld's out-of-distribution
eval set), then of ``valid_seen`` (the dev split), each sorted by path; ``data_idx`` indexes that list. As in
ALFWorld's own loader, games whose path holds "movable" or "Sliced", and games not marked solvable, are left out.
item_ids(split) is the index range of that split, so train and test never overlap.

Protocol (AgentGym's ALFWorld server): ``/reset {id, game, world_type: "Text"}`` (or ``{id, data_idx}``) ->
{observation, available_actions, task_type}; the observation drops the "-= Welcome to TextWorld, ALFRED! =-" banner.
``/step {id, action}`` -> {observation, reward (1.0 once the game is won, else 0.0), available_actions, done};
done when won or after --max-steps steps. An action that is not one of the available actions changes nothing and
is answered "Nothing happens." (ALFWorld's own reply). Expert (GET /expert): the first command of the plan that
the AlfredExpert wrapper (planner type: Fast Downward, replanned after every step) holds for the current state.

Each session owns one TextWorld env stack (PddlEnv + AlfredDemangler + AlfredInfos + AlfredExpert) with its own
copy of the planner library (fast_downward copies the 33 MB libdownward.so per env, into a temporary file that stays
mapped: peak sessions x 33 MB of temp disk). Closed sessions hand their stack back; a reset prefers a spare stack
that already has its game loaded. TextWorld's PDDL/grammar code and Fast Downward's Python translator keep
module-level state (concurrent steps from threads fail inside the grammar), so every engine call holds one lock;
the calls run off the event loop, so the server stays responsive. A load parses the domain and grammar (~0.25 s) and
every reset translates the PDDL to SAS twice (~0.2 s); both depend only on the game's text, so they are memoised
per game (LRU caches around TextWorld's ``GameLogic`` and ``fast_downward.pddl2sas``; stacks of one game share its
logic). The planner's plans can differ between server processes (seen on a pick-two task: some processes wander
to the step limit), so the shipped test games use the five task types on which it wins every time.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import threading
from dataclasses import dataclass

import fast_downward
import textworld
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpert, AlfredExpertType, AlfredInfos
from textworld.envs.pddl import PddlEnv
from textworld.envs.pddl import logic as pddl_logic

from env_gateway.servers._base import EnvServer, RequestError, serve

SPLIT_DIRS = ("train", "valid_seen", "valid_unseen", "valid_train")
# TextWorld's PddlState calls fast_downward.pddl2sas(domain, problem, verbose=..., optimize=...) on every reset.
fast_downward.pddl2sas = functools.lru_cache(maxsize=512)(fast_downward.pddl2sas)
# PddlEnv.load builds pddl_logic.GameLogic(domain=..., grammar=...) for every load.
pddl_logic.GameLogic = functools.lru_cache(maxsize=256)(pddl_logic.GameLogic)
BANNER_END = "\n\n"


def game_files(root: str, split_dir: str) -> list[str]:
    """The playable games of one split folder, sorted by path."""
    games = []
    for path in sorted(glob.glob(os.path.join(root, "json_2.1.1", split_dir, "*", "*", "game.tw-pddl"))):
        if "movable" in path or "Sliced" in path:
            continue
        with open(path) as f:
            if json.load(f).get("solvable"):
                games.append(path)
    return games


def game_splits(root: str, test_split: str = "valid_unseen") -> dict[str, list[str]]:
    """{split: games} in data_idx order: train, test, dev (dev is empty when it is the test folder)."""
    splits = {"train": game_files(root, "train"), "test": game_files(root, test_split), "dev": []}
    if test_split != "valid_seen":
        splits["dev"] = game_files(root, "valid_seen")
    return splits


def split_item_ids(splits: dict[str, list[str]], split: str) -> list[int]:
    """The data_idx range of one split in the train, test, dev game list."""
    if split not in splits:
        raise RequestError(400, "bad_split", f"split must be one of train, dev, test; got {split!r}")
    start = {"train": 0, "test": len(splits["train"]), "dev": len(splits["train"]) + len(splits["test"])}[split]
    return list(range(start, start + len(splits[split])))


def default_root() -> str:
    return os.environ.get("ALFWORLD_DATA") or os.path.expanduser("~/.cache/alfworld")


@dataclass
class Session:
    env: textworld.core.Wrapper
    game: str | None = None
    state: textworld.GameState | None = None
    steps: int = 0


class AlfWorldServer(EnvServer):
    name = "alfworld"
    max_action_chars = 1024

    def __init__(self, max_instances: int = 256, workers: int = 8, games: str | None = None,
                 test_split: str = "valid_unseen", max_steps: int = 50):
        super().__init__(max_instances, workers)
        self.root = games or default_root()
        self.splits = game_splits(self.root, test_split)
        self.games = [g for split in ("train", "test", "dev") for g in self.splits[split]]
        if not self.games:
            raise SystemExit(f"alfworld: no games under {self.root}/json_2.1.1/{{train,{test_split},valid_seen}}; "
                             "run `alfworld-download` (needs the internet) or pass --games DIR "
                             "(e.g. tests/fixtures/alfworld)")
        self.max_steps = max_steps
        self.spare: list[tuple[str | None, textworld.core.Wrapper]] = []  # (loaded game, env stack)
        self.engine_lock = threading.Lock()

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--games", default=None, help="folder laid out like $ALFWORLD_DATA "
                            "(json_2.1.1/<split>/<task>/<trial>/game.tw-pddl); default: $ALFWORLD_DATA")
        parser.add_argument("--test-split", default="valid_unseen", choices=SPLIT_DIRS[1:],
                            help="the json_2.1.1 folder that is the test split")
        parser.add_argument("--max-steps", type=int, default=50, help="steps after which an episode is done")

    def num_items(self) -> int:
        return len(self.games)

    def item_ids(self, split: str) -> list[int]:
        return split_item_ids(self.splits, split)

    def reset_fields(self, data: dict) -> dict:
        if "game" in data and "data_idx" not in data:
            if data.get("world_type", "Text") != "Text":
                raise RequestError(400, "bad_world_type", "this server plays the text world only: world_type 'Text'")
            data = {**data, "data_idx": data["game"]}
        return data

    def new_env(self) -> Session:
        with self.engine_lock:
            if self.spare:
                game, env = self.spare.pop()
                return Session(env, game)
        env = PddlEnv(textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile", "expert_plan"]))
        for wrapper in (AlfredDemangler(), AlfredInfos, AlfredExpert(AlfredExpertType.PLANNER)):
            env = wrapper(env)
        return Session(env)

    def close_env(self, session: Session) -> None:
        with self.engine_lock:
            self.spare.append((session.game, session.env))

    def reset(self, session: Session, data_idx: int) -> dict:
        game = self.games[data_idx]
        with self.engine_lock:
            if session.game != game:
                loaded = next((k for k, (g, _) in enumerate(self.spare) if g == game), None)
                if loaded is not None:  # swap this session's stack for a spare that has the game loaded
                    self.spare.append((session.game, session.env))
                    _, session.env = self.spare.pop(loaded)
                else:
                    session.env.load(game)
                session.game = game
            session.state = session.env.reset()
        session.steps = 0
        observation = session.state.feedback.split(BANNER_END, 1)[-1].strip()
        return {"observation": observation, "available_actions": session.state["admissible_commands"],
                "task_type": "/".join(game.split(os.sep)[-3:-1])}

    def step(self, session: Session, action: str) -> dict:
        with self.engine_lock:
            session.state, _, _ = session.env.step(action)
        session.steps += 1
        won = bool(session.state["won"])
        return {"observation": self.observation(session), "reward": float(won),
                "available_actions": session.state["admissible_commands"],
                "done": won or (self.max_steps > 0 and session.steps >= self.max_steps)}

    def invalid_action(self, session: Session, reason: str) -> dict:
        return {"observation": f"Invalid action: {reason}", "reward": 0.0,
                "available_actions": session.state["admissible_commands"], "done": False}

    def observation(self, session: Session) -> str:
        if session.state is None:
            raise RequestError(409, "not_reset", "the instance has not been reset: POST /reset first")
        return session.state.feedback.strip()

    def expert_action(self, session: Session) -> str:
        plan = session.state["extra.expert_plan"]
        if not plan:
            raise RequestError(409, "no_plan", "the planner has no plan from this state (the game is already won)")
        return plan[0]


def item_ids(split: str) -> list[int]:
    """Item ids of the games under $ALFWORLD_DATA (for scripts/make_itemids.py)."""
    return split_item_ids(game_splits(default_root()), split)


if __name__ == "__main__":
    serve(AlfWorldServer)
