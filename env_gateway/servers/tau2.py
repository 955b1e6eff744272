"""τ²-bench (sierra-research/tau2-bench at commit c5b2d22) as an HTTP env server shaped like WebShop's.

    .venvs/tau2/bin/python -m env_gateway.servers.tau2 --port 8011 --user-model openai/<model> \
        --user-base-url http://HOST:PORT/v1      (venv: bash scripts/setup_env.sh tau2)
    (the user simulator's API key is read from --user-key-file, default .secrets/tau2_user_api_key; never argv; a
    user model on this machine, a loopback --user-base-url, needs no key file: it gets a placeholder key)

Protocol (the gateway's ``tau2`` adapter speaks it):
    GET  /                             health
    POST /create                       -> env_idx (a bare int)
    POST /reset {env_idx, session_id}  session_id = "<domain>/<task_id>" (retail, airline, telecom; mock: τ²'s test
                                       domain) -> {state: the user's first message, policy, tools (OpenAI schemas),
                                       system_prompt, greeting, domain, task_id}; 404 for a task id the domain lacks,
                                       422 for a task that starts mid-conversation (initial_state.message_history:
                                       two mock tasks)
    POST /step {env_idx, action}       -> {state, reward, done, info}
    GET  /observation?env_idx=n        -> {observation: the latest state}
    POST /close {env_idx}

An action is the agent's reply as written. Hermes tool calls ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (one or more) go to the domain's tools, run by τ²'s own domain environment (``get_response``), and
the state is their results, each in ``<tool_response>…</tool_response>``; calling ``done`` (a tool offered only
under ``--agent-prompt project``) ends the conversation (after the reply's other calls ran). A reply without tool
calls is a message to τ²'s user simulator, and the state is the user's answer; the user ends the conversation with
τ²'s stop markers. A ``<tool_call>`` tag whose JSON body is missing or broken (the telecom failure: bare tags,
looped to the step cap) changes nothing and the state says exactly what is wrong ("Tool call error: ...").
It counts as a tool error, as does a tool call that fails;
``--max-errors`` errors end the episode with reward 0 (τ²'s orchestrator ends on too many errors the same way), and
so does ``--max-steps``, τ²'s step cap counted as its orchestrator counts messages (the user's first message 1,
each agent reply 2: the reply and its tool results or the user's answer; the user's own tool calls, telecom only,
are not counted).

The agent's prompt (``--agent-prompt``):
    project:  ``system_prompt`` is null (the agent func writes its own instruction above ``policy``); the tools are
              the domain's plus ``done``, with which the agent ends the conversation.
    tau2:     τ²'s default agent, as ``tau2 run`` drives it: ``system_prompt`` is the one τ²'s own ``LLMAgent`` builds
              (its instruction and the domain policy), the tools are the domain's alone (only the user ends the
              conversation; a ``done`` call is an unknown tool, a tool error), and the agent's history opens with
              ``greeting``, τ²'s fixed first agent message that the user answered.

Reward, 0 until the end; at the end τ²'s own evaluation of the conversation (``evaluate_simulation``,
``EvaluationType.ALL``) gives ``reward`` (the product over the task's reward basis) and its per-basis breakdown:
    --reward-shape binary:  1 if |reward - 1| <= 1e-6 else 0 (τ²'s success)
    --reward-shape dense:   mean of the breakdown's values (partial credit), or reward where there is none

Errors: a client mistake is a 4xx ``{error, detail}`` that says what to fix. Any other failure is a 500 whose body is a
stable code and a short fixed reason (``FAILURES``: ``tau2_not_installed``, ``tau2_data_missing``,
``tau2_tasks_missing``, ``reset_failed``, ``user_simulator_failed``, ``tool_call_failed``, ``evaluation_failed``,
``internal_error``): no exception text, no file path reaches a client. The cause, with its traceback, goes to the
server's log, through ``scrub``, which removes every secret (the key file's, and the environment's ``*_API_KEY`` /
``*_TOKEN`` / ``*_SECRET`` values) in any form a library may print it: verbatim, in any letter case, hex- or
base64-encoded, or split over lines. tau2's own log (loguru) and every Python log line go through it too.

Telecom's tasks: tau2 reads them from ``telecom/tasks.json`` of its data folder; ``--telecom-tasks small`` (or
``full``) reads ``tasks_small.json`` (``tasks_full.json``) of the same folder instead, in place, with tau2's own
telecom task loader.

The ``tau2`` package is imported only when a conversation starts (``RealTau2``), so this module imports without
it; the user simulator is τ²'s ``UserSimulator`` calling litellm at ``--user-base-url`` (any OpenAI-compatible
server) with a ``--user-timeout``. Tests plug a stand-in ``conversation_factory`` into ``Tau2Server``
(tests/test_tau2.py) or run this server on the real package (tests/test_tau2_real.py). Blocking calls run in a
thread pool, one lock per instance.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import ipaddress
import itertools
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from aiohttp import web

from env_gateway.secret_file import SECRETS, read_secret_file
from env_gateway.servers._base import (RequestError, bound_socket, integer_field, json_body, json_errors,
                                       reap_idle, short)

log = logging.getLogger("env_gateway.servers.tau2")

DOMAINS = ("airline", "retail", "telecom", "mock")  # mock: τ²'s small test domain
STOP_TOOL = "done"
AGENT_PROMPTS = ("project", "tau2")
FIRST_AGENT_MESSAGE = "Hi! How can I help you today?"  # τ²'s orchestrator opens every conversation with this
MAX_USER_TOOL_ROUNDS = 50  # the user simulator's own tool calls in a row before it must answer
CALL_FORMAT = 'Write <tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>.'
TELECOM_TASK_FILES = {"small": "tasks_small.json", "full": "tasks_full.json"}  # --telecom-tasks; default tasks.json
PLACEHOLDER_KEY = "EMPTY"  # the key a user model on this machine gets when there is no key file

# ---- errors: a stable code and a short reason for the client, the cause for the log only ------------------------
FAILURES = {
    "tau2_not_installed": "the tau2 package is not installed for this server: build its venv with `bash "
                          "scripts/setup_env.sh tau2` (tau2-bench at commit c5b2d22) and run the server with "
                          ".venvs/tau2/bin/python",
    "tau2_data_missing": "tau2's data folder lacks the domains or the user simulator's guidelines: point TAU2_DATA_DIR "
                         "at the data folder of tau2-bench at c5b2d22 (the server's log names the folder)",
    "tau2_tasks_missing": "tau2 cannot load this domain's task file: for telecom, name one the data folder has "
                          "(--telecom-tasks small or full), or point TAU2_DATA_DIR at a full data folder (the "
                          "server's log names the file)",
    "reset_failed": "starting the tau2 conversation failed (the server's log has the cause)",
    "user_simulator_failed": "the user simulator failed: its model call or its own tool calls (the server's log has "
                             "the cause)",
    "tool_call_failed": "running the tool calls in tau2's domain failed (the server's log has the cause)",
    "evaluation_failed": "tau2's evaluation of the conversation failed (the server's log has the cause)",
    "internal_error": "the tau2 server failed (its log has the cause)",
}


class Tau2Failure(Exception):
    """A failure the client learns by its code and ``FAILURES``' reason alone; ``detail`` (paths, causes) is for the
    server's log."""

    def __init__(self, code: str, detail: str = ""):
        super().__init__(f"{code}: {detail}" if detail else code)
        self.code, self.reason, self.detail = code, FAILURES[code], detail


SECRET_ENV = re.compile(r"(API_KEY|_TOKEN|_SECRET|_PASSWORD)$")
MIN_SECRET_CHARS = 8  # shorter values ("EMPTY") are no secret, and would blank ordinary words
_SEPARATOR = r"(?:\s|\\[nrt])*"  # what a wrapped or escaped line break leaves between two characters


def _secrets() -> frozenset[str]:
    """The key files' secrets (``read_secret_file`` registers them) and the environment's secret-named values."""
    found = {s for s in SECRETS}
    found.update(v.strip() for k, v in os.environ.items() if SECRET_ENV.search(k.upper()))
    return frozenset(s for s in found if len(s) >= MIN_SECRET_CHARS)


@functools.lru_cache(maxsize=16)
def _secret_pattern(secrets: frozenset[str]) -> re.Pattern:
    forms = set()
    for secret in secrets:
        raw = secret.encode()
        forms.update((secret, raw.hex(), base64.b64encode(raw).decode().rstrip("="),
                      base64.urlsafe_b64encode(raw).decode().rstrip("=")))
    alternatives = [_SEPARATOR.join(re.escape(c) for c in form) for form in sorted(forms, key=len, reverse=True)]
    return re.compile("|".join(alternatives), re.IGNORECASE)


def scrub(text: str) -> str:
    """``text`` with every secret replaced by [redacted], in any letter case, hex- or base64-encoded, or with white
    space or escaped line breaks between its characters."""
    secrets = _secrets()
    return _secret_pattern(secrets).sub("[redacted]", text) if secrets else text


class ScrubbingFormatter(logging.Formatter):
    """A log formatter whose lines (message and traceback) go through ``scrub``."""

    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record))


def failure_answer(request: web.Request, e: Exception) -> web.Response:
    """The τ² server's 500 (``json_errors``' hook): a stable code and ``FAILURES``' fixed reason (``internal_error``
    for an exception no stage named); its cause and traceback go only to the log, through ``scrub``."""
    failure = e if isinstance(e, Tau2Failure) else Tau2Failure("internal_error")
    cause = "".join(traceback.format_exception(e.__cause__ or e))
    log.error("tau2: %s %s failed: %s%s\n%s", request.method, request.path, failure.code,
              f" ({scrub(failure.detail)})" if failure.detail else "", scrub(cause).rstrip())
    return web.json_response({"error": failure.code, "detail": failure.reason}, status=500)


def is_loopback(url: str) -> bool:
    """Whether ``url``'s host is this machine (localhost, 127.0.0.0/8, ::1)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def parse_hermes(reply: str) -> tuple[list[ToolCall], str | None]:
    """(tool calls, None), ([], None) for a plain message, or ([], what is wrong) for a broken tool call."""
    if "<tool_call>" not in reply:
        return [], None
    calls = []
    for n, part in enumerate(reply.split("<tool_call>")[1:], 1):
        body = part.split("</tool_call>", 1)[0]
        body = body.strip()
        if not body:
            return [], f"Tool call error: <tool_call> number {n} has no JSON body. {CALL_FORMAT}"
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            return [], f"Tool call error: the body of <tool_call> number {n} is not valid JSON ({e.msg} at " \
                       f"character {e.pos}). {CALL_FORMAT}"
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            return [], f"Tool call error: <tool_call> number {n} has no \"name\". {CALL_FORMAT}"
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return [], f"Tool call error: the \"arguments\" of <tool_call> number {n} must be a JSON object. " \
                       f"{CALL_FORMAT}"
        calls.append(ToolCall(data["name"], arguments))
    return calls, None


def shape_reward(reward: float, breakdown: dict | None, shape: str) -> float:
    if shape == "binary":
        return 1.0 if abs(reward - 1.0) <= 1e-6 else 0.0
    values = [float(v) for v in (breakdown or {}).values()]
    return sum(values) / len(values) if values else float(reward)


class Conversation(Protocol):
    """One τ² task in progress, agent side. Blocking methods."""

    policy: str
    tools: list[dict]
    system_prompt: str | None  # τ²'s default agent prompt under --agent-prompt tau2, else None

    def start(self) -> str:
        """The user's first message (after τ²'s fixed greeting)."""

    def to_user(self, text: str) -> tuple[str, bool]:
        """Send the agent's message; the user's answer, and whether the user ended the conversation."""

    def call_tools(self, calls: list[ToolCall]) -> list[tuple[str, bool]]:
        """Run the agent's tool calls; each one's result text and whether it was an error."""

    def evaluate(self, agent_stopped: bool) -> tuple[float, dict]:
        """τ²'s reward for the conversation so far, and its breakdown by reward basis."""


class RealTau2:
    """Conversations on the installed ``tau2`` package (sierra-research/tau2-bench at commit c5b2d22): its domain
    environment runs the tool calls, its ``UserSimulator`` (through litellm, at the OpenAI-compatible base URL in
    ``user_llm_args``) plays the customer, its ``evaluate_simulation`` scores the conversation. Tested against the real
    package in tests/test_tau2_real.py (mock and retail domains, a scripted stand-in for the user model).

    The package is imported at the first conversation. Before that, its log (loguru) is routed through ``scrub`` at
    ``log_level`` (the key never reaches a log line), and litellm is told to use its bundled model-cost map instead of
    fetching one from the internet. Each domain's tasks are loaded once (tau2's own task loader, every split)."""

    def __init__(self, user_model: str, user_llm_args: dict, log_level: str = "WARNING", agent_prompt: str = "project",
                 telecom_tasks: str | None = None):
        if agent_prompt not in AGENT_PROMPTS:
            raise ValueError(f"agent_prompt must be one of {', '.join(AGENT_PROMPTS)}, got {agent_prompt!r}")
        if telecom_tasks is not None and telecom_tasks not in TELECOM_TASK_FILES:
            raise ValueError(f"telecom_tasks must be one of {', '.join(TELECOM_TASK_FILES)} (or None: tasks.json), got "
                             f"{telecom_tasks!r}")
        self.user_model, self._user_llm_args = user_model, user_llm_args  # holds the key: never log this dict
        self.log_level, self.agent_prompt, self.telecom_tasks = log_level, agent_prompt, telecom_tasks
        self._tasks: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def tasks(self, domain: str) -> dict[str, Any]:
        """τ²'s tasks of ``domain`` by id (loaded once, by tau2's own task loader; telecom's from the task file
        ``telecom_tasks`` names, by tau2's telecom loader)."""
        with self._lock:
            if domain not in self._tasks:
                run = import_tau2(self.log_level)
                try:
                    if domain == "telecom" and self.telecom_tasks:
                        from tau2.domains.telecom.environment import load_tasks as load_telecom_tasks
                        from tau2.domains.telecom.utils import TELECOM_DATA_DIR

                        loaded = load_telecom_tasks(str(TELECOM_DATA_DIR / TELECOM_TASK_FILES[self.telecom_tasks]))
                    else:
                        loaded = run.load_tasks(task_set_name=domain)
                except FileNotFoundError as e:
                    raise Tau2Failure("tau2_tasks_missing", f"tau2 cannot load the {domain} tasks ({e}): point "
                                      "TAU2_DATA_DIR at the data folder of a full tau2-bench checkout at c5b2d22, or "
                                      "for telecom name the task file it has (--telecom-tasks)") from e
                self._tasks[domain] = {task.id: task for task in loaded}
            return self._tasks[domain]

    def __call__(self, domain: str, task_id: str) -> "_Tau2Conversation":
        tasks = self.tasks(domain)
        if task_id not in tasks:
            raise RequestError(404, "unknown_task", f"tau2 domain {domain} has no task {short(task_id)} (it has "
                                                    f"{len(tasks)} tasks, e.g. {', '.join(list(tasks)[:3])})")
        return _Tau2Conversation(domain, tasks[task_id], self.user_model, self._user_llm_args, self.agent_prompt)


_TAU2_IMPORTED = False


def import_tau2(log_level: str = "WARNING") -> Any:
    """``tau2.run`` of the installed package, imported once with its log scrubbed at ``log_level``; Tau2Failure that
    says what to do when the package or its data folder is missing."""
    global _TAU2_IMPORTED
    if not _TAU2_IMPORTED:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import (offline hosts)
        try:
            from loguru import logger

            logger.remove()
            logger.add(lambda message: sys.stderr.write(scrub(str(message))), level=log_level.upper(),
                       format="{time:YYYY-MM-DD HH:mm:ss,SSS} tau2 {level} {message}", colorize=False)
            import tau2.run  # noqa: F401  (the import that fails where the package is missing)
            from tau2.utils.utils import DATA_DIR
        except ImportError as e:
            raise Tau2Failure("tau2_not_installed", f"the tau2 package is not importable ({e}): build this server's "
                              "venv with `bash scripts/setup_env.sh tau2` (it installs sierra-research/tau2-bench at "
                              "commit c5b2d22 from $TAU2_BENCH_DIR) and run the server with .venvs/tau2/bin/python") \
                from e
        if not os.path.isdir(os.path.join(DATA_DIR, "tau2", "domains")):
            raise Tau2Failure("tau2_data_missing", f"tau2's data folder {DATA_DIR} has no tau2/domains: set "
                              "TAU2_DATA_DIR to the data folder of a tau2-bench checkout at c5b2d22, or rebuild "
                              ".venvs/tau2 with `bash scripts/setup_env.sh tau2` (it copies the data there)")
        guidelines = os.path.join(DATA_DIR, "tau2", "user_simulator", "simulation_guidelines.md")
        if not os.path.isfile(guidelines):
            raise Tau2Failure("tau2_data_missing", f"tau2's data folder {DATA_DIR} lacks {guidelines}, the user "
                              "simulator's guidelines (a tau2-bench checkout at c5b2d22 has them under "
                              "data/tau2/user_simulator/): set TAU2_DATA_DIR to that checkout's data folder")
        _TAU2_IMPORTED = True
    import tau2.run as run

    return run


class _Tau2Conversation:
    def __init__(self, domain: str, task: Any, user_model: str, user_llm_args: dict, agent_prompt: str):
        from tau2.agent.llm_agent import LLMAgent
        from tau2.data_model.message import AssistantMessage, ToolCall as Tau2ToolCall
        from tau2.registry import registry
        from tau2.user.user_simulator import UserSimulator

        self.AssistantMessage, self.Tau2ToolCall = AssistantMessage, Tau2ToolCall
        self.domain, self.task = domain, task
        state = task.initial_state
        if state and state.message_history:
            raise RequestError(422, "mid_conversation_task", f"tau2 task {domain}/{task.id} starts mid-conversation "
                                                             "(initial_state.message_history): this server starts "
                                                             "every conversation from τ²'s greeting")
        self.env = registry.get_env_constructor(domain)()
        self.env.set_state(initialization_data=state.initialization_data if state else None,
                           initialization_actions=state.initialization_actions if state else None, message_history=[])
        self.policy = self.env.get_policy()
        domain_tools = self.env.get_tools()
        self.tools = [t.openai_schema for t in domain_tools]
        if agent_prompt == "tau2":
            self.system_prompt = LLMAgent(tools=domain_tools, domain_policy=self.policy).system_prompt
        else:
            self.system_prompt = None
            self.tools.append({"type": "function", "function": {"name": STOP_TOOL, "description": "End the "
                               "conversation when the customer's request is fully handled.",
                               "parameters": {"type": "object", "properties": {}}}})
        try:
            user_tools = self.env.get_user_tools()
        except ValueError:  # airline, retail and mock users have no tools
            user_tools = None
        self.user = UserSimulator(tools=user_tools or None, instructions=str(task.user_scenario), llm=user_model,
                                  llm_args=user_llm_args)
        self.user_state = self.user.get_init_state()
        self.messages: list = []
        self.started = time.time()

    def _user_turn(self, message: Any) -> tuple[str, bool]:
        from tau2.data_model.message import MultiToolMessage

        self.messages.append(message)
        reply, self.user_state = self.user.generate_next_message(message, self.user_state)
        for _ in range(MAX_USER_TOOL_ROUNDS):  # the user's own tools (telecom): run them and let the user go on
            if not reply.is_tool_call():
                break
            self.messages.append(reply)
            results = [self.env.get_response(call) for call in reply.tool_calls]
            self.messages.extend(results)
            wrapped = results[0] if len(results) == 1 else MultiToolMessage(role="tool", tool_messages=results)
            reply, self.user_state = self.user.generate_next_message(wrapped, self.user_state)
        else:
            if reply.is_tool_call():
                raise RuntimeError(f"the user simulator called its tools {MAX_USER_TOOL_ROUNDS} times in a row "
                                   f"without answering (tau2 {self.domain}/{self.task.id})")
        self.messages.append(reply)
        return reply.content or "", self.user.is_stop(reply)

    def start(self) -> str:
        return self._user_turn(self.AssistantMessage(role="assistant", content=FIRST_AGENT_MESSAGE))[0]

    def to_user(self, text: str) -> tuple[str, bool]:
        return self._user_turn(self.AssistantMessage(role="assistant", content=text))

    def call_tools(self, calls: list[ToolCall]) -> list[tuple[str, bool]]:
        tau2_calls = [self.Tau2ToolCall(id=f"call_{uuid.uuid4().hex[:12]}", name=c.name, arguments=c.arguments,
                                        requestor="assistant") for c in calls]
        self.messages.append(self.AssistantMessage(role="assistant", tool_calls=tau2_calls))
        results = [self.env.get_response(call) for call in tau2_calls]
        self.messages.extend(results)
        return [(r.content or "", bool(r.error)) for r in results]

    def evaluate(self, agent_stopped: bool) -> tuple[float, dict]:
        from tau2.data_model.simulation import SimulationRun, TerminationReason
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

        now = time.time()
        for turn, message in enumerate(self.messages):
            message.turn_idx = turn
        run = SimulationRun(
            id=str(uuid.uuid4()), task_id=self.task.id, start_time=str(self.started), end_time=str(now),
            duration=now - self.started, messages=self.messages,
            termination_reason=TerminationReason.AGENT_STOP if agent_stopped else TerminationReason.USER_STOP)
        info = evaluate_simulation(simulation=run, task=self.task, evaluation_type=EvaluationType.ALL,
                                   solo_mode=False, domain=self.domain)
        breakdown = {str(getattr(k, "value", k)): float(v) for k, v in (info.reward_breakdown or {}).items()}
        return float(info.reward), breakdown


@dataclass
class Episode:
    conversation: Conversation | None = None
    item: str = ""
    state: str = ""
    done: bool = False
    errors: int = 0
    steps: int = 0
    offers_stop: bool = True  # the conversation's tools include STOP_TOOL (τ²'s own agent prompt has none)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)


class Tau2Server:
    def __init__(self, conversation_factory: Callable[[str, str], Conversation], reward_shape: str = "binary",
                 max_errors: int = 10, max_instances: int = 256, workers: int = 16, instance_ttl: float = 3600.0,
                 max_steps: int = 200):
        if reward_shape not in ("binary", "dense"):
            raise ValueError(f"reward_shape must be 'binary' or 'dense', got {reward_shape!r}")
        if max_errors < 1 or max_steps < 1:
            raise ValueError(f"max_errors and max_steps must be >= 1, got {max_errors} and {max_steps}")
        self.factory, self.reward_shape, self.max_errors = conversation_factory, reward_shape, max_errors
        self.max_steps = max_steps
        self.max_instances, self.instance_ttl = max_instances, instance_ttl
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tau2")
        self.episodes: dict[int, Episode] = {}
        self._ids = itertools.count()

    async def blocking(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def stage(self, code: str, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` in the thread pool; a failure in it becomes ``Tau2Failure(code)`` (client: the code and its
        reason; log: the cause). Client mistakes (RequestError) and failures already named pass as they are."""
        try:
            return await self.blocking(fn, *args)
        except (RequestError, Tau2Failure):
            raise
        except Exception as e:
            raise Tau2Failure(code) from e

    def episode(self, raw: Any) -> Episode:
        idx = integer_field(raw, "env_idx", "bad_env_idx")
        if idx not in self.episodes:
            raise RequestError(404, "unknown_env_idx", f"no tau2 instance {idx}: create one with POST /create "
                                                       f"(instances untouched for {self.instance_ttl:g}s are closed)")
        ep = self.episodes[idx]
        ep.last_used = time.monotonic()
        return ep

    async def handle_create(self, request: web.Request) -> web.Response:
        if len(self.episodes) >= self.max_instances:
            raise RequestError(503, "full", f"this server holds its maximum of {self.max_instances} instances")
        idx = next(self._ids)
        self.episodes[idx] = Episode()
        return web.json_response(idx)

    async def handle_reset(self, request: web.Request) -> web.Response:
        data = await json_body(request, "env_idx", "session_id")
        ep = self.episode(data["env_idx"])
        domain, sep, task_id = str(data["session_id"]).partition("/")
        if not sep or domain not in DOMAINS or not task_id:
            raise RequestError(400, "bad_session_id", f"session_id must be '<domain>/<task_id>' with domain one of "
                                                      f"{', '.join(DOMAINS)}; got {short(data['session_id'])}")
        async with ep.lock:
            conversation = await self.stage("reset_failed", self.factory, domain, task_id)
            first = await self.stage("user_simulator_failed", conversation.start)
            ep.conversation, ep.item, ep.state, ep.done, ep.errors = conversation, f"{domain}/{task_id}", first, \
                False, 0
            ep.steps = 1  # τ²'s greeting is not a step; the user's first message is
            ep.offers_stop = any(t.get("function", {}).get("name") == STOP_TOOL for t in conversation.tools)
        return web.json_response({"state": first, "policy": conversation.policy, "tools": conversation.tools,
                                  "system_prompt": conversation.system_prompt, "greeting": FIRST_AGENT_MESSAGE,
                                  "domain": domain, "task_id": task_id})

    async def handle_step(self, request: web.Request) -> web.Response:
        data = await json_body(request, "env_idx", "action")
        ep = self.episode(data["env_idx"])
        if not isinstance(data["action"], str):
            raise RequestError(400, "bad_action", "'action' must be a string (the agent's reply)")
        if ep.conversation is None:
            raise RequestError(409, "not_reset", "this instance has not been reset: POST /reset first")
        async with ep.lock:
            out = await self.play(ep, data["action"])
        return web.json_response(out)

    async def play(self, ep: Episode, reply: str) -> dict:
        if ep.done:
            return {"state": "The conversation is over: reset to start another.", "reward": 0.0, "done": True,
                    "info": {}}
        calls, error = parse_hermes(reply)
        if ep.offers_stop:
            stop = any(c.name == STOP_TOOL for c in calls)
            calls = [c for c in calls if c.name != STOP_TOOL]  # a reply's other calls still run before it ends
        else:  # τ²'s default agent has no done tool: the call goes to the domain, which does not know it
            stop = False
        errors = 0
        ep.steps += 2  # as τ² counts: the agent's message, then the tool results or the user's answer
        if error is not None:
            ep.state, errors = error, 1
        elif calls:
            results = await self.stage("tool_call_failed", ep.conversation.call_tools, calls)
            ep.state = "\n".join(f"<tool_response>\n{text}\n</tool_response>" for text, _ in results)
            errors = sum(failed for _, failed in results)
        info: dict = {"tool_errors": errors, "steps": ep.steps}
        if errors:
            ep.errors += errors
            if ep.errors >= self.max_errors:  # as τ²'s orchestrator: too many tool errors end the episode, reward 0
                return self.cut(ep, info, f"Too many tool errors ({ep.errors}): the conversation is over.")
        if not stop and (error is not None or calls):
            if ep.steps >= self.max_steps:
                return self.cut(ep, info, f"The step limit ({self.max_steps}) is reached: the conversation is over.")
            return {"state": ep.state, "reward": 0.0, "done": False, "info": info}
        if stop:
            ep.state, user_stopped = "You ended the conversation.", False
        else:
            ep.state, user_stopped = await self.stage("user_simulator_failed", ep.conversation.to_user, reply.strip())
            if not user_stopped:
                if ep.steps >= self.max_steps:
                    return self.cut(ep, info, f"The step limit ({self.max_steps}) is reached: the conversation is "
                                              "over.")
                return {"state": ep.state, "reward": 0.0, "done": False, "info": info}
        ep.done = True
        reward, breakdown = await self.stage("evaluation_failed", ep.conversation.evaluate, stop)
        shaped = shape_reward(reward, breakdown, self.reward_shape)
        log.info("tau2 %s: done, tau2 reward %.3f, shaped (%s) %.3f", ep.item, reward, self.reward_shape, shaped)
        return {"state": ep.state, "reward": shaped, "done": True,
                "info": {**info, "tau2_reward": reward, "reward_breakdown": breakdown}}

    @staticmethod
    def cut(ep: Episode, info: dict, why: str) -> dict:
        """End the episode early, reward 0 (τ²'s evaluator gives 0 to a run ended by its error or step limit)."""
        ep.done = True
        ep.state = f"{ep.state}\n{why}"
        log.info("tau2 %s: %s", ep.item, why)
        return {"state": ep.state, "reward": 0.0, "done": True, "info": {**info, "ended": why}}

    async def handle_observation(self, request: web.Request) -> web.Response:
        return web.json_response({"observation": self.episode(request.query.get("env_idx")).state})

    async def handle_close(self, request: web.Request) -> web.Response:
        data = await json_body(request, "env_idx")
        self.episode(data["env_idx"])
        idx = integer_field(data["env_idx"], "env_idx", "bad_env_idx")
        self.episodes.pop(idx, None)
        return web.json_response({"closed": idx})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "env": "tau2", "instances": len(self.episodes),
                                  "reward_shape": self.reward_shape})

    def app(self) -> web.Application:
        app = web.Application(middlewares=[json_errors("tau2", failure_answer)], client_max_size=1 << 20)
        app.add_routes([web.get("/", self.handle_health), web.post("/create", self.handle_create),
                        web.post("/reset", self.handle_reset), web.post("/step", self.handle_step),
                        web.get("/observation", self.handle_observation), web.post("/close", self.handle_close)])
        app.on_startup.append(self._start_reaper)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _start_reaper(self, app: web.Application) -> None:
        async def forget(ep: Episode) -> None:  # a conversation holds no outside resource: dropping it is closing it
            pass
        self._reaper = asyncio.ensure_future(reap_idle("tau2", self.episodes, self.instance_ttl, forget))

    async def _shutdown(self, app: web.Application) -> None:
        self._reaper.cancel()
        self.episodes.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)


def read_key(path: str) -> str:
    """The user simulator's API key (``read_secret_file``: one line, owner-only, not a symlink out of .secrets/).
    Keys never come from argv, and no answer or log line shows them."""
    try:
        return read_secret_file(path)
    except ValueError as e:
        raise SystemExit(f"tau2 server: the user simulator's API key file: {e}. Write the key there (chmod 600; for "
                         "a local vLLM server any text, e.g. EMPTY), or point --user-key-file at one") from None


def user_key(path: str, base_url: str) -> str:
    """The user simulator's key: ``read_key(path)``, or, where there is no file at ``path`` and the user model runs on
    this machine (a loopback ``base_url``: a local vLLM server takes any key), the placeholder."""
    if not os.path.lexists(path) and is_loopback(base_url):
        log.info("tau2 server: no key file at %s; the user model on this machine gets a placeholder key", path)
        return PLACEHOLDER_KEY
    return read_key(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m env_gateway.servers.tau2", description="τ²-bench env server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8011, help="0: any free port (the log's 'listening on' line says which)")
    p.add_argument("--user-model", required=True, help="the user simulator's model, as litellm names it (for an "
                   "OpenAI-compatible server: openai/<served model name>)")
    p.add_argument("--user-base-url", required=True, help="OpenAI-compatible base URL of the user model, e.g. "
                   "http://127.0.0.1:8000/v1")
    p.add_argument("--user-key-file", default=os.path.join(".secrets", "tau2_user_api_key"), help="the user model's "
                   "key, one line, mode 600; none needed for a user model on this machine (a loopback "
                   "--user-base-url): without the file it gets a placeholder key")
    p.add_argument("--user-temperature", type=float, default=0.0)
    p.add_argument("--reward-shape", choices=("binary", "dense"), default="binary")
    p.add_argument("--telecom-tasks", choices=tuple(TELECOM_TASK_FILES), default=None, help="read telecom's tasks "
                   "from tasks_small.json or tasks_full.json of tau2's data folder, in place (default: tasks.json, "
                   "as tau2 does)")
    p.add_argument("--agent-prompt", choices=AGENT_PROMPTS, default="project", help="tau2: τ²'s default agent prompt "
                   "and tools, as 'tau2 run' gives them (protocol alignment); project: the agent func's own "
                   "instruction and a done tool")
    p.add_argument("--user-timeout", type=float, default=120.0, help="seconds one user-simulator call may take "
                   "(litellm's timeout; τ²'s retries come on top)")
    p.add_argument("--max-errors", type=int, default=10, help="tool errors that end an episode (τ²'s default)")
    p.add_argument("--max-steps", type=int, default=200, help="τ²'s step cap, counted as its orchestrator counts "
                   "messages (2 per agent reply; the episode ends with reward 0 there; τ²'s eval protocol: 200)")
    p.add_argument("--max-instances", type=int, default=256)
    p.add_argument("--workers", type=int, default=16, help="threads for tau2 and user-simulator calls")
    p.add_argument("--instance-ttl", type=float, default=3600.0, help="seconds an instance may go untouched before "
                   "the server closes it (keep it above the gateway's --session-ttl)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--tau2-log-level", default="WARNING", help="level of the tau2 package's own log (loguru)")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:  # every log line, litellm's too, without a secret
        handler.setFormatter(ScrubbingFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    llm_args = {"api_base": args.user_base_url, "api_key": user_key(args.user_key_file, args.user_base_url),
                "temperature": args.user_temperature, "timeout": args.user_timeout}
    try:
        conversations = RealTau2(args.user_model, llm_args, args.tau2_log_level, args.agent_prompt,
                                 args.telecom_tasks)
        server = Tau2Server(conversations, args.reward_shape, args.max_errors, args.max_instances, args.workers,
                            args.instance_ttl, args.max_steps)
    except ValueError as e:
        raise SystemExit(f"tau2 server: {e}") from None
    sock, port = bound_socket(args.host, args.port)  # the log names the port --port 0 got
    web.run_app(server.app(), sock=sock, print=lambda *_: log.info(
        "tau2 server listening on http://%s:%d (user model %s at %s, reward %s, agent prompt %s, telecom tasks %s)",
        args.host, port, args.user_model, args.user_base_url, args.reward_shape, args.agent_prompt,
        TELECOM_TASK_FILES.get(args.telecom_tasks or "", "tasks.json")))


if __name__ == "__main__":
    main()
