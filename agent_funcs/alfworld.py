"""ALFWorld agent func: ``--train.agent_func_path agent_funcs/alfworld.py``.

Action: one admissible command (``go to countertop 1``, ``take apple 1 from countertop 1``, ``heat apple 1 with
microwave 1``, ...), after ``Action:``. Reward: the env's own (1 when the game is won), passed through. Turns: 50
(as GiGPO ran ALFWorld).
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # OpenRLHF loads this file by path

from agent_funcs.base import REACT_FORMAT, GatewayAgent, GatewayAgentExecutor  # noqa: E402
from agent_funcs.instructions import INSTRUCTIONS  # noqa: E402

# Until agent_funcs/instructions.py (which the demo generator reads) has an ALFWorld text, this one is used.
_INSTRUCTION = (
    "You are in a household text game. The first observation describes the room and your task. Interact with "
    "the objects and receptacles to complete it.\n"
    "Commands: go to <receptacle>, open <receptacle>, close <receptacle>, take <object> from <receptacle>, "
    "move <object> to <receptacle>, examine <something>, use <object>, heat <object> with <receptacle>, cool "
    "<object> with <receptacle>, clean <object> with <receptacle>, slice <object> with <object>, inventory, look. "
    "Name objects and receptacles exactly as the observations do, e.g. \"apple 1\", \"countertop 2\".\n" + REACT_FORMAT
)


class ALFWorldAgent(GatewayAgent):
    env = "alfworld"
    instruction = INSTRUCTIONS.get("alfworld", _INSTRUCTION)
    default_max_turns = 50


class AgentExecutor(GatewayAgentExecutor):
    agent_cls = ALFWorldAgent
