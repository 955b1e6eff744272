"""The tau2-bench commit an installed ``tau2`` package was built from, where τ² itself cannot say.

    python scripts/tau2_commit.py --venv .venvs/tau2 [--source]     # print it, or "unknown" (--source: where read)
    python scripts/tau2_commit.py --venv .venvs/tau2 --record --checkout DIR [--commit C]    (setup_env.sh tau2)

``tau2 run`` records as a run's commit ``git rev-parse HEAD`` of its working directory, so a package installed from
a copy that is not a git checkout (an unpacked archive, a copied folder) gives "unknown", and no run made with it could
ever be compared with a published number. This module finds the commit elsewhere, in this order:

1. pip's own record: ``tau2-*.dist-info/direct_url.json`` in the venv's site-packages, whose ``vcs_info.commit_id``
   pip writes for a VCS install (``pip install git+https://github.com/sierra-research/tau2-bench@c5b2d22``);
2. the record ``setup_env.sh tau2`` writes beside the venv, ``<venv>/tau2-commit.json`` (``--record``): the
   checkout's ``git rev-parse HEAD`` when the source is a git checkout, else the commit the user stated once at
   install (``TAU2_COMMIT=c5b2d22 bash scripts/setup_env.sh tau2``, passed here as ``--commit``); a stated commit
   that contradicts the checkout's own HEAD is refused.

Contract: ``installed_commit(venv)`` returns ``(commit, source)``, commit "unknown" and source "" when nothing
records it; it reads files only (the venv's interpreter is never run). ``record(...)`` writes the JSON record and
returns it; a malformed commit (not 7-40 hex digits) is a ValueError.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys

UNKNOWN = "unknown"
RECORD = "tau2-commit.json"
HEX = re.compile(r"^[0-9a-f]{7,40}$")


def _pip_commit(venv: str) -> str | None:
    pattern = os.path.join(glob.escape(venv), "lib", "python*", "site-packages", "tau2-*.dist-info", "direct_url.json")
    for path in sorted(glob.glob(pattern)):
        try:
            with open(path, encoding="utf-8") as f:
                commit = (json.load(f).get("vcs_info") or {}).get("commit_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(commit, str) and HEX.match(commit.lower()):
            return commit.lower()
    return None


def installed_commit(venv: str) -> tuple[str, str]:
    """(commit, where it was read) of the tau2 package in ``venv``; ("unknown", "") when nothing records it."""
    commit = _pip_commit(venv)
    if commit:
        return commit, "pip (direct_url.json vcs_info)"
    try:
        with open(os.path.join(venv, RECORD), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return UNKNOWN, ""
    commit = str(saved.get("commit", "")).lower() if isinstance(saved, dict) else ""
    if HEX.match(commit):
        return commit, f"{RECORD} ({saved.get('source', 'recorded')})"
    return UNKNOWN, ""


def checkout_head(checkout: str) -> str | None:
    """``git rev-parse HEAD`` of ``checkout`` when it is the top of a git checkout, else None (a plain copy, or a
    folder inside some other repository, whose HEAD is not tau2-bench's)."""
    try:
        top = subprocess.run(["git", "-C", checkout, "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = top.stdout.split()
    if top.returncode != 0 or len(lines) != 2 or os.path.realpath(lines[0]) != os.path.realpath(checkout):
        return None
    return lines[1].lower()


def record(venv: str, checkout: str, stated: str | None = None) -> dict:
    """Write ``<venv>/tau2-commit.json``: the checkout's HEAD, else ``stated``, else keep an earlier record (a rebuild
    without the statement does not forget it), else record nothing and say how to state it."""
    stated = (stated or "").strip().lower() or None
    if stated is not None and not HEX.match(stated):
        raise ValueError(f"TAU2_COMMIT={stated!r} is not a commit: give 7 to 40 hex digits, e.g. c5b2d22")
    head = checkout_head(checkout)
    if head is not None:
        if stated is not None and not head.startswith(stated):
            raise ValueError(f"TAU2_COMMIT={stated} contradicts {checkout}, a git checkout at {head}")
        entry = {"commit": head, "source": f"git rev-parse HEAD of {checkout}"}
    elif stated is not None:
        entry = {"commit": stated, "source": f"stated at install (TAU2_COMMIT) for the copy at {checkout}"}
    else:
        commit, source = installed_commit(venv)
        if commit != UNKNOWN:
            return {"commit": commit, "source": source}
        return {"commit": UNKNOWN, "source": f"{checkout} is no git checkout and no TAU2_COMMIT was stated"}
    with open(os.path.join(venv, RECORD), "w", encoding="utf-8") as f:
        json.dump(entry, f, indent=1)
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", required=True, help="the venv the tau2 package is installed in (.venvs/tau2)")
    p.add_argument("--record", action="store_true", help="write <venv>/tau2-commit.json (setup_env.sh tau2)")
    p.add_argument("--checkout", help="with --record: the tau2-bench folder the package was installed from")
    p.add_argument("--commit", help="with --record: the commit that folder holds, stated by the user (TAU2_COMMIT)")
    p.add_argument("--source", action="store_true", help="print where the commit was read on a second line")
    args = p.parse_args(argv)
    if not args.record:
        commit, source = installed_commit(args.venv)
        print(f"{commit}\n{source}" if args.source else commit)
        return 0
    if not args.checkout:
        p.error("--record needs --checkout")
    try:
        entry = record(args.venv, args.checkout, args.commit)
    except ValueError as e:
        print(f"tau2_commit: {e}", file=sys.stderr)
        return 2
    print(entry["commit"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
