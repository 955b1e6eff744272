"""The shape a newcomer relies on: a README that is a short reference, docs small enough to travel with the tree, no
lab notes in product code, modules that import each other in one direction."""

from __future__ import annotations

import ast
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ("cope_rlhf", "env_gateway", "agent_funcs")


def product_files() -> list[str]:
    return sorted(os.path.join(dirpath, name) for folder in PRODUCT
                  for dirpath, _, names in os.walk(os.path.join(ROOT, folder)) if "__pycache__" not in dirpath
                  for name in names if name.endswith(".py"))


def test_the_readme_is_a_short_reference_with_both_commands_on_its_first_screen():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    first_screen = "\n".join(text.splitlines()[:40])
    assert len(text.split()) <= 1000
    assert "bash scripts/quickstart.sh" in first_screen and "bash scripts/test.sh" in first_screen


def test_the_tracked_docs_stay_under_6_mb():
    """What travels to a borrowed GPU machine is the tracked tree (64 MiB at most); raw run records stay out."""
    tracked = subprocess.run(["git", "ls-files", "-z", "docs"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [p for p in tracked.decode().split("\0") if p and os.path.exists(os.path.join(ROOT, p))]
    assert sum(os.path.getsize(os.path.join(ROOT, p)) for p in paths) <= 6_000_000


def test_product_code_carries_no_lab_notes():
    """Dates, session or diagnosis-point references and issue numbers belong in git history and docs/results."""
    note = re.compile(r"diagnosis point|\b20\d\d-[01]\d-[0-3]\d\b|\bsession \d|\bissue \d+|\bround \d+\b",
                      re.IGNORECASE)
    found = [f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}" for path in product_files()
             for n, line in enumerate(open(path, encoding="utf-8"), 1) if note.search(line)]
    assert found == []


def test_the_actor_stays_one_screenful_of_classes():
    with open(os.path.join(ROOT, "cope_rlhf", "actor.py"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 350


def imported_modules(path: str) -> set[str]:
    """Every module of the product packages that ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PRODUCT}


def test_no_two_product_modules_import_each_other_through_any_chain():
    modules = {os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__"): path
               for path in product_files()}
    graph = {name: {m for m in imported_modules(path) if m in modules and m != name}
             for name, path in modules.items()}
    cycles = []
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            if name == start:
                cycles.append(start)
                break
            if name not in seen:
                seen.add(name)
                todo.extend(graph[name])
    assert cycles == []


def test_the_trainer_imports_no_env_server_module():
    trainer = [name for name in product_files() if os.path.relpath(name, ROOT).startswith("cope_rlhf")]
    assert [(os.path.relpath(path, ROOT), sorted(m for m in imported_modules(path) if ".servers" in m))
            for path in trainer if any(".servers" in m for m in imported_modules(path))] == []
