"""ScienceWorld (``scienceworld`` 1.2.3, Java 17) as an AgentGym-protocol server over a small pool of JVMs, giving
item for item what AgentGym's own SciWorld server (agentenv-sciworld at commit 3ef9235) gives.

Items, as AgentGym's list: every task in the package's task order except 5-1, 5-2, 9-* and 10-*, every variation
0 .. max-1; ``data_idx`` indexes that list (4639 items with 1.2.3). Splits: AgentGym at 3ef9235 defines none for
SciWorld (its train/test item lists are data files it does not ship), so ``item_ids(split)`` uses the package's
own: an item is in train, dev or test when its variation is in ``get_variations_train/dev/test()`` for its task.

Replies, as AgentGym's:
- reset: load the item, then "look around" -> {task_name, var_num, task_description, observation (the look's
  text; AgentGym's client puts task_description and a newline before it), reward, score, deleted: false, done}.
  The first look can already score (the agent starts where the task wants it): reward = score = that score.
- step: {observation, reward, score, done}: observation is the simulator's answer as it is (an unparseable or
  empty action: "No known action matches that input."; an ambiguous one: its numbered options, and the next action
  is read as the choice); score = round(100 * simulator score) (negative when the task failed); reward = score -
  the previous reply's score; done = task completed, or score < 0, or more than --step-limit (100) moves.
- A step after done is refused (409 ``episode_done``; AgentGym answers 200 {"error": "... has finished."}).
Where this server differs by design: an action over 1024 characters or not valid Unicode is an invalid action
("Invalid action: ...", nothing changed) and never reaches the JVM (AgentGym's parses the first, "No known action
matches that input.", and answers the second 200 {"error": "An error occurred while calling o2.step"}); errors
are HTTP 4xx JSON, not 200 {"error"}; GET /observation answers {"observation": text}, not the bare text.
Checked against AgentGym's server by tests/test_parity_sciworld.py (which lists what the simulator itself does not
reproduce between JVMs).

The simulator lists a room's contents (and a container's, and the options of an ambiguous action) in an order that
follows the JVM's identity hash codes, so one item's observation can differ between runs in that order, on
AgentGym's server too; a thermometer reading can differ by a degree, a closed circuit can score a step sooner.

Fast step path: the package's ``ScienceWorldEnv.step`` also fetches the look/inventory/task texts and every valid
action, which is most of its 0.1-0.6 s and changes nothing in the world; here a step makes only the simulator's
step, score, completed and move-count calls (a few ms) and applies the package's formulas (above). Valid actions:
GET /valid_actions?id=n.

JVM pool, and why nothing deadlocks: a session is a record (item + the actions taken), not a JVM. Each call borrows
one of --jvms JVMs only for its own duration: the JVM that still holds this session's state if it is free, else a
free one (an idle JVM first, then the least recently used), where the session is restored by a load and by
replaying its actions on the fast path. A call that waits for a JVM waits only for calls already running, each of
which hands its JVM back when it returns, so no cycle of waits can form whatever the clients do (reset many
sessions before stepping any, abandon sessions without /close). While no more than --jvms sessions are active,
each keeps its JVM and nothing is replayed. Each JVM's heap is capped (--jvm-heap, default 512m). Caveat: as
above, a restored session may differ from the original in listing order, a thermometer reading or the option a
number picks.

Expert (GET /expert): the package's gold action sequence for the item (generated once per item by a load with
``generateGoldPath``, then cached), at its first action not yet taken: the position moves on when a step's
action equals the next gold action.
"""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from aiohttp import web
from scienceworld import ScienceWorldEnv
from scienceworld.constants import ID2TASK

from env_gateway.servers._base import EnvServer, RequestError, serve

SPLITS = ("train", "dev", "test")


@dataclass(frozen=True)
class Catalogue:
    items: list[tuple[str, int]]  # data_idx -> (task name, variation)
    splits: dict[str, list[int]]  # split -> data_idx values


def build_catalogue(env: ScienceWorldEnv) -> Catalogue:
    items, splits = [], {s: [] for s in SPLITS}
    for task_id, task in ID2TASK.items():
        if task_id in ("5-1", "5-2") or task_id.split("-")[0] in ("9", "10"):  # as AgentGym leaves them out
            continue
        env.load(task, 0, "")
        in_split = {"train": set(env.get_variations_train()), "dev": set(env.get_variations_dev()),
                    "test": set(env.get_variations_test())}
        for var in range(env.get_max_variations(task)):
            for split in SPLITS:
                if var in in_split[split]:
                    splits[split].append(len(items))
            items.append((task, var))
    return Catalogue(items, splits)


@dataclass
class Episode:
    """One session: its item, the actions taken since reset, and where its state last lived."""

    task: str | None = None
    var: int = 0
    actions: list[str] = field(default_factory=list)
    score: int = 0
    observation: str = ""
    gold_pos: int = 0
    done: bool = False
    jvm: "Jvm | None" = None


@dataclass(eq=False)
class Jvm:
    env: ScienceWorldEnv
    holder: Episode | None = None  # the episode whose state this JVM holds
    last_used: float = 0.0


class JvmPool:
    def __init__(self, size: int, step_limit: int, heap: str = "512m"):
        # The package starts each JVM itself, with Java's default heap cap (a quarter of the machine's memory):
        # under many sessions a JVM grew past 1.5 GB. JAVA_TOOL_OPTIONS reaches the JVMs it starts.
        # py4j reads the JVM's first stdout line as its port, and the JVM logs its warnings to stdout (under load:
        # "Cannot use file /tmp/hsperfdata_root/<pid> because it is locked"), so the JVM keeps no perf-data file
        # and logs warnings to stderr; the user's options come after, so their own -Xlog outputs still apply.
        quiet_stdout = "-XX:-UsePerfData -Xlog:disable -Xlog:all=warning:stderr"
        java_opts = f"{quiet_stdout} {os.environ.get('JAVA_TOOL_OPTIONS', '')} -Xmx{heap} -XX:+UseSerialGC"
        os.environ["JAVA_TOOL_OPTIONS"] = " ".join(java_opts.split())
        with ThreadPoolExecutor(size) as starter:  # each JVM takes ~1 s to start: start them together
            self.jvms = list(starter.map(lambda _: Jvm(ScienceWorldEnv("", envStepLimit=step_limit)), range(size)))
        self.free = list(self.jvms)
        self.cond = threading.Condition()

    @contextmanager
    def borrow(self, episode: Episode | None = None, restore: bool = True) -> Iterator[Jvm]:
        """A JVM for one call: the episode's own when free, else the idlest; restored to the episode's state."""
        with self.cond:
            self.cond.wait_for(lambda: self.free)
            own = episode is not None and episode.jvm in self.free and episode.jvm.holder is episode
            jvm = episode.jvm if own else min(self.free, key=lambda j: (j.holder is not None, j.last_used))
            self.free.remove(jvm)
        try:
            if restore and episode is not None and jvm.holder is not episode:
                self.restore(jvm, episode)
            yield jvm
        except BaseException:
            jvm.holder = None  # its state is unknown after a failure
            raise
        finally:
            with self.cond:
                jvm.last_used = time.monotonic()
                self.free.append(jvm)
                self.cond.notify()

    @staticmethod
    def restore(jvm: Jvm, episode: Episode) -> None:
        start(jvm, episode)
        for action in episode.actions:
            fast_step(jvm.env, action)

    def release(self, episode: Episode) -> None:
        with self.cond:
            if episode.jvm is not None and episode.jvm.holder is episode:
                episode.jvm.holder = None

    def close(self) -> None:
        for jvm in self.jvms:
            jvm.env.close()


def start(jvm: Jvm, episode: Episode) -> tuple[str, int, bool, int]:
    """Load the episode's item and make the first move ("look around", as AgentGym's reset does), returning
    ``fast_step``'s tuple. A load builds the world afresh; the package's reset() would build it a second time (as
    long again), and AgentGym's reset does not call it either."""
    jvm.env.load(episode.task, episode.var, "")
    jvm.holder, episode.jvm = episode, jvm
    return fast_step(jvm.env, "look around")


def fast_step(env: ScienceWorldEnv, action: str) -> tuple[str, int, bool, int]:
    """(observation, score 0-100, completed, moves) from four simulator calls, without the valid-action list."""
    server = env.server
    observation = server.step(action)
    return observation, int(round(100 * server.getScore())), server.getCompleted(), server.getNumMoves()


class SciWorldServer(EnvServer):
    name = "sciworld"
    max_action_chars = 1024

    def __init__(self, max_instances: int = 256, workers: int = 8, jvms: int = 4, step_limit: int = 100,
                 jvm_heap: str = "512m"):
        super().__init__(max_instances, workers)
        self.step_limit = step_limit
        self.jvms = JvmPool(jvms, step_limit, jvm_heap)
        with self.jvms.borrow() as jvm:
            self.catalogue = build_catalogue(jvm.env)
        self.gold: dict[tuple[str, int], list[str]] = {}

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--jvms", type=int, default=4, help="JVMs in the pool (150-450 MB each)")
        parser.add_argument("--jvm-heap", default="512m", help="maximum Java heap of each JVM (-Xmx)")
        parser.add_argument("--step-limit", type=int, default=100, help="moves after which an episode is done")

    def num_items(self) -> int:
        return len(self.catalogue.items)

    def item_ids(self, split: str) -> list[int]:
        return split_item_ids(self.catalogue, split)

    def new_env(self) -> Episode:
        return Episode()

    def close_env(self, episode: Episode) -> None:
        self.jvms.release(episode)

    def reset(self, episode: Episode, data_idx: int) -> dict:
        episode.task, episode.var = self.catalogue.items[data_idx]
        episode.actions, episode.gold_pos = [], 0
        with self.jvms.borrow(episode, restore=False) as jvm:
            observation, score, completed, moves = start(jvm, episode)
            description = jvm.env.get_task_description()  # the same before and after the first look
        # The first look can already score (the agent starts in a room the task asks for): AgentGym reports it
        # here, and the first step's reward is counted from it.
        episode.score, episode.observation = score, observation
        episode.done = self.is_done(score, completed, moves)
        return {"task_name": episode.task, "var_num": episode.var, "task_description": description,
                "observation": observation, "reward": score, "score": score, "deleted": False, "done": episode.done}

    def is_done(self, score: int, completed: bool, moves: int) -> bool:
        return bool(completed) or score < 0 or moves > self.step_limit

    @staticmethod
    def refuse_when_done(episode: Episode) -> None:
        if episode.done:  # as AgentGym's server, which answers {"error": "The task ... has finished."}
            raise RequestError(409, "episode_done", "the episode is done (task completed or failed, or the step "
                                                    "limit reached): reset to play again")

    def step(self, episode: Episode, action: str) -> dict:
        self.refuse_when_done(episode)
        with self.jvms.borrow(episode) as jvm:
            observation, score, completed, moves = fast_step(jvm.env, action)
        episode.actions.append(action)
        gold = self.gold.get((episode.task, episode.var))
        if gold and episode.gold_pos < len(gold) and action == gold[episode.gold_pos]:
            episode.gold_pos += 1
        reward, episode.score, episode.observation = score - episode.score, score, observation
        episode.done = self.is_done(score, completed, moves)
        return {"observation": observation, "reward": reward, "score": score, "done": episode.done}

    def observation(self, episode: Episode) -> str:
        return episode.observation

    def invalid_action(self, episode: Episode, reason: str) -> dict:
        self.refuse_when_done(episode)
        return {"observation": f"Invalid action: {reason}", "reward": 0, "score": episode.score, "done": False}

    def valid_actions(self, episode: Episode) -> list[str]:
        with self.jvms.borrow(episode) as jvm:
            return jvm.env.get_valid_action_object_combinations()

    def expert_action(self, episode: Episode) -> str:
        key = (episode.task, episode.var)
        if key not in self.gold:
            with self.jvms.borrow() as jvm:
                jvm.holder = None
                jvm.env.load(episode.task, episode.var, "", generateGoldPath=True)
                self.gold[key] = jvm.env.get_gold_action_sequence()
            # Catch up on gold actions taken before the sequence was known.
            for action in episode.actions:
                if episode.gold_pos < len(self.gold[key]) and action == self.gold[key][episode.gold_pos]:
                    episode.gold_pos += 1
        gold = self.gold[key]
        if episode.gold_pos >= len(gold):
            raise RequestError(409, "expert_done", "every gold action has been taken; reset to start again")
        return gold[episode.gold_pos]

    async def handle_valid_actions(self, request: web.Request) -> web.Response:
        _, inst = self.reset_instance(request.query.get("id"))
        async with inst.lock:
            actions = await self.run_blocking(self.valid_actions, inst.env)
        return web.json_response({"valid_actions": actions})

    def extra_routes(self) -> list[web.RouteDef]:
        return [web.get("/valid_actions", self.handle_valid_actions)]

    def app(self) -> web.Application:
        app = super().app()
        app.on_cleanup.append(self._close_jvms)
        return app

    async def _close_jvms(self, app: web.Application) -> None:
        self.jvms.close()


def split_item_ids(catalogue: Catalogue, split: str) -> list[int]:
    if split not in catalogue.splits:
        raise RequestError(400, "bad_split", f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    return list(catalogue.splits[split])


@functools.cache
def _catalogue() -> Catalogue:
    env = ScienceWorldEnv("")
    try:
        return build_catalogue(env)
    finally:
        env.close()


def item_ids(split: str) -> list[int]:
    """Item ids of one split (for scripts/make_itemids.py); starts one JVM for a few seconds."""
    return split_item_ids(_catalogue(), split)


if __name__ == "__main__":
    serve(SciWorldServer)
