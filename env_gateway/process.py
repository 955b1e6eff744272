"""A built-in environment server as a subprocess from its own venv, and a stdlib JSON client for it.

    with EnvServerProcess("babyai") as server:        # .venvs/babyai/bin/python -m env_gateway.servers.babyai
        env_id = server.ok("POST", "/create")["id"]   #   --host 127.0.0.1 --port 0, cwd = the repository root

The server binds a free port itself (``--port 0``) and logs it ("listening on http://127.0.0.1:PORT"); the port is
read from that line, so no other process can take it between choosing and binding. Start-up is bounded
(``startup_timeout``: the server must log its port and answer ``GET /``), and the process is stopped on exit
(SIGTERM, SIGKILL after 10 s), also when the block raises. ``call`` sends one JSON request with a timeout and returns
(status, decoded body), HTTP errors included. Stdlib only: scripts (make_demos, prepare_warm_start), benchmarks and
tests share it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTENING = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")
# the gateway's own line: its log also holds the lines of replicas it spawned, which say "listening on" too
GATEWAY_LISTENING = re.compile(rb"gateway listening on http://127\.0\.0\.1:(\d+)")


def venv_python(name: str) -> str:
    return os.path.join(ROOT, ".venvs", name, "bin", "python")


def call(base_url: str, method: str, path: str, body: dict | bytes | None = None, timeout: float = 30.0,
         content_type: str = "application/json") -> tuple[int, Any]:
    """One JSON request (``bytes`` are sent as they are); returns (status, decoded body). HTTP errors are returned,
    not raised."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url + path, data=data, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except json.JSONDecodeError:
            return e.code, raw.decode(errors="replace")


def stop_process(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; a no-op for a process that never started or already ended."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def log_text(log) -> bytes:
    """Everything a subprocess has written so far to ``log``, the file it was given as stdout/stderr. Read with
    ``pread``: the child writes through the same open file, so moving its offset (``seek(0)``) would make the
    child's next write land over what it wrote before."""
    chunks, offset = [], 0
    while chunk := os.pread(log.fileno(), 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def log_tail(log) -> str:
    """The last 5000 characters a subprocess wrote to its log file."""
    return log_text(log).decode(errors="replace")[-5000:]


def wait_listening(proc: subprocess.Popen, log, pattern: re.Pattern, ready: Callable[[str], bool], what: str,
                   timeout: float) -> str:
    """The URL of a server ``proc`` started with ``--port 0``, once it has logged the port it bound (``pattern``'s
    group 1, in the ``log`` file) and ``ready(url)`` holds. RuntimeError (with the log) if it exits first;
    TimeoutError after ``timeout`` seconds."""
    deadline, url = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail(log)}")
        if url is None:
            found = pattern.search(log_text(log))
            url = f"http://127.0.0.1:{int(found.group(1))}" if found else None
        try:
            if url is not None and ready(url):
                return url
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not {'become ready' if url else 'log its port'} within {timeout}s:\n"
                       f"{log_tail(log)}")


class EnvServerProcess:
    """A server subprocess on 127.0.0.1, on the port it chose; use as a context manager."""

    def __init__(self, name: str, *args: str, python: str | None = None, startup_timeout: float = 60.0):
        self.name, self.args = name, list(args)
        self.python = python or venv_python(name)
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()

    # what to run, where, and the log line that names the bound port (a subclass runs another server so)
    cwd = ROOT
    listening = LISTENING

    def command(self) -> list[str]:
        return [self.python, "-m", f"env_gateway.servers.{self.name}", "--host", "127.0.0.1", "--port", "0",
                *self.args]

    def __enter__(self) -> "EnvServerProcess":
        if not os.path.exists(self.python):
            raise FileNotFoundError(f"{self.python} not found: run `bash scripts/setup_env.sh {self.name}` first")
        self.proc = subprocess.Popen(self.command(), cwd=self.cwd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.url = wait_listening(self.proc, self.log, self.listening,
                                      lambda url: call(url, "GET", "/", timeout=2)[0] == 200, f"{self.name} server",
                                      self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.port = int(self.url.rsplit(":", 1)[1])
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        stop_process(self.proc)

    def output(self) -> str:
        return log_tail(self.log)

    def call(self, method: str, path: str, body: dict | bytes | None = None, timeout: float = 30.0,
             content_type: str = "application/json") -> tuple[int, Any]:
        return call(self.url, method, path, body, timeout, content_type)

    def ok(self, method: str, path: str, body: dict | None = None, timeout: float = 30.0) -> Any:
        """A request that must succeed: raises with the server's error body otherwise."""
        status, out = call(self.url, method, path, body, timeout)
        if status != 200:
            raise AssertionError(f"{method} {path} {body} -> {status} {out}")
        return out
