"""τ²-bench's env server (env_gateway/servers/tau2.py) on the real ``tau2`` package: sierra-research/tau2-bench at
commit c5b2d22, installed in .venvs/tau2 by ``bash scripts/setup_env.sh tau2`` from ../shared/tau2-bench-c5b2d22
(or $TAU2_BENCH_DIR). The server runs as a subprocess from that venv; tool calls run in τ²'s own domain environment,
τ²'s ``UserSimulator`` plays the customer through litellm, and τ²'s ``evaluate_simulation`` gives the reward.

The one part that is not real is the user model behind litellm: ``StandInUser``, a scripted stand-in for an
OpenAI-compatible chat-completions server (no model runs here). It is enough for these checks, because the reward of
the mock and retail tasks is decided by the DB state, the actions taken and the information the agent gave, not by
what the user says. The shared checkout lacks tau2's user-simulator guidelines (data/tau2/user_simulator/*.md, the
prose of the user model's system prompt): where they are absent, ``tau2_data`` puts one-line stand-ins there, in a
copy of the data folder the server gets as TAU2_DATA_DIR (a full checkout's own files are used as they are).

Checks: (1) replaying each task's gold actions (``evaluation_criteria.actions``), then telling the user its
``communicate_info``, through the gateway and the agent func under OpenRLHF's ``MultiTurnAgentExecutor``, earns
reward 1 from τ²'s evaluator (every mock task the server accepts and every retail task);
(2) a wrong action earns less; (3) bare ``<tool_call>`` tags get the server's "no JSON body" observation, and the
error cap and the step cap end the episode; (4) data/tau2_*.jsonl equal what scripts/make_tau2_itemid.py writes from
the package's own task loader; and the user model's key reaches the user model, never the server's log.

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

from env_gateway.servers.process import log_text
from tests.agent_funcs_stack import AGENT_ENV_VARS, ScriptedEngine, inprocess_gateway, run_episode
from tests.env_server_proc import ROOT, EnvServerProcess
from tests.tau2_checkout import DOMAINS_DIR, NEEDS_CHECKOUT, NEEDS_VENV, TAU2_PYTHON, data_copy
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
    assert status == 500 and "[redacted]" in body["detail"] and KEY not in body["detail"], body
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
