"""How replies and the chat template are read, in one place (agent funcs, the CoPE forecast).

ReAct replies (``Thought: ... Action: <action>``):

    parse_react_action(reply) = the first non-empty line after the last "Action:"; None when the reply has no
                                "Action:" or nothing after it (the agent funcs then answer "Invalid action" and send
                                nothing to the env)
    realized_action(reply, parse) = what ``parse`` reads, stripped; when it reads nothing: "" if the reply has an
                                "Action:" (an empty action), else the reply's last non-empty line ("" for an empty
                                reply). The action a reply took, as the CoPE forecast learns and predicts it.

The chat template's pieces (``chat_pieces``): the generation prompt (assistant header) as token ids and the text
around a user message and around an assistant message, found by rendering the template around a sentinel; the
forecast builds its samples from them. (The agent funcs' feedback text is rendered from the template directly, a
reply followed by the observation, as the conversation itself renders it.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

ACTION_MARKER = "Action:"
_SENTINEL = "\x00COPE\x00"


def parse_react_action(reply: str) -> Optional[str]:
    """The first non-empty line after the last ``Action:`` in a ReAct reply; None when there is none."""
    _, sep, tail = reply.rpartition(ACTION_MARKER)
    if not sep:
        return None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[0] if lines else None


def realized_action(reply: str, parse: Callable[[str], Optional[str]] = parse_react_action) -> str:
    """The action a reply took (module docstring)."""
    action = parse(reply)
    if action is not None:
        return action.strip()
    if ACTION_MARKER in reply:
        return ""
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@dataclass(frozen=True)
class ChatPieces:
    """Token ids of the chat template's pieces, found by rendering the template around a sentinel."""

    header: Tuple[int, ...]  # what add_generation_prompt appends (e.g. "<|im_start|>assistant\n")
    user_open: str
    user_close: str
    body_open: str
    body_close: str  # end-of-turn marker after assistant content (e.g. "<|im_end|>\n")


@functools.lru_cache(maxsize=8)
def chat_pieces(tokenizer) -> ChatPieces:
    def render(messages, generation=False):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    def delta(longer: str, shorter: str, what: str) -> str:
        if not longer.startswith(shorter):
            raise ValueError(f"the tokenizer's chat template does not render {what} as an appended suffix")
        return longer[len(shorter) :]

    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    user_text = delta(render(base + [{"role": "user", "content": _SENTINEL}]), render(base), "a user message")
    asked = base + [{"role": "user", "content": "z"}]
    header = delta(render(asked, True), render(asked), "the generation prompt")
    reply = delta(render(asked + [{"role": "assistant", "content": _SENTINEL}]), render(asked), "a reply")
    body = delta(reply, header, "an assistant message after the generation prompt")
    user_open, _, user_close = user_text.partition(_SENTINEL)
    body_open, _, body_close = body.partition(_SENTINEL)
    return ChatPieces(tuple(encode(tokenizer, header)), user_open, user_close, body_open, body_close)


def encode(tokenizer, text: str) -> List[int]:
    """``text``'s token ids, no special tokens added ([] for "")."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
