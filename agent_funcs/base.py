"""The shared agent func: OpenRLHF's ``MultiTurnAgentExecutor`` playing one gateway session per episode.

An env file subclasses ``GatewayAgent`` (env name, instruction, turn limit, reward shaping) and exposes
``class AgentExecutor(GatewayAgentExecutor): agent_cls = ThatAgent``; ``--train.agent_func_path
agent_funcs/<env>.py`` is then all an OpenRLHF run needs. A prompt-dataset row is
``{"prompt": "<env>/<item_id>", "label": "<item_id>"}``.

Episode contract (token in, token out: the policy's tokens are never re-tokenized):
  first prompt  = chat_template(first_messages, add_generation_prompt=True), by default first_messages =
                  [user: instruction, assistant: acknowledgement, user: first observation] (an env overrides
                  ``first_messages``, e.g. SciWorld's task before the look; scripts/eval.py records them)
  feedback_t    = the template's text between an assistant reply and the next one, with the observation as the
                  user turn (``<|im_end|>\\n<|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n`` for
                  ChatML), minus the end-of-turn token when the sampled action already ends with it
  action_t      = ``parse_action(reply)``: the first non-empty line after the last ``Action:``; a reply with
                  none is an invalid action (not sent to the env; "Invalid action" observation; reward 0)
  reward_t      = score(after t) - score(after t-1), so the executor's sum over steps is the episode score:
                  ``score(env_total, last_env_reward, done)`` per env (e.g. SciWorld 1 iff done with 100);
                  an episode ended by a gateway failure or the deadline scores 0

The episode ends when the env says done, after ``max_turns`` actions (MAX_TURNS, or the ScalingInter-RL
horizon HORIZON_SCHEDULE at the current training step), at the per-episode deadline, or on any gateway failure
(logged with its reason; the sample stays in its GRPO group with reward 0). The session is closed on every exit,
also on error and cancellation. ``extra_logs``: turns, invalid_actions (replies with no parsable action),
rejected_actions (actions sent whose observation says they failed: ``is_invalid``), env_time_s, success, env_failed,
horizon.

Environment (set by the launcher; read at the start of every episode):
  COPE_GATEWAY_URL          gateway base URL (default http://127.0.0.1:8800)
  MAX_TURNS                 actions per episode (default: the env's own, e.g. BabyAI 20)
  HORIZON_SCHEDULE          ScalingInter-RL horizons per stage, e.g. "6,13,20" (overrides MAX_TURNS)
  HORIZON_STAGE_STEPS       training steps per stage (default 100)
  COPE_TRAIN_STEP_FILE      file holding the current training step (the trainer rewrites it every step: write a
                            temporary file, then rename it), or
  HORIZON_EPISODES_PER_STEP episodes this engine runs per training step (step = episodes started // this)
  EPISODE_TIMEOUT_S         an episode's wall-clock budget from its start, seconds (default 900): no env call
                            starts after it or runs past it
  ENV_CALL_TIMEOUT_S        deadline of one gateway call, seconds (default 120)
  COPE_GATEWAY_TOKEN_FILE   the token file of a gateway started with --auth-token-file (read by GatewayClient)
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

from agent_funcs.instructions import ACKNOWLEDGEMENT
from cope_rlhf.chat_format import parse_react_action, realized_action
from cope_rlhf.seeds import derive_seed, with_seed
from env_gateway.client import EnvSession, GatewayClient, Overloaded

log = logging.getLogger("agent_funcs")

DEFAULT_GATEWAY_URL = "http://127.0.0.1:8800"
SEEDS_REMEMBERED = 4096  # request seeds whose episode count an executor keeps (a batch's requests, with room)
REACT_FORMAT = ("Answer every turn in this format:\nThought:\n<one or two sentences about what to do next>\n\n"
                "Action:\n<exactly one action>\n")
INVALID_ACTION = ("Invalid action: your reply has no action. End every reply with a line \"Action:\" followed by "
                  "exactly one action on the next line.")


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {raw!r}")
    return value


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return int(raw)


@dataclass(frozen=True)
class TurnLimit:
    """Fixed ``max_turns``, or a ScalingInter-RL schedule: horizon = schedule[min(step // stage_steps, last)]."""

    max_turns: int
    schedule: tuple[int, ...] = ()
    stage_steps: int = 100
    step_file: str | None = None
    episodes_per_step: int | None = None

    @classmethod
    def from_env(cls, default_max_turns: int) -> "TurnLimit":
        max_turns = _env_int("MAX_TURNS", default_max_turns)
        raw = os.environ.get("HORIZON_SCHEDULE", "").strip()
        if not raw:
            return cls(max_turns)
        try:
            schedule = tuple(int(x) for x in raw.split(","))
        except ValueError:
            raise ValueError(f"HORIZON_SCHEDULE={raw!r}: give comma-separated turn counts, e.g. \"6,13,20\"") from None
        if not schedule or min(schedule) <= 0:
            raise ValueError(f"HORIZON_SCHEDULE={raw!r}: every horizon must be a positive integer")
        step_file = os.environ.get("COPE_TRAIN_STEP_FILE") or None
        episodes = _env_int("HORIZON_EPISODES_PER_STEP", None)
        if step_file is None and episodes is None:
            raise ValueError("HORIZON_SCHEDULE needs the training step: set COPE_TRAIN_STEP_FILE (a file the trainer "
                             "rewrites with the step number) or HORIZON_EPISODES_PER_STEP (episodes per step on this "
                             "rollout engine)")
        return cls(max_turns, schedule, _env_int("HORIZON_STAGE_STEPS", 100), step_file, episodes)

    def horizon(self, episode_index: int) -> int:
        if not self.schedule:
            return self.max_turns
        step = _read_step(self.step_file) if self.step_file else None
        if step is None:
            step = episode_index // self.episodes_per_step if self.episodes_per_step else 0
        return self.schedule[min(step // self.stage_steps, len(self.schedule) - 1)]


_last_steps: dict[str, int] = {}


def _read_step(path: str) -> int | None:
    """The training step in ``path``; while the file is missing or mid-write, the last step read from it."""
    try:
        with open(path) as f:
            _last_steps[path] = int(f.read().strip())
    except (OSError, ValueError):
        pass
    return _last_steps.get(path)


CLIENTS: dict[tuple[str, float], GatewayClient] = {}


def gateway_client(url: str, call_timeout: float) -> GatewayClient:
    """One client per process, URL and timeout: it keeps one keep-alive HTTP session per event loop."""
    key = (url, call_timeout)
    if key not in CLIENTS:
        CLIENTS[key] = GatewayClient(url, timeout=call_timeout)
    return CLIENTS[key]


@dataclass
class _Episode:
    """What ``GatewayAgentExecutor.execute`` shares with the agent instance OpenRLHF builds inside it. ``seed``: the
    request seed of a seeded rollout and the episode's place among its request's episodes (None: unseeded)."""

    tokenizer: Any
    seed: tuple[int, int] | None = None
    turns: int = 0
    last_token_ids: list[int] = field(default_factory=list)
    agents: list["GatewayAgent"] = field(default_factory=list)


_EPISODE: contextvars.ContextVar[_Episode] = contextvars.ContextVar("cope_agent_episode")
_episode_counter = itertools.count()


class GatewayAgent(AgentInstanceBase):
    """One episode of one environment, played through the gateway. Subclasses set the class attributes and may
    override ``parse_action``, ``format_observation``, ``first_messages``, ``score`` and ``success``."""

    env: str = ""
    instruction: str = ""
    default_max_turns: int = 20

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        episode = _EPISODE.get(None)
        if episode is None:
            raise RuntimeError(f"{type(self).__name__} runs inside GatewayAgentExecutor.execute (use the env file's "
                               "AgentExecutor, not MultiTurnAgentExecutor directly)")
        self.episode = episode
        self.horizon = TurnLimit.from_env(self.default_max_turns).horizon(next(_episode_counter))
        self.call_timeout = _env_float("ENV_CALL_TIMEOUT_S", 120.0)
        self.deadline = time.monotonic() + _env_float("EPISODE_TIMEOUT_S", 900.0)
        self.client = gateway_client(os.environ.get("COPE_GATEWAY_URL") or DEFAULT_GATEWAY_URL, self.call_timeout)
        self.session: EnvSession | None = None
        # registered for the executor's close() only once made: a refused setting above reaches the user as its
        # ValueError, not as close()'s AttributeError on a half-made agent
        episode.agents.append(self)
        self.item_id = ""
        self.turns = self.invalid = self.rejected = 0
        self.env_time = 0.0
        self.env_total = self.last_reward = 0.0
        self.scored = 0.0
        self.done = self.failed = False

    # Lower-case phrases by which this env's observation says the last action failed or changed nothing (the
    # forecast's skip-invalid reads them through ``is_invalid``); our own INVALID_ACTION reply is one of them.
    invalid_phrases: tuple[str, ...] = ("invalid action",)
    forecast_layouts: tuple[str, ...] = ("list", "turns")  # the ACTION_FORECAST_LAYOUTs this env's actions allow

    # ---- per-env hooks ---------------------------------------------------------------------------
    @classmethod
    def parse_action(cls, reply: str) -> str | None:
        return parse_react_action(reply)

    @classmethod
    def realized_action(cls, reply: str) -> str:
        """The action a reply took, as the CoPE forecast learns and predicts it: what ``parse_action`` sends to
        the env (``cope_rlhf.chat_format.realized_action``)."""
        return realized_action(reply, cls.parse_action)

    @classmethod
    def is_invalid(cls, observation: str) -> bool:
        """Whether the observation after an action says that action failed (``invalid_phrases``)."""
        lowered = observation.lower()
        return any(phrase in lowered for phrase in cls.invalid_phrases)

    def format_observation(self, observation: Any) -> str:
        return observation if isinstance(observation, str) else str(observation)

    def score(self, env_total: float, last_reward: float, done: bool) -> float:
        """Episode score from the env's rewards: by default their sum (the env's own reward)."""
        return env_total

    def success(self, score: float, done: bool) -> bool:
        return done and score > 0

    # ---- chat formatting -------------------------------------------------------------------------
    def first_messages(self, observation: str, info: dict) -> list[dict]:
        """The chat that the policy's first reply answers, from the reset's observation and info: the env's
        instruction, our acknowledgement, the observation (scripts/eval.py records these as the episode's start)."""
        return [{"role": "user", "content": self.instruction}, {"role": "assistant", "content": ACKNOWLEDGEMENT},
                {"role": "user", "content": observation}]

    def first_prompt(self, observation: str, info: dict) -> str:
        return self.episode.tokenizer.apply_chat_template(self.first_messages(observation, info), tokenize=False,
                                                          add_generation_prompt=True)

    def wrap_observation(self, observation: str) -> str:
        """The template's text from the end of the last reply to the start of the next, around ``observation``."""
        tok = self.episode.tokenizer
        marker = "\x00REPLY\x00"
        head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
        text = tok.apply_chat_template(head + [{"role": "user", "content": observation}], tokenize=False,
                                       add_generation_prompt=True)
        feedback = text[text.index(marker) + len(marker):]
        ids = self.episode.last_token_ids
        if ids and ids[-1] in tok.all_special_ids:  # the sampled reply closed its turn with the template's token
            end = tok.convert_ids_to_tokens(ids[-1])
            if feedback.startswith(end):
                feedback = feedback[len(end):]
        return feedback

    # ---- OpenRLHF's AgentInstanceBase ----------------------------------------------------------
    async def reset(self, states: dict, **kwargs: Any) -> dict:
        self.item_id = self.item_from(states.get("observation", ""), states.get("label"))
        try:
            opened = await self._create()
        except Exception as e:  # noqa: BLE001 - one bad env answer must not take the whole batch with it
            self.fail(f"opening the session failed: {type(e).__name__}: {e}")
            return {"observation": self.first_prompt("The environment is unavailable: this episode is void.", {})}
        self.session = EnvSession(self.client, self.env, self.item_id, opened, self.call_timeout)
        return {"observation": self.first_prompt(self.format_observation(opened.observation), opened.info)}

    async def step(self, states: dict, **kwargs: Any) -> dict:
        reply = states["action_text"]
        for special in self.episode.tokenizer.all_special_tokens:  # e.g. a closing <|im_end|> left in the text
            reply = reply.replace(special, "")
        if self.failed:  # reset could not open a session: nothing to play
            return self.result("", done=True)
        self.turns += 1
        action = self.parse_action(reply)
        if action is None:
            self.invalid += 1
            return self.result(INVALID_ACTION, done=self.turns >= self.horizon)
        if time.monotonic() >= self.deadline:
            self.fail(f"episode deadline (EPISODE_TIMEOUT_S) passed before turn {self.turns}")
            return self.result("", done=True)
        try:
            r = await self._timed(self.session.step(action, timeout=self._call_budget()))
        except Exception as e:  # noqa: BLE001 - as above; cancellation (BaseException) still propagates
            self.fail(f"step {self.turns} failed: {type(e).__name__}: {e}")
            return self.result("", done=True)
        self.env_total += r.reward
        self.last_reward, self.done = r.reward, r.done
        observation = self.format_observation(r.observation)
        self.rejected += self.is_invalid(observation)
        return self.result(observation, done=r.done or self.turns >= self.horizon)

    # ---- episode bookkeeping -------------------------------------------------------------------
    def item_from(self, prompt: str, label: Any) -> str:
        if label not in (None, ""):
            return str(label).strip()
        env, sep, item = str(prompt).strip().partition("/")
        if not sep or env != self.env or not item:
            raise ValueError(f"{self.env} agent func: prompt {prompt!r} is not '{self.env}/<item_id>' and the label "
                             "is empty: build the dataset with scripts/make_itemids.py")
        return item

    async def _create(self) -> Any:
        """Open the session. "Full, retry later" (503: every replica busy or at its instance limit) is asked again
        after its Retry-After for as long as the episode's deadline allows, not only within one call's deadline."""
        while True:
            try:
                return await self._timed(self.client.create(self.env, self.item_id, timeout=self._call_budget()))
            except Overloaded as e:
                wait = e.retry_after or 1.0
                if time.monotonic() + wait >= self.deadline:
                    raise
                await asyncio.sleep(wait)

    def _call_budget(self) -> float:
        return max(0.001, min(self.call_timeout, self.deadline - time.monotonic()))

    async def _timed(self, call: Any) -> Any:
        start = time.monotonic()
        try:
            return await asyncio.wait_for(call, self._call_budget() + 1.0)  # backstop over the client's own deadline
        finally:
            self.env_time += time.monotonic() - start

    def fail(self, reason: str) -> None:
        self.failed = True
        log.warning("%s item %s: episode ends with reward 0: %s", self.env, self.item_id, reason)

    def result(self, observation: str, done: bool) -> dict:
        score = 0.0 if self.failed else self.score(self.env_total, self.last_reward, self.done)
        reward, self.scored = score - self.scored, score
        feedback = self.wrap_observation(observation or "The environment failed: the episode is over.")
        logs = {"turns": self.turns, "invalid_actions": self.invalid, "rejected_actions": self.rejected,
                "env_time_s": round(self.env_time, 4),
                "success": float(not self.failed and self.success(score, self.done)),
                "env_failed": float(self.failed), "horizon": self.horizon}
        return {"rewards": torch.tensor(reward), "scores": torch.tensor(score), "environment_feedback": feedback,
                "done": done, "extra_logs": logs}

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()  # idempotent; never raises; finishes even if we are cancelled


class _RecordingEngine:
    """The rollout engine as given, noting each reply's token ids (to know whether it closed its turn), and, in a
    seeded rollout, sampling each turn with its own seed (``cope_rlhf.seeds``: H(request seed, episode,
    turn))."""

    def __init__(self, engine: Any, episode: _Episode) -> None:
        self.engine, self.episode = engine, episode

    async def generate(self, token_ids: Any, sampling_params: Any, *args: Any, **kwargs: Any) -> Any:
        episode = self.episode
        if episode.seed is not None:
            sampling_params = with_seed(sampling_params, derive_seed(*episode.seed, episode.turns))
        episode.turns += 1
        out = await self.engine.generate(token_ids, sampling_params, *args, **kwargs)
        episode.last_token_ids = list(out.outputs[0].token_ids)
        return out


class GatewayAgentExecutor(MultiTurnAgentExecutor):
    """OpenRLHF's executor, run with the env's ``agent_cls``; closes the episode's session however it ends.
    ``action_format()`` hands CoPE the env's ``realized_action`` / ``is_invalid`` (cope_rlhf.forecast)."""

    agent_cls: type[GatewayAgent] = GatewayAgent

    @classmethod
    def action_format(cls) -> type[GatewayAgent]:
        return cls.agent_cls

    def __init__(self) -> None:
        super().__init__(self.agent_cls)
        self.episodes_of_seed: collections.OrderedDict[int, int] = collections.OrderedDict()

    def _episode_seed(self, sampling_params: Any) -> tuple[int, int] | None:
        """(request seed, this episode's place among the request's episodes), counted as they start (the engine
        starts a request's episodes in order); None when the request is unseeded."""
        seed = getattr(sampling_params, "seed", None)
        if seed is None:
            return None
        place = self.episodes_of_seed.pop(seed, 0)
        self.episodes_of_seed[seed] = place + 1
        while len(self.episodes_of_seed) > SEEDS_REMEMBERED:
            self.episodes_of_seed.popitem(last=False)
        return seed, place

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        episode = _Episode(hf_tokenizer, self._episode_seed(sampling_params))
        token = _EPISODE.set(episode)
        try:
            return await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer,
                                         _RecordingEngine(llm_engine, episode), images)
        finally:
            _EPISODE.reset(token)
            for agent in episode.agents:
                await agent.close()
