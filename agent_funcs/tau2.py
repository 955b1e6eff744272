"""τ²-bench agent func (env_gateway/servers/tau2.py behind the gateway's ``tau2`` adapter):
``--train.agent_func_path agent_funcs/tau2.py``.

Item ids are ``<domain>/<task_id>`` (data/tau2_<domain>_<split>.jsonl). The first prompt is a system message and
the simulated user's first message, with the domain's tools given to the chat template (``tools=``, so a Qwen-style
template writes them in its own Hermes tool section); a template without tool support gets them as JSON in the
system message instead. The system message is this func's instruction above the domain policy, unless the server
runs with ``--agent-prompt tau2``: then it is τ²'s own default agent prompt (the server's ``system_prompt``), and
τ²'s greeting sits between it and the user's message as the agent's first turn, as ``tau2 run`` prompts a model.
Each reply is the action, as the model wrote it: a message to the user, or one or more
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the server parses them; ``done``, where the
server offers it, ends the conversation). An empty reply is an invalid action. Reward: the server's (τ²'s own
reward, or its dense variant with ``--reward-shape dense``), passed through; success = reward within 1e-6 of 1.
Turns: 30.
"""

import json
import os
import re
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # OpenRLHF loads this file by path

from agent_funcs.base import GatewayAgent, GatewayAgentExecutor  # noqa: E402

TOOL_FORMAT = ("To call a tool, reply with <tool_call>{\"name\": <tool name>, \"arguments\": <arguments object>}"
               "</tool_call> and nothing else. To talk to the customer, reply with plain text.")


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_ERROR = re.compile(r"<tool_response>\s*error")


def is_success(reward: float) -> bool:
    return abs(reward - 1.0) <= 1e-6


class Tau2Agent(GatewayAgent):
    env = "tau2"
    instruction = "You are a customer service agent. Follow the policy below.\n" + TOOL_FORMAT
    default_max_turns = 30
    forecast_layouts = ("turns",)  # a tool call may span lines: one action per assistant turn

    @classmethod
    def parse_action(cls, reply: str) -> str | None:
        return reply.strip() or None

    @classmethod
    def realized_action(cls, reply: str) -> str:
        """The literal ``<tool_call>...</tool_call>`` span (first opening tag to last closing tag) when the reply
        calls tools, else the message to the user; the forecast needs ``ACTION_FORECAST_LAYOUT=turns`` here."""
        start, end = reply.find(TOOL_CALL_OPEN), reply.rfind(TOOL_CALL_CLOSE)
        if start >= 0 and end > start:
            return reply[start : end + len(TOOL_CALL_CLOSE)]
        return reply.strip()

    @classmethod
    def is_invalid(cls, observation: str) -> bool:
        """τ²'s failed tool calls: a tool result (``<tool_response>``) or an observation that starts with "Error",
        and the server's own "Tool call error: ..." for a call it could not parse (found anywhere: in a trajectory
        the observation sits inside the chat template's user turn)."""
        lowered = observation.lower()
        return (lowered.lstrip().startswith("error") or "tool call error:" in lowered
                or TOOL_ERROR.search(lowered) is not None)

    def success(self, score: float, done: bool) -> bool:
        return done and is_success(score)

    def first_messages(self, observation: str, info: dict) -> list[dict]:
        if info.get("system_prompt"):  # --agent-prompt tau2: τ²'s default agent, word for word
            opening = [{"role": "assistant", "content": info["greeting"]}] if info.get("greeting") else []
            return [{"role": "system", "content": info["system_prompt"]}, *opening,
                    {"role": "user", "content": observation}]
        return [{"role": "system", "content": f"{self.instruction}\n\n# Policy\n{info.get('policy', '')}"},
                {"role": "user", "content": observation}]

    def first_prompt(self, observation: str, info: dict) -> str:
        """``first_messages`` with the reset's tools, through the template's ``tools=``, or listed after the system
        message when the template ignores them."""
        tok, tools = self.episode.tokenizer, info.get("tools") or []
        messages = self.first_messages(observation, info)
        text = tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
        names = [t.get("function", t).get("name", "") for t in tools]
        if names and names[0] not in text:
            tool_list = "\n\n# Tools\n" + "\n".join(json.dumps(t) for t in tools)
            messages[0] = {"role": "system", "content": messages[0]["content"] + tool_list}
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text


class AgentExecutor(GatewayAgentExecutor):
    agent_cls = Tau2Agent
