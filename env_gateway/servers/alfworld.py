"""ALFWorld (``alfworld`` 0.4.2, TextWorld's PDDL engine) as an AgentGym-protocol server, with the planner expert.

Games: a games folder laid out like ALFWorld's data (``$ALFWORLD_DATA``, or ``--games DIR``):
``json_2.1.1/<split>/<task dir>/<trial>/game.tw-pddl`` next to ``traj_data.json``. Two game lists:

- ``--mapping DIR`` (default ``$ALFWORLD_MAPPING``): AgentGym's list, from the ``mappings_train.json`` and
  ``mappings_test.json`` of DIR (an AgentGym checkout's ``agentenv-alfworld/configs``; read, never copied). Entry k
  of the train file ({item_id, task_type, task_id}) is data_idx k, the game
  ``json_2.1.1/train/<task_type>/<task_id>/game.tw-pddl``; the test file's entries follow (data_idx 2420-2619 with
  AgentGym's files), under ``json_2.1.1/valid_train/`` as AgentGym has them. item_ids: train = the first file's
  items, test = the second's, dev = none (AgentGym has no dev list). No game is filtered out. A file that is missing,
  not a JSON list of such entries, or whose ``item_id`` is not the entry's data_idx stops the server at start-up.
  Games the folder lacks are tolerated (a folder with some of the games serves those): start-up logs how many are
  missing and stops only when none is there; a reset of a missing one answers 404 ``missing_game`` naming the path.
- without it: every game of ``train``, then of the test split (``--test-split``, default ``valid_unseen``:
  ALFWorld's out-of-distribution eval set), then of ``valid_seen`` (the dev split), each sorted by path. As in
  ALFWorld's own loader, games whose path holds "movable" or "Sliced", and games not marked solvable, are left out.

data_idx indexes the list; item_ids(split) is the index range of that split, so train and test never overlap. The
module-level ``item_ids(split)`` (scripts/make_itemids.py) follows ``$ALFWORLD_MAPPING`` when it is set (the mapping
alone, no games needed), else the games under ``$ALFWORLD_DATA``.

Protocol (AgentGym's ALFWorld server, its text included): ``/reset {id, game, world_type: "Text"}`` (or
``{id, data_idx}``) -> {observation, available_actions, task_type}; the observation is the game's first text without
its first paragraph (the "-= Welcome to TextWorld, ALFRED! =-" banner), the other paragraphs joined by one newline;
task_type is "<task dir>/<trial>". ``/step {id, action}`` -> {observation, reward (1.0 once the game is won, else
0.0), available_actions, done}; the observation is the game's text as it is, less a leading "You arrive at loc N. "
(ALFWorld's older games say so on every "go to"; AgentGym cuts through the first ". ", as here). done when won or
after --max-steps steps (50, as AgentGym's config). An action that is not one of the available actions changes
nothing and is answered "Nothing happens." (ALFWorld's own reply). Expert (GET /expert): the first command of the
plan that the AlfredExpert wrapper (planner type: Fast Downward, replanned after every step) holds for the current
state.

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
import logging
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
MAPPING_FILES = {"train": "mappings_train.json", "test": "mappings_test.json"}
MAPPING_SPLIT_DIRS = {"train": "train", "test": "valid_train"}  # where AgentGym looks for each file's games
ARRIVAL = "You arrive at loc "
log = logging.getLogger("env_gateway.servers.alfworld")


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


def read_mapping(mapping_dir: str, split: str, first_id: int) -> list[tuple[str, str]]:
    """(task_type, task_id) of each entry of one of AgentGym's mapping files, in order, whose items are data_idx
    first_id, first_id + 1, ...; SystemExit, saying what is wrong and what to do, when the file is unusable."""
    path = os.path.join(mapping_dir, MAPPING_FILES[split])
    fix = (f"pass --mapping (or set ALFWORLD_MAPPING to) the folder that holds AgentGym's {MAPPING_FILES['train']} "
           f"and {MAPPING_FILES['test']}: <AgentGym>/agentenv-alfworld/configs")
    try:
        with open(path) as f:
            entries = json.load(f)
    except OSError as e:
        raise SystemExit(f"alfworld: cannot read the mapping file {path} ({e.strerror}); {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"alfworld: the mapping file {path} is not JSON ({e}); {fix}") from None
    if not isinstance(entries, list) or not entries:
        raise SystemExit(f"alfworld: the mapping file {path} must hold a non-empty JSON list of "
                         f'{{"item_id", "task_type", "task_id"}} objects; {fix}')
    games = []
    for k, entry in enumerate(entries):
        if not (isinstance(entry, dict) and all(isinstance(entry.get(key), str) and entry[key]
                                                for key in ("task_type", "task_id"))):
            raise SystemExit(f"alfworld: entry {k} of the mapping file {path} is {json.dumps(entry)[:200]}, not an "
                             f'object with non-empty string "task_type" and "task_id"; {fix}')
        # AgentGym numbers the games by their place in the files and ignores item_id, which says the same in its
        # files: one that disagrees means a file other than the user thinks (e.g. the test file given as train).
        if "item_id" in entry and entry["item_id"] != first_id + k:
            raise SystemExit(f"alfworld: entry {k} of the mapping file {path} has item_id "
                             f"{json.dumps(entry['item_id'])}, but is data_idx {first_id + k} (the train file's "
                             "items come first, in order, then the test file's); " + fix)
        games.append((entry["task_type"], entry["task_id"]))
    return games


def mapping_splits(root: str, mapping_dir: str) -> dict[str, list[str]]:
    """{split: game paths} in data_idx order, as AgentGym's mapping files list them (dev is empty)."""
    splits: dict[str, list[str]] = {}
    for split in ("train", "test"):
        base = os.path.join(root, "json_2.1.1", MAPPING_SPLIT_DIRS[split])
        entries = read_mapping(mapping_dir, split, len(splits.get("train", ())))
        splits[split] = [os.path.join(base, task_type, task_id, "game.tw-pddl") for task_type, task_id in entries]
    splits["dev"] = []
    return splits


def default_root() -> str:
    return os.environ.get("ALFWORLD_DATA") or os.path.expanduser("~/.cache/alfworld")


def default_mapping() -> str | None:
    return os.environ.get("ALFWORLD_MAPPING") or None


def first_observation(feedback: str) -> str:
    """AgentGym's reset text: the paragraphs after the first (the banner), joined by one newline."""
    return "\n".join(feedback.split("\n\n")[1:])


def step_observation(feedback: str) -> str:
    """AgentGym's step text: the feedback less a leading "You arrive at loc N. " (cut through the first ". ", or,
    with none, the first character, as AgentGym's str.find arithmetic does)."""
    if feedback.startswith(ARRIVAL):
        return feedback[feedback.find(". ") + 2:]
    return feedback


@dataclass
class Session:
    env: textworld.core.Wrapper
    game: str | None = None
    state: textworld.GameState | None = None
    observation: str | None = None  # the last reply's text (GET /observation answers it, as AgentGym's does)
    steps: int = 0


class AlfWorldServer(EnvServer):
    name = "alfworld"
    max_action_chars = 1024

    def __init__(self, max_instances: int = 256, workers: int = 8, games: str | None = None,
                 test_split: str = "valid_unseen", max_steps: int = 50, mapping: str | None = None):
        super().__init__(max_instances, workers)
        self.root = games or default_root()
        if mapping:
            self.splits = mapping_splits(self.root, mapping)
        else:
            self.splits = game_splits(self.root, test_split)
        self.games = [g for split in ("train", "test", "dev") for g in self.splits[split]]
        if mapping:
            # Checked once here, told at reset: a folder holding part of the games (a download in progress, a
            # subset for a quick run) still serves the games it has.
            missing = [g for g in self.games if not os.path.isfile(g)]
            if len(missing) == len(self.games):
                raise SystemExit(f"alfworld: none of the {len(self.games)} games of the mapping in {mapping} is under "
                                 f"{self.root} (the first: {missing[0]}); pass --games the folder that holds "
                                 "json_2.1.1/ (ALFWorld's data, from `alfworld-download`)")
            if missing:
                log.warning("alfworld: %d of the %d mapped games are missing under %s (the first: %s); resetting one "
                            "of them answers 404 missing_game", len(missing), len(self.games), self.root, missing[0])
        elif not self.games:
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
        parser.add_argument("--mapping", default=default_mapping(), metavar="DIR",
                            help="folder with AgentGym's mappings_train.json and mappings_test.json "
                            "(<AgentGym>/agentenv-alfworld/configs): the game list and item ids follow them "
                            "(test games under json_2.1.1/valid_train, no dev split); default: $ALFWORLD_MAPPING")

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
        if session.game != game and not os.path.isfile(game):
            raise RequestError(404, "missing_game", f"data_idx {data_idx} is the game {game}, which is not there: "
                               "put ALFWorld's data (`alfworld-download`) in the games folder, or use the item ids of "
                               "the games it holds")
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
        session.observation = first_observation(session.state.feedback)
        return {"observation": session.observation, "available_actions": session.state["admissible_commands"],
                "task_type": "/".join(game.split(os.sep)[-3:-1])}

    def step(self, session: Session, action: str) -> dict:
        with self.engine_lock:
            session.state, _, _ = session.env.step(action)
        session.steps += 1
        session.observation = step_observation(session.state.feedback)
        won = bool(session.state["won"])
        return {"observation": self.observation(session), "reward": float(won),
                "available_actions": session.state["admissible_commands"],
                "done": won or (self.max_steps > 0 and session.steps >= self.max_steps)}

    def invalid_action(self, session: Session, reason: str) -> dict:
        return {"observation": f"Invalid action: {reason}", "reward": 0.0,
                "available_actions": session.state["admissible_commands"], "done": False}

    def observation(self, session: Session) -> str:
        if session.observation is None:
            raise RequestError(409, "not_reset", "the instance has not been reset: POST /reset first")
        return session.observation

    def expert_action(self, session: Session) -> str:
        plan = session.state["extra.expert_plan"]
        if not plan:
            raise RequestError(409, "no_plan", "the planner has no plan from this state (the game is already won)")
        return plan[0]


def item_ids(split: str) -> list[int]:
    """Item ids (for scripts/make_itemids.py): of AgentGym's mapping in $ALFWORLD_MAPPING when set, else of the
    games under $ALFWORLD_DATA."""
    mapping = default_mapping()
    return split_item_ids(mapping_splits(default_root(), mapping) if mapping else game_splits(default_root()), split)


if __name__ == "__main__":
    serve(AlfWorldServer)
