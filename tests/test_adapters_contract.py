"""Contract tests for the benchmarks whose servers cannot run here: WebShop (product data and a Java search index),
WebArena (the live web sites) and AppWorld (``appworld download data`` needs the internet). Each fake below speaks
that benchmark's original server protocol (env_gateway/adapters.py; AppWorld's ``appworld serve environment``)
over real HTTP on 127.0.0.1, behind the real gateway and its adapter, played by the real agent func under
OpenRLHF's ``MultiTurnAgentExecutor``. τ²-bench's server is tested in tests/test_tau2.py.
"""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest
from aiohttp import web

from agent_funcs.appworld import parse_code_action
from agent_funcs.sciworld import binarised_sciworld_score
from agent_funcs.webshop import binarised_webshop_score
from tests.agent_funcs_stack import (AGENT_ENV_VARS, ScriptedEngine, inprocess_gateway, react, run_episode,
                                     serve_app)
from tests.tiny_hf import tiny_tokenizer

pytestmark = pytest.mark.timeout(60)


class FakeWebShopServer:
    """Stand-in for AgentGym's WebShop server (its data cannot be had here): bare-int /create, reset
    ``{env_idx, session_id}`` answering WebShop's ``[observation, None]`` pair, the page by ``GET /observation``, and
    ``/step`` -> ``{state, reward, done, info}``. Buying B01 matches every attribute (reward 1), B02 half (0.5)."""

    def __init__(self) -> None:
        self.ids, self.pages, self.items, self.closed, self.sessions = itertools.count(), {}, {}, [], {}

    async def create(self, request):
        idx = next(self.ids)
        self.pages[idx] = ""
        return web.json_response(idx)

    async def reset(self, request):
        body = await request.json()
        self.sessions[body["env_idx"]] = body["session_id"]
        self.pages[body["env_idx"]] = "WebShop [SEP] Instruction: [SEP] buy red shoes, size 9 [SEP] Search"
        return web.json_response([self.pages[body["env_idx"]], None])

    async def observation(self, request):
        return web.json_response(self.pages[int(request.query["env_idx"])])

    async def step(self, request):
        body = await request.json()
        idx, action = body["env_idx"], body["action"]
        page, reward, done = self.pages[idx], 0.0, False
        if action.startswith("search["):
            page = "[Back to Search] Page 1 [SEP] B01 [SEP] Red shoes [SEP] B02 [SEP] Red boots"
        elif action in ("click[B01]", "click[B02]"):
            page = f"[Back to Search] {action[6:9]} [SEP] size [SEP] 9 [SEP] Buy Now"
            self.items[idx] = action[6:9]
        elif action == "click[Buy Now]":
            page, reward, done = "Thank you for shopping with us!", (1.0 if self.items.get(idx) == "B01" else 0.5), True
        else:
            page = "Invalid action!"
        self.pages[idx] = page
        return web.json_response({"state": page, "reward": reward, "done": done, "info": None})

    async def close(self, request):
        self.closed.append((await request.json())["env_idx"])
        return web.json_response({"closed": True})

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.get("/", lambda r: web.json_response("ok")), web.post("/create", self.create),
                        web.post("/reset", self.reset), web.get("/observation", self.observation),
                        web.post("/step", self.step), web.post("/close", self.close)])
        return app


class FakeWebArenaServer:
    """Stand-in for AgentGym's WebArena server (it needs the live sites): /create -> ``{"env_idx": n}``, reset
    ``{env_idx, seed, idx}``, ``/step`` -> ``{observation, reward, terminated, truncated, info}``. The task's answer
    is "42"; the server truncates an episode after 3 steps."""

    def __init__(self) -> None:
        self.ids, self.steps, self.resets = itertools.count(), {}, []

    async def create(self, request):
        idx = next(self.ids)
        self.steps[idx] = 0
        return web.json_response({"env_idx": idx})

    async def reset(self, request):
        body = await request.json()
        self.resets.append(body)
        return web.json_response({"observation": f"Task {body['idx']}: what is the answer? [1] link 'answer page'",
                                  "info": {}})

    async def step(self, request):
        body = await request.json()
        self.steps[body["env_idx"]] += 1
        action, n = body["action"], self.steps[body["env_idx"]]
        if action.startswith("stop ["):
            return web.json_response({"observation": "", "reward": float(action == "stop [42]"), "terminated": True,
                                      "truncated": False, "info": {}})
        return web.json_response({"observation": f"[1] link 'answer page' (after {action})", "reward": 0.0,
                                  "terminated": False, "truncated": n >= 3, "info": {}})

    async def close(self, request):
        return web.json_response({"closed": True})

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.get("/", lambda r: web.json_response("ok")), web.post("/create", self.create),
                        web.post("/reset", self.reset), web.post("/step", self.step), web.post("/close", self.close)])
        return app


class FakeAppWorldServer:
    """Stand-in for AppWorld's own environment server (``appworld serve environment``; its data cannot be had
    here): ``/initialize {task_id, ...}`` -> ``{output: task}``, ``/execute {task_id, code}`` -> ``{output}``,
    ``/task_completed {task_id}`` -> ``{output: bool}``, ``/evaluate {task_id, ...}`` -> ``{output: test report}``,
    ``/close {task_id}``. The task passes both of its tests when the answer is "Paris", one test otherwise."""

    def __init__(self) -> None:
        self.world: dict | None = None
        self.closed: list[str] = []

    def check(self, body: dict) -> dict:
        if self.world is None or self.world["task_id"] != body["task_id"]:
            raise web.HTTPBadRequest(text="AppWorld has not been initialized for this task.")
        return self.world

    async def initialize(self, request):
        body = await request.json()
        self.world = {"task_id": body["task_id"], "answer": None}
        return web.json_response({"output": {
            "task_id": body["task_id"], "instruction": "What is the capital of France?", "datetime": "2023-05-18",
            "supervisor": {"first_name": "Ada", "last_name": "Lovelace", "email": "ada@example.com",
                           "phone_number": "5550100"}}})

    async def execute(self, request):
        body = await request.json()
        world = self.check(body)
        code = body["code"]
        if "complete_task" in code:
            world["answer"] = code.split("answer=", 1)[1].strip(" )\"'\n")
            return web.json_response({"output": "Execution successful."})
        if "print" in code:
            return web.json_response({"output": "['supervisor', 'spotify']"})
        return web.json_response({"output": "Execution failed. Traceback:\nNameError: name 'x' is not defined"})

    async def task_completed(self, request):
        return web.json_response({"output": self.check(await request.json())["answer"] is not None})

    async def evaluate(self, request):
        world = self.check(await request.json())
        passed = world["answer"] == "Paris"
        passes = [{"requirement": "no side effects"}] + ([{"requirement": "answer matches"}] if passed else [])
        failures = [] if passed else [{"requirement": "answer matches", "trace": "wrong answer"}]
        return web.json_response({"output": {"success": passed, "difficulty": 1, "num_tests": 2, "passes": passes,
                                             "failures": failures}})

    async def close(self, request):
        self.closed.append(self.check(await request.json())["task_id"])
        return web.json_response({"output": None})

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.get("/", lambda r: web.json_response({"message": "Welcome to AppWorld Server!"})),
                        web.post("/initialize", self.initialize), web.post("/execute", self.execute),
                        web.post("/task_completed", self.task_completed), web.post("/evaluate", self.evaluate),
                        web.post("/close", self.close)])
        return app


def play(env: str, fake, item, replies: list[str], monkeypatch, close_turn: bool = True) -> dict:
    tok = tiny_tokenizer()
    for name in AGENT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)

    async def main():
        async with serve_app(fake.app()) as backend, inprocess_gateway({env: backend}) as gateway:
            monkeypatch.setenv("COPE_GATEWAY_URL", gateway)
            return await run_episode(env, item, ScriptedEngine(tok, replies, close_turn=close_turn), tok, timeout=30)

    return asyncio.run(main())


def decoded_feedback(result: dict, turn: int) -> str:
    tokens, ranges = result["observation_tokens"], result["action_ranges"]
    end = ranges[turn + 1][0] if turn + 1 < len(ranges) else len(tokens)
    return tiny_tokenizer().decode(tokens[ranges[turn][1]:end])


# ---- WebShop -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("item,reward", [("B01", 1.0), ("B02", 0.0)])
def test_webshop_purchase_is_binarised(item, reward, monkeypatch):
    fake = FakeWebShopServer()
    actions = ["search[red shoes]", f"click[{item}]", "click[Buy Now]"]
    result = play("webshop", fake, 12, [react(a) for a in actions], monkeypatch)
    assert result["reward"] == reward and result["extra_logs"]["success"] == reward
    assert result["extra_logs"]["turns"] == 3 and fake.sessions == {0: 12} and fake.closed == [0]
    first = tiny_tokenizer().decode(result["observation_tokens"][:result["action_ranges"][0][0]])
    assert "buy red shoes, size 9" in first  # fetched by GET /observation after the reset
    assert "B01 [SEP] Red shoes" in decoded_feedback(result, 0)


def test_binarised_scores():
    assert binarised_webshop_score(1.0, True) == 1.0
    assert binarised_webshop_score(0.99, True) == 0.0 and binarised_webshop_score(1.0, False) == 0.0
    assert binarised_sciworld_score(100, True) == 1.0
    assert binarised_sciworld_score(99, True) == 0.0 and binarised_sciworld_score(100, False) == 0.0


# ---- WebArena ------------------------------------------------------------------------------------------------
def test_webarena_stop_answer_ends_the_episode(monkeypatch):
    fake = FakeWebArenaServer()
    result = play("webarena", fake, 5, [react("click [1]"), react("stop [42]")], monkeypatch)
    assert result["reward"] == 1.0 and result["extra_logs"]["turns"] == 2
    assert fake.resets == [{"env_idx": 0, "seed": 0, "idx": 5}]
    assert "after click [1]" in decoded_feedback(result, 0)


def test_reply_cut_at_max_tokens_gets_its_turn_closed_by_the_feedback(monkeypatch):
    result = play("webarena", FakeWebArenaServer(), 5, [react("click [1]"), react("stop [42]")], monkeypatch,
                  close_turn=False)
    assert decoded_feedback(result, 0).startswith("<|im_end|>\n<|im_start|>user\n[1] link 'answer page'")
    assert result["reward"] == 1.0


def test_webarena_truncation_ends_the_episode_with_reward_0(monkeypatch):
    result = play("webarena", FakeWebArenaServer(), 5, [react("scroll [down]")] * 10, monkeypatch)
    assert result["reward"] == 0.0 and result["extra_logs"]["turns"] == 3  # the server's truncation, not MAX_TURNS


# ---- AppWorld ------------------------------------------------------------------------------------------------
def test_parse_code_action():
    assert parse_code_action("Thought: look\nAction:\n```python\nprint(apis)\n```") == "print(apis)"
    assert parse_code_action("Action:\nx = 1\ny = 2") == "x = 1\ny = 2"
    assert parse_code_action("Thought: nothing") is None
    assert parse_code_action("Action:\n```python\n```") is None


@pytest.mark.parametrize("answer,reward,success", [("Paris", 1.0, 1.0), ("Lyon", 0.5, 0.0)])
def test_appworld_code_actions_and_evaluation(answer, reward, success, monkeypatch):
    fake = FakeAppWorldServer()
    replies = [react("```python\nprint(apis.api_docs.show_app_descriptions())\n```"), react("x + 1"),
               react(f"```python\napis.supervisor.complete_task(answer=\"{answer}\")\n```")]
    result = play("appworld", fake, "82e2fac_1", replies, monkeypatch)
    assert result["reward"] == reward and result["extra_logs"]["success"] == success
    assert result["extra_logs"]["turns"] == 3 and fake.closed == ["82e2fac_1"]
    first = tiny_tokenizer().decode(result["observation_tokens"][:result["action_ranges"][0][0]])
    assert "What is the capital of France?" in first and "Ada Lovelace" in first
    assert "['supervisor', 'spotify']" in decoded_feedback(result, 0)
    assert "NameError" in decoded_feedback(result, 1)


# ---- the reward contract, on an env that rewards along the way -----------------------------------------------------
def play_partial(replies: list[str], monkeypatch, max_turns: int | None = None) -> tuple[dict, list]:
    """BabyAI's agent func (reward passed through) on the fake AgentGym backend with partial rewards (0.2 per right
    action of 5): (the executor's result, the per-turn rewards it summed)."""
    from env_gateway.fake_backend import running

    tok = tiny_tokenizer()
    for name in AGENT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    if max_turns:
        monkeypatch.setenv("MAX_TURNS", str(max_turns))
    import agent_funcs.base as base

    turn_rewards = []
    result_of = base.GatewayAgent.result

    def recording(self, observation, done):
        out = result_of(self, observation, done)
        turn_rewards.append(round(float(out["rewards"]), 6))
        return out

    monkeypatch.setattr(base.GatewayAgent, "result", recording)

    async def main():
        async with running("agentgym", partial_rewards=True) as (_, backend), \
                inprocess_gateway({"babyai": backend}) as gateway:
            monkeypatch.setenv("COPE_GATEWAY_URL", gateway)
            return await run_episode("babyai", 7, ScriptedEngine(tok, replies), tok, timeout=30)

    return asyncio.run(main()), turn_rewards


def test_per_turn_rewards_are_the_change_of_the_score(monkeypatch):
    """Rewards 0.2 at each right action: each turn reports its change, and the executor's sum is the score."""
    from env_gateway.fake_backend import expected_action

    right = [react(expected_action(7, t)) for t in range(5)]
    result, turn_rewards = play_partial([right[0], react("move 9"), *right[2:]], monkeypatch)
    assert turn_rewards == [0.2, 0.0, 0.2, 0.2, 0.2]
    assert result["reward"] == pytest.approx(0.8) and result["scores"] == pytest.approx(0.8)
    assert result["extra_logs"]["success"] == 1.0


def test_an_episode_the_env_fails_scores_0_whatever_it_had_earned(monkeypatch):
    """Two right actions (0.4 earned), then the env server fails: the episode's reward is 0, not 0.4."""
    from env_gateway.fake_backend import expected_action

    result, turn_rewards = play_partial([react(expected_action(7, 0)), react(expected_action(7, 1)), react("crash")],
                                        monkeypatch)
    assert turn_rewards == [0.2, 0.2, -0.4]
    assert result["reward"] == pytest.approx(0.0) and result["extra_logs"]["env_failed"] == 1.0
    assert result["extra_logs"]["success"] == 0.0


def eval_script(monkeypatch):
    """scripts/eval.py as the module ``scripts.eval`` (as mutmut names it), the tiny tokenizer, and no agent setting
    left from the environment."""
    import importlib

    ev = importlib.import_module("scripts.eval")
    for name in AGENT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return ev, tiny_tokenizer()


def test_eval_counts_success_as_the_agent_funcs_success_not_a_positive_reward(monkeypatch):
    """Cut by the turn limit after 2 right actions: reward 0.4, not done, so not a success."""
    from env_gateway.fake_backend import running

    ev, tok = eval_script(monkeypatch)
    monkeypatch.setenv("MAX_TURNS", "2")

    class RightActions:  # the model: reads "say 'move N'" in the last observation and says it
        eos = tok.convert_tokens_to_ids("<|im_end|>")

        def generate(self, requests):
            out = []
            for ids, *_ in requests:
                said = tok.decode(ids).rsplit("say '", 1)[1].split("'", 1)[0]
                text = react(said)
                out.append(SimpleNamespace(token_ids=tok(text, add_special_tokens=False)["input_ids"] + [self.eos],
                                           text=text, finish_reason="stop", logprobs=None))
            return out

    async def main():
        async with running("agentgym", partial_rewards=True) as (_, backend), \
                inprocess_gateway({"babyai": backend}) as gateway:
            monkeypatch.setenv("COPE_GATEWAY_URL", gateway)
            engine = ev.BatchingEngine(RightActions(), max_new_tokens=32)
            return await ev.play("babyai", ["3", "4"], 1, engine, tok, 200_000, 4)

    episodes = asyncio.run(asyncio.wait_for(main(), 60))
    assert [e["reward"] for e in episodes] == [pytest.approx(0.4)] * 2
    assert [e["success"] for e in episodes] == [False, False]
    assert [row["successes"] for row in ev.item_table(episodes, ["3", "4"])] == [0, 0]


def test_eval_main_reports_partial_reward_episodes_end_to_end(monkeypatch, tmp_path):
    """scripts/eval.py's main(), as users run it, on the fake backend with partial rewards (1/3 per right action of
    3) behind a gateway process: item 3 played right (1.0, a success), item 4 wrong at step 2 (0.667, done: a
    success), item 5's env crashes at step 1 after 0.333 earned (0, a failure, counted in env_failures). The model
    is a stand-in that reads the observation (the HF backend replaced; no checkpoint is loaded)."""
    import json
    import re

    from env_gateway.fake_backend import FakeBackendProcess
    from tests.gateway_proc import GatewayProcess

    ev, tok = eval_script(monkeypatch)

    class ObservationReader:
        tokenizer = tok
        eos = tok.convert_tokens_to_ids("<|im_end|>")

        def generate(self, requests):
            out = []
            for ids, *_ in requests:
                item, step, said = re.findall(r"item (\d+) step (\d+): say '([^']*)'", tok.decode(ids))[-1]
                action = {("4", "2"): "move 9", ("5", "1"): "crash"}.get((item, step), said)
                out.append(SimpleNamespace(token_ids=tok(react(action), add_special_tokens=False)["input_ids"]
                                           + [self.eos], text=react(action), finish_reason="stop", logprobs=None))
            return out

    monkeypatch.setattr(ev, "HFBackend", lambda model, temperature, seed: ObservationReader())
    out = tmp_path / "eval.json"
    with FakeBackendProcess("--partial-rewards", "--episode-len", "3") as backend, \
            GatewayProcess(envs={"babyai": backend.url}) as gateway:
        # main() sets COPE_GATEWAY_URL for the agent func; set here first, monkeypatch undoes both after the test (it
        # leaked into the two-node test's jobs, whose preflight then found no gateway at this test's port)
        monkeypatch.setenv("COPE_GATEWAY_URL", gateway.url)
        report = ev.main(["--env", "babyai", "--model", str(tmp_path), "--item-ids", "3,4,5", "--k", "2",
                          "--engine", "hf", "--gateway", gateway.url, "--out", str(out)])
    assert json.loads(out.read_text()) == report
    episodes = [json.loads(line) for line in open(tmp_path / "eval.episodes.jsonl")]
    assert sorted((e["item_id"], round(e["reward"], 3), e["success"]) for e in episodes) == [
        ("3", 1.0, True), ("3", 1.0, True), ("4", 0.667, True), ("4", 0.667, True), ("5", 0.0, False),
        ("5", 0.0, False)]
    assert report["episodes"] == 6 and report["env_failures"] == 2
    assert [(row["item_id"], round(row["mean_reward"], 3), row["successes"]) for row in report["per_item"]] == [
        ("3", 1.0, 2), ("4", 0.667, 2), ("5", 0.0, 0)]
    m = report["metrics"]
    assert m["success_rate"] == pytest.approx(4 / 6) and m["mean_reward"] == pytest.approx((2 + 4 / 3) / 6)
    assert m["avg@2"] == pytest.approx((1 + 2 / 3 + 0) / 3) and m["pass^1"] == pytest.approx(2 / 3)
    assert m["pass^2"] == pytest.approx(2 / 3)
