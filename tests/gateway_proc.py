"""``python -m env_gateway`` as a subprocess for the tests: ``GatewayProcess(*flags, envs={name: url})``.

It listens on 127.0.0.1 at the port it chose itself (``--port 0``, read from its "listening on" log line: no
free-port race), logs to a file (never a pipe that could fill), is started at once and waits (bounded) until
``/v1/health`` answers (``ready="answers"``) or answers 200 (``"healthy"``); ``stop()`` (also on leaving a with
block, and when start-up fails) sends SIGTERM, then SIGKILL after 20 s, and returns the exit code.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from typing import Any

from env_gateway.process import GATEWAY_LISTENING, ROOT, call, log_tail, wait_listening


class GatewayProcess:
    def __init__(self, *flags: str, envs: dict[str, str] | None = None, ready: str = "healthy",
                 startup_timeout: float = 30.0) -> None:
        cmd = [sys.executable, "-m", "env_gateway", "--host", "127.0.0.1", "--port", "0", *flags]
        for name, url in (envs or {}).items():
            cmd += ["--env", f"{name}={url}"]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.url = wait_listening(self.proc, self.log, GATEWAY_LISTENING, lambda url: call(
                url, "GET", "/v1/health", timeout=2)[0] == 200 or ready == "answers", "gateway", startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.port = int(self.url.rsplit(":", 1)[1])

    def output(self) -> str:
        return log_tail(self.log)

    def open_sessions(self) -> int:
        return call(self.url, "GET", "/v1/health", timeout=5)[1]["open_sessions"]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def __enter__(self) -> "GatewayProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
