"""The gateway against backends that answer wrongly and clients that behave badly (issue 61), over real sockets on
127.0.0.1: a backend answer the protocol cannot use fails that call alone (502 with a short, code-like detail; the
replica stays in rotation; the session's instance is closed), never a 500, never NaN in an answer; a stray byte
after an answer reaches no other request; a backend's error text stays in the log; the token header takes any
bytes and any case of "Bearer"; /metrics hides backend URLs from callers without the token; a client that gives up
on a create leaves no session or instance behind; a full env server is "retry later"; a gateway that other hosts
can reach needs a token.

``RawBackend`` is an AgentGym server on bare asyncio streams, so its step answers can be any bytes at all."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import Any, Awaitable, Callable

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from env_gateway.client import BackendFailed, BadAnswer, GatewayClient
from env_gateway.config import ConfigError, EnvConfig, GatewayConfig
from env_gateway.fake_backend import running
from env_gateway.server import Gateway
from tests.test_gateway import gateway, raw, run, until

pytestmark = pytest.mark.timeout(60)

CREATE = json.dumps({"env": "babyai", "item_id": 1}).encode()


def http(status: int, body: bytes, *headers: str) -> bytes:
    """One HTTP/1.1 answer with a Content-Length."""
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", "Content-Type: application/json", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class RawBackend:
    """AgentGym's protocol on bare asyncio streams: /, /create, /reset and /close answer correctly; /step answers
    ``step`` (the raw bytes of a whole answer, or an async function ``(writer) -> None`` that writes them), and by
    default a well-formed step result. Keep-alive, one request after another on each connection."""

    def __init__(self) -> None:
        self.instances: set[int] = set()
        self.closed: list[int] = []
        self.ids = itertools.count()
        self.step: bytes | Callable[[asyncio.StreamWriter], Awaitable[None]] | None = None
        self.connections = 0

    def route(self, path: str, body: Any) -> Any:
        if path == "/create":
            n = next(self.ids)
            self.instances.add(n)
            return {"id": n}
        if path == "/reset":
            return {"observation": f"item {body['data_idx']}", "reward": 0, "done": False}
        if path == "/close":
            self.instances.discard(body["id"])
            self.closed.append(body["id"])
            return {"closed": body["id"]}
        if path == "/step":
            return {"observation": "fine", "reward": 0.5, "done": False}
        return {"status": "ok"}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                path = head.split(" ", 2)[1]
                length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                               if line.lower().startswith("content-length:")), 0)
                body = json.loads(await reader.readexactly(length)) if length else None
                if path == "/step" and self.step is not None:
                    if callable(self.step):
                        await self.step(writer)
                    else:
                        writer.write(self.step)
                else:
                    writer.write(http(200, json.dumps(self.route(path, body)).encode()))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class raw_backend:
    """``async with raw_backend() as (backend, url)``: a RawBackend on a port of its own."""

    async def __aenter__(self) -> tuple[RawBackend, str]:
        self.backend = RawBackend()
        self.server = await asyncio.start_server(self.backend.handle, "127.0.0.1", 0)
        return self.backend, f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: Any) -> None:
        self.server.close()


async def strict(url: str, method: str, path: str, data: Any = None, headers: dict | None = None
                 ) -> tuple[int, Any, str]:
    """(status, body parsed as standard JSON, raw text): NaN or Infinity in the body fail the test."""
    import aiohttp

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in a gateway answer is not JSON")

    async with aiohttp.ClientSession() as session:
        async with session.request(method, url + path, data=data, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=20)) as r:
            text = await r.text()
            return r.status, json.loads(text, parse_constant=refuse), text


async def step_once(url: str) -> tuple[str, tuple[int, Any, str]]:
    """Open a session and send one step: (session id, the step's answer)."""
    got, opened, _ = await strict(url, "POST", "/v1/sessions", CREATE)
    assert got == 200, opened
    return opened["session_id"], await strict(url, "POST", f"/v1/sessions/{opened['session_id']}/step",
                                              json.dumps({"action": "go"}))


# ---- 1-3: a 200 the protocol cannot use ------------------------------------------------------------------------
@pytest.mark.parametrize("answer,cause", [
    (http(200, b"{not json"), "POST /step answered HTTP 200 with a body that is not standard JSON"),
    (http(200, b'{"reward": 1, "done": false}'), "POST /step answer has no 'observation' (a JSON object)"),
    (http(200, b"[1, 2]"), "POST /step answer has no 'observation' (a JSON array, not an object)"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n{}", "POST /step: not a valid HTTP answer ("),
    (http(200, b'{"observation": "x", "reward": "' + b"abc" * 700 + b'", "done": false}'),
     "POST /step answer's 'reward' is not a finite number (a JSON string)"),
    (http(200, b'{"observation": "x", "reward": {}, "done": false}'),
     "POST /step answer's 'reward' is not a finite number (a JSON object)"),
    (http(200, b'{"observation": "x", "reward": NaN, "done": false}'),
     "POST /step answered HTTP 200 with a body that is not standard JSON"),
    (http(200, b'{"observation": "x", "reward": 1e999, "done": false}'),
     "POST /step answered HTTP 200 with a body that is not standard JSON"),
    (http(200, b'{"observation": "x", "reward": 1' + b"0" * 400 + b', "done": false}'),
     "POST /step answer's 'reward' is not a finite number (a JSON number)"),
    (http(200, b'{"observation": "x", "reward": 1, "done": "false"}'),
     "POST /step answer's 'done' is not true/false (a JSON string)"),
], ids=["bad-json", "no-observation", "a-list", "negative-length", "reward-str", "reward-dict", "reward-nan",
        "reward-1e999", "reward-huge-int", "done-str"])
def test_a_200_the_protocol_cannot_use_fails_the_step_alone_and_closes_its_instance(answer, cause):
    """Was: the replica out of rotation (every create 503 until a health check) and the instance left open (bad
    JSON, no observation, a list, negative length); a 500 "internal" with the exception's 2 KB text (a wrong-type
    reward); a 200 with "reward": NaN / Infinity, not JSON (NaN, 1e999); "done": "false" read as done."""
    async def main():
        async with raw_backend() as (backend, burl), gateway({"babyai": [burl]}, health_interval=60) as (gw, url):
            backend.step = answer
            sid, (got, body, text) = await step_once(url)
            assert (got, body["error"], body["backend"]) == (502, "backend_failed", burl), body
            assert body["detail"].startswith(f"babyai step failed on backend {burl}: {cause}"), body
            assert len(text) < 400 and "abcabc" not in text
            replica = gw.pools["babyai"].replicas[0]
            assert (replica.healthy, replica.last_error) == (True, "")  # it answered: it is up
            await until(lambda: not backend.instances, timeout=5)  # the failed session's instance, closed
            backend.step = None
            _, (got, body, _) = await step_once(url)  # the next session opens and plays on the same replica
            assert (got, body["reward"]) == (200, 0.5), body
    run(main())


@pytest.mark.parametrize("body,error", [
    (b'{"observation": "x", "reward": NaN, "done": false}', "is not standard JSON"),
    (b'{"observation": "x", "reward": Infinity, "done": false}', "is not standard JSON"),
    (b'{"observation": "x", "reward": 1.0, "done": "false"}', "done str"),
    (b'{"observation": "x", "reward": "1", "done": false}', "reward str"),
    (b'{"reward": 1.0, "done": false}', "needs an observation"),
])
def test_the_client_takes_no_nan_reward_and_no_string_done_into_an_episode(body, error):
    """Was: GatewayClient returned reward nan / inf, and "false" as done == True."""
    async def step(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    async def main():
        app = web.Application()
        app.router.add_post("/v1/sessions/s/step", step)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            async with GatewayClient(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}") as client:
                with pytest.raises(BadAnswer, match=error) as e:
                    await client.step("s", "go")
                assert e.value.error == "bad_answer"
        finally:
            await runner.cleanup()
    run(main())


# ---- 4: bytes after an answer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,later", [(b"\r\n", False), (b"\r\n", True), (http(200, b'{"late": 1}'), True),
                                         (b"garbage", False)], ids=["crlf", "crlf-later", "second-answer", "garbage"])
def test_bytes_after_an_answer_never_reach_the_next_request_on_the_connection(extra, later):
    """Was: a stray CRLF after a valid answer made the next, unrelated session's step on that kept-alive connection
    a 502 "not an HTTP answer: b''", ended that session and took the replica out of rotation."""
    async def main():
        async with raw_backend() as (backend, burl), gateway({"babyai": [burl]}, health_interval=60) as (gw, url):
            first = http(200, b'{"observation": "first", "reward": 0, "done": false}')

            async def answer_then_extra(writer: asyncio.StreamWriter) -> None:
                writer.write(first if later else first + extra)
                if later:
                    await writer.drain()
                    await asyncio.sleep(0.1)  # the connection is idle in the gateway's pool by now
                    writer.write(extra)

            backend.step = answer_then_extra
            _, (got, body, _) = await step_once(url)
            assert (got, body["observation"]) == (200, "first"), body
            await asyncio.sleep(0.2)
            backend.step = None
            for _ in range(3):  # another session's steps: each gets its own answer
                _, (got, body, _) = await step_once(url)
                assert (got, body["observation"]) == (200, "fine"), body
            assert gw.pools["babyai"].replicas[0].healthy
    run(main())


# ---- 6: an answer larger than the limit --------------------------------------------------------------------------
def test_an_answer_over_the_limit_is_refused_without_reading_it_and_the_instance_is_closed():
    """Was: a 100 MB answer passed through whole (the gateway's memory 45 -> 444 MB)."""
    async def main():
        async with raw_backend() as (backend, burl), \
                gateway({"babyai": [burl]}, max_answer_bytes=100_000, health_interval=60) as (gw, url):
            sent = []

            async def huge(writer: asyncio.StreamWriter) -> None:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50000000\r\n\r\n")
                for _ in range(500):  # 50 MB, 100 KB at a time, for as long as the gateway reads
                    writer.write(b"x" * 100_000)
                    await writer.drain()
                    sent.append(1)

            backend.step = huge
            _, (got, body, _) = await step_once(url)
            assert (got, body["error"]) == (502, "backend_failed"), body
            assert "the answer is over 100000 bytes (the gateway's --max-answer-bytes)" in body["detail"], body
            assert len(sent) < 100  # it stopped reading long before the 50 MB (the socket buffers hold some)
            assert gw.pools["babyai"].replicas[0].healthy
            await until(lambda: not backend.instances, timeout=5)
    run(main())


# ---- 7: a backend's error text ----------------------------------------------------------------------------------
@pytest.mark.parametrize("body,shown", [
    (json.dumps({"error": "env_failure", "detail": "Traceback (most recent call last):\n  File \"/home/me/secret_"
                 "path.py\", line 3\nKeyError: 'x'"}).encode(), "POST /step answered HTTP 500 (env_failure)"),
    (b"<html><body>Traceback ... /home/me/secret_path.py</body></html>", "POST /step answered HTTP 500"),
    (json.dumps({"error": "Traceback (most recent call last): /home/me/secret_path.py"}).encode(),
     "POST /step answered HTTP 500"),
])
def test_a_backend_5xx_text_goes_to_the_log_not_to_the_caller(caplog, body, shown):
    """Was: up to 300 characters of the backend's answer (a traceback, file paths) in the client's 502 detail."""
    async def main():
        async with raw_backend() as (backend, burl), gateway({"babyai": [burl]}) as (gw, url):
            backend.step = http(500, body)
            _, (got, answer, text) = await step_once(url)
            assert (got, answer["error"]) == (502, "backend_failed")
            assert answer["detail"] == (f"babyai step failed on backend {burl}: {shown}. The session is ended: finish "
                                        "this episode (e.g. with reward 0) and open a new session.")
            assert "secret_path" not in text and "Traceback" not in text
            await until(lambda: not backend.instances, timeout=5)

    with caplog.at_level(logging.WARNING, logger="env_gateway"):
        run(main())
    assert any("secret_path.py" in m for m in caplog.messages)  # for whoever runs the gateway


def test_a_4xx_detail_reaches_the_caller_cut_to_160_characters():
    """A 4xx says what was wrong with the request (an item out of range): its detail is shown, on one line, cut."""
    async def main():
        async with raw_backend() as (backend, burl), gateway({"babyai": [burl]}) as (gw, url):
            backend.step = http(400, json.dumps({"error": "bad_action", "detail": "no such\nverb: " + "x" * 500}).encode())
            _, (got, answer, _) = await step_once(url)
            assert got == 502
            assert f"POST /step answered HTTP 400 (bad_action): no such verb: {'x' * 146}. The session" in (
                answer["detail"])
    run(main())


# ---- 8: the token ------------------------------------------------------------------------------------------------
async def raw_request(url: str, head: bytes) -> tuple[int, bytes]:
    """Send ``head`` (a request without a body) as bytes; (status, body) of the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    headers = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
    length = int(headers.split("content-length:")[1].split("\r\n")[0])
    body = await reader.readexactly(length)
    writer.close()
    return status, body


def test_the_token_header_takes_any_bytes_any_case_of_bearer_and_metrics_hide_urls(tmp_path):
    """Was: one non-UTF-8 byte in Authorization gave a plain-text 500 on every route (health and /metrics too) and
    a logged traceback; "bearer" in lower case got 401; /metrics showed backend URLs to callers without the token."""
    token_file = tmp_path / "gateway_token"
    token_file.write_text("tok-0123456789abcdef\n")
    token_file.chmod(0o600)

    async def main():
        async with running("agentgym") as (backend, burl), \
                gateway({"babyai": [burl]}, auth_token_file=str(token_file)) as (gw, url):
            for path, status in (("/v1/sessions/x/step", 401), ("/v1/health", 200), ("/metrics", 200),
                                 ("/v1/envs", 200)):
                method = b"POST" if "step" in path else b"GET"
                got, body = await raw_request(url, method + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                                              b"Authorization: Bearer tok-\xff\xfe\r\nContent-Length: 0\r\n\r\n")
                assert got == status, (path, body)
                if path != "/metrics":
                    json.loads(body)
            # the scheme in any case, and one or more spaces before the token (RFC 7235: 1*SP)
            for value in ("bearer tok-0123456789abcdef", "BEARER tok-0123456789abcdef",
                          "Bearer tok-0123456789abcdef", "Bearer   tok-0123456789abcdef"):
                got, opened, _ = await strict(url, "POST", "/v1/sessions", CREATE, headers={"Authorization": value})
                assert got == 200, (value, opened)
            got, _, text = await strict(url, "POST", "/v1/sessions", CREATE,
                                        headers={"Authorization": "Basic tok-0123456789abcdef"})
            assert got == 401
            got, metrics = await raw_request(url, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert got == 200 and burl.encode() not in metrics and b'replica="0"' in metrics
            got, metrics = await raw_request(url, b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
                                             b"Authorization: Bearer tok-0123456789abcdef\r\n\r\n")
            assert got == 200 and f'replica="{burl}"'.encode() in metrics
    run(main())


# ---- 9: clients that give up --------------------------------------------------------------------------------------
async def create_and_hang_up(url: str, after: float) -> None:
    """Send a create, then close the connection ``after`` seconds later, before the answer."""
    host, port = url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(CREATE)).encode() + b"\r\n\r\n" + CREATE)
    await writer.drain()
    await asyncio.sleep(after)
    writer.close()


def create_errors(gw: Gateway) -> dict:
    """The gateway's counts of its answers to creates, by status and by error name, from its /metrics text."""
    samples = [s for f in text_string_to_metric_families(gw.metrics.render().decode()) for s in f.samples
               if s.labels.get("endpoint") == "create"]
    return {s.labels.get("code") or s.labels["error"]: s.value for s in samples
            if s.name in ("cope_gateway_requests_total", "cope_gateway_errors_total")}


def test_a_client_that_gives_up_during_its_create_leaves_no_session_and_no_instance():
    """Was: the session opened anyway and nobody held it: it and its backend instance blocked capacity until the
    session TTL (15 min). No one reads the answer; the metrics count it as the client's doing."""
    async def main():
        async with running("agentgym", delay=1.0) as (backend, burl), gateway({"babyai": [burl]}) as (gw, url):
            await create_and_hang_up(url, after=0.1)  # the reset takes 1 s: the client is gone before it ends
            await until(lambda: backend.counts["reset"] == 1, timeout=5)
            await until(lambda: backend.counts["close"] == 1, timeout=5)
            assert not gw.sessions and not backend.instances
            assert gw.pools["babyai"].replicas[0].sessions == 0
            assert create_errors(gw) == {"400": 1.0, "client_disconnected": 1.0}
    run(main())


def test_a_create_whose_client_left_while_it_queued_sends_nothing():
    async def main():
        async with running("agentgym") as (backend, burl), \
                gateway({"babyai": [burl]}, max_concurrency=1, queue_timeout=10) as (gw, url):
            replica = gw.pools["babyai"].replicas[0]
            assert replica.slots.try_take()  # the only slot, held
            await create_and_hang_up(url, after=0.2)
            await until(lambda: len(replica.slots.waiters) == 1)
            await asyncio.sleep(0.5)  # the hang-up has reached the gateway
            replica.slots.release()
            await until(lambda: replica.slots.used == 0 and not replica.slots.waiters)
            await until(lambda: create_errors(gw))
            assert backend.counts["create"] == 0 and not gw.sessions and replica.sessions == 0
            assert create_errors(gw) == {"400": 1.0, "client_disconnected": 1.0}
    run(main())


# ---- 10: a full env server ----------------------------------------------------------------------------------------
def test_an_env_server_at_its_instance_limit_is_a_503_to_retry_later():
    """Was: a 502 backend_failed without Retry-After, which the agent func scored 0."""
    from tests.test_server_base import Counter, serve_inprocess

    async def main():
        async with serve_inprocess(Counter(max_instances=1)) as burl, gateway({"babyai": [burl]}) as (gw, url):
            assert (await strict(url, "POST", "/v1/sessions", CREATE))[0] == 200
            got, answer, headers = await raw(url, "POST", "/v1/sessions", CREATE)
            assert (got, answer["error"], headers.get("Retry-After")) == (503, "replicas_busy", "1"), answer
            assert answer["detail"] == (f"no babyai replica can take item 1 now: backend {burl}: POST /create "
                                        "answered HTTP 503 (full)")
            assert gw.pools["babyai"].replicas[0].healthy
    run(main())


# ---- 14: who may reach the gateway --------------------------------------------------------------------------------
@pytest.mark.parametrize("host,ok", [("127.0.0.1", True), ("::1", True), ("localhost", True), ("127.0.0.2", True),
                                     ("0.0.0.0", False), ("", False), ("10.1.2.3", False), ("::", False),
                                     ("gpu-node-7", False)])
def test_a_gateway_other_hosts_can_reach_needs_a_token(tmp_path, host, ok):
    """Was: bound to 0.0.0.0 without a token, the gateway neither warned nor refused."""
    envs = {"babyai": EnvConfig("babyai", ["http://127.0.0.1:9"])}
    if ok:
        Gateway(GatewayConfig(envs=envs, host=host))
    else:
        with pytest.raises(ConfigError, match="can be reached from other hosts, and this gateway has no token"):
            Gateway(GatewayConfig(envs=envs, host=host))
    token_file = tmp_path / "token"
    token_file.write_text("t0k3n\n")
    token_file.chmod(0o600)
    Gateway(GatewayConfig(envs={"babyai": EnvConfig("babyai", ["http://127.0.0.1:9"])}, host=host,
                          auth_token_file=str(token_file)))


def test_internal_errors_answer_json_with_a_short_detail():
    """Was: a 500 whose detail was the exception's text, whatever its length."""
    async def main():
        async with raw_backend() as (backend, burl), gateway({"babyai": [burl]}) as (gw, url):
            async def broken(*args: Any) -> Any:
                raise ValueError("x" * 3000)

            gw.pools["babyai"].adapter.open = broken
            got, answer, text = await strict(url, "POST", "/v1/sessions", CREATE)
            assert (got, answer) == (500, {"error": "internal", "detail": "the gateway failed on this request "
                                                                           "(ValueError); its log has the details"})
    run(main())


def test_a_slow_trickle_of_an_answer_is_cut_at_the_request_timeout():
    """An answer that comes a byte at a time, forever: the step ends at request_timeout (504), the gateway serves
    others meanwhile."""
    async def main():
        async with raw_backend() as (backend, burl), \
                gateway({"babyai": [burl]}, request_timeout=3.0) as (gw, url):
            async def trickle(writer: asyncio.StreamWriter) -> None:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
                for _ in range(200):
                    writer.write(b" ")
                    await writer.drain()
                    await asyncio.sleep(0.05)

            backend.step = trickle
            stepping = asyncio.ensure_future(step_once(url))
            await until(lambda: backend.instances)
            t0 = time.monotonic()
            got, health, _ = await strict(url, "GET", "/v1/health")
            assert got == 200 and not stepping.done()  # served while the step trickles in
            _, (got, body, _) = await stepping
            assert (got, body["error"]) == (504, "backend_timeout") and time.monotonic() - t0 < 6.0
    run(main())
