"""``python -m env_gateway`` as users run it: --config YAML, --spawn with restarts, CLI errors, shutdown; and the
gateway in front of each real built-in env server whose venv exists (.venvs/<name>, scripts/setup_env.sh)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from env_gateway.client import GatewayClient
from env_gateway.fake_backend import ROOT, FakeBackendProcess
from tests.env_server_proc import EnvServerProcess, venv_python
from tests.gateway_proc import GatewayProcess
from tests.test_gateway import gateway, play, run

pytestmark = pytest.mark.timeout(90)


def get(url: str, timeout: float = 5) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_config_file_episode_and_clean_shutdown(tmp_path):
    with FakeBackendProcess("--episode-len", "3") as backend:
        cfg = tmp_path / "gateway.yaml"
        cfg.write_text(f"max_concurrency: 4\nsession_ttl: 300\nenvs:\n  mybaby:\n    adapter: babyai\n"
                       f"    urls: [{backend.url}]\n")
        with GatewayProcess("--config", str(cfg), "--max-sessions", "7", ready="healthy") as gw:
            _, envs = get(gw.url + "/v1/envs")
            assert envs["max_sessions"] == 7  # the flag wins over the file's default
            mybaby = envs["envs"]["mybaby"]
            assert mybaby["adapter"] == "babyai" and mybaby["replicas"][0]["max_concurrency"] == 4

            async def episodes():
                async with GatewayClient(gw.url) as client:
                    assert await play(client, "mybaby", 2) == (1.0, 3)
                    await client.create("mybaby", 5)  # left open: shutdown must close it on the backend
            run(episodes())
            assert gw.stop() == 0
        assert backend.stats()["open"] == 0 and backend.stats()["close"] == 2


def test_spawned_replicas_restart_after_dying():
    """``--fd {fd}``: the gateway binds each replica's socket and holds it, so while a replica is down no other
    process can take its port, and the restarted replica serves the same URL."""
    cmd = f"{sys.executable} -m env_gateway.fake_backend --fd {{fd}} --episode-len 2"
    with GatewayProcess("--spawn", f"fake:agentgym={cmd}:2", "--health-interval", "0.2", ready="healthy") as gw:
        deadline = time.monotonic() + 20
        while True:  # both replicas up
            _, envs = get(gw.url + "/v1/envs")
            replicas = envs["envs"]["fake"]["replicas"]
            if all(r["healthy"] for r in replicas) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(replicas) == 2 and all(r["healthy"] and r["pid"] for r in replicas)
        victim = replicas[0]
        assert "--fd" in open(f"/proc/{victim['pid']}/cmdline").read().split("\0")
        os.kill(victim["pid"], signal.SIGKILL)
        while os.path.exists(f"/proc/{victim['pid']}"):  # reaped by the gateway at once; restarted after 1 s
            time.sleep(0.01)
        with socket.socket() as intruder:  # the replica is dead: its port is still the gateway's
            intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind (TIME_WAIT is no bar)
            with pytest.raises(OSError, match="in use"):
                intruder.bind(("127.0.0.1", int(victim["url"].rsplit(":", 1)[1])))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            _, envs = get(gw.url + "/v1/envs")
            now = next(r for r in envs["envs"]["fake"]["replicas"] if r["url"] == victim["url"])
            if now["restarts"] == 1 and now["healthy"]:
                break
            time.sleep(0.1)
        assert now["restarts"] == 1 and now["healthy"] and now["pid"] != victim["pid"]

        async def episodes():
            async with GatewayClient(gw.url, timeout=20) as client:
                for item in range(4):
                    assert await play(client, "fake", item) == (1.0, 2)
        run(episodes())
        pids = [r["pid"] for r in envs["envs"]["fake"]["replicas"]]
        assert gw.stop() == 0
    for pid in pids:  # the gateway stopped its children
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.skipif(sys.platform != "linux", reason="replicas die with the gateway through prctl, Linux only")
def test_spawned_replicas_die_with_a_killed_gateway():
    """(Also the ``{port}`` form, for a server that can only bind a port itself.)"""
    cmd = f"{sys.executable} -m env_gateway.fake_backend --host 127.0.0.1 --port {{port}}"
    with GatewayProcess("--spawn", f"fake:agentgym={cmd}:2", "--health-interval", "0.2", ready="healthy") as gw:
        deadline = time.monotonic() + 20
        while True:
            _, envs = get(gw.url + "/v1/envs")
            pids = [r["pid"] for r in envs["envs"]["fake"]["replicas"]]
            if all(r["healthy"] for r in envs["envs"]["fake"]["replicas"]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for pid in pids:  # the launcher exec'd the server itself: the pid the gateway reports is the server's
            assert "env_gateway.fake_backend" in open(f"/proc/{pid}/cmdline").read()
        gw.proc.kill()  # no chance to stop its children
        gw.proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and
                 open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        time.sleep(0.1)
    assert not alive, f"replicas {alive} outlived their gateway"


@pytest.mark.parametrize("args,message", [
    ([], "no environments"),
    (["--env", "babyai"], "expected NAME=URL"),
    (["--env", "nethack=http://127.0.0.1:1"], "no adapter named 'nethack'"),
    (["--env", "babyai=127.0.0.1:1"], "must start with http://"),
    (["--spawn", "babyai=python -m x:2"], "must contain {fd}"),
    (["--spawn", "babyai=python -m x"], "expected NAME=CMD:N"),
    (["--config", "/nonexistent/gw.yaml"], "no such file"),
    (["--env", "babyai=http://127.0.0.1:1", "--max-concurrency", "0"], "max_concurrency must be >= 1"),
])
def test_cli_errors_say_what_to_fix(args, message):
    out = subprocess.run([sys.executable, "-m", "env_gateway", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_every_setting_is_a_flag_and_a_yaml_key_of_its_type(tmp_path):
    """One declaration per setting (config.setting): its flag and YAML key exist and parse to its type; an optional
    one (auth_token_file, default None) is taken from YAML too (it was coerced with type(None))."""
    from env_gateway.__main__ import build_parser, make_config
    from env_gateway.config import GatewayConfig, scalar_settings

    settings = scalar_settings()
    assert {"max_action_bytes", "read_timeout", "auth_token_file", "max_body", "session_ttl"} <= set(settings)
    assert settings["auth_token_file"] is str and settings["read_timeout"] is float
    help_text = build_parser().format_help()
    values = {int: "7", float: "2.5", str: "x"}
    for name, typ in settings.items():
        assert f"--{name.replace('_', '-')}" in help_text
        args = build_parser().parse_args(["--" + name.replace("_", "-"), values[typ]])
        assert getattr(make_config(args), name) == typ(values[typ])
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("auth_token_file: .secrets/gateway_token\nread_timeout: 3\nenvs: {babyai: http://127.0.0.1:1}\n")
    loaded = make_config(build_parser().parse_args(["--config", str(cfg)]))
    assert loaded.auth_token_file == ".secrets/gateway_token" and loaded.read_timeout == 3.0
    assert GatewayConfig().auth_token_file is None


# ---- the real built-in servers (issue 6), each from its own venv --------------------------------------------
BUILTIN = ["babyai", "sciworld", "textcraft", "alfworld", "searchqa"]
SERVER_ARGS = {"alfworld": ["--games", "tests/fixtures/alfworld"]}  # the small games the project ships


@pytest.mark.parametrize("name", BUILTIN)
def test_gateway_in_front_of_real_builtin_server(name):
    if not os.path.exists(venv_python(name)):
        pytest.skip(f".venvs/{name} is missing: run `bash scripts/setup_env.sh {name}` to test the gateway in front "
                    f"of the real {name} server")
    if not os.path.exists(os.path.join(ROOT, "env_gateway", "servers", f"{name}.py")):
        pytest.skip(f"env_gateway/servers/{name}.py does not exist yet")
    with EnvServerProcess(name, *SERVER_ARGS.get(name, []), startup_timeout=120) as server:
        async def main():
            async with gateway({name: [server.url]}, request_timeout=60) as (gw, url):
                async with GatewayClient(url) as client:
                    async with client.session(name, 0) as s:  # the server's expert, played through the gateway
                        first = s.observation
                        assert isinstance(first, str) and first.strip()
                        assert server.ok("GET", "/")["instances"] == 1
                        instance = gw.sessions[s.id].handle["id"]
                        while not s.done and s.steps < 100:
                            action = server.ok("GET", f"/expert?id={instance}")["action"]
                            await s.step(action)
                        assert s.done and s.reward > 0, (s.steps, s.observation)
                    async with client.session(name, 0) as again:
                        assert again.observation == first  # the same item gives the same first observation
                        r = await again.step("xyzzy: not an action")  # invalid: an observation, not a 5xx
                        assert isinstance(r.observation, str) and r.observation.strip() and r.reward == 0
            assert server.ok("GET", "/")["instances"] == 0  # both closed on the backend
        run(main(), timeout=80)


def test_connections_that_send_no_whole_request_are_closed_after_read_timeout():
    """Idle connections, and ones that dribble their headers, were held 75 s (aiohttp's default keep-alive)."""
    with FakeBackendProcess() as backend:
        gw = GatewayProcess("--env", f"babyai={backend.url}", "--read-timeout", "1")
        try:
            idle = socket.create_connection(("127.0.0.1", gw.port))
            slow = socket.create_connection(("127.0.0.1", gw.port))
            slow.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends them
            for conn in (idle, slow):
                conn.settimeout(10)  # aiohttp's own keep-alive would hold them 75 s: recv times out then
                assert conn.recv(100) == b""  # closed by the gateway
                conn.close()
        finally:
            gw.stop()


def test_a_server_given_a_bad_fd_says_what_fd_is_for():
    out = subprocess.run([sys.executable, "-m", "env_gateway.fake_backend", "--fd", "987"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "--fd 987: not an open socket" in out.stderr and "--port" in out.stderr
    out = subprocess.run([sys.executable, "-m", "env_gateway.fake_backend"], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2 and "give --port" in out.stderr


def test_reading_a_servers_log_while_it_writes_loses_nothing(tmp_path):
    """wait_listening / log_tail read the file a server writes its log to. The server writes through the same open
    file (and offset): reading by seek(0) + read made its next write land over its earlier lines."""
    from env_gateway.process import log_tail, log_text

    lines = 100_000
    with open(tmp_path / "log", "w+b") as log:
        writer = subprocess.Popen([sys.executable, "-c", f"import sys\nfor i in range({lines}): "
                                   "sys.stdout.write(f'{i:07d}\\n'); sys.stdout.flush()"], stdout=log)
        reads = 0
        try:
            while writer.poll() is None or reads == 0:
                log_tail(log)
                reads += 1
        finally:
            writer.kill()  # a no-op once it has ended; a failing read leaves no writer behind
        assert writer.wait(timeout=60) == 0
        assert log_text(log) == b"".join(b"%07d\n" % i for i in range(lines)), f"after {reads} reads"
