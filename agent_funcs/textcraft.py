"""TextCraft agent func: ``--train.agent_func_path agent_funcs/textcraft.py``.

Actions: ``get <n> <item>``, ``craft <n> <item> using <n> <ingredient>, ...``, ``inventory``, after ``Action:``.
Reward: the env's own (1 when the goal item is crafted), passed through. Turns: 30 (AgentGym-RL); ScalingInter-RL
uses HORIZON_SCHEDULE="10,20,30".
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # OpenRLHF loads this file by path

from agent_funcs.base import GatewayAgent, GatewayAgentExecutor  # noqa: E402
from agent_funcs.instructions import INSTRUCTIONS  # noqa: E402


class TextCraftAgent(GatewayAgent):
    env = "textcraft"
    instruction = INSTRUCTIONS["textcraft"]
    default_max_turns = 30
    invalid_phrases = ("could not", "invalid action")  # a get or craft that fails: "Could not find ..."


class AgentExecutor(GatewayAgentExecutor):
    agent_cls = TextCraftAgent
