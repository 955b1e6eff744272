"""A bare aiohttp proxy speaking the gateway's session API to one AgentGym backend: a reference, not a product.

It is the gateway's request path and nothing else: the same aiohttp server on uvloop, the same backend
transport (env_gateway.http1.Http1Pool), one JSON decode and encode per hop, and none of the gateway's
guarantees (no admission control, deadlines on sessions, idle TTL, replica routing or health checks,
failure isolation, input checks, metrics). benchmarks/gateway_bench.py runs it as method (e), so the cost of
those guarantees is measured, not guessed: the ceiling of any aiohttp gateway on the same machine.

    POST /v1/sessions {env, item_id} -> {session_id, observation, info}     (backend: /create, /reset)
    POST /v1/sessions/{id}/step {action} -> {observation, reward, done, info}
    DELETE /v1/sessions/{id} -> {closed}                                     GET /v1/health

    python benchmarks/bare_proxy.py --port 8800 --backend http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys

import uvloop
from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from env_gateway.http1 import Http1Pool  # noqa: E402
from env_gateway.servers._base import bound_socket  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True, help="0: any free port (printed: 'listening on <url>')")
    p.add_argument("--backend", required=True, help="URL of an AgentGym-protocol server")
    args = p.parse_args()
    http = Http1Pool()
    instances: dict[str, int] = {}  # session id -> backend instance id

    async def call(path: str, body: dict) -> dict:
        _, raw = await http.request("POST", args.backend, path, json.dumps(body).encode(), timeout=120.0)
        return json.loads(raw)

    async def create(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        instance = (await call("/create", {}))["id"]
        reset = await call("/reset", {"id": instance, "data_idx": body["item_id"]})
        sid = secrets.token_hex(12)
        instances[sid] = instance
        return web.json_response({"session_id": sid, "observation": reset["observation"], "info": {}})

    async def step(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        out = await call("/step", {"id": instances[request.match_info["sid"]], "action": body["action"]})
        return web.json_response({"observation": out["observation"], "reward": out["reward"], "done": out["done"],
                                  "info": {}})

    async def close(request: web.Request) -> web.Response:
        await call("/close", {"id": instances.pop(request.match_info["sid"])})
        return web.json_response({"closed": True})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.add_routes([web.post("/v1/sessions", create), web.post("/v1/sessions/{sid}/step", step),
                    web.delete("/v1/sessions/{sid}", close), web.get("/v1/health", health)])
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    sock, port = bound_socket("127.0.0.1", args.port)
    web.run_app(app, sock=sock, loop=loop, access_log=None, backlog=4096,
                print=lambda *_: print(f"bare proxy listening on http://127.0.0.1:{port}", flush=True))


if __name__ == "__main__":
    main()
