"""The gateway and its client against fake AgentGym backends (env_gateway/fake_backend.py), over real
sockets on 127.0.0.1: episodes, the per-replica cap under 500 concurrent sessions, overload answers, timeouts,
a replica killed mid-run, retry of creates, TTL reaping, every bad input, and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import time
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from env_gateway.client import (BackendFailed, BadRequest, GatewayClient, GatewayUnavailable, Overloaded,
                                SessionGone)
from env_gateway.adapters import BackendError
from env_gateway.config import ConfigError, EnvConfig, GatewayConfig
from env_gateway.fake_backend import FakeBackendProcess, expected_action, running
from env_gateway.server import ApiError, Gateway
from tests.env_server_proc import refusing_port

pytestmark = pytest.mark.timeout(60)


def run(coro: Any, timeout: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def gateway(envs: dict[str, list[str] | EnvConfig], sock: socket.socket | None = None,
                  **settings: Any) -> AsyncIterator[tuple[Gateway, str]]:
    """An in-process gateway on 127.0.0.1 in the running loop (on ``sock``, a bound socket, when given; else on a
    port of its own): yields (gateway, url)."""
    cfg = GatewayConfig(envs={name: e if isinstance(e, EnvConfig) else EnvConfig(name, e) for name, e in envs.items()},
                        **settings)
    gw = Gateway(cfg)
    runner = web.AppRunner(gw.app(), access_log=None, shutdown_timeout=1)
    await runner.setup()
    site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield gw, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def play(client: GatewayClient, env: str, item: int) -> tuple[float, int]:
    """One episode with the right actions; returns (final reward, steps)."""
    async with client.session(env, item) as s:
        assert s.observation == f"item {item} step 0: say '{expected_action(item, 0)}'"
        while not s.done:
            await s.step(expected_action(item, s.steps))
            if not s.done:  # the observation belongs to this session's item: no cross-talk
                assert s.observation.startswith(f"item {item} step {s.steps}:")
        return s.reward, s.steps


async def until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def raw(url: str, method: str, path: str, data: Any = None, **kw: Any) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url + path, data=data, timeout=aiohttp.ClientTimeout(total=10), **kw) as r:
            return r.status, await r.json(content_type=None), r.headers


def test_full_episode_and_close():
    async def main():
        async with running("agentgym", episode_len=4) as (backend, burl), gateway({"babyai": [burl]}) as (gw, url):
            async with GatewayClient(url) as client:
                assert await play(client, "babyai", 5) == (1.0, 4)
                # wrong actions: the episode still ends, with reward 0
                async with client.session("babyai", 6) as s:
                    while not s.done:
                        r = await s.step("move nowhere")
                    assert (r.reward, r.done) == (0.0, True)
                    sid = s.id
                # a session id is 96 random bits in hex: not guessable, not the backend's instance id
                assert re.fullmatch(r"[0-9a-f]{24}", sid), sid
                with pytest.raises(SessionGone, match=f"session {sid} is closed by the client; open a new one"):
                    await client.step(sid, "move 0")
                assert backend.counts == {"create": 2, "reset": 2, "step": 8, "close": 2}
                assert not backend.instances and not gw.sessions
                envs = await client.envs()
                assert envs["envs"]["babyai"]["replicas"][0]["healthy"] is True
                assert (await client.health())["status"] == "ok"
    run(main())


def test_session_closes_on_error_and_cancellation():
    async def main():
        async with running("agentgym", episode_len=4) as (backend, burl), gateway({"babyai": [burl]}) as (gw, url):
            async with GatewayClient(url) as client:
                with pytest.raises(RuntimeError):
                    async with client.session("babyai", 1):
                        raise RuntimeError("agent crashed")
                started = asyncio.Event()

                async def episode():
                    async with client.session("babyai", 2):
                        started.set()
                        await asyncio.sleep(60)
                task = asyncio.ensure_future(episode())
                await started.wait()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await until(lambda: backend.counts["close"] == 2)  # the close ran although its caller was cancelled
                assert not gw.sessions
    run(main())


def test_cap_holds_under_500_concurrent_sessions():
    cap, n, steps = 8, 500, 3

    async def main():
        async with running("agentgym", delay=0.002, episode_len=steps) as (backend, burl), \
                gateway({"babyai": [burl]}, max_concurrency=cap, queue_timeout=60) as (gw, url):
            async with GatewayClient(url, limit=n) as client:
                results = await asyncio.gather(*(play(client, "babyai", i) for i in range(n)))
            assert results == [(1.0, steps)] * n
            assert backend.peak_inflight == cap  # pressed to the cap, never over it
            assert backend.counts == {"create": n, "reset": n, "step": n * steps, "close": n}
            assert not gw.sessions and gw.pools["babyai"].replicas[0].slots.used == 0
    run(main(), timeout=50)


def test_overload_gives_503_with_retry_after_and_sends_nothing():
    async def main():
        async with running("agentgym", delay=0.5) as (backend, burl), \
                gateway({"babyai": [burl]}, max_concurrency=1, queue_timeout=0.1) as (gw, url):
            client = GatewayClient(url, retry_overloaded=False)
            async with client:
                opened = await client.create("babyai", 1)
                other = await client.create("babyai", 2)
                first = asyncio.ensure_future(client.step(opened.session_id, "move 1"))
                await until(lambda: backend.inflight == 1)  # the first step holds the only slot
                status, body, headers = await raw(url, "POST", "/v1/sessions", json.dumps({"env": "babyai",
                                                                                         "item_id": 2}))
                assert status == 503 and body["error"] == "overloaded" and int(headers["Retry-After"]) >= 1
                assert "limit of 1" in body["detail"] and "retry" in body["detail"]
                with pytest.raises(Overloaded):
                    await client.step(other.session_id, "move 2")  # refused, and not sent
                await first
                assert backend.counts["create"] == 2 and backend.counts["step"] == 1
                # with retries on (the default), the client waits for the slot instead
                retrying = GatewayClient(url, timeout=10)
                r = await retrying.step(other.session_id, "move 2")
                assert r.observation.startswith("item 2 step 1")
                await retrying.aclose()
    run(main())


def test_a_full_queue_is_refused_at_once_and_queue_waits_are_measured():
    """--max-queue bounds how many requests wait for a replica's slot: one over it gets 503 at once (not after the
    queue timeout), and the wait of a request that queued shows in cope_gateway_queue_wait_seconds."""
    async def main():
        async with running("agentgym", delay=0.5) as (backend, burl), \
                gateway({"babyai": [burl]}, max_concurrency=1, max_queue=1, queue_timeout=20) as (gw, url):
            slots = gw.pools["babyai"].replicas[0].slots
            async with GatewayClient(url, retry_overloaded=False) as client:
                a, b = await client.create("babyai", 1), await client.create("babyai", 2)
                t0 = time.monotonic()
                first = asyncio.ensure_future(client.step(a.session_id, expected_action(1, 0)))
                await until(lambda: backend.inflight == 1)
                queued = asyncio.ensure_future(client.step(b.session_id, expected_action(2, 0)))
                await until(lambda: len(slots.waiters) == 1)
                status, body, headers = await raw(url, "POST", "/v1/sessions", json.dumps({"env": "babyai",
                                                                                         "item_id": 3}))
                assert (status, body["error"], headers["Retry-After"]) == (503, "overloaded", "1"), body
                assert "has 1 requests queued already; retry later" in body["detail"], body
                await first
                assert (await queued).observation.startswith("item 2 step 1")  # the queued step ran once freed
                elapsed = time.monotonic() - t0
            waits = {s.labels["endpoint"]: s.value for f in text_string_to_metric_families(gw.metrics.render().decode())
                     for s in f.samples if s.name == "cope_gateway_queue_wait_seconds_sum"}
            assert 0.2 < waits["step"] < elapsed, waits  # it waited out most of the first step's 0.5 s
            assert backend.counts["create"] == 2 and backend.counts["step"] == 2  # the refused create sent nothing
    run(main())


def test_a_queue_timeout_asks_to_retry_after_half_of_it():
    """Retry-After of a request that waited out --queue-timeout: half the timeout, at least 1 s."""
    async def main():
        async with running("agentgym") as (backend, burl), \
                gateway({"babyai": [burl]}, max_concurrency=1, queue_timeout=2.4) as (gw, url):
            replica = gw.pools["babyai"].replicas[0]
            assert replica.slots.try_take()  # the only slot, held for the whole test
            with pytest.raises(ApiError) as e:
                await gw.acquire(replica, None, "babyai")
            assert (e.value.status, e.value.error, e.value.retry_after) == (503, "overloaded", 1.2)
            assert "limit of 1 requests in flight for 2.4s (queue timeout)" in e.value.detail
            assert "nothing was sent to the backend" in e.value.detail
    run(main())


def test_step_timeout_fails_the_session_with_504():
    async def main():
        async with running("agentgym") as (backend, burl), \
                gateway({"babyai": [burl]}, request_timeout=0.3) as (gw, url):
            async with GatewayClient(url) as client:
                opened = await client.create("babyai", 3)
                with pytest.raises(BackendFailed) as e:  # "hang" never answers: the 0.3 s timeout must end it
                    await client.step(opened.session_id, "hang")
                assert (e.value.status, e.value.error, e.value.backend) == (504, "backend_timeout", burl)
                assert "timed out after 0.3s" in e.value.detail and "open a new session" in e.value.detail
                assert gw.pools["babyai"].replicas[0].healthy  # a slow step says nothing about the replica's health
                with pytest.raises(SessionGone, match="failed"):
                    await client.step(opened.session_id, "move 0")
                # a 5xx from the backend: 502, named
                opened = await client.create("babyai", 4)
                with pytest.raises(BackendFailed) as e:
                    await client.step(opened.session_id, "crash")
                assert (e.value.status, e.value.error) == (502, "backend_failed")
                assert "HTTP 500" in e.value.detail and burl in e.value.detail
                assert gw.pools["babyai"].replicas[0].healthy  # the backend answered: it stays in rotation
    run(main())


def test_replica_killed_mid_run():
    async def main():
        with FakeBackendProcess("--episode-len", "50") as a, FakeBackendProcess("--episode-len", "50") as b:
            async with gateway({"babyai": [a.url, b.url]}, health_interval=0.2) as (gw, url):
                async with GatewayClient(url, timeout=20) as client:
                    sessions = [await client.create("babyai", i) for i in range(10)]
                    assert {s.backend for s in sessions} == {a.url, b.url}  # spread over both
                    for s in sessions:
                        await client.step(s.session_id, expected_action(int(s.observation.split()[1]), 0))
                    a.kill()
                    outcomes = await asyncio.gather(*(client.step(s.session_id, "move 1") for s in sessions),
                                                    return_exceptions=True)
                    for s, out in zip(sessions, outcomes):
                        if s.backend == a.url:
                            assert isinstance(out, BackendFailed) and out.backend == a.url
                            assert a.url in out.detail
                        else:
                            assert out.observation.startswith("item")
                    fresh = [await client.create("babyai", i) for i in range(6)]
                    assert {s.backend for s in fresh} == {b.url}
                    health = await client.health()
                    assert health["status"] == "ok" and health["envs"]["babyai"]["healthy_replicas"] == 1
                    # the replica comes back on its port: health checks return it to rotation
                    with FakeBackendProcess("--episode-len", "50", port=a.port):
                        await until(lambda: all(r.healthy for r in gw.pools["babyai"].replicas))
                        more = [await client.create("babyai", i) for i in range(4)]
                        assert a.url in {s.backend for s in more}  # least-loaded: the empty one gets work
                        for s in fresh + more:
                            await client.close(s.session_id)
    run(main(), timeout=50)


def test_create_retries_on_another_replica():
    async def main(dead: str):
        async with running("agentgym") as (backend, burl), \
                gateway({"babyai": [dead, burl]}, health_interval=60) as (gw, url):
            await until(lambda: not gw.pools["babyai"].replicas[0].healthy)  # the start-up health check found it
            gw.pools["babyai"].replicas[0].healthy = True  # dead; pretend it has not, so creates try it first
            async with GatewayClient(url) as client:
                opened = [await client.create("babyai", i) for i in range(5)]
            assert {o.backend for o in opened} == {burl} and backend.counts["create"] == 5
            dead_replica = gw.pools["babyai"].replicas[0]
            assert not dead_replica.healthy and "cannot connect" in dead_replica.last_error
            samples = {s.name: s for m in text_string_to_metric_families(gw.metrics.render().decode())
                       for s in m.samples}
            assert samples["cope_gateway_create_retries_total"].value >= 1
    with refusing_port() as held:  # nothing listens there, and nothing can while it is held
        run(main(f"http://127.0.0.1:{held.getsockname()[1]}"))


def test_all_replicas_down_gives_clear_errors():
    async def main(dead: str):
        async with gateway({"babyai": [dead]}, health_interval=0.1) as (gw, url):
            await until(lambda: not gw.pools["babyai"].replicas[0].healthy)
            status, body, headers = await raw(url, "POST", "/v1/sessions", json.dumps({"env": "babyai", "item_id": 1}))
            assert status == 503 and body["error"] == "no_healthy_replica" and dead in body["detail"]
            assert "Retry-After" in headers
            status, body, _ = await raw(url, "GET", "/v1/health")
            assert status == 503 and body["status"] == "degraded"
            client = GatewayClient(url, timeout=1.5)
            with pytest.raises(Overloaded):  # retried until its own deadline, then raised
                await client.create("babyai", 1)
            await client.aclose()
    with refusing_port() as held:
        run(main(f"http://127.0.0.1:{held.getsockname()[1]}"))


def test_idle_sessions_are_reaped_and_closed_on_the_backend():
    async def main():
        async with running("agentgym", episode_len=100) as (backend, burl), \
                gateway({"babyai": [burl]}, session_ttl=0.6) as (gw, url):
            async with GatewayClient(url) as client:
                idle = await client.create("babyai", 1)
                created = time.monotonic()
                busy = await client.create("babyai", 2)
                t = 0
                while backend.counts["close"] == 0:  # keeps stepping (never idle for a whole TTL) until the reap
                    await asyncio.sleep(0.05)
                    await client.step(busy.session_id, expected_action(2, t))
                    t += 1
                    assert t < 200, "the idle session was never reaped"
                assert time.monotonic() - created >= 0.6  # not before its TTL
                assert backend.counts["close"] == 1 and 0 not in backend.instances  # the idle one, on the backend
                with pytest.raises(SessionGone, match="expired: idle for more than 0.6s") as e:
                    await client.step(idle.session_id, "move 1")
                assert e.value.status == 410
                assert await client.close(busy.session_id) is True
                assert await client.close(idle.session_id) is False
    run(main())


def test_a_session_with_a_step_in_flight_is_not_reaped():
    """The step takes 1 s, three session TTLs: the session is busy, not idle, and survives it."""
    async def main():
        async with running("agentgym", episode_len=10) as (backend, burl), \
                gateway({"babyai": [burl]}, session_ttl=0.3) as (gw, url):
            async with GatewayClient(url) as client:
                opened = await client.create("babyai", 1)
                backend.delay = 1.0
                r = await client.step(opened.session_id, expected_action(1, 0))
                assert r.observation.startswith("item 1 step 1")
                assert opened.session_id in gw.sessions and backend.counts["close"] == 0
    run(main())


def test_new_sessions_go_to_the_replica_with_fewest_sessions_then_fewest_requests():
    gw = Gateway(GatewayConfig(envs={"babyai": EnvConfig("babyai", ["http://a:1", "http://b:1", "http://c:1"])}))
    a, b, c = gw.pools["babyai"].replicas
    a.sessions, a.slots.used = 1, 0
    b.sessions, b.slots.used = 0, 3
    c.sessions, c.slots.used = 0, 2
    assert gw.pools["babyai"].pick(set()) is c  # fewest sessions (b, c), then fewest in flight
    c.healthy = False
    assert gw.pools["babyai"].pick(set()) is b
    assert gw.pools["babyai"].pick({b}) is a


def test_a_create_refused_as_busy_by_one_replica_and_failing_on_another_is_a_502():
    """503 replicas_busy (come back later) only when every replica said busy (409); a 5xx among them is a failure."""
    async def main():
        async with running("agentgym") as (_, url_a), running("agentgym") as (_, url_b), \
                gateway({"babyai": [url_a, url_b]}) as (gw, url):
            pool = gw.pools["babyai"]
            answers = {url_a: 409, url_b: 500}

            async def refuse(replica_url, item_id, seed):
                raise BackendError(replica_url, f"HTTP {answers[replica_url]}", retryable=True,
                                   status=answers[replica_url])

            pool.adapter.open = refuse
            body = json.dumps({"env": "babyai", "item_id": 1}).encode()
            got, answer, _ = await raw(url, "POST", "/v1/sessions", body)
            assert (got, answer["error"]) == (502, "backend_failed"), answer
            answers[url_b] = 409
            got, answer, headers = await raw(url, "POST", "/v1/sessions", body)
            assert (got, answer["error"]) == (503, "replicas_busy") and headers["Retry-After"] == "1", answer
    run(main())


def test_max_sessions():
    async def main():
        async with running("agentgym") as (backend, burl), gateway({"babyai": [burl]}, max_sessions=2) as (gw, url):
            async with GatewayClient(url, retry_overloaded=False) as client:
                a = await client.create("babyai", 1)
                await client.create("babyai", 2)
                with pytest.raises(Overloaded) as e:
                    await client.create("babyai", 3)
                assert e.value.error == "too_many_sessions" and "--max-sessions" in e.value.detail
                await client.close(a.session_id)
                await client.create("babyai", 3)  # room again
    run(main())


@pytest.mark.parametrize("method,path,body,status,error,hint", [
    ("POST", "/v1/sessions", b"{not json", 400, "bad_json", "not valid JSON"),
    ("POST", "/v1/sessions", b"[1, 2]", 400, "bad_json", "must be a JSON object, got list"),
    ("POST", "/v1/sessions", b'{"item_id": 1}', 400, "missing_field", "'env'"),
    ("POST", "/v1/sessions", b'{"env": "babyai"}', 400, "missing_field", "'item_id'"),
    ("POST", "/v1/sessions", b'{"env": "nethack", "item_id": 1}', 404, "unknown_env", "known: babyai"),
    ("POST", "/v1/sessions", b'{"env": "babyai", "item_id": "abc"}', 400, "bad_item_id", "integer"),
    ("POST", "/v1/sessions", b'{"env": "babyai", "item_id": -1}', 400, "bad_item_id", ">= 0"),
    ("POST", "/v1/sessions", b'{"env": "babyai", "item_id": 1, "seed": "x"}', 400, "bad_seed", "integer"),
    ("POST", "/v1/sessions", b'{"env": "babyai", "item_id": 99999}', 422, "backend_rejected", "out of range"),
    ("POST", "/v1/sessions/nope/step", b'{"action": "x"}', 404, "unknown_session", "POST /v1/sessions"),
    ("DELETE", "/v1/sessions/nope", None, 404, "unknown_session", "POST /v1/sessions"),
    ("POST", "/v1/sessions/{sid}/step", b"{}", 400, "missing_action", "'action'"),
    ("POST", "/v1/sessions/{sid}/step", b'{"action": 3}', 400, "bad_action", "string"),
    ("POST", "/v1/sessions/{sid}/step", b'{"action": "' + b"x" * 70_000 + b'"}', 413, "action_too_large",
     "--max-action-bytes"),
    ("POST", "/v1/sessions/{sid}/step", b'{"action": "go \\ud800"}', 400, "bad_action", "lone surrogate"),
    ("POST", "/v1/sessions", b'{"env": "babyai", "item_id": 1, "pad": "' + b"x" * 300_000 + b'"}', 413,
     "body_too_large", "over 100000 bytes: send less, or raise the gateway's --max-body"),
    ("POST", "/v1/sessions", b'{"env": "babyai", "item_id": ' + b"[" * 40_000 + b"]" * 40_000 + b"}", 400,
     "bad_json", "deeper than the JSON parser takes; send a flat JSON object"),  # was: 500 (RecursionError)
    ("POST", "/v1/sessions", b'{"env": "babyai", "item_id": 1, "seed": Infinity}', 400, "bad_json", "finite"),
    ("POST", "/v1/sessions", b'{"env": "' + b"b" * 90_000 + b'", "item_id": 1}', 404, "unknown_env",
     "(90002 characters)"),  # was: the 90 KB name echoed back
    ("GET", "/v2/whatever", None, 404, "not_found", "the API is"),
    ("PUT", "/v1/sessions", b"{}", 405, "method_not_allowed", "the API is"),
])
def test_bad_input_gets_a_helpful_4xx(method, path, body, status, error, hint):
    async def main():
        async with running("agentgym") as (backend, burl), \
                gateway({"babyai": [burl]}, max_body=100_000) as (gw, url):
            async with GatewayClient(url) as client:
                opened = await client.create("babyai", 1)
                got, answer, _ = await raw(url, method, path.replace("{sid}", opened.session_id), body)
                assert (got, answer["error"]) == (status, error), answer
                assert hint in answer["detail"], answer
                r = await client.step(opened.session_id, expected_action(1, 0))  # the gateway is unharmed
                assert r.observation.startswith("item 1 step 1")
    run(main())


def test_a_close_that_meets_a_busy_replica_is_retried_until_the_backend_has_it():
    """The replica's one slot is held by a 3 s step (long enough for the close to arrive while it runs, on a loaded
    host too: at 0.5 s, under a mutation run beside a training run, the step had ended first) and the close may queue
    0.1 s: it cannot run now. It used to answer backend_closed false, "retry later", and a retry got 410, so the
    instance stayed open for good."""
    async def main():
        async with running("agentgym", delay=3.0) as (backend, burl), \
                gateway({"babyai": [burl]}, max_concurrency=1, queue_timeout=0.1) as (gw, url):
            async with GatewayClient(url) as client:
                a, b = await client.create("babyai", 1), await client.create("babyai", 2)
                handle = gw.sessions[b.session_id].handle
                step = asyncio.ensure_future(client.step(a.session_id, expected_action(1, 0)))
                await until(lambda: gw.sessions[a.session_id].busy)
                got, answer, _ = await raw(url, "DELETE", f"/v1/sessions/{b.session_id}")
                assert got == 200 and answer["backend_closed"] is False and "nothing to do" in answer["detail"]
                await step
                await until(lambda: backend.counts["close"] == 1, timeout=5)
                assert handle["id"] not in backend.instances and a.session_id in gw.sessions
    run(main())


def test_with_a_token_file_sessions_need_the_token_and_envs_hide_where_backends_run(tmp_path, monkeypatch):
    """Without --auth-token-file anyone who could reach the gateway could step or close a session whose id they
    held, and /v1/envs showed backend URLs and pids."""
    token_file = tmp_path / "gateway_token"
    token_file.write_text("tok-0123456789abcdef\n")
    token_file.chmod(0o600)
    monkeypatch.delenv("COPE_GATEWAY_TOKEN_FILE", raising=False)

    async def main():
        async with running("agentgym") as (backend, burl), \
                gateway({"babyai": [burl]}, auth_token_file=str(token_file)) as (gw, url):
            create = json.dumps({"env": "babyai", "item_id": 1}).encode()
            for headers in ({}, {"Authorization": "Bearer tok-0123456789abcdeX"}, {"Authorization": "tok"}):
                got, answer, _ = await raw(url, "POST", "/v1/sessions", create, headers=headers)
                assert (got, answer["error"]) == (401, "unauthorized") and "--auth-token-file" in answer["detail"]
            got, envs, _ = await raw(url, "GET", "/v1/envs")
            assert got == 200 and envs["envs"]["babyai"]["replicas"][0].keys().isdisjoint({"url", "pid"})
            assert (await raw(url, "GET", "/v1/health"))[0] == 200
            async with GatewayClient(url, token_file=str(token_file)) as client:
                assert (await play(client, "babyai", 5))[0] == 1.0
                opened = await client.create("babyai", 2)
                got, answer, _ = await raw(url, "DELETE", f"/v1/sessions/{opened.session_id}")  # holding the id
                assert got == 401 and opened.session_id in gw.sessions  # is not enough
            got, envs, _ = await raw(url, "GET", "/v1/envs", headers={"Authorization": "Bearer tok-0123456789abcdef"})
            assert envs["envs"]["babyai"]["replicas"][0]["url"] == burl
            monkeypatch.setenv("COPE_GATEWAY_TOKEN_FILE", str(token_file))  # how agent funcs get it
            async with GatewayClient(url) as client:
                assert (await play(client, "babyai", 3))[0] == 1.0
    run(main())
    token_file.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        Gateway(GatewayConfig(envs={"babyai": EnvConfig("babyai", ["http://127.0.0.1:9"])},
                              auth_token_file=str(token_file)))


def test_a_body_that_does_not_arrive_in_time_gets_408():
    """Slow senders used to hold a connection and a handler for as long as they liked."""
    async def main():
        async with running("agentgym") as (backend, burl), gateway({"babyai": [burl]}, read_timeout=0.5) as (gw, url):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"env\": ")
            await writer.drain()
            t0 = time.monotonic()
            status_line = await asyncio.wait_for(reader.readline(), 5)
            assert status_line.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 > 0.4  # not before the deadline
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            answer = json.loads(await asyncio.wait_for(reader.readexactly(length), 5))
            assert answer == {"error": "body_timeout", "detail": "the body did not arrive within 0.5s "
                                                                "(--read-timeout); send it at once"}
            writer.close()
    run(main())


def test_a_client_gone_mid_body_is_not_an_internal_error():
    async def main():
        async with running("agentgym") as (backend, burl), gateway({"babyai": [burl]}) as (gw, url):
            host, port = url.removeprefix("http://").split(":")
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"env\": ")
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.close()
            errors: dict = {}
            deadline = time.monotonic() + 10
            while not errors and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                errors = {s.labels["error"]: s.value
                          for f in text_string_to_metric_families(gw.metrics.render().decode())
                          for s in f.samples if s.name == "cope_gateway_errors_total"}
            assert errors == {"client_disconnected": 1.0}  # was: {"internal": 1.0}, with a traceback in the log
            codes = {s.labels["code"] for f in text_string_to_metric_families(gw.metrics.render().decode())
                     for s in f.samples if s.name == "cope_gateway_requests_total"}
            assert codes == {"400"}  # the client's fault, counted as such
    run(main())


def test_non_ascii_actions_are_forwarded_as_utf8_not_tripled_by_escapes():
    """300,000 "é" are 600 KB as UTF-8 and 1.8 MB as JSON \\u escapes: the backend (aiohttp's 1 MiB limit) takes
    the first; the escaped form it answered with 413, and the gateway ended the session with a 502."""
    async def main():
        async with running("agentgym") as (backend, burl), \
                gateway({"babyai": [burl]}, max_body=2_000_000, max_action_bytes=700_000) as (gw, url):
            async with GatewayClient(url) as client:
                opened = await client.create("babyai", 1)
                body = json.dumps({"action": "é" * 300_000}, ensure_ascii=False).encode()
                got, answer, _ = await raw(url, "POST", f"/v1/sessions/{opened.session_id}/step", body,
                                           headers={"Content-Type": "application/json; charset=utf-8"})
                assert got == 200, answer
                assert answer["reward"] == 0
    run(main())


def test_concurrent_steps_on_one_session_get_409():
    """The first step takes 3 s at the backend, long enough for the second to arrive while it runs on a loaded host
    (at 0.3 s, beside a training run, the first had answered before the second came)."""
    async def main():
        async with running("agentgym", delay=3.0) as (backend, burl), gateway({"babyai": [burl]}) as (gw, url):
            async with GatewayClient(url) as client:
                s = await client.create("babyai", 1)
                first = asyncio.ensure_future(client.step(s.session_id, "move 1"))
                await until(lambda: gw.sessions[s.session_id].busy)
                with pytest.raises(BadRequest, match="step in flight") as e:
                    await client.step(s.session_id, "move 2")
                assert e.value.status == 409
                await first
    run(main())


def test_client_errors_without_a_gateway_and_across_event_loops():
    with refusing_port() as sock:  # bound, not listening: refused until a gateway below listens on it
        client = GatewayClient(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=2)

        async def unreachable():
            with pytest.raises(GatewayUnavailable, match="unreachable"):
                await client.create("babyai", 1)
            await client.aclose()

        run(unreachable())

        async def one_episode():
            # each gateway serves (and closes) its own copy of the socket; the port stays held by ``sock``
            async with running("agentgym", episode_len=2) as (backend, burl), \
                    gateway({"babyai": [burl]}, sock=sock.dup()):
                assert await play(client, "babyai", 3) == (1.0, 2)
                http = client.http()
                assert http is client.http()  # one HTTP session per loop, reused
                await client.aclose()
                return http

        # the same client object in fresh event loops: each gets its own HTTP session
        assert run(one_episode()) is not run(one_episode())

def test_metrics_parse_as_prometheus_text():
    async def main():
        async with running("agentgym", episode_len=3) as (backend, burl), gateway({"babyai": [burl]}) as (gw, url):
            async with GatewayClient(url) as client:
                for item in range(4):
                    await play(client, "babyai", item)
                await raw(url, "POST", "/v1/sessions", b"{bad")
                await raw(url, "GET", "/v1/envs")
                await raw(url, "GET", "/v1/health")
                async with client.http().get(url + "/metrics"):  # counted from the second scrape on
                    pass
                async with client.http().get(url + "/metrics") as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                    text = await r.text()
        families = {m.name: m for m in text_string_to_metric_families(text)}
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in families.values() for s in m.samples}
        assert samples[("cope_gateway_requests_total", (("code", "200"), ("endpoint", "step"), ("env", "babyai")))] == 12
        assert samples[("cope_gateway_requests_total", (("code", "200"), ("endpoint", "create"), ("env", "babyai")))] == 4
        assert samples[("cope_gateway_errors_total", (("endpoint", "create"), ("env", "-"), ("error", "bad_json")))] == 1
        assert samples[("cope_gateway_overhead_seconds_count", (("endpoint", "step"), ("env", "babyai")))] == 12
        # every route under the endpoint name that metrics.py documents (dashboards select on it)
        endpoints = {dict(labels)["endpoint"] for name, labels in samples if name == "cope_gateway_requests_total"}
        assert endpoints == {"create", "step", "close", "envs", "health", "metrics"}, endpoints
        assert samples[("cope_gateway_replica_up", (("env", "babyai"), ("replica", burl)))] == 1.0
        assert samples[("cope_gateway_open_sessions", (("env", "babyai"),))] == 0
        assert samples[("cope_gateway_sessions_opened_total", (("env", "babyai"),))] == 4
        for name in ("cope_gateway_backend_seconds", "cope_gateway_request_seconds", "cope_gateway_queue_depth",
                     "cope_gateway_inflight", "cope_gateway_queue_wait_seconds"):
            assert name in families
    run(main())


def test_envs_and_health_answer_their_documented_bodies(caplog):
    """GET /v1/envs and GET /v1/health, key for key (the client, launchers and dashboards read them), with one
    session open and a second env whose only replica refuses connections; that replica's going out of rotation is
    logged with its URL and the cause."""
    async def main():
        with refusing_port() as held:
            dead = f"http://127.0.0.1:{held.getsockname()[1]}"
            async with running("agentgym") as (_, burl), \
                    gateway({"babyai": [burl], "mysci": EnvConfig("mysci", [dead], adapter="agentgym")},
                            max_concurrency=3, max_sessions=5, health_interval=0.05) as (gw, url):
                await until(lambda: not gw.pools["mysci"].replicas[0].healthy)
                async with GatewayClient(url) as client, client.session("babyai", 1):
                    envs_status, envs, _ = await raw(url, "GET", "/v1/envs")
                    health_status, health, _ = await raw(url, "GET", "/v1/health")
        return dead, burl, (envs_status, envs), (health_status, health)

    with caplog.at_level(logging.WARNING, logger="env_gateway"):
        dead, burl, envs, health = run(main())
    replica = {"inflight": 0, "queued": 0, "max_concurrency": 3, "pid": None, "restarts": 0}
    assert envs == (200, {"envs": {
        "babyai": {"adapter": "babyai", "open_sessions": 1, "replicas": [
            {**replica, "url": burl, "healthy": True, "sessions": 1, "last_error": ""}]},
        "mysci": {"adapter": "agentgym", "open_sessions": 0, "replicas": [
            {**replica, "url": dead, "healthy": False, "sessions": 0,
             "last_error": "health check failed (no answer on GET /)"}]}},
        "open_sessions": 1, "max_sessions": 5})
    assert health == (503, {"status": "degraded", "open_sessions": 1, "envs": {
        "babyai": {"healthy_replicas": 1, "replicas": 1}, "mysci": {"healthy_replicas": 0, "replicas": 1}}})
    assert f"replica {dead} out of rotation: health check failed (no answer on GET /)" in caplog.messages


@pytest.mark.parametrize("answers,attempts", [([503, 503, 503, 200], 4), ([503, 404], 2), ([404], 1)])
def test_a_close_is_retried_while_the_backend_may_take_it_and_not_after_a_4xx(monkeypatch, answers, attempts):
    """A client's DELETE whose backend close fails: 5xx answers are retried in the background (after 0.5 s, then
    1 s, ...) until the backend has it; a 4xx says it never will (e.g. the instance is gone), on the DELETE's own
    try or on a background one, and is not retried."""
    from env_gateway.fake_backend import FakeBackend

    tried: list[int] = []

    async def scripted_close(self, request):
        status = answers[min(len(tried), len(answers) - 1)]
        tried.append(status)
        if status != 200:
            return web.json_response({"error": "scripted", "detail": f"close answered {status}"}, status=status)
        return web.json_response({"closed": (await request.json())["id"]})

    monkeypatch.setattr(FakeBackend, "close", scripted_close)

    async def main():
        async with running("agentgym") as (_, burl), gateway({"babyai": [burl]}) as (gw, url):
            async with GatewayClient(url) as client:
                opened = await client.create("babyai", 1)
                got, answer, _ = await raw(url, "DELETE", f"/v1/sessions/{opened.session_id}")
                assert got == 200 and {k: answer[k] for k in ("session_id", "closed", "backend_closed")} == {
                    "session_id": opened.session_id, "closed": True, "backend_closed": False}
                await until(lambda: len(tried) >= attempts, timeout=10)
                await asyncio.sleep(1.2)  # longer than the first back-off: a retry that should not come would
    run(main())
    assert tried == answers
