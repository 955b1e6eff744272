"""Write τ²-bench item-id files (OpenRLHF prompt datasets) from τ²-bench's own task splits.

    python scripts/make_tau2_itemid.py --tau2-data PATH --domains retail airline telecom --split train --out data/

writes ``<out>/tau2_<domain>_<split>.jsonl``, one line per task of that split, in the split file's order:
``{"prompt": "tau2/<domain>/<task_id>", "label": "<domain>/<task_id>"}``. ``--tau2-data`` is a checkout of
sierra-research/tau2-bench at the pinned commit c5b2d22 (its ``data/tau2/domains/<domain>/split_tasks.json``) or
a folder holding ``<domain>/split_tasks.json`` directly. The files under data/ are committed, so training and
evaluation need neither. Splits at c5b2d22: airline train 30 / test 20, retail 74 / 40, telecom 74 / 40.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DOMAINS = ("airline", "retail", "telecom")


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


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tau2-data", required=True, help="tau2-bench checkout at c5b2d22, or its domains folder")
    parser.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=DOMAINS)
    parser.add_argument("--split", required=True, help="a split of split_tasks.json: train, test, base, ...")
    parser.add_argument("--out", default="data/")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    written = []
    for domain in args.domains:
        ids = task_ids(args.tau2_data, domain, args.split)
        path = os.path.join(args.out, f"tau2_{domain}_{args.split}.jsonl")
        with open(path, "w") as f:
            for task_id in ids:
                f.write(json.dumps({"prompt": f"tau2/{domain}/{task_id}", "label": f"{domain}/{task_id}"}) + "\n")
        print(f"{path}: {len(ids)} items", file=sys.stderr)
        written.append(path)
    return written


if __name__ == "__main__":
    main()
