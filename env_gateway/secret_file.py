"""Secrets read from files, and kept out of everything a process writes or answers.

    key = read_secret_file(".secrets/user_api_key")   # the file's one line; refused unless chmod 600 and one line
    redact(text)                                       # text with every secret read so far replaced by [redacted]

Every secret read joins ``SECRETS``; the env servers' error answers and logs, the gateway's and the eval's pass
through ``redact``. Stdlib only: the trainer's preflight, the gateway and the env servers share it.
"""

from __future__ import annotations

import os

SECRETS: set[str] = set()  # text that must not leave the process (the τ² server's read_key adds its user key)


def read_secret_file(path: str) -> str:
    """The secret in ``path``: the file's one non-empty line, stripped. Refused (ValueError saying what to do) when
    the file is missing, empty, has more lines, can be read by group or others, or is a symlink out of its folder
    (secrets stay in .secrets/). The secret joins ``SECRETS``, so no error answer or log line shows it."""
    if not os.path.isfile(path):
        raise ValueError(f"no file {path}")
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    if os.path.islink(path) and os.path.dirname(os.path.realpath(path)) != folder:
        raise ValueError(f"{path} is a symlink out of its folder (to {os.path.realpath(path)}): copy the secret into "
                         f"{folder} instead")
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"{path} can be read by others (mode {mode:o}): run `chmod 600 {path}`")
    with open(path) as f:
        lines = [line.strip() for line in f.read().splitlines() if line.strip()]
    if len(lines) != 1:
        raise ValueError(f"{path} is empty" if not lines else
                         f"{path} has {len(lines)} lines: it must hold the secret alone, on one line")
    SECRETS.add(lines[0])
    return lines[0]


def redact(text: str) -> str:
    """``text`` with every one of ``SECRETS`` replaced by [redacted]."""
    for secret in SECRETS:
        text = text.replace(secret, "[redacted]")
    return text
