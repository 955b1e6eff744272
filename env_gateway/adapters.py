"""Protocol adapters: how the gateway speaks to one kind of environment server.

An adapter maps the gateway's three verbs onto a backend's own HTTP protocol:

    open(url, item_id, seed)  -> (handle, observation, info)   create an instance, reset it to the item
    step(url, handle, action) -> StepOutcome(observation, reward, done, info)
    close(url, handle)                                          release the instance
    alive(url, timeout)       -> bool                           health probe (any HTTP answer below 500)

``handle`` is whatever identifies the instance on that backend (for AgentGym, ``{"id": n}`` or
``{"env_idx": n}``); the gateway stores it with the session and never looks inside.

Every failure to get a usable answer raises ``BackendError`` naming the backend URL and the cause;
``retryable`` says whether trying another replica may help (connection refused or reset, a timeout,
or a 5xx), ``reached`` whether the request may have been seen by the backend, and ``answered`` whether the backend
answered at all (an HTTP error status, or an answer the protocol cannot use: not HTTP, over the size limit, not
standard JSON, a field missing or of the wrong type); only a backend that did not answer is taken for down.
What a backend answered is trusted for nothing: JSON with NaN or Infinity, a reward that is not a finite number,
``done`` that is not true/false are unusable answers. A cause is short and says what went wrong in the protocol's
terms (the method, path, HTTP status and the backend's error code); the backend's own text (a 5xx body can be a
traceback) goes to the log, never into a cause, except a 4xx's ``detail``, cut to 160 characters, which tells the
caller what was wrong with the request.

AgentGym's servers differ only in small ways, so ``AgentGymAdapter`` is the
whole protocol and each variant is a few lines:
  - ``/create`` answers ``{"id": n}``, ``{"env_idx": n}`` or a bare int; the key it came with (bare
    int: ``bare_id_key``) is the key later requests carry;
  - the reset body (``{id, data_idx}``; WebShop ``{env_idx, session_id}``; WebArena
    ``{env_idx, seed, idx}``; ALFWorld ``{id, game, world_type}``; SearchQA ``{env_idx, id}``);
  - where the reset answer has no observation, ``GET /observation`` fetches it;
  - the step answer's observation key (``observation`` or WebShop's ``state``), its reward (SciWorld:
    the 0-100 ``score``, the raw delta kept in ``info["env_reward"]``) and its end flag (``done``, or
    WebArena's ``terminated or truncated``). Keys the gateway does not map go to ``info``.

``AppWorldAdapter`` speaks AppWorld's own server protocol (task ids, Python code as actions, tests as reward).
``GymChatAdapter`` speaks the gym-style chat protocol (``/api/environment/initialize``, ``…/{id}/reset``,
``…/step`` with an OpenAI assistant message, ``…/close``); observations are chat-message lists.

A new adapter is one small class; ``ADAPTERS`` maps names to classes, and ``load_adapter`` also
accepts ``package.module:Class`` so an adapter can live outside this file.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from env_gateway.http1 import Http1Pool, HttpError
from env_gateway.secret_file import redact
from env_gateway.servers._base import non_finite, short

log = logging.getLogger("env_gateway")
ERROR_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,39}")  # what a backend's "error" field must look like to be shown
REJECTION_CHARS = 160  # of a 4xx's "detail" shown to the caller


def finite_float(text: str) -> float:
    """json.loads' hook for numbers with a fraction or exponent: 1e999 parses to inf, which JSON cannot carry on."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of range for a JSON number")
    return value


def loads(raw: bytes) -> Any:
    """Standard JSON only: NaN, Infinity and numbers that overflow to them are refused (ValueError)."""
    return json.loads(raw, parse_constant=non_finite, parse_float=finite_float)


def _error_of(raw: bytes) -> tuple[str, str]:
    """(error code, detail) of an error answer's body, each "" unless it is one: a code-like "error" field, and a
    "detail" string on one line, cut to REJECTION_CHARS."""
    try:
        data = loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "", ""
    if not isinstance(data, dict):
        return "", ""
    code = data.get("error")
    code = code if isinstance(code, str) and ERROR_CODE.fullmatch(code) else ""
    detail = data.get("detail")
    detail = " ".join(redact(detail).split())[:REJECTION_CHARS] if isinstance(detail, str) else ""
    return code, detail


@dataclass(frozen=True)
class StepOutcome:
    observation: Any
    reward: float
    done: bool
    info: dict


class BackendError(Exception):
    """A backend call that did not give a usable answer."""

    def __init__(self, url: str, cause: str, *, retryable: bool, reached: bool = True,
                 status: int | None = None, timed_out: bool = False, answered: bool = False):
        super().__init__(f"backend {url}: {cause}")
        self.url, self.cause, self.retryable, self.reached = url, cause, retryable, reached
        self.status, self.timed_out = status, timed_out
        self.answered = answered or status is not None

    @property
    def down(self) -> bool:
        """The backend did not answer (refused, reset or lost the connection): take it out of rotation. A timeout
        says nothing of the replica, and one that answered, however wrongly, is up."""
        return not self.answered and not self.timed_out


class BadItem(ValueError):
    """The caller's item_id, seed or action cannot be used with this adapter (becomes a 400)."""


class Adapter:
    """Base class: HTTP plumbing shared by every protocol. Subclasses implement open/step/close."""

    name = "base"

    def __init__(self, http: Http1Pool, timeout: float, options: dict | None = None):
        self.http, self.timeout = http, timeout
        self.options = dict(options or {})
        self._pending: set[asyncio.Task] = set()

    async def call(self, method: str, url: str, path: str, body: Any = None, params: dict | None = None) -> Any:
        """One JSON request to a backend; returns the decoded answer or raises BackendError."""
        if params:
            path += "?" + urlencode(params)
        where = f"{method} {path}"
        payload = None
        if body is not None:
            try:  # UTF-8 as is: \u escapes would triple non-ASCII text (and could push it over the backend's limit)
                payload = json.dumps(body, ensure_ascii=False).encode()
            except UnicodeEncodeError:  # a lone surrogate somewhere (the gateway refuses such actions): escaped
                payload = json.dumps(body).encode()
        try:
            status, raw = await self.http.request(method, url, path, payload, self.timeout)
        except HttpError as e:
            cause = f"{where}: {e}" if not e.timed_out else f"{where} timed out after {self.timeout:g}s"
            # an answer that is no HTTP (or too large) will not come out better on another try
            raise BackendError(url, cause, retryable=not e.answered, reached=e.connected, timed_out=e.timed_out,
                               answered=e.answered) from None
        if status >= 400:
            code, detail = _error_of(raw)
            log.warning("backend %s: %s answered HTTP %d: %s", url, where, status,
                        redact(raw[:500].decode(errors="replace")))
            cause = f"{where} answered HTTP {status}" + (f" ({code})" if code else "")
            raise BackendError(url, cause + (f": {detail}" if detail and status < 500 else ""),
                               retryable=status >= 500, status=status)
        try:
            return loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            log.warning("backend %s: %s answered HTTP %d with a body that is not standard JSON (%s): %s", url, where,
                        status, e, redact(raw[:200].decode(errors="replace")))
            raise BackendError(url, f"{where} answered HTTP {status} with a body that is not standard JSON",
                               retryable=False, answered=True) from None

    async def alive(self, url: str, timeout: float) -> bool:
        try:
            status, _ = await self.http.request("GET", url, "/", None, timeout)
            return status < 500
        except HttpError:
            return False

    def item(self, item_id: Any) -> Any:
        """Validate the caller's item id for this protocol; AgentGym items are integers."""
        if isinstance(item_id, bool) or not isinstance(item_id, (int, str)):
            raise BadItem(f"item_id must be an integer (or a string of digits), got {short(item_id)}")
        try:
            value = int(item_id)
        except ValueError:
            raise BadItem(f"item_id must be an integer (or a string of digits) for {self.name}, got {short(item_id)}")
        if value < 0:
            raise BadItem(f"item_id must be >= 0, got {short(value)}")
        return value

    def action(self, action: Any) -> Any:
        if not isinstance(action, str):
            raise BadItem(f"action must be a string, got {type(action).__name__}")
        return action

    def close_later(self, url: str, handle: Any) -> None:
        """Best-effort close in the background, so that a failed open is not held up by its clean-up."""
        async def close() -> None:
            try:
                await self.close(url, handle)
            except BackendError:
                pass
        task = asyncio.ensure_future(close())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def open(self, url: str, item_id: Any, seed: int | None) -> tuple[Any, Any, dict]:
        raise NotImplementedError

    async def step(self, url: str, handle: Any, action: Any) -> StepOutcome:
        raise NotImplementedError

    async def close(self, url: str, handle: Any) -> None:
        raise NotImplementedError


JSON_TYPES = {str: "string", dict: "object", list: "array", bool: "boolean", int: "number", float: "number",
              type(None): "null"}


def _json_type(value: Any) -> str:
    """The JSON type of a decoded value ("a JSON string"), for a cause: never the value itself."""
    return f"a JSON {JSON_TYPES.get(type(value), type(value).__name__)}"


def _need(url: str, data: Any, key: str, where: str) -> Any:
    if not isinstance(data, dict) or key not in data:
        what = _json_type(data) + ("" if isinstance(data, dict) else ", not an object")
        raise BackendError(url, f"{where} answer has no '{key}' ({what})", retryable=False, answered=True)
    return data[key]


def _number(url: str, data: Any, key: str, where: str) -> float:
    """``data[key]`` as a reward: a finite JSON number (null: 0)."""
    value = _need(url, data, key, where)
    if value is None:
        return 0.0
    try:  # an integer of 400 digits is JSON too, and no float
        number = float(value) if isinstance(value, (int, float)) else math.nan
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise BackendError(url, f"{where} answer's '{key}' is not a finite number ({_json_type(value)})",
                           retryable=False, answered=True)
    return number


def _flag(url: str, data: dict, key: str, where: str) -> bool:
    """``data[key]`` as an end-of-episode flag: true or false (absent or null: false). A string such as "false"
    is refused, not read as true."""
    value = data.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BackendError(url, f"{where} answer's '{key}' is not true/false ({_json_type(value)})",
                           retryable=False, answered=True)
    return value


def _object(url: str, value: Any, what: str, where: str) -> dict:
    """``value`` as a JSON object (null: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BackendError(url, f"{where} answer's {what} is not an object ({_json_type(value)})",
                           retryable=False, answered=True)
    return value


class AgentGymAdapter(Adapter):
    """AgentGym's protocol as most of its servers (and all built-in ones) speak it: ids in ``id``,
    reset ``{id, data_idx}``, step ``{id, action}`` -> ``{observation, reward, done, ...}``."""

    name = "agentgym"
    bare_id_key = "env_idx"  # where /create answers a bare int, later requests carry it under this key
    obs_key = "observation"

    def create_body(self) -> dict:
        return {}

    def reset_body(self, handle: dict, item_id: Any, seed: int | None) -> dict:
        return {**handle, "data_idx": item_id}

    def outcome(self, url: str, data: Any) -> StepOutcome:
        obs = _need(url, data, self.obs_key, "POST /step")
        reward = _number(url, data, "reward", "POST /step")
        done = _flag(url, data, "done", "POST /step")
        info = {k: v for k, v in data.items() if k not in (self.obs_key, "reward", "done")}
        return StepOutcome(obs, reward, done, info)

    async def open(self, url: str, item_id: Any, seed: int | None) -> tuple[Any, Any, dict]:
        created = await self.call("POST", url, "/create", self.create_body())
        if isinstance(created, int) and not isinstance(created, bool):
            handle = {self.bare_id_key: created}
        elif isinstance(created, dict) and ("id" in created or "env_idx" in created):
            key = "id" if "id" in created else "env_idx"
            handle = {key: created[key]}
        else:
            raise BackendError(url, f"POST /create answer carries no instance id ({_json_type(created)})",
                               retryable=False, answered=True)
        try:
            data = await self.call("POST", url, "/reset", self.reset_body(handle, item_id, seed))
            if isinstance(data, dict) and self.obs_key in data:
                obs = data[self.obs_key]
                info = {k: v for k, v in data.items() if k != self.obs_key}
            else:  # WebShop-style reset: the observation is served separately
                fetched = await self.call("GET", url, "/observation", params={k: str(v) for k, v in handle.items()})
                obs = fetched.get("observation", fetched) if isinstance(fetched, dict) else fetched
                info = data if isinstance(data, dict) else {}
        except BaseException:
            self.close_later(url, handle)  # do not leak the instance we just created
            raise
        return handle, obs, info

    async def step(self, url: str, handle: Any, action: Any) -> StepOutcome:
        return self.outcome(url, await self.call("POST", url, "/step", {**handle, "action": action}))

    async def close(self, url: str, handle: Any) -> None:
        await self.call("POST", url, "/close", dict(handle))


class SciWorldAdapter(AgentGymAdapter):
    """SciWorld: the reward the agent sees is the cumulative ``score`` (0-100), not the step delta."""

    name = "sciworld"

    def outcome(self, url: str, data: Any) -> StepOutcome:
        out = super().outcome(url, data)
        score = _number(url, data, "score", "POST /step")
        info = {**out.info, "env_reward": out.reward}
        return StepOutcome(out.observation, score, out.done, info)


class ALFWorldAdapter(AgentGymAdapter):
    """ALFWorld: reset by ``{id, game, world_type}``. ``data_idx`` rides along for servers that use it
    (the built-in one); the original server ignores it."""

    name = "alfworld"

    def reset_body(self, handle: dict, item_id: Any, seed: int | None) -> dict:
        return {**handle, "game": item_id, "world_type": self.options.get("world_type", "Text"), "data_idx": item_id}


class SearchQAAdapter(AgentGymAdapter):
    """SearchQA: the original server answers /create with a bare int and resets by
    ``{env_idx, id: item}``; the built-in one uses the common ``{id, data_idx}``."""

    name = "searchqa"

    def create_body(self) -> dict:
        return {"id": 0}

    def reset_body(self, handle: dict, item_id: Any, seed: int | None) -> dict:
        if "env_idx" in handle:
            return {**handle, "id": item_id}
        return {**handle, "data_idx": item_id}


class WebShopAdapter(AgentGymAdapter):
    """WebShop (and servers built like it, e.g. τ²-bench's): bare-int /create, reset
    ``{env_idx, session_id}``, observation by ``GET /observation``, step answers ``{state, ...}``."""

    name = "webshop"
    obs_key = "state"

    def reset_body(self, handle: dict, item_id: Any, seed: int | None) -> dict:
        return {**handle, "session_id": item_id}


class Tau2Adapter(WebShopAdapter):
    """τ²-bench's server speaks the WebShop shape; its item ids are task-id strings."""

    name = "tau2"

    def item(self, item_id: Any) -> Any:
        if isinstance(item_id, bool) or not isinstance(item_id, (int, str)) or item_id == "":
            raise BadItem(f"item_id must be a non-empty task id string (or an integer), got {short(item_id)}")
        return item_id


class AppWorldAdapter(Adapter):
    """AppWorld's own environment server (``appworld serve environment``), which keys its worlds by task id:
    ``/initialize {task_id}`` -> ``{output: task}``, ``/execute {task_id, code}`` -> ``{output}``,
    ``/task_completed``, ``/evaluate`` -> ``{output: {num_tests, passes, failures, ...}}``, ``/close``.
    Item ids are task ids; the action is Python code; the observation is the code's output. When the task is
    completed the episode is done and the reward is the fraction of the task's tests that pass (report in
    ``info["evaluation"]``). Since a server holds one world per task id, a task already open on a replica
    is opened on another one (so GRPO's samples of one task need that many replicas); ``options.initialize``
    is merged into the /initialize body (e.g. ``experiment_name``)."""

    name = "appworld"

    def __init__(self, http: Http1Pool, timeout: float, options: dict | None = None):
        super().__init__(http, timeout, options)
        self.open_tasks: set[tuple[str, str]] = set()

    def item(self, item_id: Any) -> Any:
        if isinstance(item_id, bool) or not isinstance(item_id, (int, str)) or item_id == "":
            raise BadItem(f"item_id must be an AppWorld task id such as '82e2fac_1', got {short(item_id)}")
        return str(item_id)

    async def open(self, url: str, item_id: Any, seed: int | None) -> tuple[Any, Any, dict]:
        if (url, item_id) in self.open_tasks:
            raise BackendError(url, f"task {item_id} is already open on this AppWorld server (one world per task "
                                    "id): add replicas to run more samples of one task at once", retryable=True,
                               status=409)
        self.open_tasks.add((url, item_id))
        try:
            data = await self.call("POST", url, "/initialize", {"task_id": item_id, **self.options.get("initialize", {})})
            task = _need(url, data, "output", "POST /initialize")
        except BaseException:
            self.open_tasks.discard((url, item_id))
            raise
        task = task if isinstance(task, dict) else {"instruction": str(task)}
        boss = task.get("supervisor") if isinstance(task.get("supervisor"), dict) else {}
        name = f"{boss.get('first_name', '')} {boss.get('last_name', '')}".strip()
        lines = [f"Supervisor: {name} (email {boss.get('email', '?')}, phone {boss.get('phone_number', '?')})"
                 if boss else "", f"Date and time: {task['datetime']}" if task.get("datetime") else "",
                 f"Task: {task.get('instruction', '')}"]
        return item_id, "\n".join(line for line in lines if line), task

    async def step(self, url: str, handle: Any, action: Any) -> StepOutcome:
        out = _need(url, await self.call("POST", url, "/execute", {"task_id": handle, "code": action}), "output",
                    "POST /execute")
        done = _need(url, await self.call("POST", url, "/task_completed", {"task_id": handle}), "output",
                     "POST /task_completed")
        if not done:
            return StepOutcome(str(out), 0.0, False, {})
        report = _object(url, _need(url, await self.call("POST", url, "/evaluate", {"task_id": handle}), "output",
                                    "POST /evaluate"), "'output'", "POST /evaluate")
        passes, failures = report.get("passes") or [], report.get("failures") or []
        total = report.get("num_tests") or len(passes) + len(failures)
        if not (isinstance(passes, list) and isinstance(failures, list) and isinstance(total, int)):
            raise BackendError(url, "POST /evaluate answer's 'output' has passes/failures that are not lists or "
                                    "num_tests that is not an integer", retryable=False, answered=True)
        reward = len(passes) / total if total else float(bool(report.get("success")))
        return StepOutcome(str(out), reward, True, {"evaluation": report})

    async def close(self, url: str, handle: Any) -> None:
        try:
            await self.call("POST", url, "/close", {"task_id": handle})
        finally:
            self.open_tasks.discard((url, handle))


class WebArenaAdapter(AgentGymAdapter):
    """WebArena: ``{"env_idx": n}`` from /create, reset ``{env_idx, seed, idx}``, and an episode ends
    when the step answer says ``terminated`` or ``truncated``."""

    name = "webarena"

    def reset_body(self, handle: dict, item_id: Any, seed: int | None) -> dict:
        return {**handle, "seed": seed or 0, "idx": item_id}

    def outcome(self, url: str, data: Any) -> StepOutcome:
        obs = _need(url, data, "observation", "POST /step")
        reward = _number(url, data, "reward", "POST /step")
        done = any([_flag(url, data, key, "POST /step") for key in ("terminated", "truncated", "done")])
        info = {k: v for k, v in data.items() if k not in ("observation", "reward")}
        return StepOutcome(obs, reward, done, info)


class GymChatAdapter(Adapter):
    """The gym-style chat protocol. The item id is the seed; ``options`` may set the backend's
    ``env_name`` (default: the gateway's env name) and ``env_kwargs``. A string action is sent as an
    assistant message; a dict action is sent as given (an OpenAI assistant message with tool_calls)."""

    name = "gym"

    def action(self, action: Any) -> Any:
        if isinstance(action, str):
            return {"role": "assistant", "content": action}
        if isinstance(action, dict) and action.get("role") == "assistant":
            return action
        raise BadItem("action must be a string or an OpenAI assistant message object {\"role\": \"assistant\", ...}")

    async def open(self, url: str, item_id: Any, seed: int | None) -> tuple[Any, Any, dict]:
        seed = item_id if seed is None else seed
        body = {"env_name": self.options["env_name"], "seed": seed, "env_kwargs": self.options.get("env_kwargs")}
        created = await self.call("POST", url, "/api/environment/initialize", body)
        env_id = _need(url, created, "env_id", "POST /api/environment/initialize")
        try:
            data = await self.call("POST", url, f"/api/environment/{env_id}/reset",
                                   {"env_id": env_id, "seed": seed, "options": self.options.get("env_kwargs")})
            obs = _need(url, data, "observation", "POST /api/environment/{id}/reset")
        except BaseException:
            self.close_later(url, env_id)
            raise
        return env_id, obs, dict(_object(url, data.get("info"), "'info'", "POST /api/environment/{id}/reset"))

    async def step(self, url: str, handle: Any, action: Any) -> StepOutcome:
        where = "POST /api/environment/{id}/step"
        data = await self.call("POST", url, f"/api/environment/{handle}/step", {"action": action})
        obs = _need(url, data, "observation", where)
        reward = _number(url, data, "reward", where)
        info = dict(_object(url, data.get("info"), "'info'", where))
        info["truncated"] = _flag(url, data, "truncated", where)
        return StepOutcome(obs, reward, _flag(url, data, "done", where) or info["truncated"], info)

    async def close(self, url: str, handle: Any) -> None:
        await self.call("POST", url, f"/api/environment/{handle}/close", {"env_id": handle})


ADAPTERS: dict[str, type[Adapter]] = {
    "agentgym": AgentGymAdapter,
    "babyai": AgentGymAdapter,
    "textcraft": AgentGymAdapter,
    "sciworld": SciWorldAdapter,
    "alfworld": ALFWorldAdapter,
    "searchqa": SearchQAAdapter,
    "webshop": WebShopAdapter,
    "tau2": Tau2Adapter,
    "webarena": WebArenaAdapter,
    "appworld": AppWorldAdapter,
    "gym": GymChatAdapter,
}


def load_adapter(spec: str) -> type[Adapter]:
    """An adapter class by registered name (``ADAPTERS``) or by ``package.module:Class``."""
    if spec in ADAPTERS:
        return ADAPTERS[spec]
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load adapter {spec!r}: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, Adapter)):
            raise ValueError(f"adapter {spec!r} is not a subclass of env_gateway.adapters.Adapter")
        return cls
    raise ValueError(f"no adapter named {spec!r}; known: {', '.join(sorted(ADAPTERS))}, "
                     "or give one as package.module:Class")
