"""The episode contract of ``GatewayAgent`` (agent_funcs/base.py), pinned on the fake AgentGym backend
(env_gateway/fake_backend.py) behind the real gateway, in process, over real sockets, played by OpenRLHF's own
``MultiTurnAgentExecutor.execute``; only the LLM is a scripted stand-in (tests/agent_funcs_stack.py). No env venv is
needed, so these run wherever the tests run (also under mutmut, whose copy of the tree has no .venvs).

Pinned: the first prompt and every feedback are exactly the chat template's turns (ChatML, and a Mistral-style
template that refuses roles out of order); which item the session opens (the label, else the prompt's
``<env>/<item_id>``) and the error naming the remedy when neither says; what reaches the env (special tokens
removed, nothing for a reply without an action); the counters, rewards, score and log keys OpenRLHF reports;
the turn limit (MAX_TURNS, HORIZON_SCHEDULE by episodes started); how gateway failures, the episode deadline and a
stuck call end the episode (reward 0, the void/failed observations, the logged reason). Time in the agent is a fake
clock the backend advances (``Clock``), so env time and deadlines are exact, not raced against the wall clock.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import re

import pytest

import agent_funcs.base as base
from agent_funcs.base import INVALID_ACTION, GatewayAgent, GatewayAgentExecutor
from agent_funcs.instructions import ACKNOWLEDGEMENT, INSTRUCTIONS
from env_gateway.fake_backend import FakeBackend, expected_action, observation_text
from tests.agent_funcs_stack import (AGENT_ENV_VARS, ScriptedEngine, inprocess_gateway, load_agent_func, react,
                                     sampling_params, serve_app)
from tests.env_server_proc import refusing_port
from tests.tiny_hf import tiny_tokenizer

pytestmark = pytest.mark.timeout(60)

ITEM = 7
RIGHT = [expected_action(ITEM, t) for t in range(5)]  # the fake task's right actions for ITEM
HANG_ITEM = 666  # the backend's reset of this item never answers
FAILED = "The environment failed: the episode is over."
VOID = "The environment is unavailable: this episode is void."
LOG_KEYS = {"turns", "invalid_actions", "rejected_actions", "env_time_s", "success", "env_failed", "horizon"}
# Mistral-7B-Instruct's template (less its bos_token): it refuses a conversation whose roles are not
# user/assistant/user/...; an assistant turn ends with the EOS token, a user turn is [INST] ... [/INST].
MISTRAL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


class Clock:
    """The agent's clock (``agent_funcs.base.time``): it moves only when the backend says an env call took time."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


class ContractBackend(FakeBackend):
    """The fake AgentGym backend, plus: it records every action it is sent; it answers an action that is no
    ``move N`` with an "Invalid action" observation (as the real envs do), leaving the task where it was; the
    reset of HANG_ITEM never answers; each reset and step advances ``clock`` by ``call_s`` seconds."""

    def __init__(self, clock: Clock | None = None, call_s: float = 0.0, **kw) -> None:
        super().__init__("agentgym", **kw)
        self.clock, self.call_s, self.actions = clock, call_s, []

    def tick(self) -> None:
        if self.clock is not None:
            self.clock.now += self.call_s

    async def _reset(self, raw_id, item):
        if item == HANG_ITEM:
            await asyncio.sleep(3600)
        self.tick()
        return await super()._reset(raw_id, item)

    async def _step(self, raw_id, action):
        self.actions.append(action)
        self.tick()
        if not re.fullmatch(r"move \d", action) and action not in ("hang", "crash"):
            return f"Invalid action: {action} is not an action here.", 0.0, False, self._inst(raw_id)
        return await super()._step(raw_id, action)


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class GymAgent(GatewayAgent):
    """An env on the gym-style chat protocol: its observations are lists of chat messages, not text."""

    env = "gym"
    instruction = "Do what the last message says."


class GymExecutor(GatewayAgentExecutor):
    agent_cls = GymAgent


def babyai_executor() -> type[GatewayAgentExecutor]:
    return load_agent_func("babyai").AgentExecutor


async def execute(executor_cls, prompt, label, engine, tok, images=None) -> dict:
    """One episode through OpenRLHF's executor, as vllm_engine runs it; this loop's HTTP sessions closed after."""
    try:
        return await executor_cls().execute(prompt, label, sampling_params(), 200_000, tok, engine, images)
    finally:
        for client in base.CLIENTS.values():
            await client.aclose()


def play(monkeypatch, replies=(), *, executor_cls=None, prompt=f"babyai/{ITEM}", label=str(ITEM), settings=None,
         backend=None, tok=None, engine=None, clock=None, images=None, gateway_url=None, timeout=30.0):
    """One episode of ``executor_cls`` (BabyAI's agent func) against ``backend`` behind the in-process gateway (or
    at ``gateway_url``), with only ``settings`` of the agent's environment variables set; with ``clock``, the
    agent's time is that clock. Returns (result, engine, backend, warnings logged by agent_funcs)."""
    executor_cls = executor_cls or babyai_executor()
    tok = tok or tiny_tokenizer()
    engine = engine or ScriptedEngine(tok, list(replies))
    backend = backend or ContractBackend(clock=clock)
    for name in AGENT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in (settings or {}).items():
        monkeypatch.setenv(name, value)
    if clock is not None:
        monkeypatch.setattr(base, "time", clock)
    warnings = Warnings()
    logging.getLogger("agent_funcs").addHandler(warnings)

    async def main():
        if gateway_url is not None:
            monkeypatch.setenv("COPE_GATEWAY_URL", gateway_url)
            return await asyncio.wait_for(execute(executor_cls, prompt, label, engine, tok, images), timeout)
        env = executor_cls.agent_cls.env
        async with serve_app(backend.app()) as url, inprocess_gateway({env: url}) as gateway:
            monkeypatch.setenv("COPE_GATEWAY_URL", gateway)
            return await asyncio.wait_for(execute(executor_cls, prompt, label, engine, tok, images), timeout)

    try:
        result = asyncio.run(main())
    finally:
        logging.getLogger("agent_funcs").removeHandler(warnings)
    return result, engine, backend, warnings.messages


def spans(result: dict, tok) -> list[str]:
    """The decoded non-action spans: the first prompt, then the feedback after each reply."""
    tokens, out, start = result["observation_tokens"], [], 0
    for a, b in result["action_ranges"]:
        out.append(tok.decode(tokens[start:a]))
        start = b
    out.append(tok.decode(tokens[start:]))
    return out


def chatml(*turns: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + "<|im_start|>assistant\n"


def chatml_feedback(observation: str, reply_closed: bool = True) -> str:
    """The ChatML text between two replies: the previous reply's end-of-turn (unless the reply sampled it), the
    observation as the user turn, the next assistant turn's start."""
    closing = "" if reply_closed else "<|im_end|>"
    return f"{closing}\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"


def babyai_first_prompt(observation: str) -> str:
    return chatml(("user", INSTRUCTIONS["babyai"]), ("assistant", ACKNOWLEDGEMENT), ("user", observation))


def mistral_tokenizer():
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = MISTRAL_TEMPLATE
    return tok


# ---- seeded sampling: one seed per turn, from the request's seed, the episode's place and the turn ---------------
def test_a_seeded_request_samples_every_turn_of_every_episode_with_its_own_seed(monkeypatch):
    """The engine gets H(request seed, episode, turn) at each generate call (cope_rlhf.seeds); the request's episodes
    are counted 0, 1, ... as the executor (one per rollout engine) starts them; the caller's params keep their seed;
    an unseeded request is sampled unseeded."""
    from types import SimpleNamespace

    from cope_rlhf.seeds import derive_seed

    shared = babyai_executor()()

    class OneExecutor:  # play() builds an executor per episode; a rollout engine has one for all of them
        agent_cls = shared.agent_cls

        def __new__(cls):
            return shared

    class SeedsEngine(ScriptedEngine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.seeds: list = []

        async def generate(self, token_ids, sampling_params, **kwargs):
            self.seeds.append(sampling_params.seed)
            return await super().generate(token_ids, sampling_params, **kwargs)

    given = []
    for request_seed in (1234, 1234, None):
        params = SimpleNamespace(max_tokens=None, logprobs=None, seed=request_seed)
        given.append(params)
        monkeypatch.setitem(globals(), "sampling_params", lambda params=params: params)  # what execute() hands over
        engine = SeedsEngine(tiny_tokenizer(), [react(a) for a in RIGHT])
        play(monkeypatch, executor_cls=OneExecutor, engine=engine)
        place = sum(p.seed == request_seed for p in given[:-1]) if request_seed is not None else None
        want = [derive_seed(request_seed, place, turn) for turn in range(len(RIGHT))] if request_seed else [None] * 5
        assert engine.seeds == want
    assert [p.seed for p in given] == [1234, 1234, None]  # the caller's params untouched


# ---- the chat: token in, token out ------------------------------------------------------------------------------
@pytest.mark.parametrize("close_turn", [True, False], ids=["reply-closed-its-turn", "reply-cut-at-max-tokens"])
def test_an_expert_episode_is_the_chat_template_turn_by_turn(monkeypatch, close_turn):
    tok = tiny_tokenizer()

    class KeywordsEngine(ScriptedEngine):  # notes the keyword arguments the rollout engine is called with
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.keywords: list[dict] = []

        async def generate(self, token_ids, sampling_params, **kwargs):
            self.keywords.append(kwargs)
            return await super().generate(token_ids, sampling_params, **kwargs)

    engine = KeywordsEngine(tok, [react(a) for a in RIGHT], close_turn=close_turn)
    result, _, backend, warnings = play(monkeypatch, engine=engine)

    assert backend.actions == RIGHT and warnings == []
    assert result["reward"] == 1.0 and float(result["scores"]) == 1.0
    logs = result["extra_logs"]
    assert set(logs) == LOG_KEYS
    assert logs == {"turns": 5, "invalid_actions": 0, "rejected_actions": 0, "env_time_s": logs["env_time_s"],
                    "success": 1.0, "env_failed": 0.0, "horizon": 20}
    text = spans(result, tok)
    assert text[0] == babyai_first_prompt(observation_text(ITEM, 0))
    observations = [observation_text(ITEM, t) for t in range(1, 5)] + ["episode over: 5/5 right"]
    assert text[1:] == [chatml_feedback(o, close_turn) for o in observations]
    assert engine.keywords == [{"multi_modal_data": None}] * 5  # OpenRLHF's call, handed through as it came


def test_a_template_that_checks_roles_gets_user_and_assistant_turns(monkeypatch):
    """Mistral's template raises unless the roles go user, assistant, user, ...; its assistant turn ends with the
    EOS token, which the sampled reply already holds, so the feedback starts with the next [INST]."""
    tok = mistral_tokenizer()
    result, _, backend, _ = play(monkeypatch, [react(RIGHT[0]), "no action at all"], tok=tok,
                                 settings={"MAX_TURNS": "2"})
    assert backend.actions == RIGHT[:1]
    assert spans(result, tok) == [
        f"[INST] {INSTRUCTIONS['babyai']} [/INST]{ACKNOWLEDGEMENT}<|im_end|>[INST] {observation_text(ITEM, 0)} [/INST]",
        f"[INST] {observation_text(ITEM, 1)} [/INST]",
        f"[INST] {INVALID_ACTION} [/INST]",
    ]


def test_feedback_after_a_reply_with_no_tokens_closes_the_turn_itself(monkeypatch):
    """A reply of no tokens at all (nothing sampled) is an invalid action; its turn is closed by the feedback."""
    tok = tiny_tokenizer()
    result, _, backend, _ = play(monkeypatch, engine=ScriptedEngine(tok, [""], close_turn=False),
                                 settings={"MAX_TURNS": "1"})
    assert result["action_ranges"][0][0] == result["action_ranges"][0][1]
    assert spans(result, tok)[1] == chatml_feedback(INVALID_ACTION, reply_closed=False)
    assert backend.actions == [] and result["extra_logs"]["invalid_actions"] == 1


def test_an_observation_is_wrapped_verbatim_whatever_it_holds(monkeypatch):
    """The env's text goes into the user turn unchanged, even text that looks like the template's own markers."""
    tok = tiny_tokenizer()
    odd = "a\x00REPLY\x00b <|im_start|>assistant"
    result, _, backend, _ = play(monkeypatch, [react(odd)], settings={"MAX_TURNS": "1"})
    assert backend.actions == [odd]
    assert spans(result, tok)[1] == chatml_feedback(f"Invalid action: {odd} is not an action here.")


def test_special_tokens_left_in_the_reply_text_never_reach_the_env(monkeypatch):
    """A rollout engine that keeps special tokens in the text (skip_special_tokens=False): the env gets the action."""
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, [react(RIGHT[0]) + "<|im_end|>"], close_turn=False)
    result, _, backend, _ = play(monkeypatch, engine=engine, settings={"MAX_TURNS": "1"})
    assert backend.actions == RIGHT[:1] and result["extra_logs"]["invalid_actions"] == 0


def test_non_text_observations_are_shown_as_text(monkeypatch):
    """The gym chat protocol answers with a list of chat messages; the prompt shows it as text (str)."""
    tok = tiny_tokenizer()
    result, _, backend, _ = play(monkeypatch, [react(RIGHT[0])], executor_cls=GymExecutor, prompt=f"gym/{ITEM}",
                                 backend=FakeBackend("gym"), settings={"MAX_TURNS": "1"})
    first, feedback = spans(result, tok)
    assert first.endswith(chatml(("user", str([{"role": "user", "content": observation_text(ITEM, 0)}]))))
    assert feedback == chatml_feedback(str([{"role": "user", "content": observation_text(ITEM, 1)}]))
    assert result["extra_logs"]["env_failed"] == 0.0 and backend.counts["step"] == 1


# ---- which item ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt,label", [
    (f"babyai/{ITEM}", str(ITEM)),  # scripts/make_itemids.py's rows
    (f"babyai/{ITEM}", ""),  # no label: the prompt says
    (f" babyai/{ITEM} ", None),
    ("Reach the goal.", f" {ITEM} "),  # a free-text prompt: the label says
])
def test_the_session_opens_the_labelled_item_else_the_prompts(monkeypatch, prompt, label):
    tok = tiny_tokenizer()
    result, _, backend, _ = play(monkeypatch, [react(RIGHT[0])], prompt=prompt, label=label, images=["frame 0"],
                                 settings={"MAX_TURNS": "1"})
    assert spans(result, tok)[0] == babyai_first_prompt(observation_text(ITEM, 0))
    assert backend.counts["reset"] == 1 and backend.actions == RIGHT[:1]
    # OpenRLHF's own fields come back as it was given them
    assert (result["prompt"], result["label"], result["images"]) == (prompt, label, ["frame 0"])


@pytest.mark.parametrize("prompt", ["textcraft/7", "babyai/", "babyai", "7", "babyai:7"])
def test_a_prompt_that_names_no_item_of_this_env_is_refused_with_the_remedy(monkeypatch, prompt):
    message = (f"babyai agent func: prompt {prompt!r} is not 'babyai/<item_id>' and the label is empty: build the "
               "dataset with scripts/make_itemids.py")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        play(monkeypatch, [react(RIGHT[0])], prompt=prompt, label="")


# ---- what is counted and reported ---------------------------------------------------------------------------------
def test_replies_without_an_action_are_not_sent_and_the_turn_limit_still_ends_the_episode(monkeypatch):
    tok = tiny_tokenizer()
    result, engine, backend, _ = play(monkeypatch, ["I think.", "I think more."], settings={"MAX_TURNS": "2"})
    assert backend.actions == [] and len(engine.prompts) == 2
    logs = result["extra_logs"]
    assert (logs["turns"], logs["invalid_actions"], logs["rejected_actions"], logs["horizon"]) == (2, 2, 0, 2)
    assert result["reward"] == 0.0 and logs["success"] == 0.0 and logs["env_failed"] == 0.0
    assert spans(result, tok)[1:] == [chatml_feedback(INVALID_ACTION)] * 2


def test_actions_the_env_rejects_are_counted(monkeypatch):
    result, _, backend, _ = play(monkeypatch, [react("xyzzy"), react("dance"), react(RIGHT[0])],
                                 settings={"MAX_TURNS": "3"})
    assert backend.actions == ["xyzzy", "dance", RIGHT[0]]
    logs = result["extra_logs"]
    assert (logs["turns"], logs["invalid_actions"], logs["rejected_actions"]) == (3, 0, 2)


def test_the_reported_score_is_the_episode_score_itself(monkeypatch):
    """Thirds of a reward per right action: the turn rewards (float32 tensors) sum to about 1; ``scores`` is the
    score itself, exactly 1 (OpenRLHF falls back to the sum when an agent reports no score)."""
    backend = ContractBackend(partial_rewards=True, episode_len=3)
    result, _, _, _ = play(monkeypatch, [react(a) for a in RIGHT[:3]], backend=backend)
    assert result["reward"] == pytest.approx(1.0)
    assert float(result["scores"]) == 1.0 and result["extra_logs"]["success"] == 1.0


def test_env_time_is_the_time_spent_in_env_calls(monkeypatch):
    """Opening the session and two steps, each taking 0.123456 s of env time: 0.370368 s, reported to 0.1 ms."""
    clock = Clock()
    result, _, _, _ = play(monkeypatch, [react(a) for a in RIGHT[:2]], clock=clock,
                           backend=ContractBackend(clock=clock, call_s=0.123456), settings={"MAX_TURNS": "2"})
    assert result["extra_logs"]["env_time_s"] == 0.3704


def test_the_horizon_follows_the_schedule_by_episodes_started(monkeypatch):
    """HORIZON_EPISODES_PER_STEP=1, a stage per step: episode 0 is stage 0 (1 turn), episode 1 stage 1 (2 turns)."""
    monkeypatch.setattr(base, "_episode_counter", itertools.count())
    settings = {"HORIZON_SCHEDULE": "1,2", "HORIZON_STAGE_STEPS": "1", "HORIZON_EPISODES_PER_STEP": "1"}
    seen = []
    for _ in range(2):
        result, _, _, _ = play(monkeypatch, [react("xyzzy")] * 3, settings=settings)
        seen.append((result["extra_logs"]["turns"], result["extra_logs"]["horizon"]))
    assert seen == [(1, 1), (2, 2)]


# ---- how an episode ends badly ------------------------------------------------------------------------------------
def test_a_failed_step_ends_the_episode_with_reward_0_and_says_why(monkeypatch):
    tok = tiny_tokenizer()
    result, engine, _, warnings = play(monkeypatch, [react(RIGHT[0]), react("crash"), react(RIGHT[1])])
    assert len(engine.prompts) == 2 and result["reward"] == 0.0
    assert result["extra_logs"]["env_failed"] == 1.0 and result["extra_logs"]["turns"] == 2
    assert spans(result, tok)[-1] == chatml_feedback(FAILED)
    assert len(warnings) == 1
    assert warnings[0].startswith(f"babyai item {ITEM}: episode ends with reward 0: step 2 failed: BackendFailed: "), \
        warnings


@pytest.mark.parametrize("env,prompt,label,item", [
    ("babyai", f"babyai/{ITEM}", str(ITEM), str(ITEM)),
    ("sciworld", "sciworld/4240", "4240", "4240"),  # its first_prompt reads the reset's info
    ("tau2", "tau2/retail/5", "", "retail/5"),  # a τ² item id: <domain>/<task id>
])
def test_an_unreachable_gateway_voids_the_episode_instead_of_raising(monkeypatch, env, prompt, label, item):
    tok = tiny_tokenizer()
    with refusing_port() as dead:
        url = f"http://127.0.0.1:{dead.getsockname()[1]}"
        result, engine, _, warnings = play(monkeypatch, [react("look")] * 2, gateway_url=url, prompt=prompt,
                                           label=label, executor_cls=load_agent_func(env).AgentExecutor)
    assert len(engine.prompts) == 1 and result["reward"] == 0.0 and result["extra_logs"]["env_failed"] == 1.0
    first, feedback = spans(result, tok)
    assert first.endswith(chatml(("user", VOID)))
    if env == "babyai":
        assert first == babyai_first_prompt(VOID)
    assert feedback == chatml_feedback(FAILED)
    assert len(warnings) == 1
    assert warnings[0].startswith(f"{env} item {item}: episode ends with reward 0: opening the session failed: "
                                  f"GatewayUnavailable: unreachable: POST /v1/sessions to {url}: "), warnings


@pytest.mark.parametrize("settings,call_s", [({"EPISODE_TIMEOUT_S": "200"}, 100.0), ({}, 450.0)],
                         ids=["EPISODE_TIMEOUT_S=200", "default-900"])
def test_no_env_call_starts_once_the_episode_deadline_is_reached(monkeypatch, settings, call_s):
    """Env calls taking half the episode's budget (200 s set, 900 s by default): the reset and step 1 fit; step 2 is
    due at the deadline and is not sent."""
    clock = Clock()
    tok = tiny_tokenizer()
    result, engine, backend, warnings = play(monkeypatch, [react(a) for a in RIGHT], clock=clock,
                                             backend=ContractBackend(clock=clock, call_s=call_s), settings=settings)
    assert backend.actions == RIGHT[:1] and len(engine.prompts) == 2
    assert result["reward"] == 0.0 and result["extra_logs"]["env_failed"] == 1.0
    assert result["extra_logs"]["turns"] == 2 and result["extra_logs"]["env_time_s"] == 2 * call_s
    assert spans(result, tok)[-1] == chatml_feedback(FAILED)
    assert warnings == [f"babyai item {ITEM}: episode ends with reward 0: episode deadline (EPISODE_TIMEOUT_S) "
                        "passed before turn 2"]


@pytest.mark.parametrize("settings,timeout", [({}, 120.0), ({"ENV_CALL_TIMEOUT_S": "45"}, 45.0)])
def test_the_gateway_client_gets_the_call_deadline(monkeypatch, settings, timeout):
    """ENV_CALL_TIMEOUT_S (default 120 s) is the agent's gateway client's deadline (its session closes use it)."""
    monkeypatch.setattr(base, "CLIENTS", {})
    result, _, _, _ = play(monkeypatch, [react(RIGHT[0])], settings={"MAX_TURNS": "1", **settings})
    assert result["extra_logs"]["env_failed"] == 0.0
    assert [client.timeout for client in base.CLIENTS.values()] == [timeout]


def test_a_stuck_step_is_given_up_at_the_episode_deadline(monkeypatch):
    """ENV_CALL_TIMEOUT_S=60 but 0.5 s of the episode left: the step's deadline is 0.5 s, the gateway client's own
    (its error says so), not the agent's backstop."""
    clock = Clock()
    backend = ContractBackend(clock=clock, call_s=100.0)  # the reset takes 100 of the episode's 100.5 s
    result, _, backend, warnings = play(monkeypatch, [react("hang")], clock=clock, backend=backend,
                                        settings={"EPISODE_TIMEOUT_S": "100.5", "ENV_CALL_TIMEOUT_S": "60"})
    assert backend.actions == ["hang"] and result["extra_logs"]["env_failed"] == 1.0 and result["reward"] == 0.0
    assert len(warnings) == 1
    assert re.fullmatch(rf"babyai item {ITEM}: episode ends with reward 0: step 1 failed: GatewayUnavailable: "
                        r"timeout: POST /v1/sessions/\S+/step: no answer from http://127\.0\.0\.1:\d+ within 0\.5s",
                        warnings[0]), warnings


def test_a_stuck_reset_is_given_up_at_the_episode_deadline(monkeypatch):
    """EPISODE_TIMEOUT_S=0.5 (under a second is allowed): opening the session may take 0.5 s, not
    ENV_CALL_TIMEOUT_S."""
    tok = tiny_tokenizer()
    result, engine, _, warnings = play(monkeypatch, [react("look")], prompt=f"babyai/{HANG_ITEM}",
                                       label=str(HANG_ITEM), clock=Clock(),
                                       settings={"EPISODE_TIMEOUT_S": "0.5", "ENV_CALL_TIMEOUT_S": "60"})
    assert result["extra_logs"]["env_failed"] == 1.0 and len(engine.prompts) == 1
    assert spans(result, tok)[0] == babyai_first_prompt(VOID)
    assert len(warnings) == 1
    assert re.fullmatch(rf"babyai item {HANG_ITEM}: episode ends with reward 0: opening the session failed: "
                        r"GatewayUnavailable: timeout: POST /v1/sessions: no answer from http://127\.0\.0\.1:\d+ "
                        r"within 0\.5s", warnings[0]), warnings


def test_a_call_that_overruns_its_own_deadline_is_abandoned_a_second_later(monkeypatch):
    """The backstop: a gateway client that ignored its deadline (0.2 s left) is cut off by the agent (at 1.2 s)."""
    from env_gateway.client import GatewayClient

    async def ignores_its_deadline(self, session_id, action, *, timeout=None):
        await asyncio.Event().wait()

    monkeypatch.setattr(GatewayClient, "step", ignores_its_deadline)
    clock = Clock()
    result, _, _, warnings = play(monkeypatch, [react(RIGHT[0])], clock=clock,
                                  backend=ContractBackend(clock=clock, call_s=100.0),
                                  settings={"EPISODE_TIMEOUT_S": "100.2"})
    assert result["extra_logs"]["env_failed"] == 1.0
    assert warnings == [f"babyai item {ITEM}: episode ends with reward 0: step 1 failed: TimeoutError: "]


class FullBackend(ContractBackend):
    """Answers its first ``full_for`` creates 503 "full", as an env server at its --max-instances does."""

    def __init__(self, full_for: int, **kw) -> None:
        super().__init__(**kw)
        self.full_for, self.refused = full_for, 0

    async def create(self, request):
        from aiohttp import web

        if self.refused < self.full_for:
            self.refused += 1
            return web.json_response({"error": "full", "detail": "at --max-instances"}, status=503)
        return await super().create(request)


def test_a_full_env_server_is_asked_again_until_the_episode_deadline(monkeypatch):
    """Each 503 asks to retry after 1 s, so one create call (ENV_CALL_TIMEOUT_S=2.5) outlasts at most three of the
    four refusals: the agent asks again while the episode has time. Was: a full server's 502 voided the episode at
    once."""
    result, _, backend, warnings = play(monkeypatch, [react(a) for a in RIGHT], backend=FullBackend(4),
                                        settings={"ENV_CALL_TIMEOUT_S": "2.5", "EPISODE_TIMEOUT_S": "60"})
    assert backend.refused == 4 and warnings == []
    assert result["reward"] == 1.0 and result["extra_logs"]["env_failed"] == 0.0


def test_a_server_full_past_the_episode_deadline_voids_the_episode(monkeypatch):
    result, _, backend, warnings = play(monkeypatch, [react("look")], backend=FullBackend(1000),
                                        settings={"ENV_CALL_TIMEOUT_S": "1", "EPISODE_TIMEOUT_S": "2.5"})
    assert result["extra_logs"]["env_failed"] == 1.0 and 2 <= backend.refused <= 4
    assert len(warnings) == 1 and warnings[0].startswith(
        f"babyai item {ITEM}: episode ends with reward 0: opening the session failed: Overloaded: HTTP 503 "
        "replicas_busy: no babyai replica can take item 7 now: backend "), warnings
