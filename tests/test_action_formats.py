"""Each environment's action format (``realized_action``, ``is_invalid`` on its agent class in agent_funcs/<env>.py,
read by the CoPE forecast through ``forecast.load_action_format``), on replies from that environment's real server.

Per server: an expert episode with failing actions in between (unparsable text, and commands the env parses but
refuses). Every expert action, written as the policy writes it (a ReAct reply), is recovered exactly, the targets
are not one constant, every failing action's observation is recognised as invalid and no expert step's is.
"""

from __future__ import annotations

import os

import pytest

from agent_funcs.alfworld import ALFWorldAgent
from agent_funcs.appworld import AppWorldAgent
from agent_funcs.babyai import BabyAIAgent
from agent_funcs.sciworld import SciWorldAgent
from agent_funcs.searchqa import SearchQAAgent
from agent_funcs.tau2 import Tau2Agent
from agent_funcs.textcraft import TextCraftAgent
from agent_funcs.webarena import WebArenaAgent
from agent_funcs.webshop import WebShopAgent
from cope_rlhf.forecast import load_action_format
from tests.env_server_proc import ROOT, EnvServerProcess, require_venv

pytestmark = pytest.mark.timeout(240)

ALFWORLD_GAMES = os.path.join(ROOT, "tests", "fixtures", "alfworld")
# env: (agent class, server args, data_idx, failing actions to interleave with the expert's)
SERVERS = {
    "babyai": (BabyAIAgent, (), 0, ["fly to the moon", "xyzzy"]),
    "textcraft": (TextCraftAgent, (), 3, ["dance around", "craft 1 diamond pickaxe using 9 dirt", "get 1 unobtainium"]),
    "sciworld": (SciWorldAgent, ("--jvms", "1"), 2936, ["xyzzy plugh", "fly to the moon"]),
    "alfworld": (ALFWorldAgent, ("--games", ALFWORLD_GAMES), 0, ["fly to the moon", "xyzzy"]),
    "searchqa": (SearchQAAgent, (), 0, ["xyzzy", "what is this"]),
}


def react(action: str, turn: int) -> str:
    return f"Thought:\nStep {turn}: I act.\n\nAction:\n{action}"


def episode_with_failures(server: EnvServerProcess, data_idx: int, failing: list[str], expert_steps: int = 6):
    """[(action, observation, should_be_invalid)]: a failing action before each of the first expert steps."""
    env_id = server.ok("POST", "/create")["id"]
    out = []
    try:
        server.ok("POST", "/reset", {"id": env_id, "data_idx": data_idx})
        for i in range(expert_steps):
            bad = failing[i % len(failing)]
            reply = server.ok("POST", "/step", {"id": env_id, "action": bad})
            out.append((bad, reply.get("observation", reply.get("state", "")), True))
            action = server.ok("GET", f"/expert?id={env_id}")["action"]
            reply = server.ok("POST", "/step", {"id": env_id, "action": action})
            out.append((action, reply.get("observation", reply.get("state", "")), False))
            if reply.get("done"):
                break
    finally:
        server.call("POST", "/close", {"id": env_id})
    return out


@pytest.mark.parametrize("env", sorted(SERVERS))
def test_real_server_replies(env):
    agent, args, data_idx, failing = SERVERS[env]
    require_venv(env)
    fmt = load_action_format(os.path.join(ROOT, "agent_funcs", f"{env}.py"))  # what the trainer reads
    assert fmt.__name__ == agent.__name__
    with EnvServerProcess(env, *args) as server:
        steps = episode_with_failures(server, data_idx, failing)
    expert = [a for a, _, bad in steps if not bad]
    assert len(expert) >= 2
    realized = [fmt.realized_action(react(a, i)) for i, a in enumerate(expert)]
    assert realized == [a.strip() for a in expert]
    if len(set(expert)) > 1:
        assert len(set(realized)) > 1, "the forecast target would be one constant"
    for action, observation, bad in steps:
        assert fmt.is_invalid(observation) == bad, (action, observation)


def test_tau2_replies_through_its_server_and_the_gateway(monkeypatch):
    """τ²'s server (with the test suite's FakeTau2Task conversation, in .venv, which has no tau2 package; the
    real package: tests/test_tau2_real.py) behind the real gateway, the agent func under OpenRLHF's executor:
    targets are the literal tool-call spans (never the constant "</tool_call>"), and the failing calls'
    observations, as the trajectory holds them, are invalid."""
    from tests.test_tau2 import call_tool, play
    from tests.tiny_hf import tiny_tokenizer

    for name in ("COPE_GATEWAY_URL", "MAX_TURNS", "HORIZON_SCHEDULE"):
        monkeypatch.delenv(name, raising=False)
    replies = [call_tool("get_order", order_id="#W1"), call_tool("refund", order_id="#W1"), "<tool_call>{",
               call_tool("cancel_order", order_id="#W1"), "Your order #W1 is cancelled."]
    result, _ = play(replies, monkeypatch=monkeypatch)
    tok, tokens, ranges = tiny_tokenizer(), result["observation_tokens"], result["action_ranges"]
    actions = [tok.decode(tokens[a:b], skip_special_tokens=True) for a, b in ranges]
    feedback = [tok.decode(tokens[b:(ranges[i + 1][0] if i + 1 < len(ranges) else len(tokens))],
                           skip_special_tokens=True) for i, (_, b) in enumerate(ranges)]
    realized = [Tau2Agent.realized_action(a) for a in actions]
    assert realized[0] == replies[0] and realized[3] == replies[3] and realized[4] == replies[4]
    assert len(set(realized)) == len(realized)
    assert [Tau2Agent.is_invalid(f) for f in feedback[:4]] == [False, True, True, False]


def test_envs_without_a_server_here():
    """AppWorld, WebShop and WebArena need their own data or live sites (not available here): their formats on replies
    and observations written like theirs (stand-in text, not recorded from the servers)."""
    code = "Thought:\nlist the songs.\n\nAction:\n```python\nsongs = apis.spotify.show_songs()\nprint(songs)\n```"
    assert AppWorldAgent.realized_action(code) == "```python\nsongs = apis.spotify.show_songs()\nprint(songs)\n```"
    other = code.replace("show_songs()", "show_albums()")
    assert AppWorldAgent.realized_action(other) != AppWorldAgent.realized_action(code)  # not "```python" for all
    assert AppWorldAgent.is_invalid("Execution failed. Traceback:\nNameError: name 'x' is not defined")
    assert not AppWorldAgent.is_invalid("[{'song_id': 1}]")
    for agent in (WebShopAgent, WebArenaAgent):
        assert agent.realized_action("Thought:\nbuy it.\n\nAction:\nclick[Buy Now]") == "click[Buy Now]"
        assert agent.is_invalid("Invalid action: your reply has no action.")
