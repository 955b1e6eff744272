"""AppWorld agent func (AppWorld's own environment server behind the gateway's ``appworld`` adapter):
``--train.agent_func_path agent_funcs/appworld.py``.

Action: a block of Python code after ``Action:`` (optionally fenced in triple backticks), run by AppWorld's
``/execute`` with the ``apis`` object in scope; ``apis.supervisor.complete_task(answer=...)`` ends the task.
Reward: the adapter's (the fraction of the task's evaluation tests that pass, at the end), passed through;
success = every test passes. Turns: 40.
"""

import os
import re
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # OpenRLHF loads this file by path

from agent_funcs.base import GatewayAgent, GatewayAgentExecutor  # noqa: E402

INSTRUCTION = (
    "You are a coding agent that completes a task for your supervisor by calling the APIs of everyday apps "
    "(email, contacts, music, shopping, notes, ...) from Python. Each observation is the output of your last code "
    "block. Use apis.api_docs.show_app_descriptions(), apis.api_docs.show_api_descriptions(app_name=...) and "
    "apis.api_docs.show_api_doc(app_name=..., api_name=...) to discover the APIs; print() what you need to see. "
    "When the task is done, call apis.supervisor.complete_task() (with answer=... when the task asks a "
    "question).\nAnswer every turn in this format:\nThought:\n<what to do next>\n\nAction:\n```python\n<code>\n```\n"
)


FENCED_BLOCK = re.compile(r"```[^\n`]*\n.*?```", re.DOTALL)


def parse_code_action(reply: str) -> str | None:
    """The code after the last ``Action:``, without its ``` fences; None when there is none."""
    _, sep, tail = reply.rpartition("Action:")
    code = tail.strip()
    if code.startswith("```"):
        code = code.split("\n", 1)[1] if "\n" in code else ""
        code = code.split("```", 1)[0]
    code = code.strip("\n")
    return code if sep and code.strip() else None


class AppWorldAgent(GatewayAgent):
    env = "appworld"
    instruction = INSTRUCTION
    default_max_turns = 40

    invalid_phrases = ("execution failed", "invalid action")

    @classmethod
    def parse_action(cls, reply: str) -> str | None:
        return parse_code_action(reply)

    @classmethod
    def realized_action(cls, reply: str) -> str:
        """The last fenced code block of the reply, fences included (a multi-line action stays one item of a
        forecast list); without one, what ``parse_action`` reads, else the last non-empty line."""
        blocks = FENCED_BLOCK.findall(reply)
        return blocks[-1].strip() if blocks else super().realized_action(reply)

    def success(self, score: float, done: bool) -> bool:
        return done and score >= 1.0


class AgentExecutor(GatewayAgentExecutor):
    agent_cls = AppWorldAgent
