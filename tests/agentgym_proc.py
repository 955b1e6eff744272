"""AgentGym's own env servers (commit 3ef9235), the reference of the parity tests, as subprocesses.

    with AgentGymServer("textcraft") as ref:            # .venvs/agentgym-textcraft/bin/python -m uvicorn
        env_id = ref.ok("POST", "/create", {})           #   agentenv_textcraft:app --host 127.0.0.1 --port 0,
                                                         #   cwd = $AGENTGYM_DIR/agentenv-textcraft

The venv comes from ``bash scripts/setup_env.sh agentgym-ENV`` (pins + the package from ``AGENTGYM_DIR``, default
``../shared/agentgym-3ef9235`` beside the repository). uvicorn binds port 0 and logs the port it got ("Uvicorn running
on http://127.0.0.1:PORT"), read from the log file as for the built-in servers; the process is stopped by PID on
exit, also when the test fails. The working directory is the package's folder because TextCraft reads its recipes
relative to it. ``environ`` sets environment variables for the server (through ``env VAR=VALUE``, which execs the
server in the same process): ALFWorld's server reads its games from ``~/.cache/alfworld`` whatever the caller says,
so its test points HOME at a made-up data folder. ``agentgym_fixture`` skips, with the reason, when the checkout or
the venv is missing.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from env_gateway.process import ROOT, EnvServerProcess, venv_python

AGENTGYM_DIR = os.environ.get("AGENTGYM_DIR") or os.path.join(os.path.dirname(ROOT), "shared", "agentgym-3ef9235")
UVICORN_PORT = re.compile(rb"Uvicorn running on http://127\.0\.0\.1:(\d+)")


class AgentGymServer(EnvServerProcess):
    """AgentGym's ``agentenv-<env>`` server on 127.0.0.1, on the port uvicorn chose; use as a context manager."""

    listening = UVICORN_PORT

    def __init__(self, env: str, startup_timeout: float = 120.0, environ: dict[str, str] | None = None):
        super().__init__(f"agentgym-{env}", startup_timeout=startup_timeout)
        self.env = env
        self.cwd = os.path.join(AGENTGYM_DIR, f"agentenv-{env}")
        self.environ = dict(environ or {})

    def command(self) -> list[str]:
        prefix = ["env", *(f"{k}={v}" for k, v in self.environ.items())] if self.environ else []
        return [*prefix, self.python, "-m", "uvicorn", f"agentenv_{self.env}:app", "--host", "127.0.0.1", "--port", "0"]


def require_agentgym(env: str) -> None:
    import pytest

    if not os.path.isdir(os.path.join(AGENTGYM_DIR, f"agentenv-{env}")):
        pytest.skip(f"no AgentGym checkout at {AGENTGYM_DIR} (set AGENTGYM_DIR to AgentGym at 3ef9235): "
                    f"the {env} parity test needs AgentGym's own server")
    if not os.path.exists(venv_python(f"agentgym-{env}")):
        pytest.skip(f".venvs/agentgym-{env} is missing: run `bash scripts/setup_env.sh agentgym-{env}`")


def agentgym_fixture(env: str, scope: str = "module"):
    """A pytest fixture that yields a running AgentGymServer (skips with the reason when it cannot run)."""
    import pytest

    @pytest.fixture(scope=scope)
    def _reference():
        require_agentgym(env)
        with AgentGymServer(env) as proc:
            yield proc

    return _reference


def compare_in_threads(open_pair: Callable[[], Any], check_item: Callable[[Any, int], dict[str, str | None]],
                       items: list[int], threads: int) -> list[tuple[int, dict[str, str | None]]]:
    """``check_item(pair, item)`` -> {check: None when equal, else the first difference} for every item, ``threads``
    pairs of sessions at once (one per thread: both servers work while the test waits); each pair is
    ``open_pair()``'s, closed (``pair.close()``) after its share, also when a check raises. In item order."""
    def run(share: list[int]) -> list[tuple[int, dict]]:
        pair = open_pair()
        try:
            return [(item, check_item(pair, item)) for item in share]
        finally:
            pair.close()

    with ThreadPoolExecutor(threads) as pool:
        found = dict(r for share in pool.map(run, [items[k::threads] for k in range(threads)]) for r in share)
    return [(item, found[item]) for item in items]


def match_report(title: str, results: list[tuple[int, dict[str, str | None]]], checks: list[str]) -> list[str]:
    """Prints "check: equal/compared" per check (an item without that check was not compared on it) under ``title``
    and returns the differences, "data_idx I check: difference", in item order."""
    table = [f"{check}: {sum(r[check] is None for _, r in results if check in r)}/"
             f"{sum(check in r for _, r in results)}" for check in checks]
    print(f"\n{title}:\n  " + "\n  ".join(table))
    return [f"data_idx {item} {check}: {r[check][:600]}" for item, r in results for check in checks
            if r.get(check) is not None]
