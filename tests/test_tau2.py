"""τ²-bench: the env server (env_gateway/servers/tau2.py), its Hermes tool-call parsing and reward shapes, the
agent func through the real gateway, the item-id files, and the key handling.

These tests run in the trainer's venv, where the ``tau2`` package is not installed (it lives in .venvs/tau2), so
the server's conversations come from ``FakeTau2Task``, a stand-in for tau2's environment, user simulator and
evaluator on one small retail-like task; that keeps the server's own rules (parsing, error cap, reward shapes,
key handling) fast to pin. Everything else is real: the server's HTTP layer and parsing, the gateway and its
``tau2`` adapter, the agent func under OpenRLHF's ``MultiTurnAgentExecutor``. The server on the real package
(sierra-research/tau2-bench at c5b2d22, requires-python >= 3.10, installed into a Python 3.11 venv by
``bash scripts/setup_env.sh tau2``) is tested in tests/test_tau2_real.py.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import logging
import os
import re
import subprocess
import time

import aiohttp
import pytest

from env_gateway.servers.tau2 import STOP_TOOL, Tau2Server, ToolCall, parse_hermes, read_key, shape_reward
from tests.agent_funcs_stack import AGENT_ENV_VARS, ScriptedEngine, inprocess_gateway, run_episode, serve_app
from tests.env_server_proc import ROOT, call, stop_process
from tests.tiny_hf import tiny_tokenizer

pytestmark = pytest.mark.timeout(60)
SHARED_TAU2 = os.path.join(os.path.dirname(ROOT), "shared", "tau2-data-c5b2d22")
SPLITS = {("airline", "train"): 30, ("airline", "test"): 20, ("retail", "train"): 74, ("retail", "test"): 40,
          ("telecom", "train"): 74, ("telecom", "test"): 40}  # docs/BASELINES.md


class FakeTau2Task:
    """Stand-in for a tau2 conversation (the package is not in this venv): order #W1 must be cancelled
    (the "DB" check) and the agent must tell the user "cancelled" (the "COMMUNICATE" check)."""

    policy = "Cancel pending orders only after looking them up."
    tools = [{"type": "function", "function": {"name": "get_order", "parameters": {"type": "object", "properties": {
        "order_id": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "cancel_order", "parameters": {"type": "object", "properties": {
            "order_id": {"type": "string"}}}}},
        {"type": "function", "function": {"name": STOP_TOOL, "parameters": {"type": "object", "properties": {}}}}]
    system_prompt = None  # --agent-prompt project: the agent func writes its own

    def __init__(self, domain: str, task_id: str):
        assert (domain, task_id) == ("retail", "7"), (domain, task_id)
        self.cancelled, self.told = False, False

    def start(self) -> str:
        return "Hi, please cancel my order #W1."

    def to_user(self, text: str) -> tuple[str, bool]:
        self.told = self.told or "cancelled" in text.lower()
        return ("Thanks, bye! ###STOP###", True) if self.told else ("Is it done?", False)

    def call_tools(self, calls: list[ToolCall]) -> list[tuple[str, bool]]:
        out = []
        for c in calls:
            if c.name == "get_order":
                out.append((json.dumps({"order_id": c.arguments.get("order_id"), "status": "pending"}), False))
            elif c.name == "cancel_order" and c.arguments.get("order_id") == "#W1":
                self.cancelled = True
                out.append((json.dumps({"order_id": "#W1", "status": "cancelled"}), False))
            else:
                out.append((f"Error: unknown tool or order: {c.name} {c.arguments}", True))
        return out

    def evaluate(self, agent_stopped: bool) -> tuple[float, dict]:
        breakdown = {"DB": float(self.cancelled), "COMMUNICATE": float(self.told)}
        return breakdown["DB"] * breakdown["COMMUNICATE"], breakdown


class FakeTau2TaskDefaultAgent(FakeTau2Task):
    """The same stand-in as ``--agent-prompt tau2`` serves it: τ²'s default agent prompt, no ``done`` tool."""

    tools = FakeTau2Task.tools[:2]
    system_prompt = "<instructions>\nStand-in for tau2's agent instruction.\n</instructions>\n<policy>\n" \
                    f"{FakeTau2Task.policy}\n</policy>"


def call_tool(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ---- parsing and shaping -------------------------------------------------------------------------------------
def test_parse_hermes_tool_calls_and_messages():
    assert parse_hermes("Sure, one moment.") == ([], None)
    assert parse_hermes(call_tool("get_order", order_id="#W1")) == ([ToolCall("get_order", {"order_id": "#W1"})],
                                                                    None)
    two = "Let me check.\n" + call_tool("get_order", order_id="1") + call_tool("get_order", order_id="2")
    assert [c.arguments["order_id"] for c in parse_hermes(two)[0]] == ["1", "2"]
    as_string = '<tool_call>{"name": "get_order", "arguments": "{\\"order_id\\": \\"3\\"}"}</tool_call>'
    assert parse_hermes(as_string)[0] == [ToolCall("get_order", {"order_id": "3"})]


@pytest.mark.parametrize("reply,says", [
    ("<tool_call>", "has no JSON body"),                      # telecom's collapse: a bare tag
    ("<tool_call>\n</tool_call>", "has no JSON body"),
    ("<tool_call>\n<tool_call>", "has no JSON body"),
    ("<tool_call>{'name': 'x'}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'has no "name"'),
    ('<tool_call>{"name": "x", "arguments": [1]}</tool_call>', "must be a JSON object"),
])
def test_parse_hermes_says_what_is_wrong(reply, says):
    calls, error = parse_hermes(reply)
    assert calls == [] and says in error and '<tool_call>{"name": "<tool name>"' in error


def test_reward_shapes():
    assert shape_reward(1.0, {"DB": 1.0, "COMMUNICATE": 1.0}, "binary") == 1.0
    assert shape_reward(1.0 - 1e-9, None, "binary") == 1.0
    assert shape_reward(0.0, {"DB": 1.0, "COMMUNICATE": 0.0}, "binary") == 0.0
    assert shape_reward(0.0, {"DB": 1.0, "COMMUNICATE": 0.0}, "dense") == 0.5
    assert shape_reward(0.25, {}, "dense") == 0.25
    with pytest.raises(ValueError, match="binary' or 'dense"):
        Tau2Server(FakeTau2Task, reward_shape="sparse")


# ---- the agent func's own rules (agent_funcs/tau2.py, imported by module name as scripts/mutation_test.sh needs) --
def bare_agent(tokenizer=None):
    """A Tau2Agent without an episode (its rules need none): ``first_prompt`` reads only the tokenizer."""
    import types

    from agent_funcs.tau2 import Tau2Agent

    agent = object.__new__(Tau2Agent)
    agent.episode = types.SimpleNamespace(tokenizer=tokenizer)
    return agent


def test_agent_func_actions_successes_and_invalid_observations():
    from agent_funcs.tau2 import TOOL_FORMAT, Tau2Agent, is_success

    assert (Tau2Agent.env, Tau2Agent.default_max_turns, Tau2Agent.forecast_layouts) == ("tau2", 30, ("turns",))
    assert Tau2Agent.instruction.startswith("You are a customer service agent.") and TOOL_FORMAT in Tau2Agent.instruction
    assert Tau2Agent.parse_action("  Hello there \n") == "Hello there" and Tau2Agent.parse_action(" \n ") is None
    two = "Let me look.\n" + call_tool("a", x="1") + "\nand\n" + call_tool("b") + "\nDone."
    assert Tau2Agent.realized_action(two) == two[two.index("<tool_call>"):two.rindex("</tool_call>") + 12]
    assert Tau2Agent.realized_action(call_tool("a") + " ok") == call_tool("a")  # a reply that opens with the call
    assert Tau2Agent.realized_action("  Your order is cancelled.  ") == "Your order is cancelled."
    assert Tau2Agent.realized_action("</tool_call> then <tool_call>") == "</tool_call> then <tool_call>"
    invalid = ["Error: no such order", "  error: bad", "user: Tool call error: <tool_call> number 1 has no JSON body",
               "<tool_response>\nError: unknown tool\n</tool_response>", "<tool_response> ERROR x</tool_response>"]
    valid = ["<tool_response>\n{\"status\": \"pending\"}\n</tool_response>", "Is it done?", "No errors here.",
             "<tool_response>\n\"an error happened earlier\"</tool_response>"]
    assert [Tau2Agent.is_invalid(o) for o in invalid] == [True] * len(invalid)
    assert [Tau2Agent.is_invalid(o) for o in valid] == [False] * len(valid)
    assert is_success(1.0) and is_success(1.0 - 9e-7) and is_success(1.0 + 9e-7) and not is_success(1.0 - 1.1e-6)
    agent = bare_agent()
    assert agent.success(1.0, True) and not agent.success(1.0, False) and not agent.success(0.5, True)


def test_agent_func_first_messages_for_each_agent_prompt():
    agent = bare_agent()
    own = agent.first_messages("Hi, cancel #W1.", {"policy": "Be nice."})
    assert own == [{"role": "system", "content": f"{agent.instruction}\n\n# Policy\nBe nice."},
                   {"role": "user", "content": "Hi, cancel #W1."}]
    tau2 = agent.first_messages("Hi.", {"system_prompt": "TAU2 PROMPT", "greeting": "Hi! How can I help you today?",
                                        "policy": "ignored"})
    assert tau2 == [{"role": "system", "content": "TAU2 PROMPT"},
                    {"role": "assistant", "content": "Hi! How can I help you today?"}, {"role": "user", "content": "Hi."}]
    assert agent.first_messages("Hi.", {"system_prompt": "P"}) == [{"role": "system", "content": "P"},
                                                                   {"role": "user", "content": "Hi."}]
    assert agent.first_messages("Hi.", {})[0]["content"].endswith("\n\n# Policy\n")  # no policy: nothing after it


def test_agent_func_first_prompt_gives_the_tools_to_the_template_or_lists_them():
    import copy

    tok = copy.deepcopy(tiny_tokenizer())  # its own template ignores tools=: the func lists them itself
    tools = FakeTau2Task.tools
    listed = bare_agent(tok).first_prompt("Hi.", {"policy": "P", "tools": tools})
    assert "\n\n# Tools\n" + "\n".join(json.dumps(t) for t in tools) in listed
    assert listed.startswith(f"<|im_start|>system\n{bare_agent().instruction}\n\n# Policy\nP\n\n# Tools\n")
    assert listed.endswith("<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n")
    bare = [{"name": "lookup", "parameters": {}}]  # a tool not wrapped in {"function": ...}: listed all the same
    assert '{"name": "lookup"' in bare_agent(tok).first_prompt("Hi.", {"tools": bare})
    nameless = [{"type": "function", "function": {"parameters": {}}}]  # no name to look for: nothing to add
    assert "# Tools" not in bare_agent(tok).first_prompt("Hi.", {"tools": nameless})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
                         "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    native = bare_agent(tok).first_prompt("Hi.", {"policy": "P", "tools": tools})
    assert "TOOLS:get_order;cancel_order;done;" in native and "# Tools" not in native  # the template's own section
    assert native.endswith("TOOLS:get_order;cancel_order;done;<|im_start|>assistant\n")
    assert "# Tools" not in bare_agent(tok).first_prompt("Hi.", {"policy": "P"})


# ---- the agent func through the gateway ----------------------------------------------------------------------
def play(replies: list[str], reward_shape: str = "binary", max_errors: int = 10, item: str = "retail/7",
         monkeypatch=None, max_steps: int = 200, task: type = FakeTau2Task) -> tuple[dict, ScriptedEngine]:
    tok = tiny_tokenizer()

    async def main():
        server = Tau2Server(task, reward_shape=reward_shape, max_errors=max_errors, max_steps=max_steps)
        async with serve_app(server.app()) as backend, inprocess_gateway({"tau2": backend}) as gateway:
            monkeypatch.setenv("COPE_GATEWAY_URL", gateway)
            engine = ScriptedEngine(tok, replies)
            result = await run_episode("tau2", item, engine, tok, timeout=30)
            assert server.episodes == {}  # the agent func closed its session
            return result, engine

    return asyncio.run(main())


@pytest.fixture
def clean_env(monkeypatch):
    for name in AGENT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_agent_func_solves_the_task_through_the_gateway(clean_env):
    replies = [call_tool("get_order", order_id="#W1"), call_tool("cancel_order", order_id="#W1"),
               "Your order #W1 is cancelled."]
    result, engine = play(replies, monkeypatch=clean_env)
    tok = tiny_tokenizer()
    assert result["reward"] == 1.0 and result["extra_logs"]["success"] == 1.0 and result["extra_logs"]["turns"] == 3
    tokens = result["observation_tokens"]
    first = tok.decode(tokens[:result["action_ranges"][0][0]])
    assert FakeTau2Task.policy in first and '"cancel_order"' in first  # tools listed (template has no tools=)
    assert first.endswith("<|im_start|>user\nHi, please cancel my order #W1.<|im_end|>\n<|im_start|>assistant\n")
    feedback = tok.decode(tokens[result["action_ranges"][0][1]:result["action_ranges"][1][0]])
    assert feedback.startswith("\n<|im_start|>user\n<tool_response>\n{") and '"pending"' in feedback
    assert [tokens[a:b] for a, b in result["action_ranges"]] == engine.outputs


def test_done_tool_ends_the_episode_and_tau2_judges_it(clean_env):
    result, _ = play([call_tool("cancel_order", order_id="#W1"), call_tool(STOP_TOOL)], monkeypatch=clean_env)
    assert result["reward"] == 0.0 and result["extra_logs"]["turns"] == 2  # never told the user: COMMUNICATE 0
    dense, _ = play([call_tool("cancel_order", order_id="#W1"), call_tool(STOP_TOOL)], reward_shape="dense",
                    monkeypatch=clean_env)
    assert dense["reward"] == 0.5 and dense["extra_logs"]["success"] == 0.0


def test_with_taus_default_agent_prompt_the_first_prompt_is_it_then_the_greeting_then_the_user(clean_env):
    replies = [call_tool("cancel_order", order_id="#W1"), "Your order #W1 is cancelled."]
    result, engine = play(replies, monkeypatch=clean_env, task=FakeTau2TaskDefaultAgent)
    first = tiny_tokenizer().decode(engine.prompts[0])
    system = FakeTau2TaskDefaultAgent.system_prompt
    assert first.startswith(f"<|im_start|>system\n{system}\n\n# Tools\n"), first  # τ²'s prompt, word for word
    assert "You are a customer service agent" not in first and '"done"' not in first  # none of the project's own
    assert first.endswith("<|im_start|>assistant\nHi! How can I help you today?<|im_end|>\n"
                          "<|im_start|>user\nHi, please cancel my order #W1.<|im_end|>\n<|im_start|>assistant\n")
    assert result["reward"] == 1.0


def test_with_taus_default_agent_prompt_done_is_an_unknown_tool_not_the_end(clean_env):
    result, engine = play([call_tool(STOP_TOOL), call_tool("cancel_order", order_id="#W1"), "It is cancelled."],
                          monkeypatch=clean_env, task=FakeTau2TaskDefaultAgent)
    tok = tiny_tokenizer()
    feedback = tok.decode(result["observation_tokens"][result["action_ranges"][0][1]:result["action_ranges"][1][0]])
    assert "Error: unknown tool or order: done" in feedback  # τ²'s domain answers it, as tau2 run's would
    assert result["extra_logs"]["turns"] == 3 and result["reward"] == 1.0


def test_done_in_a_reply_with_other_calls_runs_them_first(clean_env):
    result, _ = play([call_tool("cancel_order", order_id="#W1") + call_tool(STOP_TOOL)], reward_shape="dense",
                     monkeypatch=clean_env)
    assert result["reward"] == 0.5 and result["extra_logs"]["turns"] == 1  # DB 1 (was: the cancel never ran), COMM. 0


def test_the_step_cap_ends_a_conversation_that_goes_nowhere(clean_env):
    result, _ = play(["Hmm."] * 6, max_steps=5, monkeypatch=clean_env)  # steps: 1, then 2 per reply: 3, 5 = the cap
    tok = tiny_tokenizer()
    assert result["reward"] == 0.0 and result["extra_logs"]["turns"] == 2
    assert "step limit (5)" in tok.decode(result["observation_tokens"][result["action_ranges"][1][1]:])
    with pytest.raises(ValueError, match="max_errors and max_steps must be >= 1"):
        Tau2Server(FakeTau2Task, max_steps=0)


def test_bare_tool_call_tags_get_a_clear_observation_and_end_at_max_errors(clean_env):
    result, _ = play(["<tool_call>"] * 5, max_errors=3, monkeypatch=clean_env)
    tok = tiny_tokenizer()
    feedback = tok.decode(result["observation_tokens"][result["action_ranges"][0][1]:result["action_ranges"][1][0]])
    assert "has no JSON body" in feedback
    assert result["reward"] == 0.0 and result["extra_logs"]["turns"] == 3  # the server ended it at 3 errors


def test_failing_tool_calls_count_toward_max_errors(clean_env):
    result, _ = play([call_tool("get_order", order_id="1") + call_tool("refund", order_id="1"),
                      call_tool("cancel_order", order_id="#W9"), "<tool_call>{", "Anything else?"], max_errors=3,
                     monkeypatch=clean_env)
    tok = tiny_tokenizer()
    feedback = tok.decode(result["observation_tokens"][result["action_ranges"][0][1]:result["action_ranges"][1][0]])
    assert '"pending"' in feedback and "Error: unknown tool" in feedback  # both results, in order
    assert result["reward"] == 0.0 and result["extra_logs"]["turns"] == 3  # errors: 1, 2, then 3 (broken JSON)


def test_empty_reply_is_an_invalid_action(clean_env):
    clean_env.setenv("MAX_TURNS", "1")
    result, _ = play(["   "], monkeypatch=clean_env)
    assert result["extra_logs"]["invalid_actions"] == 1 and result["reward"] == 0.0


def test_bad_item_ids_get_a_clear_400():
    async def main():
        async with serve_app(Tau2Server(FakeTau2Task).app()) as url:
            import aiohttp
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/create") as r:
                    idx = await r.json()
                async with http.post(url + "/reset", json={"env_idx": idx, "session_id": "shopping/7"}) as r:
                    return r.status, await r.json()

    status, body = asyncio.run(main())
    assert status == 400 and "'<domain>/<task_id>'" in body["detail"] and "retail" in body["detail"]


def key_file(folder, text: str, mode: int = 0o600):
    path = folder / "key"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_key_files_others_can_read_or_with_two_lines_or_linked_from_elsewhere_are_refused(tmp_path):
    secrets, elsewhere = tmp_path / ".secrets", tmp_path / "elsewhere"
    secrets.mkdir(), elsewhere.mkdir()
    with pytest.raises(SystemExit, match="chmod 600"):  # was: taken silently
        read_key(key_file(secrets, "sk-1\n", 0o644))
    with pytest.raises(SystemExit, match="2 lines"):  # was: a key with a newline in it
        read_key(key_file(secrets, "sk-1\nsk-2\n"))
    (secrets / "link").symlink_to(key_file(elsewhere, "sk-1\n"))
    with pytest.raises(SystemExit, match="symlink out of its folder"):  # was: followed
        read_key(str(secrets / "link"))
    assert read_key(key_file(secrets, "\n  sk-ok  \n\n")) == "sk-ok"


def test_a_user_model_on_this_machine_needs_no_key_file_and_a_remote_one_does(tmp_path):
    from env_gateway.servers.tau2 import PLACEHOLDER_KEY, user_key

    absent = str(tmp_path / "no-key-file")
    for url in ("http://127.0.0.1:8000/v1", "http://localhost:8000/v1", "http://[::1]:8000/v1", "http://127.1.2.3/v1"):
        assert user_key(absent, url) == PLACEHOLDER_KEY, url  # was: SystemExit, "no file ..."
    for url in ("https://api.openai.com/v1", "http://10.0.0.5:8000/v1", "http://localhost.example.com/v1"):
        with pytest.raises(SystemExit, match="API key file: no file"):
            user_key(absent, url)
    assert user_key(key_file(tmp_path, "sk-from-the-file\n"), "http://127.0.0.1:8000/v1") == "sk-from-the-file"


def test_loose_ids_are_refused_and_untouched_instances_are_closed():
    async def main():
        server = Tau2Server(FakeTau2Task, instance_ttl=0.5)
        async with serve_app(server.app()) as url, aiohttp.ClientSession() as http:
            async with http.post(f"{url}/create", json={}) as r:
                idx = await r.json()
            async with http.post(f"{url}/create", json={}) as r:
                kept = await r.json()
            for bad in (True, idx + 0.9, "1e0"):  # int() took them as instances 1 / idx / 1
                async with http.post(f"{url}/reset", json={"env_idx": bad, "session_id": "retail/7"}) as r:
                    assert (r.status, (await r.json())["error"]) == (400, "bad_env_idx")
            for _ in range(8):  # 1.2 s, touching one instance
                async with http.get(f"{url}/observation", params={"env_idx": kept}) as r:
                    assert r.status == 200
                await asyncio.sleep(0.15)
            async with http.post(f"{url}/reset", json={"env_idx": idx, "session_id": "retail/7"}) as r:
                assert r.status == 404 and "untouched for 0.5s" in (await r.json())["detail"]
            assert list(server.episodes) == [kept]
    asyncio.run(main())


def test_a_failure_answers_a_stable_code_and_a_short_reason_and_its_cause_goes_only_to_the_log(tmp_path, caplog,
                                                                                                clean_env):
    """A stand-in user-simulator library whose error quotes its call's arguments and a file path (litellm's do):
    the server's 500 and the gateway's 502 carry no exception text at all (it was the server's 500 detail, with the
    key replaced only where it appeared verbatim), only a stable code and a short reason; the log has the cause, with
    the key removed however it is written: verbatim, upper-cased, hex-encoded, split over lines, or an
    OPENAI_API_KEY in the environment that no key file registered."""
    key = read_key(key_file(tmp_path, "sk-stand-in-key-0987654321\n"))
    env_key = "sk-env-only-key-1122334455"
    clean_env.setenv("OPENAI_API_KEY", env_key)
    path = "/home/someone/.venvs/tau2/lib/python3.11/site-packages/litellm/main.py"
    forms = [key, key.upper(), key.encode().hex(), key.encode().hex().upper(), key[:9] + "\n    " + key[9:], env_key]

    class LeakyTask(FakeTau2Task):
        def to_user(self, text: str) -> tuple[str, bool]:
            raise RuntimeError(f"AuthenticationError at {path}: call(model='openai/user', api_key=...) was refused; "
                               f"tried {' / '.join(forms)}")

    async def main():
        async with serve_app(Tau2Server(LeakyTask).app()) as backend, \
                inprocess_gateway({"tau2": backend}) as gateway, aiohttp.ClientSession() as http:
            async with http.post(f"{backend}/create", json={}) as r:
                idx = await r.json()
            async with http.post(f"{backend}/reset", json={"env_idx": idx, "session_id": "retail/7"}) as r:
                assert r.status == 200
            async with http.post(f"{backend}/step", json={"env_idx": idx, "action": "hello"}) as r:
                direct = (r.status, await r.json())
            async with http.post(f"{gateway}/v1/sessions", json={"env": "tau2", "item_id": "retail/7"}) as r:
                sid = (await r.json())["session_id"]
            async with http.post(f"{gateway}/v1/sessions/{sid}/step", json={"action": "hello"}) as r:
                through = (r.status, await r.text())
            return direct, through

    with caplog.at_level(logging.INFO):
        direct, through = asyncio.run(main())
    status, body = direct
    assert status == 500 and body["error"] == "user_simulator_failed", body
    assert "log" in body["detail"] and "AuthenticationError" not in body["detail"] and "/" not in body["detail"]
    assert through[0] == 502 and "AuthenticationError" not in through[1] and path not in through[1]
    logged = caplog.text
    assert "Traceback" in logged and "AuthenticationError" in logged and path in logged  # the cause, in the log
    for form in forms:
        assert form not in logged and form not in json.dumps(body) + through[1], form
    assert logged.count("[redacted]") >= len(forms)


def test_the_scrubber_takes_every_written_form_of_a_secret(monkeypatch):
    from env_gateway.servers.tau2 import scrub

    monkeypatch.setenv("OPENAI_API_KEY", "sk-abcdefgh12345678")
    monkeypatch.setenv("SOME_SETTING", "not-a-secret-value-1234")
    key = "sk-abcdefgh12345678"
    for text in (key, key.upper(), key.encode().hex(), key.encode().hex().upper(), "sk-abcd\nefgh12345678",
                 "sk-abcd\\nefgh12345678", base64.b64encode(key.encode()).decode()):
        assert "[redacted]" in scrub(f"before {text} after") and "abcdefgh" not in scrub(text).lower(), text
    assert scrub("not-a-secret-value-1234 EMPTY") == "not-a-secret-value-1234 EMPTY"


# ---- the real server process: key handling, and the missing package ------------------------------------------
def test_server_reads_its_key_from_a_file_and_never_shows_it(tmp_path):
    key = "sk-test-not-a-real-key-1234567890"
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    assert read_key(str(key_file)) == key
    with pytest.raises(SystemExit, match="API key file: no file"):
        read_key(str(tmp_path / "absent"))
    cmd = [os.path.join(ROOT, ".venv", "bin", "python"), "-m", "env_gateway.servers.tau2", "--port", "0",
           "--user-model", "openai/user", "--user-base-url", "http://127.0.0.1:9/v1", "--user-key-file", str(key_file)]
    log = tmp_path / "server.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        url, deadline = None, time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
            if found and call(found.group(1), "GET", "/", timeout=2)[0] == 200:
                url = found.group(1)
                break
            time.sleep(0.1)
        assert url, log.read_text(errors="replace")[-3000:]
        idx = call(url, "POST", "/create", {})[1]
        status, body = call(url, "POST", "/reset", {"env_idx": idx, "session_id": "retail/0"})
        assert importlib.util.find_spec("tau2") is None  # this venv is the trainer's: tau2 lives in .venvs/tau2
        # the real failure mode where the package is absent: what to run
        assert status == 500 and "scripts/setup_env.sh tau2" in body["detail"] and "c5b2d22" in body["detail"], body
        assert body["error"] == "tau2_not_installed" and ROOT not in body["detail"] and "/work" not in body["detail"]
    finally:
        stop_process(proc)
    out = log.read_text(errors="replace")
    assert key not in out and key not in " ".join(cmd)
    assert "openai/user" in out  # the log does name the user model


# ---- item ids --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("domain,split", list(SPLITS))
def test_item_id_files_match_the_pinned_splits(domain, split):
    path = os.path.join(ROOT, "data", f"tau2_{domain}_{split}.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == SPLITS[domain, split]
    assert all(r["prompt"] == f"tau2/{r['label']}" and r["label"].startswith(f"{domain}/") for r in rows)
    assert len({r["label"] for r in rows}) == len(rows)
    other = "test" if split == "train" else "train"
    with open(os.path.join(ROOT, "data", f"tau2_{domain}_{other}.jsonl")) as f:
        assert not {r["label"] for r in rows} & {json.loads(line)["label"] for line in f}
    if os.path.isdir(SHARED_TAU2):  # regenerate from the pinned split files and compare
        with open(os.path.join(SHARED_TAU2, domain, "split_tasks.json")) as f:
            assert [r["label"] for r in rows] == [f"{domain}/{t}" for t in json.load(f)[split]]


def test_make_tau2_itemid_writes_the_committed_files(tmp_path):
    if not os.path.isdir(SHARED_TAU2):
        pytest.skip(f"{SHARED_TAU2} (the split files at c5b2d22) is not on this machine")
    spec = importlib.util.spec_from_file_location("make_tau2_itemid", os.path.join(ROOT, "scripts",
                                                                                  "make_tau2_itemid.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for path in module.main(["--tau2-data", SHARED_TAU2, "--split", "train", "--out", str(tmp_path)]):
        with open(path) as new, open(os.path.join(ROOT, "data", os.path.basename(path))) as committed:
            assert new.read() == committed.read()
    with pytest.raises(SystemExit, match="no split 'nope'"):
        module.main(["--tau2-data", SHARED_TAU2, "--split", "nope", "--out", str(tmp_path)])


def test_make_tau2_itemid_with_no_source_and_no_tau2_anywhere_says_what_to_do(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make_tau2_itemid", os.path.join(ROOT, "scripts",
                                                                                  "make_tau2_itemid.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "TAU2_VENV_PYTHON", str(tmp_path / "no-venv" / "python"))
    with pytest.raises(SystemExit, match="no .venvs/tau2.*--tau2-data"):  # was: argparse's "one of ... is required"
        module.main(["--domains", "retail", "--split", "train", "--out", str(tmp_path)])


def test_setup_env_without_a_tau2_bench_checkout_says_what_to_set_and_builds_nothing(tmp_path):
    absent = tmp_path / "no-tau2-bench"
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_env.sh"), "tau2"], cwd=ROOT, text=True,
                         capture_output=True, timeout=60, env={**os.environ, "TAU2_BENCH_DIR": str(absent),
                                                              "PYTHON": str(tmp_path / "no-python-here")})
    assert out.returncode == 0, out.stderr
    assert f"no tau2-bench checkout at {absent}" in out.stdout and "TAU2_BENCH_DIR" in out.stdout, out.stdout
    assert "skipped" in out.stdout and "building" not in out.stdout and not absent.exists()
