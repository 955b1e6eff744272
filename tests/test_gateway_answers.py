"""The gateway's answers, word for word, and its bookkeeping behind them: what a create, step or close that fails
answers (status, error, detail, backend, Retry-After), that a failed or cancelled create gives back its replica
reservation, what each endpoint's backend and queue time add up to, how the ended-session memory forgets, the
background close's back-off and stop conditions, the reaper's tick, the health probe, shutdown, and the admission
queue under cancellation. The details are the remedies users read, so they are pinned in full.

Backends are the in-process fake (env_gateway/fake_backend.py) on real sockets; a failure is injected by replacing
one adapter call of the running gateway with a scripted one."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from typing import Any

import pytest

from env_gateway import server as gateway_module
from env_gateway.adapters import BackendError
from env_gateway.config import GatewayConfig, EnvConfig
from env_gateway.fake_backend import expected_action, running
from env_gateway.server import ApiError, Gateway, Slots
from tests.test_gateway import gateway, raw, run, until

pytestmark = pytest.mark.timeout(60)

CREATE = json.dumps({"env": "babyai", "item_id": 1}).encode()


def metric(gw: Gateway, name: str, **labels: str) -> float:
    """The value of one sample of the gateway's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(gw.metrics.render().decode()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def scripted_open(answers: dict[str, Any]):
    """An adapter.open that fails on each replica URL as ``answers`` says: a BackendError, or any exception."""
    async def open_(url: str, item_id: Any, seed: Any) -> Any:
        raise answers[url]
    return open_


def test_a_create_every_replica_refuses_names_each_replica_and_cause_and_gives_back_the_reservations():
    async def main():
        async with running("agentgym") as (_, a), running("agentgym") as (_, b), \
                gateway({"babyai": [a, b]}) as (gw, url):
            pool = gw.pools["babyai"]
            pool.adapter.open = scripted_open({a: BackendError(a, "HTTP 409", retryable=True, status=409),
                                               b: BackendError(b, "HTTP 409", retryable=True, status=409)})
            got, answer, headers = await raw(url, "POST", "/v1/sessions", CREATE)
            assert (got, headers["Retry-After"]) == (503, "1")
            assert answer == {"error": "replicas_busy", "detail": f"no babyai replica can take item 1 now: "
                                                                  f"backend {a}: HTTP 409; backend {b}: HTTP 409"}
            # busy (409), too many requests (429) and full (503: an env server at its --max-instances) all say "later"
            pool.adapter.open = scripted_open({a: BackendError(a, "HTTP 429", retryable=True, status=429),
                                               b: BackendError(b, "HTTP 503", retryable=True, status=503)})
            got, answer, headers = await raw(url, "POST", "/v1/sessions", CREATE)
            assert (got, headers["Retry-After"]) == (503, "1")
            assert answer == {"error": "replicas_busy", "detail": f"no babyai replica can take item 1 now: "
                                                                  f"backend {a}: HTTP 429; backend {b}: HTTP 503"}
            pool.adapter.open = scripted_open({a: BackendError(a, "HTTP 409", retryable=True, status=409),
                                               b: BackendError(b, "HTTP 500", retryable=True, status=500)})
            got, answer, headers = await raw(url, "POST", "/v1/sessions", CREATE)
            assert got == 502 and "Retry-After" not in headers
            assert answer == {"error": "backend_failed", "detail": f"could not open a babyai session on any replica: "
                                                                   f"backend {a}: HTTP 409; backend {b}: HTTP 500"}
            assert [r.sessions for r in pool.replicas] == [0, 0]  # each try's reservation given back
            assert all(r.healthy for r in pool.replicas)  # a backend that answers is up, whatever it answered
            assert metric(gw, "cope_gateway_create_retries_total", env="babyai") == 6
    run(main())


@pytest.mark.parametrize("cause,backend_status,status,error,detail", [
    ("HTTP 404: no item 1", 404, 422, "backend_rejected",
     "the babyai backend {b} rejected item_id 1: HTTP 404: no item 1"),
    ("HTTP 500: boom", 500, 502, "backend_failed", "babyai: backend {b}: HTTP 500: boom"),
    ("the answer is not JSON", None, 502, "backend_failed", "babyai: backend {b}: the answer is not JSON"),
])
def test_a_create_the_backend_refuses_for_good_is_answered_at_once_with_that_backend(cause, backend_status, status,
                                                                                   error, detail):
    """Not retried on the other replica; a 4xx is the item's fault (422), anything else the backend's (502)."""
    async def main():
        async with running("agentgym") as (_, a), running("agentgym") as (_, b), \
                gateway({"babyai": [a, b]}) as (gw, url):
            pool = gw.pools["babyai"]
            kept = (await raw(url, "POST", "/v1/sessions", CREATE))[1]
            assert kept["backend"] == a  # so the failing create below goes to b (fewer sessions), and only there
            pool.adapter.open = scripted_open({b: BackendError(b, cause, retryable=False, status=backend_status)})
            got, answer, _ = await raw(url, "POST", "/v1/sessions", CREATE)
            assert (got, answer) == (status, {"error": error, "detail": detail.format(b=b), "backend": b})
            assert metric(gw, "cope_gateway_create_retries_total", env="babyai") == 0
            assert [r.sessions for r in pool.replicas] == [1, 0]
            # a failure without an HTTP status (no usable answer) takes the replica out of rotation with its cause;
            # one with a status comes from a backend that is up
            assert (pool.replicas[1].healthy, pool.replicas[1].last_error) == (
                (True, "") if backend_status is not None else (False, cause))
    run(main())


def test_a_create_that_raises_unexpectedly_gives_back_its_reservation():
    async def main():
        async with running("agentgym") as (_, a), gateway({"babyai": [a]}) as (gw, url):
            gw.pools["babyai"].adapter.open = scripted_open({a: RuntimeError("a bug in an adapter")})
            got, answer, _ = await raw(url, "POST", "/v1/sessions", CREATE)
            assert (got, answer["error"]) == (500, "internal")
            assert gw.pools["babyai"].replicas[0].sessions == 0
    run(main())


def test_sessions_are_counted_per_replica_and_a_seed_reaches_the_backend():
    async def main():
        async with running("agentgym") as (_, a), gateway({"babyai": [a]}) as (gw, url):
            pool, seen = gw.pools["babyai"], []
            real_open = pool.adapter.open

            async def recording_open(replica_url: str, item_id: Any, seed: Any) -> Any:
                seen.append((replica_url, item_id, seed))
                return await real_open(replica_url, item_id, seed)

            pool.adapter.open = recording_open
            for seed in (7, None, 9):
                body = {"env": "babyai", "item_id": 2, **({"seed": seed} if seed is not None else {})}
                got, answer, _ = await raw(url, "POST", "/v1/sessions", json.dumps(body))
                assert got == 200 and set(answer) == {"session_id", "observation", "info", "backend"}
            assert seen == [(a, 2, 7), (a, 2, None), (a, 2, 9)]
            assert pool.replicas[0].sessions == 3 and len(gw.sessions) == 3
            assert metric(gw, "cope_gateway_sessions_opened_total", env="babyai") == 3
    run(main())


def test_no_healthy_replica_lists_each_replica_with_its_last_error_and_asks_to_retry_after_a_health_check():
    async def main():
        async with running("agentgym") as (_, a), running("agentgym") as (_, b), \
                gateway({"babyai": [a, b]}, health_interval=40) as (gw, url):
            first, second = gw.pools["babyai"].replicas
            for task in list(gw._tasks):  # no health check may put them back during the test
                task.cancel()
            first.healthy = False  # taken out without a recorded cause
            gw.mark_down(second, "cannot connect: refused")
            got, answer, headers = await raw(url, "POST", "/v1/sessions", CREATE)
            assert (got, headers["Retry-After"]) == (503, "40")
            assert answer == {"error": "no_healthy_replica", "detail": f"no healthy babyai replica right now: {a} "
                                                                       f"(down), {b} (cannot connect: refused); "
                                                                       "retry later"}
    run(main())


def test_backend_time_adds_up_over_a_create_that_was_retried():
    """cope_gateway_backend_seconds of a create counts every replica it tried: 0.3 s failing + the real open."""
    async def main():
        async with running("agentgym") as (_, a), running("agentgym") as (_, b), \
                gateway({"babyai": [a, b]}) as (gw, url):
            pool = gw.pools["babyai"]
            real_open = pool.adapter.open

            async def slow_fail_on_a(replica_url: str, item_id: Any, seed: Any) -> Any:
                if replica_url == a:
                    await asyncio.sleep(0.3)
                    raise BackendError(a, "HTTP 503", retryable=True, status=503)
                return await real_open(replica_url, item_id, seed)

            pool.adapter.open = slow_fail_on_a
            got, answer, _ = await raw(url, "POST", "/v1/sessions", CREATE)
            assert (got, answer["backend"]) == (200, b)
            backend = metric(gw, "cope_gateway_backend_seconds_sum", env="babyai", endpoint="create")
            total = metric(gw, "cope_gateway_request_seconds_sum", env="babyai", endpoint="create")
            assert 0.3 <= backend <= total
            assert metric(gw, "cope_gateway_overhead_seconds_sum", env="babyai", endpoint="create") >= 0
    run(main())


def test_queue_time_adds_up_over_a_create_that_waited_on_two_replicas():
    """Both replicas full: the create waits 0.3 s for the first, whose open fails, then waits for the second until
    0.6 s; cope_gateway_queue_wait_seconds of the create counts both waits."""
    async def main():
        async with running("agentgym") as (_, a), running("agentgym") as (_, b), \
                gateway({"babyai": [a, b]}, max_concurrency=1, queue_timeout=10) as (gw, url):
            first, second = gw.pools["babyai"].replicas
            real_open = gw.pools["babyai"].adapter.open

            async def fail_on_a(replica_url: str, item_id: Any, seed: Any) -> Any:
                if replica_url == a:
                    raise BackendError(a, "HTTP 503", retryable=True, status=503)
                return await real_open(replica_url, item_id, seed)

            gw.pools["babyai"].adapter.open = fail_on_a
            assert first.slots.try_take() and second.slots.try_take()  # both replicas at their one request
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, first.slots.release)
            loop.call_later(0.6, second.slots.release)
            got, answer, _ = await raw(url, "POST", "/v1/sessions", CREATE)
            assert (got, answer["backend"]) == (200, b)
            assert metric(gw, "cope_gateway_queue_wait_seconds_sum", env="babyai", endpoint="create") >= 0.55
    run(main())


def test_creates_steps_and_closes_wait_in_the_replica_queue_and_the_wait_is_measured_per_endpoint(caplog):
    """One slot, held by a slow step: a create, a step and a close queue behind it (their waits are measured), and
    with a short queue timeout each is refused naming the env; a close that cannot get a slot is logged and
    retried in the background."""
    async def main():
        async with running("agentgym", episode_len=50) as (backend, a), \
                gateway({"babyai": [a]}, max_concurrency=1, queue_timeout=10) as (gw, url):
            sids = []
            for item in (1, 2, 3):
                sids.append((await raw(url, "POST", "/v1/sessions", json.dumps({"env": "babyai", "item_id": item}))
                             )[1]["session_id"])
            slots = gw.pools["babyai"].replicas[0].slots
            backend.delay = 0.4
            holder = asyncio.ensure_future(raw(url, "POST", f"/v1/sessions/{sids[0]}/step",
                                               json.dumps({"action": expected_action(1, 0)})))
            await until(lambda: slots.used == 1)
            queued = [asyncio.ensure_future(raw(url, "POST", "/v1/sessions", CREATE)),
                      asyncio.ensure_future(raw(url, "POST", f"/v1/sessions/{sids[1]}/step",
                                                json.dumps({"action": expected_action(2, 0)}))),
                      asyncio.ensure_future(raw(url, "DELETE", f"/v1/sessions/{sids[2]}"))]
            await until(lambda: len(slots.waiters) == 3)
            assert [r[0] for r in await asyncio.gather(holder, *queued)] == [200, 200, 200, 200]
            for endpoint in ("create", "step", "close"):
                assert metric(gw, "cope_gateway_queue_wait_seconds_sum", env="babyai", endpoint=endpoint) > 0, endpoint

            gw.config.queue_timeout = 0.2
            backend.delay = 1.0  # the slot stays taken past both refusals below
            open_sid = (await raw(url, "POST", "/v1/sessions", CREATE))[1]["session_id"]
            holder = asyncio.ensure_future(raw(url, "POST", f"/v1/sessions/{sids[1]}/step",
                                               json.dumps({"action": expected_action(2, 1)})))
            await until(lambda: slots.used == 1)
            refusals = await asyncio.gather(
                raw(url, "POST", "/v1/sessions", CREATE),
                raw(url, "POST", f"/v1/sessions/{sids[0]}/step", json.dumps({"action": expected_action(1, 1)})))
            closed = await raw(url, "DELETE", f"/v1/sessions/{open_sid}")
            for got, answer, _ in refusals:
                assert (got, answer) == (503, {"error": "overloaded", "detail": refused_detail(a)})
            assert closed[:2] == (200, {"session_id": open_sid, "closed": True, "backend_closed": False, "detail": (
                "the backend could not take the close now (busy, or a failure that may pass); the gateway keeps "
                "closing the instance there in the background: nothing to do")})
            await holder
            await until(lambda: backend.counts["close"] == 2)  # the background retry got it closed
            return open_sid, a

    def refused_detail(a: str) -> str:
        return (f"babyai replica {a} stayed at its limit of 1 requests in flight for 0.2s (queue timeout); nothing "
                "was sent to the backend: retry later")

    with caplog.at_level(logging.WARNING, logger="env_gateway"):
        open_sid, a = run(main())
    assert f"closing babyai session {open_sid} on {a} deferred: {refused_detail(a)}" in caplog.messages


def test_a_close_answers_exactly_what_happened_on_the_backend(caplog):
    async def main():
        async with running("agentgym") as (backend, a), gateway({"babyai": [a]}) as (gw, url):
            pool = gw.pools["babyai"]
            done = (await raw(url, "POST", "/v1/sessions", CREATE))[1]["session_id"]
            got, answer, _ = await raw(url, "DELETE", f"/v1/sessions/{done}")
            assert (got, answer) == (200, {"session_id": done, "closed": True, "backend_closed": True})
            assert backend.counts["close"] == 1
            assert metric(gw, "cope_gateway_requests_total", env="babyai", endpoint="close", code="200") == 1
            assert metric(gw, "cope_gateway_backend_seconds_count", env="babyai", endpoint="close") == 1
            assert 0 <= metric(gw, "cope_gateway_backend_seconds_sum", env="babyai", endpoint="close") <= metric(
                gw, "cope_gateway_request_seconds_sum", env="babyai", endpoint="close")

            gone = (await raw(url, "POST", "/v1/sessions", CREATE))[1]["session_id"]
            real_close = pool.adapter.close

            async def refuse(replica_url: str, handle: Any) -> None:
                raise BackendError(replica_url, "HTTP 404: no such instance", retryable=False, status=404)

            pool.adapter.close = refuse
            got, answer, _ = await raw(url, "DELETE", f"/v1/sessions/{gone}")
            assert (got, answer) == (200, {"session_id": gone, "closed": True, "backend_closed": False,
                                           "detail": f"backend {a}: HTTP 404: no such instance"})
            pool.adapter.close = real_close
            got, answer, _ = await raw(url, "POST", f"/v1/sessions/{gone}/step", json.dumps({"action": "x"}))
            assert (got, answer) == (410, {"error": "session_gone", "detail": f"session {gone} is closed by the "
                                                                              "client; open a new one with POST "
                                                                              "/v1/sessions"})
            return gone, a

    with caplog.at_level(logging.WARNING, logger="env_gateway"):
        gone, a = run(main())
    assert caplog.messages == [f"closing babyai session {gone}: backend {a}: HTTP 404: no such instance"]


def test_step_answers_in_full():
    """Every refusal of a step, key for key, the action-size limit at its edge, and the 409 of a second step."""
    async def main():
        async with running("agentgym", episode_len=50) as (backend, a), \
                gateway({"babyai": [a]}, max_action_bytes=12) as (gw, url):
            sid = (await raw(url, "POST", "/v1/sessions", CREATE))[1]["session_id"]
            step = f"/v1/sessions/{sid}/step"
            got, answer, _ = await raw(url, "POST", step, json.dumps({"act": "x"}))
            assert (got, answer) == (400, {"error": "missing_action", "detail": "the body needs 'action': the agent's "
                                                                                "action, e.g. {\"action\": \"go "
                                                                                "forward\"}"})
            got, answer, _ = await raw(url, "POST", step, json.dumps({"action": "x" * 11}))
            assert (got, answer) == (413, {"error": "action_too_large", "detail": "babyai: the action is 13 bytes as "
                                                                                  "forwarded, over the gateway's "
                                                                                  "--max-action-bytes 12; send a "
                                                                                  "shorter action (the session stays "
                                                                                  "open)"})
            got, answer, _ = await raw(url, "POST", step, json.dumps({"action": "x" * 10}))  # "xxxxxxxxxx": 12 bytes
            assert got == 200, answer
            backend.delay = 0.5
            first = asyncio.ensure_future(raw(url, "POST", step, json.dumps({"action": "y"})))
            await until(lambda: gw.sessions[sid].busy)
            got, answer, _ = await raw(url, "POST", step, json.dumps({"action": "z"}))
            assert (got, answer) == (409, {"error": "session_busy", "detail": f"session {sid} has a step in flight "
                                                                              "already; send one step at a time and "
                                                                              "wait for its answer"})
            assert (await first)[0] == 200 and not gw.sessions[sid].busy
            assert 0.5 <= metric(gw, "cope_gateway_backend_seconds_sum", env="babyai", endpoint="step") <= metric(
                gw, "cope_gateway_request_seconds_sum", env="babyai", endpoint="step")
            got, answer, _ = await raw(url, "POST", "/v1/sessions/feedbeef/step", json.dumps({"action": "x"}))
            assert (got, answer) == (404, {"error": "unknown_session", "detail": "no session 'feedbeef': open one "
                                                                                 "with POST /v1/sessions"})
    run(main())


@pytest.mark.parametrize("timed_out,status,error", [(False, 502, "backend_failed"), (True, 504, "backend_timeout")])
def test_a_step_that_fails_on_a_backend_that_is_up_ends_the_session_and_closes_its_instance(timed_out, status, error):
    async def main():
        async with running("agentgym") as (backend, a), gateway({"babyai": [a]}) as (gw, url):
            pool = gw.pools["babyai"]
            sid = (await raw(url, "POST", "/v1/sessions", CREATE))[1]["session_id"]
            cause = "timed out after 1s" if timed_out else "HTTP 500: boom"

            async def fail(replica_url: str, handle: Any, action: Any) -> Any:
                raise BackendError(replica_url, cause, retryable=False, status=None if timed_out else 500,
                                   timed_out=timed_out)

            pool.adapter.step = fail
            got, answer, _ = await raw(url, "POST", f"/v1/sessions/{sid}/step", json.dumps({"action": "x"}))
            assert (got, answer) == (status, {"error": error, "backend": a, "detail": (
                f"babyai step failed on backend {a}: {cause}. The session is ended: finish this episode (e.g. with "
                "reward 0) and open a new session.")})
            assert pool.replicas[0].healthy and pool.replicas[0].sessions == 0
            assert metric(gw, "cope_gateway_sessions_failed_total", env="babyai") == 1
            await until(lambda: backend.counts["close"] == 1)  # released on the backend, in the background
    run(main())


def test_a_step_that_cannot_reach_its_backend_takes_the_replica_out_with_the_cause():
    async def main():
        async with running("agentgym") as (backend, a), gateway({"babyai": [a]}, health_interval=60) as (gw, url):
            pool = gw.pools["babyai"]
            sid = (await raw(url, "POST", "/v1/sessions", CREATE))[1]["session_id"]

            async def unreachable(replica_url: str, handle: Any, action: Any) -> Any:
                raise BackendError(replica_url, "cannot connect: refused", retryable=True, reached=False)

            pool.adapter.step = unreachable
            got, answer, _ = await raw(url, "POST", f"/v1/sessions/{sid}/step", json.dumps({"action": "x"}))
            assert (got, answer["error"]) == (502, "backend_failed")
            assert (pool.replicas[0].healthy, pool.replicas[0].last_error) == (False, "cannot connect: refused")
            await asyncio.sleep(0.2)
            assert backend.counts["close"] == 0  # no close sent to a replica that is down
    run(main())


def test_a_session_closed_while_its_step_is_in_flight_fails_that_step_cleanly():
    """A DELETE during a step ends the session; the step then failing on the backend must not end it twice (a 502,
    not a 500)."""
    async def main():
        async with running("agentgym") as (_, a), gateway({"babyai": [a]}) as (gw, url):
            pool = gw.pools["babyai"]
            sid = (await raw(url, "POST", "/v1/sessions", CREATE))[1]["session_id"]
            release = asyncio.Event()

            async def fail_later(replica_url: str, handle: Any, action: Any) -> Any:
                await release.wait()
                raise BackendError(replica_url, "HTTP 500: instance closed", retryable=False, status=500)

            pool.adapter.step = fail_later
            stepping = asyncio.ensure_future(raw(url, "POST", f"/v1/sessions/{sid}/step", json.dumps({"action": "x"})))
            await until(lambda: gw.sessions[sid].busy)
            assert (await raw(url, "DELETE", f"/v1/sessions/{sid}"))[0] == 200
            release.set()
            got, answer, _ = await stepping
            assert (got, answer["error"]) == (502, "backend_failed")
            assert pool.replicas[0].sessions == 0 and gw.gone[sid] == "closed by the client"
    run(main())


def test_ended_sessions_are_remembered_newest_first_up_to_the_limit(monkeypatch):
    monkeypatch.setattr(gateway_module, "GONE_MEMORY", 3)

    async def main():
        async with running("agentgym") as (_, a), gateway({"babyai": [a]}) as (gw, url):
            sids = [(await raw(url, "POST", "/v1/sessions", CREATE))[1]["session_id"] for _ in range(4)]
            for sid in sids:
                await raw(url, "DELETE", f"/v1/sessions/{sid}")
            assert list(gw.gone) == sids[1:]
            answers = [(await raw(url, "DELETE", f"/v1/sessions/{sid}"))[:2] for sid in sids]
            assert [got for got, _ in answers] == [404, 410, 410, 410]
    run(main())


def test_unknown_envs_seeds_fields_and_the_session_limit_are_answered_in_full():
    async def main():
        async with running("agentgym", delay=0.3) as (_, a), \
                gateway({"babyai": [a], "alfworld": EnvConfig("alfworld", [a], adapter="agentgym")},
                        max_sessions=2) as (gw, url):
            got, answer, _ = await raw(url, "POST", "/v1/sessions", json.dumps({"env": "babyai"}))
            assert (got, answer) == (400, {"error": "missing_field", "detail": "the body needs 'item_id', e.g. "
                                                                               "{\"env\": \"babyai\", \"item_id\": 3}"})
            for env in ("nope", ["babyai"]):
                got, answer, _ = await raw(url, "POST", "/v1/sessions", json.dumps({"env": env, "item_id": 1}))
                assert (got, answer["error"]) == (404, "unknown_env")
                assert answer["detail"].endswith("behind this gateway; known: alfworld, babyai")
            got, answer, _ = await raw(url, "POST", "/v1/sessions", json.dumps({"env": "babyai", "item_id": 1,
                                                                                 "seed": "7"}))
            assert (got, answer) == (400, {"error": "bad_seed", "detail": "'seed' must be an integer or absent, got "
                                                                          "'7'"})
            # three creates at once against a limit of two: sessions still opening count
            answers = await asyncio.gather(*(raw(url, "POST", "/v1/sessions", CREATE) for _ in range(3)))
            assert sorted(got for got, _, _ in answers) == [200, 200, 503]
            refused, headers = next((answer, headers) for got, answer, headers in answers if got == 503)
            assert refused == {"error": "too_many_sessions", "detail": "the gateway holds its maximum of 2 open "
                                                                       "sessions (--max-sessions): close finished "
                                                                       "sessions, or retry later"}
            assert headers["Retry-After"] == "1"
            assert gw.opening == 0
    run(main())


def test_the_background_close_backs_off_from_half_a_second_to_ten_and_stops_when_it_should(monkeypatch):
    gw = Gateway(GatewayConfig(envs={"babyai": EnvConfig("babyai", ["http://a:1"])}))
    replica = gw.pools["babyai"].replicas[0]
    session = gateway_module.Session("s", gw.pools["babyai"], replica, None, 0.0)
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(delay: float) -> None:
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(gateway_module.asyncio, "sleep", fake_sleep)

    def attempts(*answers: tuple[bool, str, bool]) -> list:
        calls = []

        async def close_on_backend(s: Any, request: Any = None) -> tuple[bool, str, bool]:
            assert s is session
            calls.append(answers[min(len(calls), len(answers) - 1)])
            return calls[-1]
        gw.close_on_backend = close_on_backend
        slept.clear()
        asyncio.run(gw.close_in_background(session))
        return calls

    busy, closed, refused = (False, "busy", True), (True, "", False), (False, "HTTP 404", False)
    assert len(attempts(*[busy] * 8, closed)) == 9
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert len(attempts(refused)) == 1 and slept == []
    assert len(attempts(busy, busy, refused)) == 3 and slept == [0.5, 1.0]
    replica.healthy = False  # down: the env server's own TTL reaps the instance
    assert len(attempts(busy)) == 1 and slept == []


@pytest.mark.parametrize("ttl,tick", [(2.0, 0.5), (0.1, 0.05), (100.0, 10.0)])
def test_the_reaper_looks_every_quarter_ttl_between_50ms_and_10s(monkeypatch, ttl, tick):
    gw = Gateway(GatewayConfig(envs={"babyai": EnvConfig("babyai", ["http://a:1"])}, session_ttl=ttl))
    slept: list[float] = []

    async def fake_sleep(delay: float) -> None:
        slept.append(delay)
        raise asyncio.CancelledError

    monkeypatch.setattr(gateway_module.asyncio, "sleep", fake_sleep)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(gw.reap_loop())
    assert slept == [pytest.approx(tick)]


def test_a_reaped_session_is_counted_for_its_env():
    async def main():
        async with running("agentgym") as (backend, a), gateway({"babyai": [a]}, session_ttl=0.2) as (gw, url):
            sid = (await raw(url, "POST", "/v1/sessions", CREATE))[1]["session_id"]
            await until(lambda: backend.counts["close"] == 1)
            assert metric(gw, "cope_gateway_sessions_reaped_total", env="babyai") == 1
            assert gw.gone[sid] == "expired: idle for more than 0.2s (--session-ttl), and closed on the backend"
    run(main())


@pytest.mark.parametrize("request_timeout,probe_timeout", [(30.0, 5.0), (2.0, 2.0)])
def test_the_health_probe_waits_at_most_5s_and_puts_a_replica_back_with_its_error_cleared(caplog, request_timeout,
                                                                                        probe_timeout):
    """A replica goes out of rotation on its first failed probe, stays out while probes fail, and comes back (error
    cleared) on the first that answers; each change is logged once, a healthy replica's probe logs nothing."""
    gw = Gateway(GatewayConfig(envs={"babyai": EnvConfig("babyai", ["http://a:1"])}, request_timeout=request_timeout))
    pool = gw.pools["babyai"]
    replica, answers, timeouts = pool.replicas[0], [], []

    class Probe:
        async def alive(self, url: str, timeout: float) -> bool:
            timeouts.append(timeout)
            return answers.pop(0)

    pool.adapter = Probe()
    answers[:] = [True, False, False, True]  # healthy and answering; down; still down; back
    with caplog.at_level(logging.INFO, logger="env_gateway"):
        asyncio.run(gw.probe(pool, replica))
        assert (replica.healthy, replica.last_error) == (True, "") and not caplog.messages
        for _ in range(2):
            asyncio.run(gw.probe(pool, replica))
            assert (replica.healthy, replica.last_error) == (False, "health check failed (no answer on GET /)")
        asyncio.run(gw.probe(pool, replica))
    assert (replica.healthy, replica.last_error) == (True, "")
    assert timeouts == [probe_timeout] * 4
    assert caplog.messages == ["replica http://a:1 out of rotation: health check failed (no answer on GET /)",
                               "replica http://a:1 (babyai) answers again: back in rotation"]


def test_shutdown_closes_open_sessions_on_their_backend_and_does_not_wait_on_one_that_hangs():
    """The hanging close is given up after the shutdown's 5 s bound, not sooner and not later (a hang would hit this
    test's deadline)."""
    async def main():
        async with running("agentgym") as (backend, a), running("agentgym") as (_, b):
            async with gateway({"babyai": [a], "alfworld": EnvConfig("alfworld", [b], adapter="agentgym")},
                               request_timeout=60) as (gw, url):
                ok = (await raw(url, "POST", "/v1/sessions", CREATE))[1]["session_id"]
                hung = (await raw(url, "POST", "/v1/sessions", json.dumps({"env": "alfworld", "item_id": 1})))[1]

                async def never_answers(replica_url: str, handle: Any) -> None:
                    await asyncio.Event().wait()

                gw.pools["alfworld"].adapter.close = never_answers
                leaving = time.perf_counter()
            # The bound is what a user's supervisor waits for: all of it for a slow close, and not a second more.
            assert 4.9 <= time.perf_counter() - leaving < 5.8
            assert backend.counts["close"] == 1
            assert gw.gone[ok] == gw.gone[hung["session_id"]] == "closed: the gateway shut down"
            assert gw.http is not None and not gw.http._idle  # no kept-alive backend connection left open
    run(main(), timeout=20)


def test_shutdown_returns_once_its_background_loops_have_ended_and_needs_no_start():
    """The health probe and the reaper are cancelled and awaited: none is left pending when the app's cleanup ends
    (asyncio would report it destroyed while pending when the loop closes). A gateway never started stops too."""
    async def main():
        gw = Gateway(GatewayConfig(envs={"babyai": EnvConfig("babyai", ["http://127.0.0.1:9"])}))
        await gw.start()
        loops = list(gw._tasks)
        assert len(loops) == 2 and not any(task.done() for task in loops)
        await gw.stop()
        assert all(task.cancelled() for task in loops)
        never_started = Gateway(GatewayConfig(envs={"babyai": EnvConfig("babyai", ["http://127.0.0.1:9"])}))
        await never_started.stop()  # an app whose start-up failed is still cleaned up: nothing to stop, no error
    run(main())


def test_a_waiter_cancelled_after_it_was_handed_the_slot_hands_it_on_and_one_cancelled_otherwise_takes_nothing():
    async def main():
        slots = Slots(1)
        assert slots.try_take() and not slots.try_take()
        granted_then_cancelled = asyncio.ensure_future(slots.wait(10))
        still_waiting = asyncio.ensure_future(slots.wait(10))
        await until(lambda: len(slots.waiters) == 2)
        slots.release()  # hands the slot to the first waiter, whose task is cancelled before it runs
        granted_then_cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await granted_then_cancelled
        assert await still_waiting is True and slots.used == 1  # the slot went on to the next in line
        never_granted = asyncio.ensure_future(slots.wait(10))
        await until(lambda: len(slots.waiters) == 1)
        never_granted.cancel()
        with pytest.raises(asyncio.CancelledError):
            await never_granted
        assert slots.used == 1
        slots.release()
        assert slots.used == 0 and slots.try_take()
        assert await slots.wait(0.05) is False and not slots.waiters  # a timed-out waiter leaves the line
        timed_out_then_cancelled = asyncio.ensure_future(slots.wait(10))
        await until(lambda: len(slots.waiters) == 1)
        slots.waiters[0].set_result(False)  # its timer fired, and its task is cancelled before it runs
        timed_out_then_cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await timed_out_then_cancelled
        assert slots.used == 1  # it held no slot, so it gave none back
    run(main())


def test_requests_waiting_for_a_replica_count_as_its_load_when_routing():
    gw = Gateway(GatewayConfig(envs={"babyai": EnvConfig("babyai", ["http://a:1", "http://b:1"])}))
    a, b = gw.pools["babyai"].replicas
    a.slots.used, a.slots.waiters = 1, collections.deque([object(), object()])  # 1 in flight + 2 queued
    b.slots.used = 2
    assert gw.pools["babyai"].pick(set()) is b


def test_an_api_error_reads_as_its_detail():
    """What a log line or a traceback of one shows."""
    assert str(ApiError(503, "overloaded", "the replica is full: retry later", retry_after=1)) == (
        "the replica is full: retry later")


def test_an_answer_never_carries_nan_or_infinity():
    """Every answer is standard JSON: a non-finite number raises where the answer is made (the middleware turns that
    into a JSON 500) instead of going out as ``NaN``, which strict parsers (and this project's client) refuse."""
    for value in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
            gateway_module.answer({"reward": value})
    assert json.loads(gateway_module.answer({"reward": 1.5}).text) == {"reward": 1.5}
