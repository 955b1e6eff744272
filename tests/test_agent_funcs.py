"""The agent funcs, run for real: OpenRLHF's own ``MultiTurnAgentExecutor.execute`` drives each env's agent file
(loaded by path, as vllm_engine loads it) through the real gateway subprocess and the real env server subprocess;
only the LLM is a scripted stand-in (tests/agent_funcs_stack.py) that replays the env expert's actions.

Per env (BabyAI, TextCraft, SearchQA, SciWorld, ALFWorld): the expert episode succeeds with the shaped reward;
``action_ranges`` hold exactly the scripted reply tokens; every observation span decodes to the server's own
observation inside the chat template's turn markers; each turn's engine input extends the previous one token for
token; an unparsable reply gets the "Invalid action" observation without reaching the env, and a wrong action gets
the server's invalid-action observation, both with reward 0. Then: a server killed mid-episode, an unreachable
gateway, a cancelled episode, the ScalingInter-RL horizon. Envs whose venv or server module is missing are
skipped with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time

import pytest

import agent_funcs.base as agent_base
from agent_funcs.babyai import BabyAIAgent
from agent_funcs.base import INVALID_ACTION, TurnLimit, gateway_client
from cope_rlhf.chat_format import parse_react_action
from cope_rlhf.forecast import ReActFormat
from tests.agent_funcs_stack import (AGENT_ENV_VARS, TEST_GATEWAY_FLAGS, ScriptedEngine, expert_rollout, load_agent_func,
                                     react, run_episode, server_module_exists)
from tests.env_server_proc import EnvServerProcess, call, refusing_port, venv_python
from tests.gateway_proc import GatewayProcess

# env -> (item id, server args): short expert episodes, so the module stays fast
ENVS = {
    "babyai": (0, ()),
    "textcraft": (0, ()),
    "searchqa": (0, ()),
    "sciworld": (4240, ()),  # lifespan-longest-lived, variation 0: a 6-step gold path
    "alfworld": (0, ("--games", "tests/fixtures/alfworld")),  # the small games the project ships
}
WRONG_ACTION = "juggle the moon"
pytestmark = pytest.mark.timeout(180)


def require_env(name: str) -> None:
    if not server_module_exists(name):
        pytest.skip(f"env_gateway/servers/{name}.py is not there yet: the {name} agent func needs its server")
    if not os.path.exists(venv_python(name)):
        pytest.skip(f".venvs/{name} is missing: run `bash scripts/setup_env.sh {name}` to test the {name} agent func")


@pytest.fixture(scope="module", params=list(ENVS))
def stack(request):
    """(env, env server, gateway) for one env, shared by every test of that env in this module."""
    env = request.param
    require_env(env)
    with EnvServerProcess(env, *ENVS[env][1], startup_timeout=90) as server:
        with GatewayProcess(*TEST_GATEWAY_FLAGS, envs={env: server.url}) as gateway:
            yield env, server, gateway


@pytest.fixture
def gateway_env(monkeypatch):
    def use(gateway: GatewayProcess, **extra: str) -> None:
        for name in AGENT_ENV_VARS:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("COPE_GATEWAY_URL", gateway.url)
        for name, value in extra.items():
            monkeypatch.setenv(name, value)
    return use


def wrapped(obs: str) -> str:
    """An observation in ChatML's turn markers after a reply that ended with <|im_end|>."""
    return f"\n<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n"


def spans(result: dict) -> list[list[int]]:
    """The non-action token spans: the first prompt, then the feedback after each action."""
    tokens, out, start = result["observation_tokens"], [], 0
    for a, b in result["action_ranges"]:
        out.append(tokens[start:a])
        start = b
    out.append(tokens[start:])
    return out


def test_expert_episode_succeeds_token_in_token_out(stack, tok, gateway_env):
    env, server, gateway = stack
    gateway_env(gateway, MAX_TURNS="60")
    item = ENVS[env][0]
    actions, observations, answers = expert_rollout(server.url, item)
    engine = ScriptedEngine(tok, [react(a) for a in actions])
    result = asyncio.run(run_episode(env, item, engine, tok))

    logs = result["extra_logs"]
    assert logs["success"] == 1.0 and logs["env_failed"] == 0.0, (logs, gateway.output())
    assert logs["turns"] == len(actions) and logs["invalid_actions"] == 0 and logs["rejected_actions"] == 0
    expected = answers[-1]["reward"] if env == "babyai" else 1.0  # BabyAI passes minigrid's reward through
    assert result["reward"] == pytest.approx(expected) and result["reward"] > 0

    # action_ranges cover exactly the scripted replies' tokens
    tokens = result["observation_tokens"]
    assert [tokens[a:b] for a, b in result["action_ranges"]] == engine.outputs
    # the first prompt is the chat template of instruction, acknowledgement, first observation
    agent_cls = load_agent_func(env).AgentExecutor.agent_cls
    first = tok.decode(spans(result)[0])
    assert first.startswith("<|im_start|>user\n" + agent_cls.instruction)
    task = ""
    if env == "sciworld":  # its first observation: the task, a newline, the first look (as AgentGym's client has it)
        sid = call(server.url, "POST", "/create", {})[1]["id"]
        task = call(server.url, "POST", "/reset", {"id": sid, "data_idx": item})[1]["task_description"] + "\n"
        call(server.url, "POST", "/close", {"id": sid})
    assert first.endswith(f"<|im_start|>user\n{task}{observations[0]}<|im_end|>\n<|im_start|>assistant\n")
    # every later span is the server's own observation in the template's turn markers
    assert [tok.decode(s) for s in spans(result)[1:]] == [wrapped(o) for o in observations[1:]]
    # token in, token out: each engine input is exactly the tokens so far
    for prompt in engine.prompts:
        assert tokens[:len(prompt)] == prompt
    assert gateway.open_sessions() == 0


def test_unparsable_and_wrong_actions_get_invalid_observations_and_no_reward(stack, tok, gateway_env):
    env, server, gateway = stack
    gateway_env(gateway, MAX_TURNS="2")
    _, created = call(server.url, "POST", "/create", {})
    first = call(server.url, "POST", "/reset", {"id": created["id"], "data_idx": ENVS[env][0]})[1]["observation"]
    server_says = call(server.url, "POST", "/step", {"id": created["id"], "action": WRONG_ACTION})[1]
    call(server.url, "POST", "/close", {"id": created["id"]})
    engine = ScriptedEngine(tok, ["I will just think and never act.", react(WRONG_ACTION)])
    result = asyncio.run(run_episode(env, ENVS[env][0], engine, tok))

    logs = result["extra_logs"]
    assert result["reward"] == 0.0 and logs["success"] == 0.0 and logs["env_failed"] == 0.0
    assert logs["turns"] == 2 and logs["invalid_actions"] == 1  # the env judged the second one itself:
    assert logs["rejected_actions"] == 1  # ... and said so in its own words (the agent class's is_invalid)
    feedback = [tok.decode(s) for s in spans(result)[1:]]
    assert feedback[0] == wrapped(INVALID_ACTION)
    assert feedback[1] == wrapped(server_says["observation"]) and server_says["reward"] == 0
    assert tok.decode(spans(result)[0]).endswith(f"{first}<|im_end|>\n<|im_start|>assistant\n")
    assert gateway.open_sessions() == 0


def test_horizon_schedule_ends_the_episode_at_the_stage_horizon(stack, tok, gateway_env, tmp_path):
    env, server, gateway = stack
    step_file = tmp_path / "step"
    step_file.write_text("0")
    gateway_env(gateway, HORIZON_SCHEDULE="1,3", HORIZON_STAGE_STEPS="10", COPE_TRAIN_STEP_FILE=str(step_file))
    replies = [react(WRONG_ACTION)] * 5
    first = asyncio.run(run_episode(env, ENVS[env][0], ScriptedEngine(tok, replies), tok))
    step_file.write_text("12")  # stage 1
    later = asyncio.run(run_episode(env, ENVS[env][0], ScriptedEngine(tok, replies), tok))
    assert (first["extra_logs"]["turns"], first["extra_logs"]["horizon"]) == (1, 1)
    assert (later["extra_logs"]["turns"], later["extra_logs"]["horizon"]) == (3, 3)


# ---- failures: one env is enough (SearchQA: the cheapest server) ----------------------------------------------
@pytest.fixture(scope="module")
def searchqa_alone():
    require_env("searchqa")
    with EnvServerProcess("searchqa", startup_timeout=90) as server:
        with GatewayProcess(*TEST_GATEWAY_FLAGS, envs={"searchqa": server.url}) as gateway:
            yield server, gateway


@pytest.fixture
def doomed_searchqa():
    require_env("searchqa")
    with EnvServerProcess("searchqa", startup_timeout=90) as server:
        with GatewayProcess(*TEST_GATEWAY_FLAGS, envs={"searchqa": server.url}) as gateway:
            yield server, gateway


def test_server_killed_mid_episode_ends_with_reward_0_and_a_logged_reason(doomed_searchqa, tok, gateway_env, caplog):
    server, gateway = doomed_searchqa
    gateway_env(gateway, ENV_CALL_TIMEOUT_S="30")
    actions, _, _ = expert_rollout(server.url, 0)

    def kill_before_second_reply(n: int) -> None:
        if n == 1:
            server.proc.kill()
            server.proc.wait(timeout=10)

    engine = ScriptedEngine(tok, [react(a) for a in actions], on_call=kill_before_second_reply)
    with caplog.at_level(logging.WARNING, logger="agent_funcs"):
        result = asyncio.run(run_episode("searchqa", 0, engine, tok, timeout=60))
    assert result["reward"] == 0.0 and result["extra_logs"]["env_failed"] == 1.0
    assert result["extra_logs"]["success"] == 0.0 and result["extra_logs"]["turns"] == 2
    reasons = [r.getMessage() for r in caplog.records if "reward 0" in r.getMessage()]
    assert reasons and "step 2 failed" in reasons[0], reasons
    assert "timed out" not in reasons[0] and "deadline" not in reasons[0], reasons  # noticed, not waited out
    assert tok.decode(spans(result)[-1]) == wrapped("The environment failed: the episode is over.")


def test_episode_deadline_ends_the_episode_with_reward_0(searchqa_alone, tok, gateway_env, caplog):
    server, gateway = searchqa_alone
    gateway_env(gateway, EPISODE_TIMEOUT_S="0.5")
    engine = ScriptedEngine(tok, [react("<search>capital</search>")] * 3, on_call=lambda n: time.sleep(0.6 * (n == 1)))
    with caplog.at_level(logging.WARNING, logger="agent_funcs"):
        result = asyncio.run(run_episode("searchqa", 0, engine, tok, timeout=30))
    assert result["reward"] == 0.0 and result["extra_logs"]["env_failed"] == 1.0
    assert result["extra_logs"]["turns"] == 2 and len(engine.prompts) == 2
    assert any("deadline" in r.getMessage() for r in caplog.records)
    assert gateway.open_sessions() == 0


def test_unreachable_gateway_gives_reward_0_instead_of_raising(tok, monkeypatch, caplog):
    for name in AGENT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    engine = ScriptedEngine(tok, [react("<answer>x</answer>")])
    with refusing_port() as dead, caplog.at_level(logging.WARNING, logger="agent_funcs"):
        monkeypatch.setenv("COPE_GATEWAY_URL", f"http://127.0.0.1:{dead.getsockname()[1]}")  # nothing listens there
        result = asyncio.run(run_episode("searchqa", 3, engine, tok, timeout=30))
    assert result["reward"] == 0.0 and result["extra_logs"]["env_failed"] == 1.0
    assert len(result["action_ranges"]) == 1
    assert any("opening the session failed" in r.getMessage() for r in caplog.records)


def test_cancelled_episode_closes_its_session(searchqa_alone, tok, gateway_env):
    server, gateway = searchqa_alone
    gateway_env(gateway)

    class StallingEngine(ScriptedEngine):
        async def generate(self, *args, **kwargs):
            await asyncio.sleep(3600)

    async def main():
        task = asyncio.ensure_future(run_episode("searchqa", 0, StallingEngine(tok, []), tok))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if gateway.open_sessions() == 1:
                break
        assert gateway.open_sessions() == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert gateway.open_sessions() == 0


# ---- pure parts ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reply,action", [
    ("Thought:\nx\n\nAction:\ngo to red ball 1", "go to red ball 1"),
    ("Action: look\nAction:\n\n  pick up key  \nextra", "pick up key"),
    ("Thought: no action", None),
    ("Action:\n   \n", None),
])
def test_parse_react_action(reply, action):
    assert parse_react_action(reply) == action


@pytest.mark.parametrize("reply,realized", [
    ("Thought:\nx\n\nAction:\ngo to red ball 1", "go to red ball 1"),
    ("Thought: x\nAction:\n", ""),  # an empty action: nothing for the forecast to learn (was "Action:")
    ("just text\n\nlast line \n", "last line"),  # no Action: the reply's last line
    ("", ""),
])
def test_built_in_agents_and_the_forecast_default_realize_actions_alike(reply, realized):
    """One rule (cope_rlhf.chat_format.realized_action) for the agent funcs and the forecast's ReActFormat."""
    assert BabyAIAgent.realized_action(reply) == ReActFormat.realized_action(reply) == realized


def test_turn_limit_from_environment(monkeypatch, tmp_path):
    for name in AGENT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    assert TurnLimit.from_env(20).horizon(5) == 20
    monkeypatch.setenv("MAX_TURNS", "7")
    assert TurnLimit.from_env(20).horizon(5) == 7
    monkeypatch.setenv("HORIZON_SCHEDULE", "6,13,20")
    with pytest.raises(ValueError, match="COPE_TRAIN_STEP_FILE"):
        TurnLimit.from_env(20)
    monkeypatch.setenv("HORIZON_EPISODES_PER_STEP", "4")  # episode index // 4 = training step
    limit = TurnLimit.from_env(20)
    assert [limit.horizon(i) for i in (0, 399, 400, 799, 800, 10**6)] == [6, 6, 13, 13, 20, 20]
    step_file = tmp_path / "step"
    monkeypatch.setenv("COPE_TRAIN_STEP_FILE", str(step_file))  # the file wins once it exists
    assert TurnLimit.from_env(20).horizon(800) == 20
    step_file.write_text("150")
    assert TurnLimit.from_env(20).horizon(0) == 13
    step_file.write_text("")  # caught mid-write: the last step read stands
    assert TurnLimit.from_env(20).horizon(0) == 13
    monkeypatch.setenv("HORIZON_SCHEDULE", "6,x")
    with pytest.raises(ValueError, match="comma-separated"):
        TurnLimit.from_env(20)
    monkeypatch.setenv("MAX_TURNS", "-1")
    with pytest.raises(ValueError, match="MAX_TURNS"):
        TurnLimit.from_env(20)


def test_turn_limit_boundaries(monkeypatch, tmp_path):
    """One turn is a turn limit; until the trainer first writes the step file, the episode is at step 0."""
    for name in AGENT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MAX_TURNS", "1")
    assert TurnLimit.from_env(20).horizon(0) == 1
    monkeypatch.setenv("HORIZON_SCHEDULE", "1,3")
    monkeypatch.setenv("HORIZON_STAGE_STEPS", "1")
    monkeypatch.setenv("HORIZON_EPISODES_PER_STEP", "1")
    assert [TurnLimit.from_env(20).horizon(i) for i in (0, 1, 2)] == [1, 3, 3]
    monkeypatch.delenv("HORIZON_EPISODES_PER_STEP")
    monkeypatch.setenv("COPE_TRAIN_STEP_FILE", str(tmp_path / "not-written-yet"))
    assert TurnLimit.from_env(20).horizon(5) == 1


NEEDS_STEP = ("HORIZON_SCHEDULE needs the training step: set COPE_TRAIN_STEP_FILE (a file the trainer rewrites with "
              "the step number) or HORIZON_EPISODES_PER_STEP (episodes per step on this rollout engine)")


BAD_SETTINGS = [  # (settings, the error they get)
    ({"ENV_CALL_TIMEOUT_S": "abc"}, "ENV_CALL_TIMEOUT_S='abc' is not a number"),
    ({"ENV_CALL_TIMEOUT_S": "0"}, "ENV_CALL_TIMEOUT_S must be > 0, got '0'"),
    ({"EPISODE_TIMEOUT_S": "15 min"}, "EPISODE_TIMEOUT_S='15 min' is not a number"),
    ({"EPISODE_TIMEOUT_S": "-5"}, "EPISODE_TIMEOUT_S must be > 0, got '-5'"),
    ({"MAX_TURNS": "0"}, "MAX_TURNS must be a positive integer, got '0'"),
    ({"MAX_TURNS": "ten"}, "MAX_TURNS must be a positive integer, got 'ten'"),
    ({"MAX_TURNS": "2.5"}, "MAX_TURNS must be a positive integer, got '2.5'"),
    ({"HORIZON_SCHEDULE": "6,0", "HORIZON_EPISODES_PER_STEP": "4"},
     "HORIZON_SCHEDULE='6,0': every horizon must be a positive integer"),
    ({"HORIZON_SCHEDULE": "6,-13,20", "HORIZON_EPISODES_PER_STEP": "4"},
     "HORIZON_SCHEDULE='6,-13,20': every horizon must be a positive integer"),
    ({"HORIZON_SCHEDULE": "6,13", "HORIZON_EPISODES_PER_STEP": "0"},
     "HORIZON_EPISODES_PER_STEP must be a positive integer, got '0'"),
    ({"HORIZON_SCHEDULE": "6,13", "HORIZON_EPISODES_PER_STEP": "4", "HORIZON_STAGE_STEPS": "x"},
     "HORIZON_STAGE_STEPS must be a positive integer, got 'x'"),
    ({"HORIZON_SCHEDULE": "6,13"}, NEEDS_STEP),
]


@pytest.mark.parametrize("settings,message", BAD_SETTINGS,
                         ids=[" ".join(f"{k}={v}" for k, v in settings.items()) for settings, _ in BAD_SETTINGS])
def test_a_bad_setting_is_refused_naming_the_variable(tok, monkeypatch, settings, message):
    """Read as the executor makes the agent (the episode's start, before any env call or generation): the error says
    which variable, what it holds and what it needs. It used to reach users as AttributeError: the agent was
    registered for the executor's close() before it read its settings, and close() met a half-made agent."""
    for name in AGENT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    engine = ScriptedEngine(tok, [react("look")])
    with refusing_port() as dead, pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        monkeypatch.setenv("COPE_GATEWAY_URL", f"http://127.0.0.1:{dead.getsockname()[1]}")  # were it to get that far
        asyncio.run(run_episode("babyai", 0, engine, tok, timeout=30))
    assert engine.prompts == []


def test_the_agent_outside_its_executor_says_which_executor_to_use(tok):
    from openrlhf.utils.agent import MultiTurnAgentExecutor

    message = ("BabyAIAgent runs inside GatewayAgentExecutor.execute (use the env file's AgentExecutor, not "
               "MultiTurnAgentExecutor directly)")
    executor = MultiTurnAgentExecutor(BabyAIAgent)
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        asyncio.run(executor.execute("babyai/0", "0", None, 1000, tok, ScriptedEngine(tok, [])))


def test_one_gateway_client_per_url_and_call_timeout(monkeypatch):
    monkeypatch.setattr(agent_base, "CLIENTS", {})
    monkeypatch.setenv("COPE_GATEWAY_URL", "http://127.0.0.1:1")  # not the URL asked for
    client = gateway_client("http://127.0.0.1:2", 7.5)
    assert (client.base_url, client.timeout) == ("http://127.0.0.1:2", 7.5)
    assert gateway_client("http://127.0.0.1:2", 7.5) is client
    other = gateway_client("http://127.0.0.1:2", 30.0)
    assert other is not client and other.timeout == 30.0


def test_an_envs_own_action_parser_decides_the_realized_action():
    """AppWorld's action (unfenced here) is all the code after Action:, not its first line."""
    from agent_funcs.appworld import AppWorldAgent

    assert AppWorldAgent.realized_action("Thought: set up.\nAction:\nx = 1\ny = x + 1\n") == "x = 1\ny = x + 1"
