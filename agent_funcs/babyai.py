"""BabyAI agent func: ``--train.agent_func_path agent_funcs/babyai.py``.

Action: one of the observation's "Available actions", after ``Action:``. Reward: the env's own (``1 - 0.9 *
steps / max_steps`` on success, else 0), passed through. Turns: 20 (AgentGym-RL); ScalingInter-RL uses
HORIZON_SCHEDULE="6,13,20".
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # OpenRLHF loads this file by path

from agent_funcs.base import GatewayAgent, GatewayAgentExecutor  # noqa: E402
from agent_funcs.instructions import INSTRUCTIONS  # noqa: E402


class BabyAIAgent(GatewayAgent):
    env = "babyai"
    instruction = INSTRUCTIONS["babyai"]
    default_max_turns = 20


class AgentExecutor(GatewayAgentExecutor):
    agent_cls = BabyAIAgent
