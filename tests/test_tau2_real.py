"""τ²-bench's env server (env_gateway/servers/tau2.py) on the real ``tau2`` package: sierra-research/tau2-bench at
commit c5b2d22, installed in .venvs/tau2 by ``bash scripts/setup_env.sh tau2`` from ../shared/tau2-bench-c5b2d22
(or $TAU2_BENCH_DIR). The server runs as a subprocess from that venv; tool calls run in τ²'s own domain environment,
τ²'s ``UserSimulator`` plays the customer through litellm, and τ²'s ``evaluate_simulation`` gives the reward.

The one part that is not real is the user model behind litellm: ``StandInUser``, a scripted stand-in for an
OpenAI-compatible chat-completions server (no model runs here; ``ActingUser`` also calls the telecom user's own
tools when asked). It is enough for these checks, because the reward of the mock, retail and telecom tasks is decided
by the DB and device state, the actions taken and the information the agent gave, not by what the user says. The
user simulator's prompt is tau2's own (data/tau2/user_simulator/simulation_guidelines*.md of the checkout; where an
older copy lacks them, ``tau2_data`` puts one-line stand-ins in a copy of the data folder).

Checks: (1) replaying each task's gold actions (``evaluation_criteria.actions``), then telling the user its
``communicate_info``, through the gateway and the agent func under OpenRLHF's ``MultiTurnAgentExecutor``, earns
reward 1 from τ²'s evaluator (every mock task the server accepts and every retail task);
(2) a wrong action earns less; (3) bare ``<tool_call>`` tags get the server's "no JSON body" observation, and the
error cap and the step cap end the episode; (4) data/tau2_*.jsonl equal what scripts/make_tau2_itemid.py writes from
the package's own task loader; the user model's key reaches the user model, never the server's log or answers;
(5) every telecom task of tasks_small.json, read in place (``--telecom-tasks small``), earns 1 when both sides replay
their gold actions, the user's through τ²'s UserSimulator and its own tools; (6) with no key file and a loopback
user model, a whole conversation runs with τ²'s real user-simulator prompt and is scored by τ²'s evaluator.

Skips, with the reason, only where the tau2-bench checkout or .venvs/tau2 is absent.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from typing import Iterator

import pytest
from aiohttp import web

from env_gateway.process import log_text
from tests.agent_funcs_stack import AGENT_ENV_VARS, ScriptedEngine, inprocess_gateway, run_episode
from tests.env_server_proc import ROOT, EnvServerProcess
from tests.tau2_checkout import DOMAINS_DIR, NEEDS_CHECKOUT, NEEDS_VENV, TAU2_BENCH, TAU2_PYTHON, data_copy
from tests.threaded_app import ThreadedApp
from tests.tiny_hf import tiny_tokenizer

KEY = "sk-stand-in-user-key-5550123"

pytestmark = [NEEDS_CHECKOUT, NEEDS_VENV, pytest.mark.timeout(300)]

STOP_WORD = "goodbye"  # the stand-in user ends the conversation when the agent says it
REFUSE = "REFUSE"  # the stand-in user model answers 401, quoting the key, when the agent's message holds it


class StandInUser(ThreadedApp):
    """A scripted STAND-IN for the user simulator's LLM, not a model: an OpenAI-compatible ``POST
    /v1/chat/completions`` on 127.0.0.1, in its own thread and event loop, that τ²'s ``UserSimulator`` calls through
    litellm. Its first answer in a conversation (only τ²'s greeting so far) asks for help; later answers end the
    conversation with τ²'s stop marker ``###STOP###`` when the agent's last message contains "goodbye", and ask the
    agent to go on otherwise; with ``patience`` set, it also ends the conversation once the agent has sent that many
    messages after the greeting, whatever they say. An agent message holding ``REFUSE`` gets an HTTP 401 whose error
    quotes the Authorization header back, as some providers do. It records the model and the Authorization header of
    every request."""

    def __init__(self, patience: int | None = None) -> None:
        super().__init__()
        self.patience = patience
        self.requests: list[dict] = []

    def answer(self, messages: list[dict]) -> str:
        said = [m for m in messages if m.get("role") != "system"]  # τ² flips roles: the agent's turns are "user"
        if len(said) <= 1:
            return "Hi, I need help with my request."
        last = said[-1].get("content") or ""
        agent_messages = sum(m.get("role") == "user" for m in said) - 1  # after the greeting
        hang_up = self.patience is not None and agent_messages >= self.patience
        return "Thank you, that is all. ###STOP###" if hang_up or STOP_WORD in last.lower() else "Please go on."

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"model": body.get("model"), "authorization": request.headers.get("Authorization")})
        said = [m for m in body.get("messages") or [] if m.get("role") != "system"]
        if said and REFUSE in (said[-1].get("content") or ""):
            return web.json_response({"error": {"message": f"Incorrect API key provided: "
                                                           f"{request.headers.get('Authorization')}",
                                                "type": "invalid_request_error", "code": "invalid_api_key"}},
                                     status=401)
        text = self.answer(body.get("messages") or [])
        return web.json_response({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model"), "choices": [{"index": 0, "finish_reason": "stop",
                                                    "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def routes(self) -> list:
        return [web.post("/v1/chat/completions", self.completions)]


def tasks(domain: str) -> dict[str, dict]:
    name = "tasks_small.json" if domain == "telecom" else "tasks.json"
    with open(os.path.join(DOMAINS_DIR, domain, name)) as f:
        return {t["id"]: t for t in json.load(f)}


def call_tool(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def gold_replies(task: dict) -> list[str]:
    """The agent's side of a perfect conversation: each gold action as a tool call, then a last message to the user
    that holds every ``communicate_info`` string and says goodbye."""
    criteria = task.get("evaluation_criteria") or {}
    replies = [call_tool(a["name"], a.get("arguments") or {}) for a in criteria.get("actions") or []
               if a.get("requestor", "assistant") == "assistant"]
    info = " ".join(str(x) for x in criteria.get("communicate_info") or [])
    return replies + [f"All done. {info} Thank you, goodbye.".replace("  ", " ")]


def mid_conversation(task: dict) -> bool:
    return bool((task.get("initial_state") or {}).get("message_history"))


@pytest.fixture(scope="module")
def tau2_data(tmp_path_factory) -> Iterator[str]:
    """tau2's data folder with stand-in guidelines (tests/tau2_checkout.py), set as TAU2_DATA_DIR for the servers
    the tests start."""
    data = data_copy(tmp_path_factory)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TAU2_DATA_DIR", data)
        yield data


@pytest.fixture(scope="module")
def user() -> Iterator[StandInUser]:
    with StandInUser() as u:
        yield u


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("secrets") / "tau2_user_api_key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return str(path)


def full_log(server: EnvServerProcess) -> str:
    """Everything the server process has logged so far (``output()`` is only the tail)."""
    return log_text(server.log).decode(errors="replace")


def tau2_server(user: StandInUser, key_file: str, *flags: str) -> EnvServerProcess:
    return EnvServerProcess("tau2", "--user-model", "openai/stand-in-user", "--user-base-url", f"{user.url}/v1",
                            "--user-key-file", key_file, "--user-timeout", "30", "--tau2-log-level", "INFO", *flags,
                            python=TAU2_PYTHON, startup_timeout=120)


@pytest.fixture(scope="module")
def server(tau2_data, user, key_file) -> Iterator[EnvServerProcess]:
    with tau2_server(user, key_file) as s:
        yield s


@pytest.fixture
def agent_env(monkeypatch):
    for name in AGENT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MAX_TURNS", "60")
    return monkeypatch


def play(server: EnvServerProcess, episodes: list[tuple[str, list[str]]], monkeypatch) -> list[dict]:
    """Each (item, replies) as one episode through the real gateway and agent func (OpenRLHF's
    ``MultiTurnAgentExecutor``, replies from ``ScriptedEngine``): the agent func's results, in order."""
    tok = tiny_tokenizer()

    async def main() -> list[dict]:
        out = []
        async with inprocess_gateway({"tau2": server.url}) as gateway:
            monkeypatch.setenv("COPE_GATEWAY_URL", gateway)
            for item, replies in episodes:
                out.append(await run_episode("tau2", item, ScriptedEngine(tok, replies), tok, timeout=120))
        return out

    return asyncio.run(main())


def direct(server: EnvServerProcess, item: str, replies: list[str]) -> list[dict]:
    """The same episode on the server's own protocol (no gateway): reset's answer, then each step's."""
    idx = server.ok("POST", "/create")
    try:
        answers = [server.ok("POST", "/reset", {"env_idx": idx, "session_id": item}, timeout=60)]
        for reply in replies:
            answers.append(server.ok("POST", "/step", {"env_idx": idx, "action": reply}, timeout=60))
            if answers[-1]["done"]:
                break
        return answers
    finally:
        server.call("POST", "/close", {"env_idx": idx})


def replay_gold(server: EnvServerProcess, domain: str, ids: list[str], monkeypatch) -> dict[str, float]:
    all_tasks = tasks(domain)
    results = play(server, [(f"{domain}/{i}", gold_replies(all_tasks[i])) for i in ids], monkeypatch)
    for i, result in zip(ids, results):
        assert result["extra_logs"]["turns"] == len(gold_replies(all_tasks[i])), (i, result["extra_logs"])
    return {i: result["reward"] for i, result in zip(ids, results)}


def explain(server: EnvServerProcess, domain: str, failed: list[str]) -> str:
    """Why each failed task failed: τ²'s breakdown from the direct protocol."""
    lines = []
    for i in failed:
        last = direct(server, f"{domain}/{i}", gold_replies(tasks(domain)[i]))[-1]
        lines.append(f"{domain}/{i}: {last.get('info')}")
    return "\n".join(lines)


# ---- (1) the gold actions earn 1 ---------------------------------------------------------------------------------
def test_gold_actions_earn_reward_1_on_every_mock_task(server, agent_env):
    mock = tasks("mock")
    ids = [i for i, t in mock.items() if not mid_conversation(t)]
    assert len(ids) == 7  # of 9: two start mid-conversation (checked below)
    rewards = replay_gold(server, "mock", ids, agent_env)
    failed = [i for i, r in rewards.items() if r != 1.0]
    assert not failed, explain(server, "mock", failed)


def test_tasks_that_start_mid_conversation_are_refused_with_the_reason(server):
    mid = [i for i, t in tasks("mock").items() if mid_conversation(t)]
    assert mid == ["update_task_with_message_history", "update_task_with_history_and_env_assertions"]
    idx = server.ok("POST", "/create")
    for i in mid:
        status, body = server.call("POST", "/reset", {"env_idx": idx, "session_id": f"mock/{i}"})
        assert status == 422 and "mid-conversation" in body["detail"], body
    status, body = server.call("POST", "/reset", {"env_idx": idx, "session_id": "retail/no-such-task"})
    assert status == 404 and "has no task" in body["detail"], body
    server.call("POST", "/close", {"env_idx": idx})


def retail_ids() -> list[str]:
    return sorted(tasks("retail"), key=int) if os.path.isdir(DOMAINS_DIR) else []


@pytest.mark.timeout(900)  # about 90 s on 2 cores: every retail task, in CI (issue 20's bar: at least 90% earn 1)
def test_gold_actions_earn_reward_1_on_at_least_90_percent_of_retail_tasks(server, agent_env):
    ids = retail_ids()
    t0 = time.monotonic()
    rewards = replay_gold(server, "retail", ids, agent_env)
    failed = [i for i, r in rewards.items() if r != 1.0]
    print(f"retail: {len(ids) - len(failed)} of {len(ids)} tasks earn 1 in {time.monotonic() - t0:.0f} s; "
          f"failed: {failed}")
    assert len(failed) <= 0.1 * len(ids), explain(server, "retail", failed)


# ---- (2) a wrong action earns less -------------------------------------------------------------------------------
def test_wrong_actions_earn_less(server, agent_env):
    mock_gold = gold_replies(tasks("mock")["create_task_1"])
    wrong_title = [call_tool("create_task", {"user_id": "user_1", "title": "Unimportant Meeting"}), mock_gold[-1]]
    retail = tasks("retail")["40"]  # look up, then change an order's payment; the user must hear "60", "mastercard"
    assert retail["evaluation_criteria"]["actions"][-1]["name"] == "modify_pending_order_payment"
    assert retail["evaluation_criteria"]["communicate_info"] == ["60", "mastercard"]
    gold = gold_replies(retail)
    skip_last_write = gold[:-2] + gold[-1:]  # the payment is never changed
    said_nothing = gold[:-1] + ["Thank you, goodbye."]  # every action, but the user is not told what they must hear
    results = play(server, [("mock/create_task_1", mock_gold), ("mock/create_task_1", wrong_title),
                            ("retail/40", gold), ("retail/40", skip_last_write), ("retail/40", said_nothing)],
                   agent_env)
    assert [r["reward"] for r in results] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert [r["extra_logs"]["success"] for r in results] == [1.0, 0.0, 1.0, 0.0, 0.0]
    # τ²'s own verdicts, by reward basis
    assert direct(server, "mock/create_task_1", wrong_title)[-1]["info"]["reward_breakdown"]["DB"] == 0.0
    assert direct(server, "retail/40", skip_last_write)[-1]["info"]["reward_breakdown"] == {"DB": 0.0,
                                                                                            "COMMUNICATE": 1.0}
    assert direct(server, "retail/40", said_nothing)[-1]["info"]["reward_breakdown"] == {"DB": 1.0,
                                                                                         "COMMUNICATE": 0.0}


# ---- (3) bare tags, the error cap and the step cap ---------------------------------------------------------------
def test_bare_tool_call_tags_get_the_promised_observation_and_the_caps_end_the_episode(tau2_data, user, key_file):
    with tau2_server(user, key_file, "--max-errors", "4", "--max-steps", "12") as capped:
        bare = direct(capped, "retail/0", ["<tool_call>"] * 10)
        loop = direct(capped, "retail/0", ["Let me think about it."] * 10)
        output = full_log(capped)
    assert all("Tool call error: <tool_call> number 1 has no JSON body" in a["state"] for a in bare[1:])
    assert all(a["info"]["tool_errors"] == 1 for a in bare[1:])
    assert [a["done"] for a in bare[1:]] == [False] * 3 + [True] and bare[-1]["reward"] == 0.0
    assert "Too many tool errors (4)" in bare[-1]["state"]
    # steps: 1 (the user's first message) + 2 per reply: the cap of 12 ends it at the sixth reply
    assert [a["done"] for a in loop[1:]] == [False] * 5 + [True] and loop[-1]["reward"] == 0.0
    assert "Please go on." in loop[1]["state"] and "step limit (12)" in loop[-1]["state"]
    assert KEY not in output


# ---- scripts/eval.py on τ²'s own rewards -------------------------------------------------------------------------
def test_eval_scores_a_tiny_checkpoint_with_taus_own_evaluator(tau2_data, key_file, agent_env, tmp_path):
    """``scripts/eval.py --env tau2`` end to end: a tiny random checkpoint (it talks; it never calls a tool) through
    the gateway and the real server; the stand-in user hangs up after the agent's first message; τ²'s evaluator
    scores what happened. create_task_1_nl_eval asks for no change to the DB (its reward basis is DB and
    COMMUNICATE, with nothing to communicate): reward 1. create_task_1 needs a task created: reward 0."""
    from tests.agent_funcs_stack import TEST_GATEWAY_FLAGS
    from tests.gateway_proc import GatewayProcess
    from tests.test_eval import load_script
    from tests.tiny_hf import tiny_checkpoint

    tiny_checkpoint(tmp_path / "ckpt")
    items = ["mock/create_task_1", "mock/create_task_1_nl_eval"]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps({"prompt": f"tau2/{i}", "label": i}) + "\n"
                                                  for i in items))
    agent_env.setenv("MAX_TURNS", "4")
    # a τ² reset (domain, user simulator, the user's first message) took over the tests' 20 s request timeout on a
    # loaded 2-core machine, with four at once: the gateway waits up to 120 s here, the outcome is the rewards
    assert TEST_GATEWAY_FLAGS[0] == "--request-timeout"
    flags = ("--request-timeout", "120", *TEST_GATEWAY_FLAGS[2:])
    with StandInUser(patience=1) as hasty, tau2_server(hasty, key_file) as server, \
            GatewayProcess(*flags, envs={"tau2": server.url}) as gateway:
        agent_env.setenv("COPE_GATEWAY_URL", gateway.url)  # main() sets it; monkeypatch puts the old value back
        report = load_script("eval").main([
            "--env", "tau2", "--model", str(tmp_path / "ckpt"), "--items", str(tmp_path / "items.jsonl"), "--k",
            "2", "--engine", "hf", "--gateway", gateway.url, "--max-new-tokens", "12", "--max-length", "16384",
            "--out", str(tmp_path / "out" / "tau2.json")])
        logged = full_log(server)
    assert report["episodes"] == 4 and report["env_failures"] == 0
    assert {row["item_id"]: row["rewards"] for row in report["per_item"]} == {
        "mock/create_task_1": [0.0, 0.0], "mock/create_task_1_nl_eval": [1.0, 1.0]}, logged[-3000:]
    assert report["metrics"]["success_rate"] == 0.5 and report["metrics"]["pass^2"] == 0.5
    assert logged.count("done, tau2 reward 1.000") == 2 and logged.count("done, tau2 reward 0.000") == 2


# ---- the key: to the user model, never to the log ----------------------------------------------------------------
def test_the_key_reaches_the_user_model_and_never_the_log(server, user, agent_env):
    before = len(user.requests)
    play(server, [("mock/create_task_1", gold_replies(tasks("mock")["create_task_1"]))], agent_env)
    seen = user.requests[before:]
    assert len(seen) == 2  # the user's first message and its goodbye
    assert all(r["authorization"] == f"Bearer {KEY}" and r["model"] == "stand-in-user" for r in seen), seen
    # an error from the user model that quotes the key: through litellm, tau2's own log and the server's answer
    answers = []
    idx = server.ok("POST", "/create")
    try:
        server.ok("POST", "/reset", {"env_idx": idx, "session_id": "mock/create_task_1"}, timeout=60)
        answers.append(server.call("POST", "/step", {"env_idx": idx, "action": f"{REFUSE} this"}, timeout=120))
    finally:
        server.call("POST", "/close", {"env_idx": idx})
    status, body = answers[0]
    assert status == 500 and body["error"] == "user_simulator_failed", body  # a code and a reason: no exception text
    assert KEY not in body["detail"] and "Incorrect API key" not in body["detail"], body
    assert user.requests[-1]["authorization"] == f"Bearer {KEY}"
    output = full_log(server)
    assert "Incorrect API key provided: Bearer [redacted]" in output and KEY not in output
    assert " tau2 ERROR " in output and " tau2 INFO " in output  # tau2's own log is there, redacted too


# ---- (4) the committed item-id files -----------------------------------------------------------------------------
def test_item_id_files_equal_what_the_package_task_loader_gives(tmp_path):
    out = subprocess.run([TAU2_PYTHON, os.path.join(ROOT, "scripts", "make_tau2_itemid.py"), "--from-package",
                          "--split", "train", "test", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    written = sorted(os.listdir(tmp_path))
    assert written == sorted(f"tau2_{d}_{s}.jsonl" for d in ("airline", "retail", "telecom")
                             for s in ("train", "test"))
    for name in written:
        with open(tmp_path / name) as new, open(os.path.join(ROOT, "data", name)) as committed:
            assert new.read() == committed.read(), name


def test_the_seeds_item_id_command_with_neither_source_uses_the_installed_package(tmp_path):
    """`make_tau2_itemid.py --domains retail airline telecom --split train --out data/`, run by the trainer's
    interpreter (no tau2 there), said "one of the arguments --tau2-data --from-package is required"; it now uses the
    installed package (.venvs/tau2's) and writes the committed files."""
    out = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "scripts/make_tau2_itemid.py", "--domains",
                          "retail", "airline", "telecom", "--split", "train", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    written = sorted(os.listdir(tmp_path))
    assert written == [f"tau2_{d}_train.jsonl" for d in ("airline", "retail", "telecom")]
    for name in written:
        with open(tmp_path / name) as new, open(os.path.join(ROOT, "data", name)) as committed:
            assert new.read() == committed.read(), name


# ---- telecom-small, the user's own tool calls, the real UserSimulator with no key -------------------------------
PLEASE_RUN = "PLEASE_RUN"  # an agent message holding it asks the acting user to call the tool named in the JSON after


class ActingUser(StandInUser):
    """``StandInUser`` that also acts on its phone, as telecom's user does: when the agent's last message holds
    ``PLEASE_RUN {"name": ..., "arguments": ...}``, it answers with that OpenAI-format tool call (τ²'s
    ``UserSimulator`` runs it through the user's own tools); after the tool's result it says it did it. It records each
    request's system prompt and the tool calls it made."""

    def __init__(self) -> None:
        super().__init__()
        self.systems: list[str] = []
        self.calls: list[str] = []

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        messages = body.get("messages") or []
        self.systems.append(" ".join(m.get("content") or "" for m in messages if m.get("role") == "system"))
        said = [m for m in messages if m.get("role") != "system"]
        last = said[-1] if said else {}
        if last.get("role") == "tool":
            message = {"role": "assistant", "content": "I did it. What now?"}
        elif PLEASE_RUN in (last.get("content") or ""):
            call = json.loads(last["content"].split(PLEASE_RUN, 1)[1])
            self.calls.append(call["name"])
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_user_{len(self.calls)}", "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]}
        else:
            message = {"role": "assistant", "content": self.answer(messages)}
        self.requests.append({"model": body.get("model"), "authorization": request.headers.get("Authorization")})
        return web.json_response({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model"), "choices": [{"index": 0, "message": message,
                                                    "finish_reason": "tool_calls" if message.get("tool_calls")
                                                    else "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def gold_replies_both_sides(task: dict) -> list[str]:
    """``gold_replies``, with each of the user's own gold actions (``requestor: user``) asked of the user in order."""
    replies = []
    for action in (task.get("evaluation_criteria") or {}).get("actions") or []:
        if action.get("requestor", "assistant") == "user":
            replies.append(f"Please do this on your phone: {PLEASE_RUN} "
                           f"{json.dumps({'name': action['name'], 'arguments': action.get('arguments') or {}})}")
        else:
            replies.append(call_tool(action["name"], action.get("arguments") or {}))
    return replies + gold_replies(task)[-1:]


@pytest.fixture(scope="module")
def acting_user() -> Iterator[ActingUser]:
    with ActingUser() as u:
        yield u


@pytest.fixture(scope="module")
def keyless(acting_user, tmp_path_factory) -> Iterator[EnvServerProcess]:
    """The server on the checkout's own data folder (no copy: telecom's tasks_small.json read in place), with no key
    file, its user model on this machine (loopback)."""
    absent = tmp_path_factory.mktemp("no-secrets") / "tau2_user_api_key"
    server = EnvServerProcess("tau2", "--user-model", "openai/stand-in-user", "--user-base-url",
                              f"{acting_user.url}/v1", "--user-key-file", str(absent), "--telecom-tasks", "small",
                              "--user-timeout", "30", "--tau2-log-level", "INFO", python=TAU2_PYTHON,
                              startup_timeout=120)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TAU2_DATA_DIR", os.path.join(TAU2_BENCH, "data"))
        server.__enter__()
    try:
        yield server
    finally:
        server.__exit__(None, None, None)


def test_telecom_small_gold_actions_of_both_sides_earn_reward_1_on_every_task(keyless, acting_user):
    """Every telecom task of tasks_small.json (20), read in place with --telecom-tasks small: the agent's gold
    actions as its tool calls, the user's gold actions (toggle_roaming, reboot_device, ...) asked of the user and run
    by τ²'s UserSimulator through its own tools; τ²'s evaluator gives 1 to each. Skipping the user's action earns 0."""
    small = tasks("telecom")
    assert len(small) == 20 and not os.path.exists(os.path.join(DOMAINS_DIR, "telecom", "tasks.json"))
    failed, user_actions = {}, 0
    for task_id, task in small.items():
        before = len(acting_user.calls)
        last = direct(keyless, f"telecom/{task_id}", gold_replies_both_sides(task))[-1]
        wanted = [a["name"] for a in task["evaluation_criteria"]["actions"] if a["requestor"] == "user"]
        assert acting_user.calls[before:] == wanted, task_id
        user_actions += len(wanted)
        if not (last["done"] and last["reward"] == 1.0):
            failed[task_id] = last.get("info")
    assert not failed, failed
    assert user_actions == 20  # every user-side gold action of the 20 tasks ran (1 or 2 per task, none in 4)
    airplane = "[service_issue]airplane_mode_on[PERSONA:None]"
    skipped = direct(keyless, f"telecom/{airplane}", gold_replies_both_sides(small[airplane])[1:])[-1]
    assert skipped["done"] and skipped["reward"] == 0.0 and skipped["info"]["reward_breakdown"]["ENV_ASSERTION"] == 0.0


def test_a_whole_conversation_with_the_real_user_simulator_prompt_no_key_and_taus_evaluator(keyless, acting_user):
    """τ²'s UserSimulator with its real guidelines (data/tau2/user_simulator/simulation_guidelines*.md of the
    checkout) against the loopback stand-in, with no key file (the server refused to start without one): /reset
    starts the conversation, the agent works, the user hangs up, τ²'s evaluator scores it."""
    data = os.path.join(os.path.dirname(DOMAINS_DIR), "user_simulator")
    with open(os.path.join(data, "simulation_guidelines.md")) as f:
        guidelines = f.read().strip()
    with open(os.path.join(data, "simulation_guidelines_tools.md")) as f:
        guidelines_tools = f.read().strip()
    assert "Stand-in guidelines" not in guidelines and len(guidelines) > 500  # the real prose, not a stand-in line
    before = len(acting_user.systems)
    task = tasks("mock")["create_task_1"]
    answers = direct(keyless, "mock/create_task_1", gold_replies(task))
    assert answers[0]["state"] == "Hi, I need help with my request."  # the user's first message, through the user
    assert answers[-1]["done"] and answers[-1]["reward"] == 1.0 and answers[-1]["info"]["tau2_reward"] == 1.0
    systems = acting_user.systems[before:]
    assert systems and all(guidelines in system for system in systems)
    assert task["user_scenario"]["instructions"] in systems[0]  # the task's scenario, below the guidelines
    assert all(r["authorization"] == "Bearer EMPTY" for r in acting_user.requests[-len(systems):])
    # telecom's user has tools: its prompt is the tools guidelines
    before = len(acting_user.systems)
    direct(keyless, "telecom/[service_issue]airplane_mode_on[PERSONA:None]", ["Thank you, goodbye."])
    assert all(guidelines_tools in system for system in acting_user.systems[before:])
    assert "placeholder key" in full_log(keyless)


def test_setup_env_records_the_commit_of_an_install_from_a_copy_once_stated(tmp_path):
    """The shared copy is no git checkout, so tau2 run records "unknown" for every run made with it; setup_env.sh
    records the commit stated once at install beside the venv (.venvs/tau2/tau2-commit.json), where the eval script
    and the scorer read it. Runs only where the venv is current (setup_env.sh then only checks it: no rebuild)."""
    import hashlib

    venv = os.path.dirname(os.path.dirname(TAU2_PYTHON))
    with open(os.path.join(ROOT, "env_gateway", "servers", "requirements", "tau2.txt"), "rb") as f:
        want = hashlib.sha256(f.read() + b"\n" + os.path.realpath(TAU2_BENCH).encode() + b"\n").hexdigest()
    with open(os.path.join(venv, ".requirements.sha256")) as f:
        if f.read().strip() != want:
            pytest.skip(f"{venv} was built from another requirements file or checkout: this would rebuild it")
    record = os.path.join(venv, "tau2-commit.json")
    kept = open(record).read() if os.path.exists(record) else None
    env = {**os.environ, "TAU2_BENCH_DIR": TAU2_BENCH}
    env.pop("TAU2_COMMIT", None)
    try:
        if kept is not None:
            os.remove(record)
        plain = subprocess.run(["bash", "scripts/setup_env.sh", "tau2"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=300)
        assert plain.returncode == 0, plain.stderr[-2000:]
        assert "commit of this install is unknown" in plain.stdout and "TAU2_COMMIT=c5b2d22" in plain.stdout
        assert not os.path.exists(record)
        stated = subprocess.run(["bash", "scripts/setup_env.sh", "tau2"], cwd=ROOT,
                                env={**env, "TAU2_COMMIT": "c5b2d22"}, capture_output=True, text=True, timeout=300)
        assert stated.returncode == 0, stated.stderr[-2000:]
        assert "installed from tau2-bench commit c5b2d22" in stated.stdout
        with open(record) as f:
            assert json.load(f)["commit"] == "c5b2d22"
        shown = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "scripts/tau2_commit.py", "--venv", venv],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert shown.stdout.strip() == "c5b2d22"
    finally:
        if kept is None:
            if os.path.exists(record):
                os.remove(record)
        else:
            with open(record, "w") as f:
                f.write(kept)
