"""Write τ²-bench item-id files (OpenRLHF prompt datasets) from τ²-bench's own task splits.

    python scripts/make_tau2_itemid.py --domains retail airline telecom --split train --out data/
    python scripts/make_tau2_itemid.py --tau2-data PATH --domains retail airline telecom --split train --out data/
    .venvs/tau2/bin/python scripts/make_tau2_itemid.py --from-package --split train test --out data/

writes ``<out>/tau2_<domain>_<split>.jsonl`` for each split, one line per task of that split, in the split's order:
``{"prompt": "tau2/<domain>/<task_id>", "label": "<domain>/<task_id>"}``. The splits come either from the split
files (``--tau2-data``: a checkout of sierra-research/tau2-bench at the pinned commit c5b2d22, its
``data/tau2/domains/<domain>/split_tasks.json``, or a folder holding ``<domain>/split_tasks.json`` directly), or
(``--from-package``) from the installed tau2 package's own loaders, ``tau2.run.load_task_splits``, with every id
checked against ``tau2.run.load_tasks`` where the domain's tasks file is present (the shared copy lacks telecom's).
With neither flag the installed package is used: this interpreter's ``tau2`` when it has one, else the τ² server's
venv (.venvs/tau2, from ``bash scripts/setup_env.sh tau2``), which runs this script again with ``--from-package``.
The files under data/ are committed, so training and evaluation need neither. Splits at c5b2d22: airline train
30 / test 20, retail 74 / 40, telecom 74 / 40.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

DOMAINS = ("airline", "retail", "telecom")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAU2_VENV_PYTHON = os.path.join(ROOT, ".venvs", "tau2", "bin", "python")


def split_file(tau2_data: str, domain: str) -> str:
    for path in (os.path.join(tau2_data, domain, "split_tasks.json"),
                 os.path.join(tau2_data, "data", "tau2", "domains", domain, "split_tasks.json")):
        if os.path.isfile(path):
            return path
    raise SystemExit(f"no split_tasks.json for {domain} under {tau2_data}: give a tau2-bench checkout at commit "
                     "c5b2d22 (or a folder with <domain>/split_tasks.json) as --tau2-data")


def task_ids(tau2_data: str, domain: str, split: str) -> list[str]:
    with open(split_file(tau2_data, domain)) as f:
        splits = json.load(f)
    if split not in splits:
        raise SystemExit(f"{domain} has no split {split!r}; it has: {', '.join(sorted(splits))}")
    return [str(t) for t in splits[split]]


def package_task_ids(domain: str, split: str) -> list[str]:
    """The split's task ids from the installed tau2 package's own loaders (run this in .venvs/tau2)."""
    os.environ.setdefault("LOGURU_LEVEL", "WARNING")  # tau2 logs every file it loads at INFO
    try:
        from tau2.run import load_task_splits, load_tasks
    except ImportError as e:
        raise SystemExit(f"--from-package needs the tau2 package ({e}): run this script with .venvs/tau2/bin/python "
                         "(bash scripts/setup_env.sh tau2 builds it)") from None
    splits = load_task_splits(domain)
    if not splits or split not in splits:
        raise SystemExit(f"tau2's {domain} has no split {split!r}; it has: {', '.join(sorted(splits or {}))}")
    ids = [str(t) for t in splits[split]]
    try:
        known = {task.id for task in load_tasks(domain)}
    except FileNotFoundError as e:
        print(f"{domain}: task ids not checked against the task list (tau2 cannot load it: {e})", file=sys.stderr)
    else:
        missing = [t for t in ids if t not in known]
        if missing:
            raise SystemExit(f"tau2's {domain} split {split!r} names tasks its task list lacks: {missing}")
    return ids


def in_tau2_venv(argv: list[str]) -> list[str]:
    """Run this script with --from-package under the τ² server's venv (this interpreter lacks tau2); the files it
    wrote, from its stderr lines "<path>: <n> items"."""
    if not os.path.exists(TAU2_VENV_PYTHON):
        raise SystemExit("make_tau2_itemid: no tau2 package here and no .venvs/tau2 (bash scripts/setup_env.sh tau2 "
                         "builds it from a tau2-bench checkout at c5b2d22); or give the split files with --tau2-data "
                         "<tau2-bench checkout>")
    done = subprocess.run([TAU2_VENV_PYTHON, os.path.abspath(__file__), "--from-package", *argv],
                          stderr=subprocess.PIPE, text=True)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        raise SystemExit(done.returncode)
    return [line.rsplit(": ", 1)[0] for line in done.stderr.splitlines() if line.endswith(" items")]


def main(argv: list[str] | None = None) -> list[str]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tau2-data", help="tau2-bench checkout at c5b2d22, or its domains folder")
    source.add_argument("--from-package", action="store_true", help="the installed tau2 package's own task loaders "
                        "(the default: this interpreter's, else .venvs/tau2's)")
    parser.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=DOMAINS)
    parser.add_argument("--split", nargs="+", required=True, help="splits of split_tasks.json: train, test, base, ...")
    parser.add_argument("--out", default="data/")
    args = parser.parse_args(argv)
    if not args.tau2_data and not args.from_package:
        if importlib.util.find_spec("tau2") is None:
            return in_tau2_venv(argv)
        args.from_package = True
    os.makedirs(args.out, exist_ok=True)
    written = []
    for split in args.split:
        for domain in args.domains:
            ids = package_task_ids(domain, split) if args.from_package else task_ids(args.tau2_data, domain, split)
            path = os.path.join(args.out, f"tau2_{domain}_{split}.jsonl")
            with open(path, "w") as f:
                for task_id in ids:
                    f.write(json.dumps({"prompt": f"tau2/{domain}/{task_id}", "label": f"{domain}/{task_id}"}) + "\n")
            print(f"{path}: {len(ids)} items", file=sys.stderr)
            written.append(path)
    return written


if __name__ == "__main__":
    main()
