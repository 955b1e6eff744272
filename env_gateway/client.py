"""``GatewayClient``: the async client agent funcs use to reach the gateway.

    client = GatewayClient("http://127.0.0.1:8800")           # default: $COPE_GATEWAY_URL, else this URL
    async with client.session("babyai", item_id=17) as s:     # always closed on exit, also on error/cancel
        obs = s.observation
        while not s.done:
            r = await s.step(action)                            # StepResult(observation, reward, done, info)

Transport: one ``aiohttp.ClientSession`` per event loop (a session is bound to the loop it was made in, and
a client object may be shared by threads that each run a loop), keep-alive, at most ``limit`` connections;
``await client.aclose()`` in a loop before that loop ends (aiohttp warns about sessions left open).
A gateway started with ``--auth-token-file`` gets its token in every request (``token_file=``, default
``$COPE_GATEWAY_TOKEN_FILE``: a mode-600 file in .secrets/). Every call has a deadline (``timeout``, overridable
per call). A 503 from the gateway (queue full, no healthy
replica, too many sessions) means nothing reached the backend, so the call waits ``Retry-After`` and tries
again until its deadline, then raises ``Overloaded``.

Errors are ``GatewayError`` subclasses carrying ``status``, ``error`` and ``detail`` from the gateway:
``BadRequest`` (4xx: fix the call), ``SessionGone`` (404/410: unknown, expired or failed session),
``Overloaded`` (503 past the deadline), ``BackendFailed`` (502/504: the env server failed; the session
is over, ``backend`` names the server), ``GatewayUnavailable`` (no answer from the gateway itself) and ``BadAnswer``
(an answer that breaks the API: not standard JSON, NaN or Infinity in it, a step's reward that is not a finite
number or ``done`` that is not true/false; nothing of it reaches the episode).
An agent func ends the episode with reward 0 on any ``GatewayError`` and keeps its group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp

from env_gateway.secret_file import read_secret_file
from env_gateway.servers._base import non_finite

log = logging.getLogger("env_gateway.client")
DEFAULT_URL = "http://127.0.0.1:8800"


class GatewayError(Exception):
    def __init__(self, status: int | None, error: str, detail: str, retry_after: float | None = None,
                 backend: str | None = None):
        super().__init__(f"{error}: {detail}" if status is None else f"HTTP {status} {error}: {detail}")
        self.status, self.error, self.detail, self.retry_after, self.backend = status, error, detail, retry_after, backend


class BadRequest(GatewayError):
    """4xx: the call itself is wrong (unknown env, bad item id, missing action, ...)."""


class SessionGone(GatewayError):
    """404/410: the session is unknown, or ended (closed, expired after the idle TTL, or failed)."""


class Overloaded(GatewayError):
    """503 until the call's deadline: no replica slot, no healthy replica, or too many open sessions."""


class BackendFailed(GatewayError):
    """502/504: the environment server failed or timed out; the session is over."""


class GatewayUnavailable(GatewayError):
    """No answer from the gateway (connection refused or reset, or the call's deadline passed)."""


class BadAnswer(GatewayError):
    """The gateway's answer breaks the API (not standard JSON, or a step result of the wrong types)."""


def strict_loads(text: str) -> Any:
    """JSON without NaN / Infinity (ValueError)."""
    return json.loads(text, parse_constant=non_finite)


@dataclass(frozen=True)
class Opened:
    session_id: str
    observation: Any
    info: dict
    backend: str = ""


@dataclass(frozen=True)
class StepResult:
    observation: Any
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


def _error_for(status: int, body: Any, retry_after: str | None) -> GatewayError:
    body = body if isinstance(body, dict) else {"error": "http_error", "detail": str(body)[:500]}
    args = (status, str(body.get("error", "http_error")), str(body.get("detail", "")))
    retry = float(retry_after) if retry_after and retry_after.replace(".", "", 1).isdigit() else None
    if status == 503:
        return Overloaded(*args, retry_after=retry)
    if status in (502, 504):
        return BackendFailed(*args, backend=body.get("backend"))
    if status in (404, 410) and args[1] in ("unknown_session", "session_gone"):
        return SessionGone(*args)
    if 400 <= status < 500:
        return BadRequest(*args)
    return GatewayError(*args)


class GatewayClient:
    def __init__(self, base_url: str | None = None, *, timeout: float = 120.0,
                 connect_timeout: float = 10.0, limit: int = 1024, retry_overloaded: bool = True,
                 token_file: str | None = None):
        self.base_url = (base_url or os.environ.get("COPE_GATEWAY_URL", DEFAULT_URL)).rstrip("/")
        # the gateway's --auth-token-file token, when it has one (default: $COPE_GATEWAY_TOKEN_FILE)
        token_file = token_file or os.environ.get("COPE_GATEWAY_TOKEN_FILE") or None
        self.headers = {"Authorization": f"Bearer {read_secret_file(token_file)}"} if token_file else {}
        self.timeout, self.connect_timeout, self.limit = timeout, connect_timeout, limit
        self.retry_overloaded = retry_overloaded
        self._http: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._lock = threading.Lock()

    # ---- transport -----------------------------------------------------------------------------
    def http(self) -> aiohttp.ClientSession:
        """The HTTP session of the running event loop (made on first use)."""
        loop = asyncio.get_running_loop()
        http = self._http.get(loop)
        if http is None or http.closed:
            with self._lock:
                for old in [lp for lp in self._http if lp.is_closed()]:  # loops that ended without aclose()
                    del self._http[old]
                # Idle connections closed after 5 s, before the gateway's --read-timeout (default 10 s) closes them
                # under a request about to be sent.
                http = self._http[loop] = aiohttp.ClientSession(
                    headers=self.headers, connector=aiohttp.TCPConnector(limit=self.limit, keepalive_timeout=5))
        return http

    async def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """One call with a deadline; 503s are retried after Retry-After until the deadline."""
        total = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total
        http = self.http()
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise GatewayUnavailable(None, "timeout", f"{method} {path}: no answer from {self.base_url} within "
                                                          f"{total:g}s")
            try:
                async with http.request(method, self.base_url + path, json=body, timeout=aiohttp.ClientTimeout(
                        total=left, sock_connect=min(self.connect_timeout, left))) as resp:
                    if resp.status < 400:
                        try:
                            return await resp.json(loads=strict_loads)
                        except ValueError as e:  # not JSON, or NaN/Infinity in it
                            raise BadAnswer(resp.status, "bad_answer", f"{method} {path}: the answer is not "
                                                                       f"standard JSON ({e})") from None
                    try:
                        data = await resp.json(content_type=None)
                    except ValueError:
                        data = await resp.text()
                    err = _error_for(resp.status, data, resp.headers.get("Retry-After"))
            except asyncio.TimeoutError:
                raise GatewayUnavailable(None, "timeout", f"{method} {path}: no answer from {self.base_url} within "
                                                          f"{total:g}s") from None
            except aiohttp.ClientError as e:
                raise GatewayUnavailable(None, "unreachable", f"{method} {path} to {self.base_url}: "
                                                              f"{type(e).__name__}: {e}") from None
            wait = err.retry_after or 1.0
            if not (isinstance(err, Overloaded) and self.retry_overloaded and deadline - loop.time() > wait):
                raise err
            await asyncio.sleep(wait)

    async def aclose(self) -> None:
        """Close this event loop's HTTP session (other loops' sessions belong to those loops)."""
        http = self._http.pop(asyncio.get_running_loop(), None)
        if http is not None:
            await http.close()

    async def __aenter__(self) -> "GatewayClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # ---- API -----------------------------------------------------------------------------------
    async def create(self, env: str, item_id: int | str, *, seed: int | None = None,
                     timeout: float | None = None) -> Opened:
        body = {"env": env, "item_id": item_id}
        if seed is not None:
            body["seed"] = seed
        data = await self.request("POST", "/v1/sessions", body, timeout)
        return Opened(data["session_id"], data["observation"], data.get("info") or {}, data.get("backend", ""))

    async def step(self, session_id: str, action: Any, *, timeout: float | None = None) -> StepResult:
        data = await self.request("POST", f"/v1/sessions/{session_id}/step", {"action": action}, timeout)
        reward, done = data.get("reward"), data.get("done")
        # bool("false") is True and float(nan) poisons a whole batch's advantages: take only what the API says
        if (not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward)
                or not isinstance(done, bool) or "observation" not in data):
            raise BadAnswer(200, "bad_answer", f"step of session {session_id}: the answer needs an observation, a "
                                               f"finite number as reward and true/false as done; got reward "
                                               f"{type(reward).__name__}, done {type(done).__name__}")
        return StepResult(data["observation"], float(reward), done, data.get("info") or {})

    async def close(self, session_id: str, *, timeout: float | None = None) -> bool:
        """Close a session; True when it was open. Closing an ended session is not an error."""
        try:
            await self.request("DELETE", f"/v1/sessions/{session_id}", timeout=timeout)
            return True
        except SessionGone:
            return False

    async def envs(self, *, timeout: float | None = None) -> dict:
        return await self.request("GET", "/v1/envs", timeout=timeout)

    async def health(self, *, timeout: float | None = None) -> dict:
        try:
            return await self.request("GET", "/v1/health", timeout=timeout)
        except Overloaded as e:  # 503 here is the answer "degraded", not a reason to wait
            return {"status": "degraded", "detail": e.detail}

    @contextlib.asynccontextmanager
    async def session(self, env: str, item_id: int | str, *, seed: int | None = None,
                      timeout: float | None = None) -> AsyncIterator["EnvSession"]:
        """Open a session; it is closed when the block exits, however it exits."""
        opened = await self.create(env, item_id, seed=seed, timeout=timeout)
        s = EnvSession(self, env, item_id, opened, timeout)
        try:
            yield s
        finally:
            await s.close()


class EnvSession:
    """One open episode. ``observation``, ``reward``, ``done`` and ``info`` track the latest answer."""

    def __init__(self, client: GatewayClient, env: str, item_id: Any, opened: Opened, timeout: float | None):
        self.client, self.env, self.item_id, self.timeout = client, env, item_id, timeout
        self.id, self.backend = opened.session_id, opened.backend
        self.observation, self.info = opened.observation, opened.info
        self.reward, self.done, self.steps, self.closed = 0.0, False, 0, False

    async def step(self, action: Any, *, timeout: float | None = None) -> StepResult:
        r = await self.client.step(self.id, action, timeout=self.timeout if timeout is None else timeout)
        self.observation, self.reward, self.done, self.info = r.observation, r.reward, r.done, r.info
        self.steps += 1
        return r

    async def close(self) -> None:
        """Idempotent; survives cancellation of the caller (the close runs to its end) and never raises,
        so it cannot hide the error that ended the block (the gateway's TTL reaps what a failed close leaves)."""
        if self.closed:
            return
        self.closed = True
        task = asyncio.ensure_future(self.client.close(self.id, timeout=min(self.client.timeout, 30.0)))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if we are cancelled
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except GatewayError as e:
            log.warning("closing %s session %s failed (the gateway's idle TTL will reap it): %s", self.env, self.id, e)
