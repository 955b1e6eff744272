"""WebShop agent func (the original WebShop server behind the gateway's ``webshop`` adapter):
``--train.agent_func_path agent_funcs/webshop.py``.

Actions: ``search[<query>]`` or ``click[<button or product>]``, after ``Action:``. Reward, binarised as CoPE ran
it: ``1`` only when the episode is done with WebShop's reward at 1 (every attribute, option and price matched),
else ``0``. Turns: 15.
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # OpenRLHF loads this file by path

from agent_funcs.base import REACT_FORMAT, GatewayAgent, GatewayAgentExecutor  # noqa: E402

INSTRUCTION = (
    "You are shopping on a web store for the product the instruction in the first observation describes. Each "
    "observation is the current web page; clickable elements are shown in [brackets].\n"
    "Actions: search[<keywords>] (only where the page has a search box), click[<element>] with the element's text "
    "exactly as shown, e.g. click[Buy Now], click[< Prev], or a product id or option.\n" + REACT_FORMAT
)


def binarised_webshop_score(reward: float, done: bool) -> float:
    """1 only when the purchase ends the episode with WebShop's full reward of 1."""
    return 1.0 if done and reward >= 1.0 else 0.0


class WebShopAgent(GatewayAgent):
    env = "webshop"
    instruction = INSTRUCTION
    default_max_turns = 15

    def score(self, env_total: float, last_reward: float, done: bool) -> float:
        return binarised_webshop_score(last_reward, done)


class AgentExecutor(GatewayAgentExecutor):
    agent_cls = WebShopAgent
