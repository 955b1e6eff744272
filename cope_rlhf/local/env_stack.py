"""The environment side of a local run: the gateway, with the env server(s) it supervises.

    python -m env_gateway --host 127.0.0.1 --port 0 --spawn <env>='<.venvs/env>/bin/python -m
        env_gateway.servers.<env> --fd {fd}':<replicas>

``EnvStack`` starts that as one subprocess in its own process group (the gateway starts, restarts and stops its
replicas, each on a socket the gateway bound), reads the port the gateway bound from its log, waits until
``GET /v1/health`` says every env has a healthy replica (bounded), and on exit stops the whole group (SIGTERM, then
SIGKILL after 10 s) and closes its log. The gateway's and its replicas' output goes to ``log_path`` (written anew:
the port is read from it), else to a kept ``cope-gateway-*.log`` in the temp folder; errors name the file. With
``url`` given it only checks that gateway's health.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from typing import Optional

from env_gateway.process import GATEWAY_LISTENING, wait_listening

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gateway_health(url: str, timeout: float = 5.0) -> Optional[dict]:
    """The gateway's health body when every env has a healthy replica, else None."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/health", timeout=timeout) as r:
            body = json.loads(r.read())
            return body if body.get("status") == "ok" else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


class EnvStack:
    def __init__(self, env: str, url: Optional[str] = None, replicas: int = 1, startup_timeout: float = 120.0,
                 log_path: Optional[str] = None):
        self.env, self.url, self.replicas, self.startup_timeout = env, url, replicas, startup_timeout
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self.log = None

    def command(self) -> list:
        python = os.path.join(ROOT, ".venvs", self.env, "bin", "python")
        if not os.path.exists(python):
            raise FileNotFoundError(f"no venv for the {self.env} server at {python}: run "
                                    f"`bash scripts/setup_env.sh {self.env}`")
        server = f"{shlex.quote(python)} -m env_gateway.servers.{self.env} --fd {{fd}}"
        return [sys.executable, "-m", "env_gateway", "--host", "127.0.0.1", "--port", "0", "--no-uvloop",
                "--health-interval", "1", "--spawn", f"{self.env}={server}:{self.replicas}"]

    def __enter__(self) -> "EnvStack":
        if self.url:
            if gateway_health(self.url) is None:
                raise ConnectionError(f"the gateway at {self.url} is not healthy (GET /v1/health): start it, or "
                                      "drop --local.gateway_url to let the trainer start one")
            return self
        if self.log_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
            self.log = open(self.log_path, "w+b")  # read back for the port (log_text)
        else:
            self.log = tempfile.NamedTemporaryFile(prefix="cope-gateway-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.command(), cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self.url = wait_listening(self.proc, self.log, GATEWAY_LISTENING,
                                      lambda url: gateway_health(url, 2) is not None,
                                      f"the gateway for {self.env} (log: {self.log.name})", self.startup_timeout)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                    try:
                        os.killpg(self.proc.pid, sig)
                        self.proc.wait(timeout=wait)
                        break
                    except ProcessLookupError:
                        break
                    except subprocess.TimeoutExpired:
                        continue
        finally:
            if self.log is not None:
                self.log.close()
