"""WebArena agent func (the original AgentGym WebArena server behind the gateway's ``webarena`` adapter):
``--train.agent_func_path agent_funcs/webarena.py``.

Actions: WebArena's browser commands (``click [id]``, ``type [id] [text] [1]``, ``scroll [down]``, ``goto [url]``,
``go_back``, ``stop [answer]``, ...), after ``Action:``. Reward: WebArena's evaluator score, passed through. The
episode ends on ``terminated`` or ``truncated``. Turns: 15 (AgentGym-RL); ScalingInter-RL uses
HORIZON_SCHEDULE="8,12,15" with HORIZON_STAGE_STEPS=80.
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # OpenRLHF loads this file by path

from agent_funcs.base import REACT_FORMAT, GatewayAgent, GatewayAgentExecutor  # noqa: E402

INSTRUCTION = (
    "You are a web agent completing a task in a browser. Each observation gives the task, the current URL and "
    "the page's accessibility tree, where every element has an id in [brackets].\n"
    "Actions: click [id], type [id] [text] [1 to press Enter after typing, else 0], hover [id], press [key combo], "
    "scroll [down] or scroll [up], new_tab, tab_focus [tab index], close_tab, goto [url], go_back, go_forward, "
    "stop [answer] (when the task is done; put the answer in the brackets, or leave them empty).\n" + REACT_FORMAT
)


class WebArenaAgent(GatewayAgent):
    env = "webarena"
    instruction = INSTRUCTION
    default_max_turns = 15


class AgentExecutor(GatewayAgentExecutor):
    agent_cls = WebArenaAgent
