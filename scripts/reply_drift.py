"""Where in its replies a trained model moved away from another (its warm start): KL per part of the reply.

    python scripts/reply_drift.py --ref MODEL_DIR --new MODEL_DIR --episodes EPISODES.jsonl [--limit 60]

Teacher-forces both models on the same episodes (``scripts/eval.py``'s ``*.episodes.jsonl``: each line's
``messages``, rendered with the ref tokenizer's chat template) and, for every token of every assistant reply after
the first scripted one, takes

    KL_t = sum_v p_new(v | prefix) * (log p_new(v | prefix) - log p_ref(v | prefix))

at the position that predicts it. Each token is put in one part of a ReAct reply ("Thought: ... Action: <action>"),
by the reply text before it:

    thought       up to the end of the thought's first line (the "Thought:" header included)
    to-action     after that line, up to and including "Action:" and its newline
    action        the action line(s) after "Action:"
    end           the reply's end-of-turn token (the tokenizer's EOS, which the policy writes; template tokens
                  after it, such as ChatML's newline, are not the policy's and are left out)

and prints, per part, the token count and the mean and largest KL. RL that only reweighs which action to take moves
"action"; a collapse of the format shows as KL in "thought" / "to-action" / "end" (e.g. replies that no longer
stop after the action).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

PARTS = ("thought", "to-action", "action", "end")


def reply_part(before: str) -> str:
    """The part of a ReAct reply that the next token belongs to, given the reply text ``before`` it."""
    if "Action:\n" in before:
        return "action"
    thought = before.split("Thought:", 1)[1] if "Thought:" in before else ""
    if "\n" in thought.lstrip("\n"):
        return "to-action"
    return "thought"


def drift_by_part(ref, new, tokenizer, episodes: list[dict]) -> dict[str, list[float]]:
    """KL_t of every assistant token of ``episodes`` (see the module docstring), grouped by ``reply_part``."""
    import torch

    def encode(messages, **kwargs) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    parts: dict[str, list[float]] = defaultdict(list)
    with torch.no_grad():
        for episode in episodes:
            messages = episode["messages"]
            ids = encode(messages)
            x = torch.tensor([ids])
            log_ref = torch.log_softmax(ref(x).logits[0].float(), -1)
            log_new = torch.log_softmax(new(x).logits[0].float(), -1)
            kl = (log_new.exp() * (log_new - log_ref)).sum(-1)
            for i, message in enumerate(messages):
                if message["role"] != "assistant" or i < 2:  # message 1 is the scripted acknowledgement
                    continue
                start, end = len(encode(messages[:i], add_generation_prompt=True)), len(encode(messages[: i + 1]))
                stop = next((p for p in range(start, end) if ids[p] == tokenizer.eos_token_id), end - 1)
                for p in range(start, stop + 1):
                    part = "end" if p == stop else reply_part(tokenizer.decode(ids[start:p]))
                    parts[part].append(float(kl[p - 1]))
    return parts


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", required=True, help="the model to compare against (e.g. the warm start)")
    parser.add_argument("--new", required=True, help="the trained model")
    parser.add_argument("--episodes", required=True, help="a scripts/eval.py *.episodes.jsonl")
    parser.add_argument("--limit", type=int, default=60, help="episodes to read (default 60)")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(args.episodes) as f:
        episodes = [json.loads(line) for line in f if line.strip()][: args.limit]
    if not episodes:
        raise SystemExit(f"reply_drift: {args.episodes} has no episodes")
    tokenizer = AutoTokenizer.from_pretrained(args.ref)
    ref = AutoModelForCausalLM.from_pretrained(args.ref).eval()
    new = AutoModelForCausalLM.from_pretrained(args.new).eval()
    parts = drift_by_part(ref, new, tokenizer, episodes)
    table = {}
    print(f"{'part':<10} {'tokens':>7} {'mean KL':>8} {'max KL':>7}")
    for part in PARTS:
        values = parts.get(part, [])
        if values:
            table[part] = {"tokens": len(values), "mean": sum(values) / len(values), "max": max(values)}
            print(f"{part:<10} {len(values):>7} {table[part]['mean']:>8.3f} {table[part]['max']:>7.2f}")
    return table


if __name__ == "__main__":
    main()
