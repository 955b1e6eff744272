"""What a model's replies asked the env to do: a census of the actions in eval episodes.

    python scripts/reply_census.py EPISODES.jsonl [EPISODES.jsonl ...] [--top 5] [--json OUT.json]

Reads ``scripts/eval.py``'s ``*.episodes.jsonl`` (each line's ``messages``). Every assistant reply after the first
(the scripted acknowledgement of the system turn) is one reply; its action is the first non-empty line after its
last "Action:" (none when it has no "Action:" or nothing after it), and it is put in one class:

    listed      the action is one of the "Available actions: [...]" the observation before it listed
    unlisted    an action the observation did not list (a broken one: "go to" cut short, two run together, ...)
    none        no action at all
    no list     the observation listed no actions (envs whose observations do not), so it cannot be told

and prints, per file, the replies, each class's share and the most common actions with their shares. A policy that
learns keeps "listed" high while its actions follow the view; a collapse shows as "unlisted" / "none" rising, or as
one action taking most replies whatever the view.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter

CLASSES = ("listed", "unlisted", "none", "no list")
LISTED = re.compile(r"Available actions: (\[.*\])")


def reply_action(reply: str) -> str:
    """The first non-empty line after the reply's last "Action:" ("" when there is none)."""
    if "Action:" not in reply:
        return ""
    return next((line.strip() for line in reply.rsplit("Action:", 1)[1].splitlines() if line.strip()), "")


def census(path: str, top: int) -> dict:
    classes, actions = Counter(), Counter()
    with open(path, encoding="utf-8") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            for i in replies[1:]:
                action = reply_action(messages[i]["content"])
                listed = LISTED.findall(messages[i - 1]["content"])
                if not action:
                    classes["none"] += 1
                elif not listed:
                    classes["no list"] += 1
                else:
                    classes["listed" if action in json.loads(listed[-1]) else "unlisted"] += 1
                actions[action] += 1
    n = sum(classes.values())
    return {"file": path, "replies": n, **{c: classes[c] / n if n else 0.0 for c in CLASSES},
            "top_actions": [(a, k / n) for a, k in actions.most_common(top)]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("episodes", nargs="+", help="scripts/eval.py's *.episodes.jsonl files")
    parser.add_argument("--top", type=int, default=5, help="how many of the most common actions to show")
    parser.add_argument("--json", help="also write the census here")
    args = parser.parse_args(argv)
    missing = [p for p in args.episodes if not os.path.isfile(p)]
    if missing:
        parser.error(f"no such episodes file: {', '.join(missing)} (scripts/eval.py --out X writes X's "
                     "*.episodes.jsonl beside it)")
    rows = [census(path, args.top) for path in args.episodes]
    for row in rows:
        print(f"{row['file']}: {row['replies']} replies; " + ", ".join(f"{c} {row[c]:.3f}" for c in CLASSES))
        print("  most common: " + "; ".join(f"{a or '(none)'!r} {share:.3f}" for a, share in row["top_actions"]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
