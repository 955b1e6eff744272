"""TextCraft agent func: ``--train.agent_func_path agent_funcs/textcraft.py``.

Actions: ``get <n> <item>``, ``craft <n> <item> using <n> <ingredient>, ...``, ``inventory``, after ``Action:``,
cleaned as AgentGym's TextCraft client (agentenv 3ef9235) cleans them before they reach its server: only letters,
digits, commas and spaces are kept, runs of spaces become one. The server's replies are AgentGym's
(env_gateway/servers/textcraft.py); a failed action reads "Could not ...".
Reward: the env's own (1 when the goal item is crafted), passed through. Turns: 30 (AgentGym-RL); ScalingInter-RL
uses HORIZON_SCHEDULE="10,20,30".
"""

import os
import re
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # OpenRLHF loads this file by path

from agent_funcs.base import GatewayAgent, GatewayAgentExecutor  # noqa: E402
from agent_funcs.instructions import INSTRUCTIONS  # noqa: E402
from cope_rlhf.chat_format import parse_react_action  # noqa: E402

NOT_SENT = re.compile(r"[^A-Za-z0-9, ]+")  # what AgentGym's client drops from an action


class TextCraftAgent(GatewayAgent):
    env = "textcraft"
    instruction = INSTRUCTIONS["textcraft"]
    default_max_turns = 30
    invalid_phrases = ("could not", "invalid action")  # a failed or unrecognised action: "Could not find ..."

    @classmethod
    def parse_action(cls, reply: str) -> str | None:
        action = parse_react_action(reply)
        return None if action is None else " ".join(NOT_SENT.sub("", action).split())


class AgentExecutor(GatewayAgentExecutor):
    agent_cls = TextCraftAgent
