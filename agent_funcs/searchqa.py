"""SearchQA agent func: ``--train.agent_func_path agent_funcs/searchqa.py``.

Actions: ``<search>query</search>`` or ``<answer>text</answer>``, after ``Action:``. Reward: the env's own (1 for an
exact-match answer, which ends the episode), passed through. Turns: 5 (AgentGym-RL); ScalingInter-RL uses
HORIZON_SCHEDULE="5,8,10".
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # OpenRLHF loads this file by path

from agent_funcs.base import GatewayAgent, GatewayAgentExecutor  # noqa: E402
from agent_funcs.instructions import INSTRUCTIONS  # noqa: E402


class SearchQAAgent(GatewayAgent):
    env = "searchqa"
    instruction = INSTRUCTIONS["searchqa"]
    default_max_turns = 5
    invalid_phrases = ("your previous action is invalid", "invalid action")  # AgentGym's text, the base server's


class AgentExecutor(GatewayAgentExecutor):
    agent_cls = SearchQAAgent
