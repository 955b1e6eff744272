"""Write OpenRLHF prompt datasets of item ids for one environment, one file per split.

    python scripts/make_itemids.py --env NAME --split train|dev|test [...] --out data/

writes ``<out>/<NAME>_<split>.jsonl`` for each split, one line per item:
``{"prompt": "<NAME>/<item_id>", "label": "<item_id>"}``.
The ids come from the server module's ``item_ids(split)`` (the benchmark's own task list; deterministic, test
never overlaps train). The env packages live in the env's own venv: when importing the server module fails
here and ``.venvs/NAME/bin/python`` exists, the script re-runs itself under that interpreter.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def load_item_ids(env: str, split: str) -> list[int]:
    module = importlib.import_module(f"env_gateway.servers.{env}")
    item_ids = getattr(module, "item_ids", None)
    if item_ids is None:  # a server module without a module-level item_ids: ask a server instance
        from env_gateway.servers._base import EnvServer

        server_cls = next(v for v in vars(module).values()
                          if isinstance(v, type) and issubclass(v, EnvServer) and getattr(v, "name", None) == env)
        item_ids = server_cls().item_ids
    return item_ids(split)


def write_item_rows(path: str, env: str, ids: list) -> None:
    """One prompt-dataset line per item: ``{"prompt": "<env>/<item_id>", "label": "<item_id>"}``."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": f"{env}/{i}", "label": str(i)}) + "\n" for i in ids)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", required=True, help="server module name under env_gateway/servers/")
    parser.add_argument("--split", required=True, nargs="+", choices=["train", "dev", "test"])
    parser.add_argument("--out", default="data/", help="output folder")
    args = parser.parse_args(argv)
    if not os.path.exists(os.path.join(ROOT, "env_gateway", "servers", f"{args.env}.py")):
        parser.error(f"no server module env_gateway/servers/{args.env}.py")
    try:
        splits = {split: load_item_ids(args.env, split) for split in args.split}
    except ImportError as e:
        venv_python = os.path.join(ROOT, ".venvs", args.env, "bin", "python")
        if os.path.exists(venv_python) and os.path.realpath(sys.prefix) != os.path.realpath(os.path.dirname(
                os.path.dirname(venv_python))):
            os.execv(venv_python, [venv_python, os.path.abspath(__file__), *sys.argv[1:]])
        sys.exit(f"make_itemids: cannot import env_gateway.servers.{args.env} ({e}); "
                 f"run `bash scripts/setup_env.sh {args.env}` first")
    os.makedirs(args.out, exist_ok=True)
    paths = []
    for split, ids in splits.items():
        paths.append(os.path.join(args.out, f"{args.env}_{split}.jsonl"))
        write_item_rows(paths[-1], args.env, ids)
        print(f"make_itemids: wrote {len(ids)} {args.env} {split} items to {paths[-1]}")
    return paths

if __name__ == "__main__":
    main()
