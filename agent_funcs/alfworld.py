"""ALFWorld agent func: ``--train.agent_func_path agent_funcs/alfworld.py``.

Action: one admissible command (``go to countertop 1``, ``take apple 1 from countertop 1``, ``heat apple 1 with
microwave 1``, ...), after ``Action:``. Reward: the env's own (1 when the game is won), passed through. Turns: 50
(as GiGPO ran ALFWorld).
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # OpenRLHF loads this file by path

from agent_funcs.base import GatewayAgent, GatewayAgentExecutor  # noqa: E402
from agent_funcs.instructions import INSTRUCTIONS  # noqa: E402

class ALFWorldAgent(GatewayAgent):
    env = "alfworld"
    instruction = INSTRUCTIONS["alfworld"]
    default_max_turns = 50
    invalid_phrases = ("nothing happens", "invalid action")  # ALFWorld's answer to an inadmissible command


class AgentExecutor(GatewayAgentExecutor):
    agent_cls = ALFWorldAgent
