"""A fake (stand-in) environment server that speaks every AgentGym protocol variant the gateway knows: for load tests
of a gateway (benchmarks/gateway_bench.py, or a deployment's own), the gateway's tests, and checking rollout plumbing
without an environment.

It is a real aiohttp server on a real socket; only the environment behind it is fake, so that the gateway
can be tested under load, with failures and with every AgentGym protocol variant (env_gateway/adapters.py), without
the env packages (the real built-in servers are tested separately, when their venvs exist).

The fake task of item i: an episode of ``episode_len`` steps; the observation at step t says
``item {i} step {t}: say 'move {(i + t) % 4}'``; the last step gives reward 1.0 if every action was the
one asked for, else 0.0 (with ``partial_rewards``: 1 / episode_len for every right action, when it is taken, so
the episode's total is the share of right actions). Actions ``hang`` (sleeps an hour: a stuck backend) and
``crash`` (HTTP 500) act out failures. Every env call (reset, step) waits ``delay`` seconds first (simulated work,
not CPU).

Variants: ``agentgym`` (ids in ``id``, reset ``{id, data_idx}``), ``sciworld`` (+ cumulative ``score``),
``alfworld`` (reset ``{id, game, world_type}``, ``available_actions``), ``searchqa`` (bare-int /create,
``env_idx``, reset ``{env_idx, id}``), ``webshop`` (bare-int /create, reset ``{env_idx, session_id}`` without
an observation, ``GET /observation``, step -> ``state``, no /close route), ``webarena`` (``{"env_idx": n}``,
reset ``{env_idx, seed, idx}``, ``terminated``/``truncated``), ``gym`` (the gym-style chat protocol).

``GET /stats`` reports the peak number of requests in flight and counts of every call, so tests can check
that the gateway's caps held and that no request was lost or duplicated.

    python -m env_gateway.fake_backend --port 8001 [--variant agentgym] [--delay 0.005] [--episode-len 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from typing import Any, AsyncIterator

from aiohttp import web

from env_gateway.servers._base import bound_socket
from env_gateway.process import call, wait_listening

VARIANTS = ("agentgym", "sciworld", "alfworld", "searchqa", "webshop", "webarena", "gym")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def expected_action(item: int, t: int) -> str:
    return f"move {(item + t) % 4}"


def observation_text(item: int, t: int) -> str:
    return f"item {item} step {t}: say '{expected_action(item, t)}'"


class FakeBackend:
    def __init__(self, variant: str = "agentgym", delay: float = 0.0, episode_len: int = 5,
                 partial_rewards: bool = False):
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.variant, self.delay, self.episode_len = variant, delay, episode_len
        self.partial_rewards = partial_rewards
        self.instances: dict[int, dict] = {}
        self.ids = itertools.count()
        self.inflight = self.peak_inflight = 0
        self.counts = {"create": 0, "reset": 0, "step": 0, "close": 0}
        self.id_key = "env_idx" if variant in ("searchqa", "webshop", "webarena") else "id"

    # ---- the fake task -------------------------------------------------------------------------
    def _new(self) -> int:
        self.counts["create"] += 1
        n = next(self.ids)
        self.instances[n] = {"item": None, "t": 0, "right": 0, "steps": 0}
        return n

    def _inst(self, raw: Any) -> dict:
        try:
            return self.instances[int(raw)]
        except (KeyError, TypeError, ValueError):
            raise web.HTTPNotFound(text=json.dumps({"error": "unknown_id", "detail": f"no instance {raw!r}"}),
                                   content_type="application/json")

    async def _reset(self, raw_id: Any, item: Any) -> str:
        inst = self._inst(raw_id)
        if self.delay:
            await asyncio.sleep(self.delay)
        if not isinstance(item, int) or item < 0 or item >= 10_000:
            raise web.HTTPBadRequest(text=json.dumps({"error": "bad_data_idx", "detail": f"item {item!r} out of "
                                                      "range [0, 10000)"}), content_type="application/json")
        self.counts["reset"] += 1
        inst.update(item=item, t=0, right=0)
        return observation_text(item, 0)

    async def _step(self, raw_id: Any, action: str) -> tuple[str, float, bool, dict]:
        inst = self._inst(raw_id)
        if action == "hang":
            await asyncio.sleep(3600)
        if action == "crash":
            raise web.HTTPInternalServerError(text=json.dumps({"error": "env_failure", "detail": "fake crash"}),
                                              content_type="application/json")
        if self.delay:
            await asyncio.sleep(self.delay)
        self.counts["step"] += 1
        inst["steps"] += 1
        item, t = inst["item"], inst["t"]
        right = action == expected_action(item, t)
        inst["right"] += right
        inst["t"] = t + 1
        done = inst["t"] >= self.episode_len
        if self.partial_rewards:
            reward = right / self.episode_len
        else:
            reward = 1.0 if done and inst["right"] == self.episode_len else 0.0
        obs = f"episode over: {inst['right']}/{self.episode_len} right" if done else observation_text(item, t + 1)
        return obs, reward, done, inst

    def _close(self, raw_id: Any) -> None:
        self._inst(raw_id)
        self.counts["close"] += 1
        del self.instances[int(raw_id)]

    # ---- HTTP ----------------------------------------------------------------------------------
    @web.middleware
    async def track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in ("/", "/stats"):
            return await handler(request)
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            return await handler(request)
        finally:
            self.inflight -= 1

    async def body(self, request: web.Request, *keys: str) -> dict:
        data = await request.json()
        missing = [k for k in keys if k not in data]
        if missing:
            raise web.HTTPBadRequest(text=json.dumps({"error": "missing_field", "detail": f"missing {missing}"}),
                                     content_type="application/json")
        return data

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "env": f"fake-{self.variant}", "instances": len(self.instances)})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"inflight": self.inflight, "peak_inflight": self.peak_inflight, **self.counts,
                                  "open": len(self.instances)})

    async def create(self, request: web.Request) -> web.Response:
        n = self._new()
        if self.variant in ("searchqa", "webshop"):
            return web.json_response(n)
        return web.json_response({self.id_key: n})

    async def reset(self, request: web.Request) -> web.Response:
        v = self.variant
        if v == "alfworld":
            data = await self.body(request, "id", "game", "world_type")
            obs = await self._reset(data["id"], data["game"])
            return web.json_response({"observation": obs, "available_actions": ["move 0", "move 1", "move 2",
                                                                                 "move 3"], "task_type": "fake"})
        if v == "searchqa":
            data = await self.body(request, "env_idx", "id")
            return web.json_response({"observation": await self._reset(data["env_idx"], data["id"])})
        if v == "webshop":
            data = await self.body(request, "env_idx", "session_id")
            await self._reset(data["env_idx"], data["session_id"])
            return web.json_response(["reset", data["session_id"]])  # no observation: fetched separately
        if v == "webarena":
            data = await self.body(request, "env_idx", "seed", "idx")
            return web.json_response({"observation": await self._reset(data["env_idx"], data["idx"]),
                                      "info": {"seed": data["seed"]}})
        data = await self.body(request, "id", "data_idx")
        out = {"observation": await self._reset(data["id"], data["data_idx"]), "reward": 0.0, "done": False}
        if v == "sciworld":
            out["score"] = 0
        return web.json_response(out)

    async def step(self, request: web.Request) -> web.Response:
        data = await self.body(request, self.id_key, "action")
        obs, reward, done, inst = await self._step(data[self.id_key], data["action"])
        v = self.variant
        if v == "webshop":
            return web.json_response({"state": obs, "reward": reward, "done": done, "info": None})
        if v == "webarena":
            return web.json_response({"observation": obs, "reward": reward, "terminated": done, "truncated": False,
                                      "info": {}})
        out = {"observation": obs, "reward": reward, "done": done}
        if v == "sciworld":  # the score is cumulative (0-100); reward is its change
            score = round(100 * inst["right"] / self.episode_len)
            out["reward"], out["score"] = score - inst.get("score", 0), score
            inst["score"] = score
        if v == "alfworld":
            out["available_actions"] = ["move 0", "move 1", "move 2", "move 3"]
        return web.json_response(out)

    async def observation(self, request: web.Request) -> web.Response:
        inst = self._inst(request.query.get(self.id_key))
        text = observation_text(inst["item"], inst["t"])
        return web.json_response(text if self.variant == "webshop" else {"observation": text})

    async def close(self, request: web.Request) -> web.Response:
        data = await self.body(request, self.id_key)
        self._close(data[self.id_key])
        return web.json_response({"closed": data[self.id_key]})

    # gym-style chat protocol
    async def gym_initialize(self, request: web.Request) -> web.Response:
        data = await self.body(request, "env_name", "seed")
        n = self._new()
        self.instances[n]["seed"] = data["seed"]
        return web.json_response({"message": "ok", "env_id": f"g{n}", "observation": [], "info": {}})

    def _gym_id(self, request: web.Request) -> int:
        return int(request.match_info["env_id"].lstrip("g"))

    async def gym_reset(self, request: web.Request) -> web.Response:
        n = self._gym_id(request)
        obs = await self._reset(n, self._inst(n)["seed"])
        return web.json_response({"observation": [{"role": "user", "content": obs}], "info": {"fake": True}})

    async def gym_step(self, request: web.Request) -> web.Response:
        data = await self.body(request, "action")
        action = data["action"]
        if not isinstance(action, dict) or action.get("role") != "assistant":
            raise web.HTTPBadRequest(text=json.dumps({"error": "bad_action", "detail": "need an assistant message"}),
                                     content_type="application/json")
        obs, reward, done, _ = await self._step(self._gym_id(request), action.get("content") or "")
        return web.json_response({"observation": [{"role": "user", "content": obs}], "reward": reward,
                                  "done": done, "truncated": False, "info": {}})

    async def gym_close(self, request: web.Request) -> web.Response:
        self._close(self._gym_id(request))
        return web.json_response({"message": "closed"})

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.track])
        app.add_routes([web.get("/", self.health), web.get("/stats", self.stats)])
        if self.variant == "gym":
            app.add_routes([
                web.post("/api/environment/initialize", self.gym_initialize),
                web.post("/api/environment/{env_id}/reset", self.gym_reset),
                web.post("/api/environment/{env_id}/step", self.gym_step),
                web.post("/api/environment/{env_id}/close", self.gym_close),
            ])
        else:
            app.add_routes([web.post("/create", self.create), web.post("/reset", self.reset),
                            web.post("/step", self.step), web.get("/observation", self.observation)])
            if self.variant != "webshop":
                app.add_routes([web.post("/close", self.close)])
        return app


@contextlib.asynccontextmanager
async def running(variant: str = "agentgym", *, port: int = 0, **kw: Any) -> AsyncIterator[tuple[FakeBackend, str]]:
    """An in-process fake backend on 127.0.0.1 in the running event loop: yields (backend, url)."""
    backend = FakeBackend(variant, **kw)
    runner = web.AppRunner(backend.app(), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    try:
        yield backend, f"http://127.0.0.1:{bound}"
    finally:
        await runner.cleanup()


class FakeBackendProcess:
    """The fake backend as a subprocess (so it can be killed like a real replica). Context manager."""

    def __init__(self, *args: str, port: int | None = None, startup_timeout: float = 20.0):
        self.port = port  # None: the port the process binds itself (--port 0) and prints; given: to come back on it
        self.url = f"http://127.0.0.1:{port}" if port else ""
        self.args, self.startup_timeout = list(args), startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()

    def start(self) -> "FakeBackendProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "env_gateway.fake_backend", "--port", str(self.port or 0),
                                      *self.args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log)
        try:
            self.url = wait_listening(self.proc, self.log, re.compile(rb"listening on http://127\.0\.0\.1:(\d+)"),
                                      lambda url: call(url, "GET", "/", timeout=1)[0] == 200,
                                      "fake backend", self.startup_timeout)
        except BaseException:
            self.kill()
            raise
        self.port = int(self.url.rsplit(":", 1)[1])
        return self

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/stats", timeout=5) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> "FakeBackendProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def main() -> None:
    p = argparse.ArgumentParser(description="fake AgentGym-protocol env server (load tests and plumbing checks; "
                                "no environment behind it)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="0: any free port (printed to stderr)")
    p.add_argument("--fd", type=int, default=None, help="serve on this inherited, already-bound socket (the "
                   "gateway's --spawn '... --fd {fd}')")
    p.add_argument("--variant", default="agentgym", choices=VARIANTS)
    p.add_argument("--delay", type=float, default=0.0, help="seconds of simulated work per reset/step")
    p.add_argument("--episode-len", type=int, default=5)
    p.add_argument("--partial-rewards", action="store_true", help="1 / episode_len for each right action, when taken "
                   "(default: 1.0 at the end of an episode of right actions only)")
    p.add_argument("--uvloop", action="store_true")
    args = p.parse_args()
    if (args.port is None) == (args.fd is None):
        p.error("give --port (0: any free port) or --fd (an inherited socket), one of them")
    loop = None
    if args.uvloop:
        import uvloop
        loop = uvloop.new_event_loop()
    backend = FakeBackend(args.variant, delay=args.delay, episode_len=args.episode_len,
                          partial_rewards=args.partial_rewards)
    sock, port = bound_socket(args.host, args.port, args.fd)  # --port 0: any free port, printed below
    print(f"fake backend listening on http://{sock.getsockname()[0]}:{port}", file=sys.stderr, flush=True)
    web.run_app(backend.app(), sock=sock, access_log=None, print=None, loop=loop, backlog=4096)


if __name__ == "__main__":
    main()
