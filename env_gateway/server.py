"""The gateway: one aiohttp service between agent funcs and pools of environment servers.

    POST   /v1/sessions            {env, item_id, seed?} -> {session_id, observation, info, backend}
    POST   /v1/sessions/{id}/step  {action}              -> {observation, reward, done, info}
    DELETE /v1/sessions/{id}                             -> {session_id, closed, backend_closed[, detail]}
                                                            (backend_closed false: the gateway retries the close)
    GET    /v1/envs     GET /v1/health (503 when an env has no healthy replica)     GET /metrics

Contract:
- Routing: a new session goes to the healthy replica of its env with the fewest open sessions (ties: the
  fewest requests in flight or queued) and sticks to it.
- Admission control: at most ``max_concurrency`` requests in flight per replica. Excess requests wait in a
  FIFO queue for at most ``queue_timeout`` seconds (and at most ``max_queue`` of them), else 503 with
  ``Retry-After``; a step that got a 503 was never sent, so retrying it is safe.
- Deadlines: a client has ``read_timeout`` for a request's headers and again for its body (408), and an idle
  connection is closed after it; every backend call has ``request_timeout``; a session idle for ``session_ttl`` is closed on
  its backend and later requests for it get 410; at most ``max_sessions`` sessions are open. A backend close
  that cannot run now (replica busy, a failure that may pass) is retried in the background until it runs, the
  backend answers 4xx, or the replica is declared down (then the env server's own idle TTL reaps the instance).
- Failures: a create/reset that fails at the connection, times out or gets a 5xx is retried on another
  healthy replica; when every replica refuses it as busy or full (409: e.g. AppWorld holds one world per task id;
  429; 503: e.g. an env server at its --max-instances) the caller gets 503 with ``Retry-After``. A client that
  closes its connection while its create waits or runs gets no session: none is sent to a backend once it has
  gone, and an instance opened meanwhile is closed at once. A failed step is not retried (a step is not
  idempotent): the session is ended (410 afterwards), its backend instance is closed unless the backend is down,
  and the caller gets 502 (504 on a timeout) naming the backend and the cause, so the agent func can end that
  episode with reward 0 while the rest of its group carries on. Only a backend that does not answer (refused,
  reset, lost connection) is taken out of rotation, at once; periodic health checks put it back when it answers.
  One that answers wrongly (not HTTP, over ``max_answer_bytes``, not standard JSON, a missing field, a reward
  that is not a finite number, ``done`` that is not true/false) fails that call only (env_gateway/adapters.py).
- Actions are forwarded as sent (UTF-8 JSON, no ``\\u`` escapes that would triple non-ASCII text); one larger than
  ``max_action_bytes`` as forwarded gets 413 and one that is not valid Unicode (a lone surrogate) 400, before a
  backend sees it; the session stays open.
- Access: with ``auth_token_file``, /v1/sessions requests need ``Authorization: Bearer <token>`` (the scheme in
  any case, RFC 7235; 401 otherwise, whatever bytes the header holds; compared in constant time), and /v1/envs and
  /metrics show backend URLs and pids only to them (/metrics names replicas by position otherwise); health and
  /metrics stay open. Without it everything is open, which only a gateway on a loopback address may be (config.py
  refuses any other host without a token).
- Errors: every answer is standard JSON (never NaN or Infinity); an error answer is ``{"error": name, "detail":
  what happened and what to do}``, the name a stable code and the detail short: a backend's own error text (a
  traceback, file paths) goes to the log, not to the caller. Bad input gets a 4xx, never a 500, and nothing waits
  without a deadline; backend answers are bounded in time (``request_timeout``) and size (``max_answer_bytes``).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from env_gateway.adapters import Adapter, BackendError, BadItem, load_adapter
from env_gateway.config import ConfigError, EnvConfig, GatewayConfig
from env_gateway.secret_file import read_secret_file
from env_gateway.servers._base import non_finite, short
from env_gateway.http1 import Http1Pool
from env_gateway.metrics import GatewayMetrics

log = logging.getLogger("env_gateway")

API_HELP = ("the API is POST /v1/sessions, POST /v1/sessions/{id}/step, DELETE /v1/sessions/{id}, "
            "GET /v1/envs, GET /v1/health, GET /metrics")
ENV, BACKEND_S, QUEUE_S = web.RequestKey("env", str), web.RequestKey("backend_s", float), web.RequestKey("queue_s", float)
AUTHORIZED = web.RequestKey("authorized", bool)
GONE_MEMORY = 100_000  # ended session ids remembered, so late requests get 410 with the reason, not 404
BUSY = (409, 429, 503)  # a backend's "not now": a create every replica answers with one of these is a 503 to retry
# every answer standard JSON: NaN/Infinity raise instead (one encoder, made once: json.dumps with a non-default
# argument builds a new one per call)
dumps = json.JSONEncoder(allow_nan=False).encode


def answer(data: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    """A JSON answer (``dumps``)."""
    return web.json_response(data, status=status, headers=headers, dumps=dumps)


def client_gone(request: web.Request) -> bool:
    """The client closed its connection: nobody will read this request's answer."""
    transport = request.transport
    return transport is None or transport.is_closing()


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: str, retry_after: float | None = None, **extra: Any):
        super().__init__(detail)
        self.status, self.error, self.detail, self.retry_after, self.extra = status, error, detail, retry_after, extra

    def response(self) -> web.Response:
        headers = {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after is not None else None
        return answer({"error": self.error, "detail": self.detail, **self.extra}, self.status, headers)


class Slots:
    """Admission control for one replica: ``cap`` holders at a time, the rest wait FIFO with a deadline.
    A waiter's future is settled exactly once, by ``release`` (True: the slot is handed over) or by its
    timer (False), so a timeout can never leak or double-count a slot."""

    def __init__(self, cap: int):
        self.cap, self.used = cap, 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    def try_take(self) -> bool:
        """A slot now, if one is free and nobody waits for one (no coroutine: the gateway's fast path)."""
        if self.used < self.cap and not self.waiters:
            self.used += 1
            return True
        return False

    async def wait(self, timeout: float) -> bool:
        """After ``try_take`` failed: wait in line for a slot; True once ``release`` hands one over, False after
        ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.waiters.append(fut)
        timer = loop.call_later(timeout, lambda: fut.done() or fut.set_result(False))
        try:
            granted = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self.release()
            raise
        finally:
            timer.cancel()
        if not granted:
            try:
                self.waiters.remove(fut)
            except ValueError:
                pass
        return granted

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(True)
                return
        self.used -= 1


class Replica:
    def __init__(self, url: str, cap: int):
        self.url, self.slots = url, Slots(cap)
        self.healthy, self.last_error = True, ""
        self.sessions = 0  # open (or opening) sessions routed here
        self.pid: int | None = None  # set by the supervisor for spawned replicas
        self.restarts = 0

    def describe(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "sessions": self.sessions, "inflight": self.slots.used,
                "queued": len(self.slots.waiters), "max_concurrency": self.slots.cap, "last_error": self.last_error,
                "pid": self.pid, "restarts": self.restarts}


class Pool:
    """The replicas of one environment and the adapter that speaks their protocol."""

    def __init__(self, cfg: EnvConfig, default_cap: int):
        self.name, self.cfg = cfg.name, cfg
        self.adapter_cls = load_adapter(cfg.adapter or cfg.name)
        self.adapter: Adapter | None = None  # built at start-up, when the HTTP session exists
        self.replicas = [Replica(url, cfg.max_concurrency or default_cap) for url in cfg.urls]

    def pick(self, exclude: set) -> Replica | None:
        ready = [r for r in self.replicas if r.healthy and r not in exclude]
        return min(ready, key=lambda r: (r.sessions, r.slots.used + len(r.slots.waiters)), default=None)


@dataclass(eq=False)
class Session:
    id: str
    pool: Pool
    replica: Replica
    handle: Any
    last_used: float
    busy: bool = False


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config.validate()
        self.pools = {name: Pool(env, config.max_concurrency) for name, env in config.envs.items()}
        self.sessions: dict[str, Session] = {}
        self.gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.opening = 0
        self.metrics = GatewayMetrics(self.describe_envs)
        self.http: Http1Pool | None = None
        self._tasks: set[asyncio.Task] = set()
        try:
            self.token = read_secret_file(config.auth_token_file).encode() if config.auth_token_file else None
        except ValueError as e:
            raise ConfigError(f"--auth-token-file: {e}") from None

    # ---- lifecycle -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.middleware], client_max_size=self.config.max_body)
        app.add_routes([
            web.post("/v1/sessions", self.create_session, name="create"),
            web.post("/v1/sessions/{session_id}/step", self.step_session, name="step"),
            web.delete("/v1/sessions/{session_id}", self.delete_session, name="close"),
            web.get("/v1/envs", self.list_envs, name="envs"),
            web.get("/v1/health", self.health, name="health"),
            web.get("/metrics", self.render_metrics, name="metrics"),
        ])
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    async def start(self, app: web.Application | None = None) -> None:
        # connections per replica are bounded by its cap (admission control), an answer's size by max_answer_bytes
        self.http = Http1Pool(max_answer_bytes=self.config.max_answer_bytes)
        for pool in self.pools.values():
            pool.adapter = pool.adapter_cls(self.http, self.config.request_timeout, pool.cfg.options)
        self._background(self.health_loop())
        self._background(self.reap_loop())

    async def stop(self, app: web.Application | None = None) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        open_sessions = list(self.sessions.values())
        for s in open_sessions:
            self.end_session(s, "closed: the gateway shut down")
        if open_sessions:  # bounded: a dead backend must not hold up shutdown
            _, late = await asyncio.wait([asyncio.ensure_future(self.close_on_backend(s)) for s in open_sessions],
                                         timeout=5)
            for task in late:
                task.cancel()
        if self.http is not None:
            self.http.close()

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- plumbing ------------------------------------------------------------------------------
    def authorized(self, request: web.Request) -> bool:
        """Whether the request carries this gateway's token (always, without one): ``Bearer`` in any case (RFC 7235),
        then the token, compared in constant time (no guessing by timing). The header's text is compared as the bytes
        it came as (aiohttp keeps bytes that are not UTF-8 as surrogates), so no header value can raise."""
        if self.token is None:
            return True
        scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
        return hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), self.token) and (
            scheme.lower() == "bearer")

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        t0 = time.perf_counter()
        request[ENV], request[BACKEND_S], request[QUEUE_S], request[AUTHORIZED] = "-", 0.0, 0.0, False
        error = None
        try:
            request[AUTHORIZED] = self.authorized(request)
            if not request[AUTHORIZED] and request.path.startswith("/v1/sessions"):
                raise ApiError(401, "unauthorized", "this gateway needs 'Authorization: Bearer <token>' with the token "
                                                    "in its --auth-token-file (GatewayClient and the agent funcs: "
                                                    "COPE_GATEWAY_TOKEN_FILE)")
            resp = await handler(request)
        except ApiError as e:
            resp, error = e.response(), e.error
        except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
            error = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(e.status, "http_error")
            detail = (f"request body over {self.config.max_body} bytes (--max-body)" if e.status == 413
                      else f"{request.method} {request.path}: {e.reason}; {API_HELP}")
            resp = answer({"error": error, "detail": detail}, e.status)
        except Exception as e:  # a bug of ours: answer, log, keep serving
            log.exception("%s %s failed", request.method, request.path)
            error = "internal"  # the exception's text (it may quote anything) stays in the log
            resp = answer({"error": error, "detail": f"the gateway failed on this request ({type(e).__name__}); its "
                                                     "log has the details"}, 500)
        route = request.match_info.route
        self.metrics.observe(request[ENV], route.name or "unknown", resp.status, error,
                             time.perf_counter() - t0, request[BACKEND_S], request[QUEUE_S])
        return resp

    async def read_json(self, request: web.Request) -> dict:
        try:
            raw = await asyncio.wait_for(request.read(), self.config.read_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, "body_timeout", f"the body did not arrive within {self.config.read_timeout:g}s "
                                                "(--read-timeout); send it at once") from None
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, "body_too_large", f"request body over {self.config.max_body} bytes: send less, or "
                                                  "raise the gateway's --max-body") from None
        except ConnectionResetError:  # the client went away mid-body: its mistake, not ours (no one reads this)
            raise ApiError(400, "client_disconnected", "the client closed the connection before the body "
                                                       "ended") from None
        try:
            data = json.loads(raw, parse_constant=non_finite)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, "bad_json", f"the body is not valid JSON ({e}); send a JSON object") from None
        except RecursionError:
            raise ApiError(400, "bad_json", "the body nests arrays/objects deeper than the JSON parser takes; send a "
                                            "flat JSON object") from None
        if not isinstance(data, dict):
            raise ApiError(400, "bad_json", f"the body must be a JSON object, got {type(data).__name__}")
        return data

    async def acquire(self, replica: Replica, request: web.Request | None, env: str) -> None:
        slots = replica.slots
        if slots.try_take():
            return
        if len(slots.waiters) >= self.config.max_queue:
            raise ApiError(503, "overloaded", f"{env} replica {replica.url} has {len(slots.waiters)} requests "
                                              "queued already; retry later", retry_after=1)
        t0 = time.perf_counter()
        granted = await slots.wait(self.config.queue_timeout)
        if request is not None:
            request[QUEUE_S] += time.perf_counter() - t0
        if not granted:
            raise ApiError(503, "overloaded", f"{env} replica {replica.url} stayed at its limit of {slots.cap} "
                                              f"requests in flight for {self.config.queue_timeout:g}s (queue timeout); "
                                              "nothing was sent to the backend: retry later",
                           retry_after=max(1.0, self.config.queue_timeout / 2))

    def mark_down(self, replica: Replica, cause: str) -> None:
        if replica.healthy:
            log.warning("replica %s out of rotation: %s", replica.url, cause)
        replica.healthy, replica.last_error = False, cause

    def live_session(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is not None:
            return session
        if sid in self.gone:
            raise ApiError(410, "session_gone", f"session {sid} is {self.gone[sid]}; open a new one with POST "
                                                "/v1/sessions")
        raise ApiError(404, "unknown_session", f"no session {short(sid)}: open one with POST /v1/sessions")

    def end_session(self, session: Session, reason: str) -> None:
        if self.sessions.pop(session.id, None) is not None:
            session.replica.sessions -= 1
            self.gone[session.id] = reason
            if len(self.gone) > GONE_MEMORY:
                self.gone.popitem(last=False)

    async def close_on_backend(self, session: Session, request: web.Request | None = None
                               ) -> tuple[bool, str, bool]:
        """One try: (closed, why not, worth retrying: the replica was busy or failed in a way that may pass)."""
        replica, env = session.replica, session.pool.name
        try:
            await self.acquire(replica, request, env)
        except ApiError as e:
            log.warning("closing %s session %s on %s deferred: %s", env, session.id, replica.url, e.detail)
            return False, e.detail, True
        t0 = time.perf_counter()
        try:
            await session.pool.adapter.close(replica.url, session.handle)
            return True, "", False
        except BackendError as e:
            log.warning("closing %s session %s: %s", env, session.id, e)
            return False, str(e), e.retryable
        finally:
            replica.slots.release()
            if request is not None:
                request[BACKEND_S] += time.perf_counter() - t0

    async def close_in_background(self, session: Session) -> None:
        """Close ``session``'s backend instance, retrying (every 0.5 s, doubling to 10 s) until it is closed, the
        backend says it cannot be (a 4xx: e.g. already gone), or the replica is declared down (the env server's
        own --instance-ttl reaps the instance then). A backend instance is never left open for want of a retry."""
        delay = 0.5
        while True:
            closed, _, retry = await self.close_on_backend(session)
            if closed or not retry or not session.replica.healthy:
                return
            await asyncio.sleep(delay)
            delay = min(2 * delay, 10.0)

    # ---- handlers ------------------------------------------------------------------------------
    async def create_session(self, request: web.Request) -> web.Response:
        body = await self.read_json(request)
        for key in ("env", "item_id"):
            if key not in body:
                raise ApiError(400, "missing_field", f"the body needs '{key}', e.g. {{\"env\": \"babyai\", "
                                                     "\"item_id\": 3}")
        pool = self.pools.get(body["env"]) if isinstance(body["env"], str) else None
        if pool is None:
            raise ApiError(404, "unknown_env", f"no environment {short(body['env'])} behind this gateway; known: "
                                               f"{', '.join(sorted(self.pools))}")
        env = request[ENV] = pool.name
        try:
            item_id = pool.adapter.item(body["item_id"])
        except BadItem as e:
            raise ApiError(400, "bad_item_id", f"{env}: {e}") from None
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, "bad_seed", f"'seed' must be an integer or absent, got {short(seed)}")
        if len(self.sessions) + self.opening >= self.config.max_sessions:
            raise ApiError(503, "too_many_sessions", f"the gateway holds its maximum of {self.config.max_sessions} "
                                                     "open sessions (--max-sessions): close finished sessions, or "
                                                     "retry later", retry_after=1)
        self.opening += 1
        try:
            replica, handle, obs, info = await self._open(pool, item_id, seed, request)
        finally:
            self.opening -= 1
        session = Session(secrets.token_hex(12), pool, replica, handle, asyncio.get_running_loop().time())
        if client_gone(request):  # it gave up while the session opened: nobody can ever hold it, so close it now
            replica.sessions -= 1
            self._background(self.close_in_background(session))
            raise ApiError(400, "client_disconnected", "the client closed the connection while its session opened; "
                                                       "the session was closed")
        self.sessions[session.id] = session
        self.metrics.opened.labels(env).inc()
        return answer({"session_id": session.id, "observation": obs, "info": info, "backend": replica.url})

    async def _open(self, pool: Pool, item_id: Any, seed: int | None, request: web.Request) -> tuple:
        env, tried, failures = pool.name, set(), []
        while True:
            replica = pool.pick(tried)
            if replica is None:
                if failures and all(status in BUSY for status, _ in failures):  # busy or full: come back later
                    raise ApiError(503, "replicas_busy", f"no {env} replica can take item {short(item_id)} now: "
                                                         + "; ".join(f for _, f in failures), retry_after=1)
                if failures:
                    raise ApiError(502, "backend_failed", f"could not open a {env} session on any replica: "
                                                          + "; ".join(f for _, f in failures))
                states = ", ".join(f"{r.url} ({r.last_error or 'down'})" for r in pool.replicas)
                raise ApiError(503, "no_healthy_replica", f"no healthy {env} replica right now: {states}; retry "
                                                          "later", retry_after=self.config.health_interval)
            tried.add(replica)
            replica.sessions += 1  # reserve now, so concurrent creates spread over the replicas
            try:
                await self.acquire(replica, request, env)
                if client_gone(request):  # it gave up while its create waited for the slot: send nothing
                    replica.slots.release()
                    raise ApiError(400, "client_disconnected", "the client closed the connection before its session "
                                                               "was opened")
                t0 = time.perf_counter()
                try:
                    handle, obs, info = await pool.adapter.open(replica.url, item_id, seed)
                finally:
                    replica.slots.release()
                    request[BACKEND_S] += time.perf_counter() - t0
                return replica, handle, obs, info
            except BackendError as e:
                replica.sessions -= 1
                if e.down:
                    self.mark_down(replica, e.cause)
                if not e.retryable:
                    if e.status is not None and 400 <= e.status < 500:
                        raise ApiError(422, "backend_rejected", f"the {env} backend {e.url} rejected item_id "
                                                                f"{short(item_id)}: {e.cause}", backend=e.url) from None
                    raise ApiError(502, "backend_failed", f"{env}: {e}", backend=e.url) from None
                failures.append((e.status, str(e)))
                self.metrics.retries.labels(env).inc()
            except BaseException:
                replica.sessions -= 1
                raise

    async def step_session(self, request: web.Request) -> web.Response:
        body = await self.read_json(request)
        session = self.live_session(request.match_info["session_id"])
        pool, replica = session.pool, session.replica
        env = request[ENV] = pool.name
        if "action" not in body:
            raise ApiError(400, "missing_action", "the body needs 'action': the agent's action, e.g. "
                                                  "{\"action\": \"go forward\"}")
        try:
            action = pool.adapter.action(body["action"])
        except BadItem as e:
            raise ApiError(400, "bad_action", f"{env}: {e}") from None
        try:
            size = len(json.dumps(action, ensure_ascii=False).encode())
        except UnicodeEncodeError as e:
            raise ApiError(400, "bad_action", f"{env}: the action is not valid Unicode (a lone surrogate, "
                                              f"{e.object[e.start:e.end]!a}); send UTF-8 text") from None
        if size > self.config.max_action_bytes:
            raise ApiError(413, "action_too_large", f"{env}: the action is {size} bytes as forwarded, over the "
                                                    f"gateway's --max-action-bytes {self.config.max_action_bytes}; "
                                                    "send a shorter action (the session stays open)")
        if session.busy:
            raise ApiError(409, "session_busy", f"session {session.id} has a step in flight already; send one step "
                                                "at a time and wait for its answer")
        session.busy = True
        try:
            await self.acquire(replica, request, env)
            t0 = time.perf_counter()
            try:
                out = await pool.adapter.step(replica.url, session.handle, action)
            except BackendError as e:
                self.end_session(session, f"failed: {e}")
                self.metrics.failed.labels(env).inc()
                if e.down:
                    self.mark_down(replica, e.cause)
                else:  # the backend is up: release the instance there
                    self._background(self.close_in_background(session))
                raise ApiError(504 if e.timed_out else 502, "backend_timeout" if e.timed_out else "backend_failed",
                               f"{env} step failed on backend {e.url}: {e.cause}. The session is ended: finish this "
                               "episode (e.g. with reward 0) and open a new session.", backend=e.url) from None
            finally:
                replica.slots.release()
                request[BACKEND_S] += time.perf_counter() - t0
        finally:
            session.busy = False
            session.last_used = asyncio.get_running_loop().time()
        return answer({"observation": out.observation, "reward": out.reward, "done": out.done, "info": out.info})

    async def delete_session(self, request: web.Request) -> web.Response:
        session = self.live_session(request.match_info["session_id"])
        request[ENV] = session.pool.name
        self.end_session(session, "closed by the client")
        ok, detail, retry = await self.close_on_backend(session, request)
        body = {"session_id": session.id, "closed": True, "backend_closed": ok}
        if retry:
            self._background(self.close_in_background(session))
            detail = ("the backend could not take the close now (busy, or a failure that may pass); the gateway keeps "
                      "closing the instance there in the background: nothing to do")
        if detail:
            body["detail"] = detail
        return answer(body)

    def describe_envs(self) -> list[dict]:
        return [{"name": p.name, "adapter": p.cfg.adapter or p.name,
                 "open_sessions": sum(r.sessions for r in p.replicas),
                 "replicas": [r.describe() for r in p.replicas]} for p in self.pools.values()]

    async def list_envs(self, request: web.Request) -> web.Response:
        envs = self.describe_envs()
        if not request[AUTHORIZED]:  # where the backends run is for the token's holders
            for env in envs:
                env["replicas"] = [{k: v for k, v in r.items() if k not in ("url", "pid")} for r in env["replicas"]]
        return answer({"envs": {e.pop("name"): e for e in envs}, "open_sessions": len(self.sessions),
                       "max_sessions": self.config.max_sessions})

    async def health(self, request: web.Request) -> web.Response:
        envs = {p.name: {"healthy_replicas": sum(r.healthy for r in p.replicas), "replicas": len(p.replicas)}
                for p in self.pools.values()}
        ok = all(e["healthy_replicas"] > 0 for e in envs.values())
        return answer({"status": "ok" if ok else "degraded", "envs": envs, "open_sessions": len(self.sessions)},
                      200 if ok else 503)

    async def render_metrics(self, request: web.Request) -> web.Response:
        # replicas by URL only for the token's holders, as in /v1/envs
        return web.Response(body=self.metrics.render(show_urls=request[AUTHORIZED]),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    # ---- background loops ----------------------------------------------------------------------
    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(p, r) for p in self.pools.values() for r in p.replicas))
            await asyncio.sleep(self.config.health_interval)

    async def probe(self, pool: Pool, replica: Replica) -> None:
        alive = await pool.adapter.alive(replica.url, timeout=min(self.config.request_timeout, 5.0))
        if alive and not replica.healthy:
            log.info("replica %s (%s) answers again: back in rotation", replica.url, pool.name)
            replica.healthy, replica.last_error = True, ""
        elif not alive:
            self.mark_down(replica, "health check failed (no answer on GET /)")

    async def reap_loop(self) -> None:
        ttl = self.config.session_ttl
        while True:
            await asyncio.sleep(min(max(ttl / 4, 0.05), 10.0))
            now = asyncio.get_running_loop().time()
            for s in [s for s in self.sessions.values() if not s.busy and now - s.last_used > ttl]:
                self.end_session(s, f"expired: idle for more than {ttl:g}s (--session-ttl), and closed on the backend")
                self.metrics.reaped.labels(s.pool.name).inc()
                self._background(self.close_in_background(s))
