"""Shared scaffolding for the built-in environment servers (AgentGym protocol).

Contract every server module follows (``python -m env_gateway.servers.<name> --host H --port P``, or ``--fd N``: serve
on an inherited bound socket, as the gateway's ``--spawn`` passes one):

    GET  /                          health: {"status": "ok", "env": name, "instances": n, "max_instances": m}
    POST /create                    -> {"id": n}
    POST /reset   {id, data_idx}    -> env-specific dict (at least "observation")
    POST /step    {id, action}      -> env-specific dict (at least "observation", "reward", "done")
    GET  /observation?id=n          -> {"observation": str}
    GET  /expert?id=n               -> {"action": str}  (the expert's next action, where the env has one)
    GET  /items?split=train|dev|test -> {"env": name, "split": s, "item_ids": [data_idx, ...]}
    POST /close   {id}              -> {"closed": n}

A subclass of ``EnvServer`` implements the blocking env calls (``new_env``, ``reset``, ``step``,
``observation``, optionally ``expert_action``, ``close_env``). They run in a thread pool, never on the
event loop, so one slow step does not stall other sessions; each instance has its own lock, so two
requests for one instance never interleave. Bad requests get a 4xx JSON ``{"error", "detail"}`` that
says what to fix; an exception inside the env gets a 500 JSON error naming the env and the cause.

An action the env should never parse is an invalid action, not an error: one longer than the server's
``max_action_chars`` (no real command of these envs comes near it; a degenerate LLM reply can be a 64K-character
line, and an env's parser must not spend the server's time on it), or one that is not valid Unicode (a lone
surrogate, which the Java/C side of some envs cannot take). ``step`` is not called; ``invalid_action`` answers with
an observation that says why, reward 0, and the episode as it was.

Deadlines (``--read-timeout``, default 10 s; the gateway sends a request whole, at once): a connection that has not
sent a whole request's headers within it, or sits idle that long between requests, is closed, and a body that has
not arrived within it is a 408 after which the connection is closed (``http_settings``), so no client can hold a
connection, a handler or memory for as long as it likes.

An instance no request has touched for ``--instance-ttl`` seconds (default an hour, well above the gateway's
15-minute session TTL) is closed by the server itself, so a client that dies (a killed gateway) leaks nothing for
long; requests for it then get 404.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import socket
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web

from env_gateway.secret_file import redact

log = logging.getLogger("env_gateway.servers")
READ_TIMEOUT = web.AppKey("read_timeout", float)  # the app's body deadline (json_body); absent: DEFAULT_READ_TIMEOUT
DEFAULT_READ_TIMEOUT = 10.0


class RequestError(Exception):
    """A client mistake: becomes a 4xx JSON error."""

    def __init__(self, status: int, error: str, detail: str):
        super().__init__(f"{error}: {detail}")
        self.status, self.error, self.detail = status, error, detail


def non_finite(name: str) -> None:
    """json.loads' hook for NaN / Infinity / -Infinity, which standard JSON does not have: refuse them (the gateway
    uses it too)."""
    raise ValueError(f"{name} is not a JSON number: send finite numbers")


async def read_body(request: web.Request) -> bytes:
    """The request's body, if it arrives within the app's ``READ_TIMEOUT`` (else a 408 RequestError)."""
    deadline = request.app.get(READ_TIMEOUT, DEFAULT_READ_TIMEOUT)
    try:
        async with asyncio.timeout(deadline):
            return await request.read()
    except TimeoutError:
        raise RequestError(408, "body_timeout", f"the request body did not arrive within {deadline:g}s "
                                                "(--read-timeout): send it at once") from None
    except ConnectionResetError:
        raise RequestError(400, "client_disconnected", "the client closed the connection before the body "
                                                       "ended") from None


async def json_body(request: web.Request, *required: str) -> dict:
    """The request's JSON object, with the required fields present; else a 400 that says what to fix (408: the body
    did not arrive in time, ``read_body``). The body is read as bytes (JSON is UTF-8/16/32 by its own first bytes),
    so a Content-Type charset Python does not know cannot fail the request; NaN/Infinity and nesting past the
    parser's depth are 400s."""
    raw = await read_body(request)
    try:
        data = json.loads(raw, parse_constant=non_finite)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, "bad_json", f"the request body must be a JSON object ({e})") from None
    except RecursionError:
        raise RequestError(400, "bad_json", "the request body nests deeper than the JSON parser takes: send a flat "
                                            "JSON object") from None
    if not isinstance(data, dict):
        raise RequestError(400, "bad_json", "the request body must be a JSON object")
    missing = [k for k in required if k not in data]
    if missing:
        raise RequestError(400, "missing_field", f"required field(s) missing: {', '.join(missing)}")
    return data


def http_settings(read_timeout: float) -> dict:
    """aiohttp server settings (``web.run_app`` / ``web.AppRunner`` keywords) for a server with ``read_timeout``:
    ``keepalive_timeout`` closes a connection that has not sent a whole request's headers by then (a fresh one, a slow
    sender, an idle keep-alive one); ``lingering_time`` 0: after answering a request whose body has not all come
    (``read_body``'s 408), close at once instead of reading on for up to 10 s more."""
    return {"keepalive_timeout": read_timeout, "lingering_time": 0}


def json_errors(env_name: str, failure_answer: Callable | None = None) -> Callable:
    """Middleware: RequestError -> its 4xx/503 JSON; aiohttp's own 404/405 -> JSON; any other exception (an env
    failure) -> ``failure_answer(request, exception)`` when given (the τ² server's: a stable code, the cause only in
    its log), else a 500 JSON naming the env and the cause (at most 500 characters), logged with its traceback; the
    server keeps serving. Answer and log are ``redact``ed: a library's exception may quote the credentials it was
    called with."""

    @web.middleware
    async def errors(request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as e:
            return web.json_response({"error": e.error, "detail": e.detail}, status=e.status)
        except web.HTTPException as e:
            return web.json_response({"error": e.reason, "detail": f"{request.method} {request.path}: {e.text}"},
                                     status=e.status)
        except Exception as e:
            if failure_answer is not None:
                return failure_answer(request, e)
            log.error("%s: %s %s failed\n%s", env_name, request.method, request.path,
                      redact("".join(traceback.format_exception(e))).rstrip())
            cause = redact(f"{type(e).__name__}: {e}")
            return web.json_response({"error": "env_failure", "detail": f"{env_name}: {cause[:500]}"}, status=500)

    return errors


def bound_socket(host: str, port: int, fd: int | None = None) -> tuple[socket.socket, int]:
    """A socket bound to (host, port) for ``web.run_app(sock=...)``, and its port: bound before serving, so a server
    started with ``--port 0`` can log the port it got (the gateway, every env server, the tests' fake backend).
    With ``fd``: the already-bound socket this process inherited under that number (the gateway's ``--spawn ...
    --fd {fd}``), host and port ignored."""
    if fd is not None:
        try:
            sock = socket.socket(fileno=fd)
        except OSError as e:
            raise SystemExit(f"--fd {fd}: not an open socket inherited from the parent process ({e.strerror}); "
                             "--fd is for a parent that binds the socket (the gateway's --spawn '... --fd {fd}'), "
                             "otherwise use --port") from None
        return sock, sock.getsockname()[1]
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock, sock.getsockname()[1]


def integer_field(raw: Any, name: str, error: str) -> int:
    """``raw`` as an int: a JSON integer, or ASCII digits (query strings). Not true, 1.9 or "1e3", which ``int``
    would turn into some other instance or item: those are a 400 ``error``."""
    if not (type(raw) is int or (isinstance(raw, str) and raw.isascii() and raw.isdigit())):
        raise RequestError(400, error, f"'{name}' must be an integer, got {short(raw)}")
    return int(raw)


async def reap_idle(name: str, instances: dict, ttl: float, close: Callable[[Any], Awaitable[None]]) -> None:
    """Forever: close (``close(instance)``, after removing it) every value of ``instances`` whose ``last_used``
    (time.monotonic) is more than ``ttl`` seconds ago and whose ``lock`` is free; checks every ttl/4 (<= 30 s). One
    that a request closed while an earlier close ran is not closed again."""
    while True:
        await asyncio.sleep(min(ttl / 4, 30.0))
        now = time.monotonic()
        for key, inst in list(instances.items()):
            if now - inst.last_used > ttl and not inst.lock.locked() and instances.get(key) is inst:
                del instances[key]
                log.info("%s: closing instance %s, untouched for %.0fs (--instance-ttl)", name, key,
                         now - inst.last_used)
                try:
                    await close(inst)
                except Exception:
                    log.exception("%s: closing idle instance %s failed", name, key)


def short(value: Any) -> str:
    """``value``'s repr, cut to 60 characters: an error answer never echoes a large input back."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}... ({len(text)} characters)"


@dataclass
class Instance:
    env: Any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    data_idx: int | None = None
    last_used: float = field(default_factory=time.monotonic)


class EnvServer:
    """Base class of an AgentGym-protocol environment server. Subclasses set ``name`` and implement the
    blocking calls below; everything HTTP (routing, validation, errors, health, shutdown) lives here."""

    name: str = "env"
    max_action_chars: int = 4096  # longer actions are invalid actions, unparsed (see the module docstring)
    instance_ttl: float = 3600.0  # seconds untouched before the server closes an instance (--instance-ttl)
    read_timeout: float = DEFAULT_READ_TIMEOUT  # seconds for a request's headers, its body, an idle connection

    def __init__(self, max_instances: int = 256, workers: int = 8):
        self.max_instances = max_instances
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{self.name}-env")
        self.instances: dict[int, Instance] = {}
        self._ids = itertools.count()

    # ---- blocking env calls (run in the thread pool) -------------------------------------------
    def new_env(self) -> Any:
        raise NotImplementedError

    def reset(self, env: Any, data_idx: int) -> dict:
        raise NotImplementedError

    def step(self, env: Any, action: str) -> dict:
        raise NotImplementedError

    def observation(self, env: Any) -> str:
        raise NotImplementedError

    def invalid_action(self, env: Any, reason: str) -> dict:
        """The step result of an action the env does not get to see: no state change, reward 0. Envs whose step
        results carry more fields (score, the current view, available actions) add them here."""
        return {"observation": f"Invalid action: {reason}", "reward": 0, "done": False}

    def expert_action(self, env: Any) -> str:
        raise RequestError(404, "no_expert", f"the {self.name} server has no expert")

    def close_env(self, env: Any) -> None:
        pass

    def item_ids(self, split: str) -> list[int]:
        """The benchmark's own task list for a split, as data_idx values: deterministic, and the test split
        never overlaps train. Unknown split -> raise RequestError(400, ...)."""
        raise RequestError(404, "no_items", f"the {self.name} server does not list item ids")

    def num_items(self) -> int | None:
        """How many data_idx values are valid (None: unbounded). Out-of-range reset -> 400."""
        return None

    def reset_fields(self, data: dict) -> dict:
        """Map an env's own /reset fields onto ``data_idx`` (e.g. ALFWorld's ``{id, game, world_type}``)."""
        return data

    def extra_routes(self) -> list[web.RouteDef]:
        return []

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        """Server-specific command-line options."""

    # ---- HTTP ----------------------------------------------------------------------------------
    async def run_blocking(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def instance(self, raw_id: Any) -> tuple[int, Instance]:
        env_id = integer_field(raw_id, "id", "bad_id")
        if env_id not in self.instances:
            raise RequestError(404, "unknown_id", f"no {self.name} instance {env_id}: create one with POST /create "
                                                  f"(instances untouched for {self.instance_ttl:g}s are closed)")
        inst = self.instances[env_id]
        inst.last_used = time.monotonic()
        return env_id, inst

    def reset_instance(self, raw_id: Any) -> tuple[int, Instance]:
        """``instance``, and 409 unless it has been reset (the expert and the like need an episode)."""
        env_id, inst = self.instance(raw_id)
        if inst.data_idx is None:
            raise RequestError(409, "not_reset", f"instance {env_id} has not been reset: POST /reset first")
        return env_id, inst

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "env": self.name, "instances": len(self.instances),
                                  "max_instances": self.max_instances})

    async def handle_create(self, request: web.Request) -> web.Response:
        if len(self.instances) >= self.max_instances:
            raise RequestError(503, "full", f"{self.name} server holds its maximum of {self.max_instances} "
                                            "instances: close some, or start another replica")
        env = await self.run_blocking(self.new_env)
        env_id = next(self._ids)
        self.instances[env_id] = Instance(env)
        return web.json_response({"id": env_id})

    async def handle_reset(self, request: web.Request) -> web.Response:
        data = self.reset_fields(await json_body(request, "id"))
        if "data_idx" not in data:
            raise RequestError(400, "missing_field", "required field(s) missing: data_idx")
        env_id, inst = self.instance(data["id"])
        data_idx = integer_field(data["data_idx"], "data_idx", "bad_data_idx")
        n = self.num_items()
        if data_idx < 0 or (n is not None and data_idx >= n):
            raise RequestError(400, "bad_data_idx", f"'data_idx' {data_idx} is out of range [0, {n})")
        async with inst.lock:
            result = await self.run_blocking(self.reset, inst.env, data_idx)
            inst.data_idx = data_idx
        return web.json_response(result)

    async def handle_step(self, request: web.Request) -> web.Response:
        data = await json_body(request, "id", "action")
        env_id, inst = self.instance(data["id"])
        if not isinstance(data["action"], str):
            raise RequestError(400, "bad_action", "'action' must be a string")
        if inst.data_idx is None:
            raise RequestError(409, "not_reset", f"instance {env_id} has not been reset: POST /reset first")
        action, reason = data["action"], None
        if len(action) > self.max_action_chars:
            reason = (f"the action is {len(action)} characters long, over the {self.max_action_chars} this "
                      f"{self.name} server takes. Answer with one short command.")
        elif not action.isascii():
            try:
                action.encode("utf-8")
            except UnicodeEncodeError as e:
                reason = f"the action holds a lone surrogate at position {e.start}, which is not text. Answer in text."
        async with inst.lock:
            if reason is None:
                result = await self.run_blocking(self.step, inst.env, action)
            else:
                result = await self.run_blocking(self.invalid_action, inst.env, reason)
        return web.json_response(result)

    async def handle_observation(self, request: web.Request) -> web.Response:
        env_id, inst = self.instance(request.query.get("id"))
        async with inst.lock:
            obs = await self.run_blocking(self.observation, inst.env)
        return web.json_response({"observation": obs})

    async def handle_expert(self, request: web.Request) -> web.Response:
        _, inst = self.reset_instance(request.query.get("id"))
        async with inst.lock:
            action = await self.run_blocking(self.expert_action, inst.env)
        return web.json_response({"action": action})

    async def handle_items(self, request: web.Request) -> web.Response:
        split = request.query.get("split", "train")
        ids = await self.run_blocking(self.item_ids, split)
        return web.json_response({"env": self.name, "split": split, "item_ids": ids})

    async def handle_close(self, request: web.Request) -> web.Response:
        data = await json_body(request, "id")
        env_id, inst = self.instance(data["id"])
        async with inst.lock:
            if self.instances.get(env_id) is not inst:  # a close of it that came first held the lock: closed once
                raise RequestError(404, "unknown_id", f"no {self.name} instance {env_id}: it was closed meanwhile")
            del self.instances[env_id]
            await self.run_blocking(self.close_env, inst.env)
        return web.json_response({"closed": env_id})

    def app(self) -> web.Application:
        app = web.Application(middlewares=[json_errors(self.name)], client_max_size=1 << 20)
        app.add_routes([
            web.get("/", self.handle_health),
            web.post("/create", self.handle_create),
            web.post("/reset", self.handle_reset),
            web.post("/step", self.handle_step),
            web.get("/observation", self.handle_observation),
            web.get("/expert", self.handle_expert),
            web.get("/items", self.handle_items),
            web.post("/close", self.handle_close),
            *self.extra_routes(),
        ])
        app[READ_TIMEOUT] = self.read_timeout
        app.on_startup.append(self._start_reaper)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _start_reaper(self, app: web.Application) -> None:
        self._reaper = asyncio.ensure_future(reap_idle(self.name, self.instances, self.instance_ttl,
                                                       lambda inst: self.run_blocking(self.close_env, inst.env)))

    async def _shutdown(self, app: web.Application) -> None:
        self._reaper.cancel()
        for env_id, inst in list(self.instances.items()):
            try:
                await self.run_blocking(self.close_env, inst.env)
            except Exception:
                log.exception("%s: closing instance %s failed", self.name, env_id)
        self.instances.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)


def build_server(server_cls: type[EnvServer], argv: list[str] | None = None) -> tuple[EnvServer, argparse.Namespace]:
    """The server ``python -m env_gateway.servers.<name> ARGV`` runs, built from its command line (logging set up
    first: some servers log while they load), and the parsed arguments (``host``, ``port``, ``fd``: where it
    serves)."""
    parser = argparse.ArgumentParser(prog=f"python -m env_gateway.servers.{server_cls.name}",
                                     description=f"AgentGym-protocol {server_cls.name} environment server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (the log's 'listening on' line "
                        "says which)")
    parser.add_argument("--fd", type=int, default=None, help="serve on this inherited, already-bound socket instead "
                        "of binding --host/--port (what the gateway's --spawn '... --fd {fd}' passes)")
    parser.add_argument("--max-instances", type=int, default=256)
    parser.add_argument("--workers", type=int, default=8, help="threads that run blocking env calls")
    parser.add_argument("--instance-ttl", type=float, default=server_cls.instance_ttl,
                        help="seconds an instance may go untouched before the server closes it (keep it above the "
                             "gateway's --session-ttl)")
    parser.add_argument("--read-timeout", type=float, default=server_cls.read_timeout,
                        help="seconds a client has to send a request's headers, and again its body (408), and that an "
                             "idle connection stays open")
    parser.add_argument("--log-level", default="INFO")
    server_cls.add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for flag in ("instance_ttl", "read_timeout"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    extra = {k: v for k, v in vars(args).items()
             if k not in ("host", "port", "fd", "log_level", "instance_ttl", "read_timeout")}
    server = server_cls(**extra)
    server.instance_ttl, server.read_timeout = args.instance_ttl, args.read_timeout
    return server, args


def serve(server_cls: type[EnvServer], argv: list[str] | None = None) -> None:
    """Command-line entry point shared by every server module."""
    server, args = build_server(server_cls, argv)
    sock, port = bound_socket(args.host, args.port, args.fd)  # the log names the port --port 0 got
    host = sock.getsockname()[0]
    # run_app turns SIGINT and SIGTERM into a graceful shutdown, which closes every instance.
    web.run_app(server.app(), sock=sock, **http_settings(args.read_timeout), print=lambda *_: log.info(
        "%s server listening on http://%s:%d", server_cls.name, host, port))
