"""SciWorld (ScienceWorld) agent func: ``--train.agent_func_path agent_funcs/sciworld.py``.

First observation: the task description, a newline, then the first look, as AgentGym's SciWorld client joins the
two fields of the reset reply (``task_description``, ``observation``); later observations are the server's as they
are. Action: one ScienceWorld command (e.g. ``open door to kitchen``, ``focus on red apple``), after ``Action:``.
Reward, binarised as CoPE ran it: ``1`` only when the episode is done with score 100, else ``0`` (the gateway's
SciWorld reward is the cumulative 0-100 score). Turns: 20 (AgentGym-RL); ScalingInter-RL uses
HORIZON_SCHEDULE="10,20,30".
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # OpenRLHF loads this file by path

from agent_funcs.base import GatewayAgent, GatewayAgentExecutor  # noqa: E402
from agent_funcs.instructions import INSTRUCTIONS  # noqa: E402

def binarised_sciworld_score(score: float, done: bool) -> float:
    """1 only when the task is done with the full score of 100."""
    return 1.0 if done and score >= 100 else 0.0


class SciWorldAgent(GatewayAgent):
    env = "sciworld"
    instruction = INSTRUCTIONS["sciworld"]
    default_max_turns = 20
    invalid_phrases = ("no known action matches that input", "invalid action")  # what ScienceWorld's parser says

    def score(self, env_total: float, last_reward: float, done: bool) -> float:
        return binarised_sciworld_score(last_reward, done)

    def first_messages(self, observation: str, info: dict) -> list[dict]:
        # The look alone does not say what the task is: the reset reply carries the task in its own field.
        task = info.get("task_description")
        return super().first_messages(f"{task}\n{observation}" if task else observation, info)


class AgentExecutor(GatewayAgentExecutor):
    agent_cls = SciWorldAgent
