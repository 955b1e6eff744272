"""The tests' side of the built-in env servers: ``EnvServerProcess`` and ``call`` (env_gateway/process.py,
shared with the scripts), episode helpers that drive the AgentGym protocol (``expert_episode``, ``replay``,
``check_no_cross_talk``, ``check_crafted_actions``), and pytest helpers (``require_venv``, ``server_fixture``) that
skip with a clear reason when a server's venv has not been built, a port nothing listens on (``refusing_port``), and
the check that a script stopped by SIGTERM stops the processes it started (``check_sigterm_stops``).

Run by a server's own venv (``.venvs/<name>/bin/python -m pytest ...``, as ``scripts/mutation_test.sh`` runs the
BabyAI server's tests), ``server_fixture`` serves in this process instead (``InProcessServer``): the same app on a
thread's event loop, so a tool that watches calls in process (mutmut) sees which test reaches which function.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import io
import logging
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from env_gateway.process import (ROOT, EnvServerProcess, call, log_tail, stop_process,  # noqa: F401
                                       venv_python)


@contextlib.contextmanager
def refusing_port() -> Iterator[socket.socket]:
    """A socket bound to a free port of 127.0.0.1 and not listening: while it is held, a connection there is refused
    (an address where nothing listens) and no other process can take the port. ``listen()`` on it (or hand it to a
    server) to serve there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s


def expert_episode(server: EnvServerProcess, data_idx: int, max_turns: int = 200
                   ) -> tuple[dict, list[tuple[str, dict]]]:
    """create, reset, GET /expert -> POST /step until done or max_turns, close: (reset reply, [(action, reply)])."""
    env_id = server.ok("POST", "/create")["id"]
    try:
        first = server.ok("POST", "/reset", {"id": env_id, "data_idx": data_idx})
        steps, last = [], first
        while not last.get("done") and len(steps) < max_turns:
            action = server.ok("GET", f"/expert?id={env_id}")["action"]
            last = server.ok("POST", "/step", {"id": env_id, "action": action})
            steps.append((action, last))
        return first, steps
    finally:
        server.call("POST", "/close", {"id": env_id})


def replay(server: EnvServerProcess, data_idx: int, actions: list[str], barrier: threading.Barrier | None = None
           ) -> list[dict]:
    """create, reset, [wait for every other session to exist], step each action, close: the replies in order."""
    env_id = server.ok("POST", "/create")["id"]
    try:
        replies = [server.ok("POST", "/reset", {"id": env_id, "data_idx": data_idx})]
        if barrier is not None:
            barrier.wait(timeout=60)
        for action in actions:
            replies.append(server.ok("POST", "/step", {"id": env_id, "action": action}))
        return replies
    finally:
        server.call("POST", "/close", {"id": env_id})


def concurrent_replays(server: EnvServerProcess, jobs: list[tuple[int, list[str]]]) -> list[list[dict]]:
    """Every (data_idx, actions) job in its own session, all sessions open at once (one thread each)."""
    barrier = threading.Barrier(len(jobs))
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(replay, server, idx, actions, barrier) for idx, actions in jobs]
        return [f.result(timeout=120) for f in futures]


def check_no_cross_talk(server: EnvServerProcess, data_indices: list[int], steps: int) -> None:
    """The first ``steps`` expert actions of each item, replayed in concurrent sessions, give exactly the replies
    a session alone got: no errors, and no session sees another's state."""
    jobs, expected = [], []
    for idx in data_indices:
        first, episode = expert_episode(server, idx, max_turns=steps)
        jobs.append((idx, [a for a, _ in episode]))
        expected.append([first, *(reply for _, reply in episode)])
    got = concurrent_replays(server, jobs)
    for (idx, _), want, have in zip(jobs, expected, got):
        assert have == want, f"data_idx {idx}: concurrent session diverged from the lone run"
    assert server.ok("GET", "/")["instances"] == 0


def check_crafted_actions(server: EnvServerProcess, reset: dict, actions: list[str]) -> list[dict]:
    """Each action, stepped on one reset instance while another thread asks for health, answers fast: in the best of
    3 tries the step takes under 100 ms and the slowest health answer meanwhile too (an env's parser that
    backtracks holds the GIL, so health stalls as long, in every try; one try may meet a scheduling hiccup).
    Returns each action's (last) reply; the instance is closed."""
    env_id = server.ok("POST", "/create")["id"]
    server.ok("POST", "/reset", {"id": env_id, **reset})
    replies = []
    for action in actions:
        step_s, health_s, reply = [], [], None
        for _ in range(3):
            done, polled = threading.Event(), []

            def poll_health() -> None:  # at least once, until the step has answered
                while not (polled and done.is_set()):
                    t0 = time.perf_counter()
                    server.ok("GET", "/", timeout=10)
                    polled.append(time.perf_counter() - t0)

            poller = threading.Thread(target=poll_health)
            poller.start()
            t0 = time.perf_counter()
            try:
                reply = server.ok("POST", "/step", {"id": env_id, "action": action}, timeout=60)
            finally:
                step_s.append(time.perf_counter() - t0)
                done.set()
                poller.join(timeout=60)
                health_s.append(max(polled))
        assert min(step_s) < 0.1, f"a {len(action)}-character action took {min(step_s):.3f} s at best: {action[:40]!r}"
        assert min(health_s) < 0.1, f"health took {min(health_s):.3f} s at best during a {len(action)}-character action"
        replies.append(reply)
    server.ok("POST", "/close", {"id": env_id})
    return replies


def require_venv(name: str) -> None:
    import pytest

    if not os.path.exists(venv_python(name)):
        pytest.skip(f".venvs/{name} is missing: run `bash scripts/setup_env.sh {name}` to test the {name} server")


class InProcessServer(EnvServerProcess):
    """``EnvServerProcess(name, *args)``'s server (built from the same command line by ``build_server``), served in
    this process: its app on an event loop in a thread, on a free port of 127.0.0.1; ``output()`` is what it logged.
    Needs the server's packages importable here, i.e. the server's own venv."""

    def __enter__(self) -> "InProcessServer":
        from aiohttp import web

        from env_gateway.servers._base import EnvServer, bound_socket, build_server, http_settings

        module = importlib.import_module(f"env_gateway.servers.{self.name}")
        server_cls = next(c for c in vars(module).values()
                          if isinstance(c, type) and issubclass(c, EnvServer) and c.name == self.name)
        server, _ = build_server(server_cls, self.args)
        sock, self.port = bound_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.port}"
        self.logged = io.StringIO()
        self.handler = logging.StreamHandler(self.logged)
        self.logger = logging.getLogger("env_gateway")
        self.logger.addHandler(self.handler)
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.loop = asyncio.new_event_loop()
        runner = web.AppRunner(server.app(), **http_settings(server.read_timeout))
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.SockSite(runner, sock).start())

        def serve() -> None:  # until stop(); then aiohttp's shutdown, which closes every instance
            asyncio.set_event_loop(self.loop)
            self.loop.run_forever()
            self.loop.run_until_complete(runner.cleanup())
            self.loop.close()

        self.thread = threading.Thread(target=serve, name=f"{self.name} server", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=60)
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)

    def output(self) -> str:
        return self.logged.getvalue()[-5000:]


def runs_in_own_venv(name: str) -> bool:
    """Whether this interpreter is .venvs/<name>'s, the one its server runs in."""
    return os.path.realpath(sys.prefix) == os.path.realpath(os.path.dirname(os.path.dirname(venv_python(name))))


def server_fixture(name: str, *args: str, scope: str = "module"):
    """A pytest fixture that yields a running EnvServerProcess (skips when .venvs/<name> is missing), or an
    InProcessServer when the tests run in .venvs/<name> itself."""
    import pytest

    @pytest.fixture(scope=scope)
    def _server():
        require_venv(name)
        with (InProcessServer if runs_in_own_venv(name) else EnvServerProcess)(name, *args) as proc:
            yield proc

    return _server


def check_sigterm_stops(proc, started: list, timeout: float = 30.0) -> None:
    """SIGTERM to ``proc`` (a Popen of a script that starts env servers and the like): it exits with 128 + SIGTERM
    and every process of ``started`` (psutil.Process) is gone within ``timeout``. Whatever the outcome, nothing is left
    running: all of them are killed on the way out."""
    import signal

    import psutil

    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=timeout * 3) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(started, timeout=timeout)
        assert not alive, f"left running: {[' '.join(p.cmdline())[:120] for p in alive]}"
    finally:
        for process in [proc, *started]:
            with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                process.kill()
        proc.wait()


if __name__ == "__main__":  # manual smoke run: python tests/env_server_proc.py NAME
    with EnvServerProcess(sys.argv[1], *sys.argv[2:]) as p:
        print(p.ok("GET", "/"))
