"""The env servers' shared base (env_gateway/servers/_base.py) on a counter env, with no env package, in process (so
that mutmut's copy of the tree runs it): the AgentGym protocol word for word, every refusal (4xx) and an env failure
(500, redacted), invalid actions the env never sees, read deadlines (headers, body, idle connections;
``--read-timeout``), a full server's 503, the idle-instance reaper, shutdown, the command line (``serve``), and the
helpers (secret files, redaction, integer fields, bound sockets, ``short``).

``Counter`` is the smallest ``EnvServer`` with every hook: an episode counts the steps whose action is "up" (the
expert's action; "boom" raises). ``Bare`` has only the required calls, so the base class's defaults answer. In
process (``serve_inprocess``, the app as ``serve`` runs it) and as its own process through ``serve``
(``CounterProcess``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from env_gateway.servers import _base
from env_gateway.secret_file import SECRETS, read_secret_file, redact
from env_gateway.servers._base import EnvServer, Instance, RequestError, http_settings, integer_field, read_body, short
from env_gateway.process import EnvServerProcess
from tests.test_gateway import run, until

pytestmark = pytest.mark.timeout(60)


class Counter(EnvServer):
    name = "counter"

    def __init__(self, max_instances: int = 256, workers: int = 8, start: int = 0) -> None:
        super().__init__(max_instances, workers)
        self.start, self.steps, self.closed = start, 0, []

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--start", type=int, default=0)

    def new_env(self) -> dict:
        return {"item": None, "count": self.start}

    def reset(self, env: dict, data_idx: int) -> dict:
        env.update(item=data_idx, count=0)
        return {"observation": f"item {data_idx}: count 0"}

    def step(self, env: dict, action: str) -> dict:
        self.steps += 1
        if action == "boom":
            raise RuntimeError(f"the env broke, key sk-secret-123 {'x' * 600}")
        env["count"] += action == "up"
        return {"observation": f"item {env['item']}: count {env['count']}", "reward": float(env["count"]),
                "done": env["count"] >= 3}

    def observation(self, env: dict) -> str:
        return f"item {env['item']}: count {env['count']}"

    def expert_action(self, env: dict) -> str:
        return "up" if env["count"] < 3 else "stop"

    def invalid_action(self, env: dict, reason: str) -> dict:
        return {"observation": f"Invalid action: {reason}", "reward": 0.0, "done": False, "count": env["count"]}

    def close_env(self, env: dict) -> None:
        self.closed.append(env["item"])
        if env["item"] == "fail":
            raise RuntimeError("cannot close")

    def item_ids(self, split: str) -> list[int]:
        if split not in ("train", "test"):
            raise RequestError(400, "bad_split", f"no split {split!r}: train or test")
        return [0, 1, 2] if split == "train" else [97, 98, 99]

    def num_items(self) -> int:
        return 100

    def reset_fields(self, data: dict) -> dict:
        return {**data, "data_idx": data["level"]} if "level" in data else data


class Bare(EnvServer):
    """Only the required calls: the base class answers the rest."""

    name = "bare"

    def new_env(self) -> list:
        return []

    def reset(self, env: list, data_idx: int) -> dict:
        return {"observation": f"item {data_idx}"}

    def step(self, env: list, action: str) -> dict:
        env.append(action)
        self.thread = threading.current_thread().name
        return {"observation": action, "reward": 0, "done": False}

    def observation(self, env: list) -> str:
        return " ".join(env)


@contextlib.asynccontextmanager
async def serve_inprocess(server: EnvServer) -> AsyncIterator[str]:
    """``server``'s app on a port of 127.0.0.1 in the running loop, with ``serve``'s deadlines: its URL."""
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=0.5, **http_settings(server.read_timeout))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


class CounterProcess(EnvServerProcess):
    """``serve(Counter, argv)`` as its own process (the entry point every server module runs)."""

    def __init__(self, *args: str) -> None:
        super().__init__("counter", *args, python=sys.executable, startup_timeout=30)

    def command(self) -> list[str]:
        return [self.python, "-c", "import sys; from env_gateway.servers._base import serve; "
                                   "from tests.test_server_base import Counter; serve(Counter, sys.argv[1:])",
                "--host", "127.0.0.1", "--port", "0", *self.args]


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sends until it closes the connection, which it must within ``seconds``."""
    return await asyncio.wait_for(reader.read(), seconds)


async def slow_body_answer(url: str, seconds: float) -> tuple[float, bytes]:
    """Send a POST /step whose body never ends: (seconds until the server answered and closed, the answer)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                 b'{"id": 0, ')
    await writer.drain()
    t0 = time.monotonic()
    answer = await closed_within(reader, seconds)
    writer.close()
    return time.monotonic() - t0, answer


def test_a_body_that_does_not_arrive_in_time_is_a_408():
    """Was: a slow body to POST /step held the connection and the handler with no end (100 s and counting)."""
    async def main():
        server = Counter()
        server.read_timeout = 0.3
        async with serve_inprocess(server) as url:
            took, answer = await slow_body_answer(url, 5)
            assert answer.startswith(b"HTTP/1.1 408 ") and 0.25 < took < 3, (took, answer)
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {
                "error": "body_timeout", "detail": "the request body did not arrive within 0.3s (--read-timeout): "
                                                   "send it at once"}
    run(main())


def test_serve_closes_slow_headers_idle_connections_and_slow_bodies_at_the_read_timeout():
    """Was: no read deadline: slow headers and idle connections held 76 s, slow bodies to POST /step 100 s+."""
    with CounterProcess("--read-timeout", "0.5") as server:
        async def main():
            host, port = server.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            await writer.drain()
            t0 = time.monotonic()
            await closed_within(reader, 5)
            assert time.monotonic() - t0 < 3
            writer.close()

            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # one request, then idle
            await writer.drain()
            answer = await closed_within(reader, 5)
            assert answer.startswith(b"HTTP/1.1 200 ") and b'"env": "counter"' in answer
            writer.close()

            took, answer = await slow_body_answer(server.url, 5)
            assert answer.startswith(b"HTTP/1.1 408 ") and took < 3, (took, answer)
        run(main())
        assert server.ok("POST", "/create") == {"id": 0}  # the server serves on


@pytest.mark.parametrize("flag", ["--read-timeout", "--instance-ttl"])
def test_a_deadline_that_is_not_positive_is_refused(flag):
    with pytest.raises(RuntimeError, match=f"{flag} must be > 0 seconds, got 0.0"):
        with CounterProcess(flag, "0"):
            pass


# ---- the protocol, in process ---------------------------------------------------------------------------------------
async def call(url: str, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        async with http.request(method, url + path, data=data, timeout=aiohttp.ClientTimeout(total=10)) as r:
            return r.status, await r.json(content_type=None)


def test_the_protocol_word_for_word():
    async def main():
        server = Counter(max_instances=5)
        async with serve_inprocess(server) as url:
            assert await call(url, "GET", "/") == (200, {"status": "ok", "env": "counter", "instances": 0,
                                                           "max_instances": 5})
            assert await call(url, "POST", "/create") == (200, {"id": 0})
            assert await call(url, "POST", "/create") == (200, {"id": 1})  # ids are never reused
            assert (await call(url, "GET", "/"))[1]["instances"] == 2
            assert await call(url, "POST", "/reset", {"id": 1, "data_idx": 7}) == (200, {"observation": "item 7: "
                                                                                                "count 0"})
            assert await call(url, "POST", "/reset", {"id": 0, "data_idx": 0}) == (200, {"observation": "item 0: "
                                                                                                 "count 0"})
            assert await call(url, "POST", "/reset", {"id": 0, "level": "5"}) == (200, {"observation": "item 5: "
                                                                                               "count 0"})
            assert await call(url, "GET", "/expert?id=1") == (200, {"action": "up"})
            assert await call(url, "POST", "/step", {"id": 1, "action": "up"}) == (
                200, {"observation": "item 7: count 1", "reward": 1.0, "done": False})
            assert await call(url, "GET", "/observation?id=1") == (200, {"observation": "item 7: count 1"})
            assert await call(url, "GET", "/items") == (200, {"env": "counter", "split": "train",
                                                              "item_ids": [0, 1, 2]})
            assert await call(url, "GET", "/items?split=test") == (200, {"env": "counter", "split": "test",
                                                                         "item_ids": [97, 98, 99]})
            assert await call(url, "POST", "/step", {"id": 1, "action": "x" * 5000}) == (200, {
                "observation": "Invalid action: the action is 5000 characters long, over the 4096 this counter server "
                               "takes. Answer with one short command.", "reward": 0.0, "done": False, "count": 1})
            assert await call(url, "POST", "/close", {}) == (400, {"error": "missing_field",
                                                                    "detail": "required field(s) missing: id"})
            assert await call(url, "POST", "/close", {"id": 1}) == (200, {"closed": 1})
            assert server.closed == [7] and list(server.instances) == [0]
            assert await call(url, "POST", "/step", {"id": 1, "action": "up"}) == (404, {
                "error": "unknown_id", "detail": "no counter instance 1: create one with POST /create (instances "
                                                 "untouched for 3600s are closed)"})
        assert server.closed == [7, 5]  # shutdown closed the one left open
        assert server.instances == {}
    run(main())


@pytest.mark.parametrize("method,path,body,status,error,detail", [
    ("POST", "/reset", b"{bad", 400, "bad_json", "the request body must be a JSON object (Expecting property name "
                                                 "enclosed in double quotes: line 1 column 2 (char 1))"),
    ("POST", "/reset", b"[1]", 400, "bad_json", "the request body must be a JSON object"),
    ("POST", "/reset", b"\xff\xfe{", 400, "bad_json", None),
    ("POST", "/step", b'{"id": 0, "action": NaN}', 400, "bad_json",
     "the request body must be a JSON object (NaN is not a JSON number: send finite numbers)"),
    ("POST", "/step", b"[" * 100_000 + b"]" * 100_000, 400, "bad_json",
     "the request body nests deeper than the JSON parser takes: send a flat JSON object"),
    ("POST", "/reset", b'{"data_idx": 1}', 400, "missing_field", "required field(s) missing: id"),
    ("POST", "/step", b"{}", 400, "missing_field", "required field(s) missing: id, action"),
    ("POST", "/reset", b'{"id": 0}', 400, "missing_field", "required field(s) missing: data_idx"),
    ("POST", "/reset", b'{"id": true, "data_idx": 1}', 400, "bad_id", "'id' must be an integer, got True"),
    ("POST", "/reset", b'{"id": 0, "data_idx": 1.5}', 400, "bad_data_idx", "'data_idx' must be an integer, got 1.5"),
    ("POST", "/reset", b'{"id": 0, "data_idx": 100}', 400, "bad_data_idx", "'data_idx' 100 is out of range [0, 100)"),
    ("POST", "/reset", b'{"id": 0, "data_idx": -1}', 400, "bad_data_idx", "'data_idx' -1 is out of range [0, 100)"),
    ("POST", "/reset", b'{"id": 9, "data_idx": 1}', 404, "unknown_id",
     "no counter instance 9: create one with POST /create (instances untouched for 3600s are closed)"),
    ("POST", "/step", b'{"id": 0, "action": 3}', 400, "bad_action", "'action' must be a string"),
    ("POST", "/step", b'{"id": 0, "action": "up"}', 409, "not_reset", "instance 0 has not been reset: POST /reset "
                                                                      "first"),
    ("GET", "/expert?id=0", None, 409, "not_reset", "instance 0 has not been reset: POST /reset first"),
    ("GET", "/expert", None, 400, "bad_id", "'id' must be an integer, got None"),
    ("GET", "/observation?id=1e3", None, 400, "bad_id", "'id' must be an integer, got '1e3'"),
    ("GET", "/observation?id=%EF%BC%91", None, 400, "bad_id", "'id' must be an integer, got '１'"),
    ("GET", "/items?split=dev", None, 400, "bad_split", "no split 'dev': train or test"),
    ("POST", "/close", b'{"id": "0x"}', 400, "bad_id", "'id' must be an integer, got '0x'"),
    ("GET", "/nope", None, 404, "Not Found", "GET /nope: 404: Not Found"),
    ("PUT", "/create", None, 405, "Method Not Allowed", "PUT /create: 405: Method Not Allowed"),
])
def test_every_refusal_is_json_word_for_word(method, path, body, status, error, detail):
    async def main():
        server = Counter()
        async with serve_inprocess(server) as url:
            assert await call(url, "POST", "/create") == (200, {"id": 0})
            got, answer = await call(url, method, path, raw=body)
            assert (got, answer["error"]) == (status, error), answer
            if detail is not None:
                assert answer["detail"] == detail
            assert server.steps == 0 and list(server.instances) == [0]  # refused before the env
            assert await call(url, "POST", "/reset", {"id": 0, "data_idx": 3}) == (200, {"observation": "item 3: "
                                                                                                "count 0"})
    run(main())


def test_the_base_class_defaults():
    server = Bare()
    async def main():
        async with serve_inprocess(server) as url:
            assert await call(url, "POST", "/create") == (200, {"id": 0})
            assert await call(url, "POST", "/reset", {"id": 0, "data_idx": 10**9}) == (200, {"observation":
                                                                                                 "item 1000000000"})
            assert await call(url, "GET", "/expert?id=0") == (404, {"error": "no_expert", "detail": "the bare server "
                                                                                                    "has no expert"})
            assert await call(url, "GET", "/items") == (404, {"error": "no_items", "detail": "the bare server does not "
                                                                                             "list item ids"})
            assert await call(url, "POST", "/step", {"id": 0, "action": "a" * 4097}) == (200, {
                "observation": "Invalid action: the action is 4097 characters long, over the 4096 this bare server "
                               "takes. Answer with one short command.", "reward": 0, "done": False})
            assert await call(url, "POST", "/step", {"id": 0, "action": "a" * 4096}) == (200, {
                "observation": "a" * 4096, "reward": 0, "done": False})
            assert await call(url, "POST", "/step", {"id": "0", "action": "née"}) == (200, {
                "observation": "née", "reward": 0, "done": False})
            assert await call(url, "POST", "/step", raw=b'{"id": 0, "action": "go \\ud800 west"}') == (200, {
                "observation": "Invalid action: the action holds a lone surrogate at position 3, which is not text. "
                               "Answer in text.", "reward": 0, "done": False})
            assert await call(url, "GET", "/observation?id=0") == (200, {"observation": "a" * 4096 + " née"})
            assert server.thread.startswith("bare-env_")  # env calls run in the server's own pool

    server = Bare()
    assert (server.max_instances, server.pool._max_workers) == (256, 8)
    with pytest.raises(NotImplementedError):
        EnvServer().new_env()
    for call_ in (lambda s: s.reset(None, 0), lambda s: s.step(None, "x"), lambda s: s.observation(None)):
        with pytest.raises(NotImplementedError):
            call_(EnvServer())
    assert EnvServer().num_items() is None and EnvServer().close_env(None) is None and EnvServer().extra_routes() == []
    assert EnvServer().reset_fields({"a": 1}) == {"a": 1}
    run(main())


def test_an_env_failure_is_a_500_that_names_the_env_and_keeps_secrets(caplog):
    SECRETS.add("sk-secret-123")

    async def main():
        async with serve_inprocess(Counter()) as url:
            await call(url, "POST", "/create")
            await call(url, "POST", "/reset", {"id": 0, "data_idx": 1})
            got, answer = await call(url, "POST", "/step", {"id": 0, "action": "boom"})
            assert (got, answer["error"]) == (500, "env_failure")
            assert answer["detail"] == ("counter: " + f"RuntimeError: the env broke, key [redacted] {'x' * 600}"[:500])
            assert (await call(url, "POST", "/step", {"id": 0, "action": "up"}))[0] == 200  # it serves on

    try:
        with caplog.at_level(logging.ERROR, logger="env_gateway.servers"):
            run(main())
    finally:
        SECRETS.discard("sk-secret-123")
    logged = "\n".join(caplog.messages)
    assert logged.startswith("counter: POST /step failed\nTraceback (most recent call last):")
    assert "[redacted]" in logged and "sk-secret-123" not in logged and logged.endswith("x" * 10)


def test_a_full_server_answers_503_full():
    """What the gateway reads as "retry later" (tests/test_gateway_hostile.py)."""
    async def main():
        async with serve_inprocess(Counter(max_instances=1)) as url:
            assert await call(url, "POST", "/create") == (200, {"id": 0})
            assert await call(url, "POST", "/create") == (503, {
                "error": "full", "detail": "counter server holds its maximum of 1 instances: close some, or start "
                                           "another replica"})
            assert await call(url, "POST", "/close", {"id": 0}) == (200, {"closed": 0})
            assert await call(url, "POST", "/create") == (200, {"id": 1})
    run(main())


def test_a_body_from_a_client_that_left_is_a_400():
    class Gone:
        app: dict = {}

        async def read(self) -> bytes:
            raise ConnectionResetError

    with pytest.raises(RequestError) as e:
        asyncio.run(read_body(Gone()))
    assert (e.value.status, e.value.error, e.value.detail) == (400, "client_disconnected", "the client closed the "
                                                                                          "connection before the body "
                                                                                          "ended")
    assert str(e.value) == "client_disconnected: the client closed the connection before the body ended"


# ---- the idle-instance reaper ---------------------------------------------------------------------------------------
def test_the_reaper_closes_what_is_idle_and_free_and_goes_on_when_a_close_fails(monkeypatch, caplog):
    now = [1000.0]
    monkeypatch.setattr(_base.time, "monotonic", lambda: now[0])
    slept: list[float] = []

    async def main():
        locked = Instance("locked", last_used=0.0)
        await locked.lock.acquire()
        instances = {1: Instance("old", last_used=10.0), 2: Instance("fresh", last_used=995.0), 3: locked,
                     4: Instance("bad", last_used=989.0), 5: Instance("edge", last_used=990.0),
                     6: Instance("closed by a request meanwhile", last_used=0.0)}
        closed: list[str] = []

        async def close(inst: Instance) -> None:
            closed.append(inst.env)
            if inst.env == "old":
                del instances[6]  # a request's close, while this one ran
            if inst.env == "bad":
                raise RuntimeError("cannot close")

        async def one_tick(delay: float) -> None:
            slept.append(delay)
            if len(slept) > 1:
                raise asyncio.CancelledError

        monkeypatch.setattr(_base.asyncio, "sleep", one_tick)
        with pytest.raises(asyncio.CancelledError):
            await _base.reap_idle("counter", instances, 10.0, close)
        return closed, instances

    with caplog.at_level(logging.INFO, logger="env_gateway.servers"):
        closed, instances = asyncio.run(main())
    assert closed == ["old", "bad"] and sorted(instances) == [2, 3, 5]
    assert slept == [2.5, 2.5]
    assert "counter: closing instance 1, untouched for 990s (--instance-ttl)" in caplog.messages
    assert "counter: closing idle instance 4 failed" in caplog.messages
    slept.clear()

    async def once(delay: float) -> None:
        slept.append(delay)
        raise asyncio.CancelledError

    monkeypatch.setattr(_base.asyncio, "sleep", once)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_base.reap_idle("counter", {}, 3600.0, close=None))
    assert slept == [30.0]  # at most every 30 s


def test_a_request_marks_its_instance_used_and_the_app_reaps_at_its_ttl(monkeypatch):
    async def main():
        server = Counter()
        server.instance_ttl = 0.6
        async with serve_inprocess(server) as url:
            t0 = time.monotonic()  # instance 0 is last used after this
            await call(url, "POST", "/create")
            await call(url, "POST", "/create")
            await call(url, "POST", "/reset", {"id": 1, "data_idx": 4})
            while not server.closed:  # instance 1 stays in use; instance 0 goes idle past its TTL and is closed
                assert time.monotonic() - t0 < 10
                await asyncio.sleep(0.05)
                await call(url, "GET", "/observation?id=1")
            assert time.monotonic() - t0 >= 0.6  # not before its TTL
            assert list(server.instances) == [1] and server.closed == [None]
    run(main())


# ---- the command line -----------------------------------------------------------------------------------------------
def test_serve_builds_the_server_from_its_flags(monkeypatch):
    ran: dict = {}

    def fake_run_app(app: web.Application, **kw: Any) -> None:
        ran.update(kw, app=app)
        kw["print"]("ignored")

    monkeypatch.setattr(_base.web, "run_app", fake_run_app)
    made: list[Counter] = []
    monkeypatch.setattr(Counter, "app", lambda self: made.append(self) or "the app")
    _base.serve(Counter, ["--port", "0", "--max-instances", "3", "--workers", "2", "--instance-ttl", "7.5",
                          "--read-timeout", "2.5", "--start", "4"])
    server = made[0]
    assert (server.max_instances, server.pool._max_workers, server.start) == (3, 2, 4)
    assert (server.instance_ttl, server.read_timeout) == (7.5, 2.5)
    assert ran["app"] == "the app" and ran["keepalive_timeout"] == 2.5 and ran["lingering_time"] == 0
    assert ran["sock"].getsockname()[0] == "127.0.0.1"
    ran["sock"].close()
    _base.serve(Counter, ["--port", "0"])
    assert (made[1].max_instances, made[1].instance_ttl, made[1].read_timeout) == (256, 3600.0, 10.0)
    assert ran["keepalive_timeout"] == 10.0
    ran["sock"].close()
    for flag in ("--instance-ttl", "--read-timeout"):
        for value in ("0", "-1"):
            with pytest.raises(SystemExit):
                _base.serve(Counter, ["--port", "0", flag, value])


def test_http_settings_bound_headers_idle_and_lingering():
    assert http_settings(3.0) == {"keepalive_timeout": 3.0, "lingering_time": 0}


# ---- helpers ------------------------------------------------------------------------------------------------------
def test_read_secret_file_takes_one_private_line_and_refuses_the_rest(tmp_path):
    def secret(name: str, text: str, mode: int = 0o600) -> str:
        path = tmp_path / name
        path.write_text(text)
        path.chmod(mode)
        return str(path)

    try:
        assert read_secret_file(secret("ok", "\n  tok-1  \n\n")) == "tok-1" and "tok-1" in SECRETS
        assert redact("a tok-1 b tok-1") == "a [redacted] b [redacted]"
        with pytest.raises(ValueError, match=f"^no file {tmp_path}/missing$"):
            read_secret_file(str(tmp_path / "missing"))
        with pytest.raises(ValueError, match=f"^{tmp_path}/empty is empty$"):
            read_secret_file(secret("empty", "\n \n"))
        with pytest.raises(ValueError, match=f"^{tmp_path}/two has 2 lines: it must hold the secret alone, on one "
                                             "line$"):
            read_secret_file(secret("two", "a\nb\n"))
        for mode in (0o640, 0o604, 0o610):
            with pytest.raises(ValueError, match=rf"can be read by others \(mode {mode:o}\): run `chmod 600 "):
                read_secret_file(secret("open", "x", mode))
        outside = tmp_path / "elsewhere"
        outside.mkdir()
        target = secret("elsewhere/real", "tok-2")
        (tmp_path / "link").symlink_to(target)
        with pytest.raises(ValueError, match=f"^{tmp_path}/link is a symlink out of its folder \\(to {target}\\): "
                                             f"copy the secret into {tmp_path} instead$"):
            read_secret_file(str(tmp_path / "link"))
        (tmp_path / "near").symlink_to(tmp_path / "ok")  # a link within its folder is fine
        assert read_secret_file(str(tmp_path / "near")) == "tok-1"
    finally:
        SECRETS.discard("tok-1")
    assert redact("tok-1") == "tok-1"


@pytest.mark.parametrize("raw,value", [(12, 12), ("12", 12), ("007", 7), (0, 0)])
def test_integer_fields_take_ints_and_ascii_digits(raw, value):
    assert integer_field(raw, "id", "bad_id") == value


@pytest.mark.parametrize("raw", [True, 1.0, "1e3", "-1", " 1", "１", "", None, [1]])
def test_integer_fields_refuse_anything_int_would_bend(raw):
    with pytest.raises(RequestError) as e:
        integer_field(raw, "data_idx", "bad_data_idx")
    assert (e.value.status, e.value.error, e.value.detail) == (400, "bad_data_idx", f"'data_idx' must be an integer, "
                                                                                     f"got {short(raw)}")


def test_short_cuts_long_values_and_says_how_long():
    assert short("x" * 58) == repr("x" * 58)
    assert short("x" * 59) == f"{repr('x' * 59)[:60]}... (61 characters)"
    assert short(list(range(100))).endswith("... (390 characters)") and len(short(list(range(100)))) == 80


def test_bound_socket_binds_v4_v6_and_takes_an_inherited_one():
    sock, port = _base.bound_socket("127.0.0.1", 0)
    with sock:
        assert port > 0 and sock.family == socket.AF_INET and sock.getsockname() == ("127.0.0.1", port)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        inherited, same = _base.bound_socket("ignored", 1, fd=os.dup(sock.fileno()))
        with inherited:
            assert same == port
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pass  # no IPv6 loopback on this host
    else:
        sock, port = _base.bound_socket("::1", 0)
        with sock:
            assert sock.family == socket.AF_INET6 and port > 0
    with pytest.raises(SystemExit) as e:
        _base.bound_socket("127.0.0.1", 0, fd=987)
    assert str(e.value) == ("--fd 987: not an open socket inherited from the parent process (Bad file descriptor); "
                            "--fd is for a parent that binds the socket (the gateway's --spawn '... --fd {fd}'), "
                            "otherwise use --port")


def test_non_finite_names_the_constant():
    with pytest.raises(ValueError, match="^-Infinity is not a JSON number: send finite numbers$"):
        _base.non_finite("-Infinity")


def test_two_closes_of_one_instance_close_it_once():
    """Two closes that came while a step held the instance's lock: the first closes it, the second finds it gone
    (404), not closed twice."""
    async def main():
        gate = threading.Event()

        class SlowStep(Counter):
            def step(self, env: dict, action: str) -> dict:
                gate.wait(5)
                return super().step(env, action)

        server = SlowStep()
        async with serve_inprocess(server) as url:
            await call(url, "POST", "/create")
            await call(url, "POST", "/reset", {"id": 0, "data_idx": 4})
            lock = server.instances[0].lock
            step = asyncio.ensure_future(call(url, "POST", "/step", {"id": 0, "action": "up"}))
            await until(lock.locked)
            first = asyncio.ensure_future(call(url, "POST", "/close", {"id": 0}))
            second = asyncio.ensure_future(call(url, "POST", "/close", {"id": 0}))
            await until(lambda: len(lock._waiters or ()) == 2)  # both wait for the lock the step holds
            gate.set()
            assert (await step)[0] == 200
            answers = sorted(await asyncio.gather(first, second), key=lambda a: a[0])
            assert answers == [(200, {"closed": 0}), (404, {"error": "unknown_id", "detail": "no counter instance 0: "
                                                                                            "it was closed meanwhile"})]
            assert server.closed == [4]
    run(main())


def test_the_default_body_deadline_applies_to_apps_without_one(monkeypatch):
    monkeypatch.setattr(_base, "DEFAULT_READ_TIMEOUT", 0.1)

    class Slow:
        app: dict = {}

        async def read(self) -> bytes:
            await asyncio.sleep(2)
            return b"{}"

    with pytest.raises(RequestError) as e:
        asyncio.run(read_body(Slow()))
    assert (e.value.status, e.value.detail) == (408, "the request body did not arrive within 0.1s (--read-timeout): "
                                                     "send it at once")


@pytest.mark.parametrize("size,status", [(1 << 20, 200), ((1 << 20) + 1, 413), ((3 << 19), 413)])
def test_bodies_up_to_a_mebibyte(size, status):
    """A body over 1 MiB is refused (413) before it is parsed; the gateway sends actions of 64 KB at most."""
    async def main():
        async with serve_inprocess(Bare()) as url:
            await call(url, "POST", "/create")
            await call(url, "POST", "/reset", {"id": 0, "data_idx": 1})
            head = b'{"id": 0, "action": "'
            got, answer = await call(url, "POST", "/step", raw=head + b"a" * (size - len(head) - 2) + b'"}')
            assert got == status, answer
    run(main())


def test_shutdown_closes_every_instance_logs_a_failed_close_and_leaves_env_calls_behind(caplog):
    """A close that fails is logged and the others still run; env calls still running are not waited for (the
    process is ending) and queued ones never start."""
    gate = threading.Event()

    class Lingering(Counter):
        def close_env(self, env: dict) -> None:
            super().close_env(env)
            if env["item"] == "linger":  # work still in the pool when the shutdown ends: one runs, others queue
                self.left = [self.pool.submit(gate.wait, 5) for _ in range(3)]

    async def main():
        server = Lingering(workers=2)
        server.instances = {3: Instance({"item": "fail", "count": 0}), 4: Instance({"item": "next", "count": 0}),
                            5: Instance({"item": "linger", "count": 0})}
        server._reaper = asyncio.ensure_future(asyncio.sleep(100))
        t0 = time.monotonic()
        await server._shutdown(None)
        took = time.monotonic() - t0
        gate.set()
        return server, took

    with caplog.at_level(logging.ERROR, logger="env_gateway.servers"):
        server, took = asyncio.run(main())
    assert server.closed == ["fail", "next", "linger"] and server.instances == {}
    assert took < 2 and any(f.cancelled() for f in server.left)
    assert caplog.messages == ["counter: closing instance 3 failed"]
    assert caplog.records[0].exc_info[0] is RuntimeError


def test_the_apps_reaper_logs_under_the_servers_name(caplog):
    async def main():
        server = Counter()
        server.instance_ttl = 0.2
        async with serve_inprocess(server) as url:
            await call(url, "POST", "/create")
            t0 = time.monotonic()
            while not server.closed:
                assert time.monotonic() - t0 < 10
                await asyncio.sleep(0.05)

    with caplog.at_level(logging.INFO, logger="env_gateway.servers"):
        run(main())
    assert any(m.startswith("counter: closing instance 0, untouched for ") for m in caplog.messages), caplog.messages


HELP = """usage: python -m env_gateway.servers.counter [-h] [--host HOST] [--port PORT] [--fd FD]
                                             [--max-instances MAX_INSTANCES] [--workers WORKERS]
                                             [--instance-ttl INSTANCE_TTL] [--read-timeout READ_TIMEOUT]
                                             [--log-level LOG_LEVEL] [--start START]

AgentGym-protocol counter environment server

options:
  -h, --help            show this help message and exit
  --host HOST
  --port PORT           0: any free port (the log's 'listening on' line says which)
  --fd FD               serve on this inherited, already-bound socket instead of binding --host/--port (what the
                        gateway's --spawn '... --fd {fd}' passes)
  --max-instances MAX_INSTANCES
  --workers WORKERS     threads that run blocking env calls
  --instance-ttl INSTANCE_TTL
                        seconds an instance may go untouched before the server closes it (keep it above the gateway's
                        --session-ttl)
  --read-timeout READ_TIMEOUT
                        seconds a client has to send a request's headers, and again its body (408), and that an idle
                        connection stays open
  --log-level LOG_LEVEL
  --start START
"""


def test_serve_says_what_each_flag_does(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit):
        _base.serve(Counter, ["--help"])
    assert capsys.readouterr().out == HELP


def test_serve_passes_its_defaults_on_and_logs_where_it_listens(monkeypatch, caplog, capsys):
    """No flags: 127.0.0.1:8000 (no socket is bound here: bound_socket is a stand-in), INFO logs, 10 s deadlines."""
    bound, configured, ran = [], [], {}

    class Sock:
        def getsockname(self) -> tuple:
            return ("127.0.0.9", 4321)

    monkeypatch.setattr(_base, "bound_socket", lambda host, port, fd: bound.append((host, port, fd)) or (Sock(), 4321))
    monkeypatch.setattr(_base.logging, "basicConfig", lambda **kw: configured.append(kw))
    monkeypatch.setattr(_base.web, "run_app", lambda app, **kw: ran.update(kw, app=app) or kw["print"]("x"))
    made: list[Counter] = []
    monkeypatch.setattr(Counter, "app", lambda self: made.append(self) or "the app")
    with caplog.at_level(logging.INFO, logger="env_gateway.servers"):
        _base.serve(Counter, [])
    assert bound == [("127.0.0.1", 8000, None)]
    assert configured == [{"level": "INFO", "format": "%(asctime)s %(name)s %(levelname)s %(message)s"}]
    assert (made[0].max_instances, made[0].pool._max_workers, made[0].read_timeout) == (256, 8, 10.0)
    assert ran["keepalive_timeout"] == 10.0 and ran["sock"].getsockname() == ("127.0.0.9", 4321)
    assert caplog.messages == ["counter server listening on http://127.0.0.9:4321"]
    _base.serve(Counter, ["--fd", "7", "--host", "::1", "--log-level", "DEBUG", "--read-timeout", "0.5"])
    assert bound[-1] == ("::1", 8000, 7) and configured[-1]["level"] == "DEBUG" and made[-1].read_timeout == 0.5
    for flag, value in (("--read-timeout", "0"), ("--instance-ttl", "-2")):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            _base.serve(Counter, [flag, value])
        assert capsys.readouterr().err.endswith(f"error: {flag} must be > 0 seconds, got {float(value)}\n")

