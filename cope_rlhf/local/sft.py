"""``python -m cope_rlhf.local sft``: supervised warm start on expert demonstrations (loss on the agent's tokens).

    python -m cope_rlhf.local sft --demos demos.jsonl --model models/tiny --out models/tiny-sft [--epochs 4]

A demo is ``{"messages": [user: instruction, assistant: acknowledgement, user: first observation,
assistant: action_1, user: observation_1, ...]}`` (scripts/make_demos.py). Its tokens are laid out as a rollout lays
them out (agent_funcs/base.py): the chat template's text, cut at each agent reply, each piece tokenized on its own:

    [prompt ... "<assistant turn start>"] [reply_1 + EOS] [feedback_1 ... "<assistant turn start>"] [reply_2 + EOS] ...

and the loss is the mean next-token cross-entropy over the reply pieces only (replies after the first
observation; the acknowledgement belongs to the prompt). AdamW with a constant (default) or decaying learning rate
(``--schedule``), a fixed seed, padded batches sorted by length. ``--bf16``: the forward and backward under bfloat16
autocast (weights, gradients and optimizer stay float32): faster on a CPU with AMX / AVX512-BF16, but it ends at
a higher loss and so at another warm start. ``--gradient-checkpointing``: each decoder layer's activations are
recomputed in the backward pass instead of kept: the same weights, bit for bit, in far less memory (the activations
of SmolLM2-135M's 30 layers over 2 demos of 2048 tokens are several GB) for one more forward's time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from typing import List, Optional, Tuple

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

FIRST_REPLY = 3  # messages[3] is the agent's first action


def demo_tokens(tokenizer, messages: List[dict], max_len: int) -> Tuple[List[int], List[int]]:
    """(token ids, loss mask) of one demo, laid out as in the module docstring."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    eos = tokenizer.eos_token
    pieces, cursor = [], 0
    for i in range(FIRST_REPLY, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
        target = messages[i]["content"] + eos
        if full[start:start + len(target)] != target:
            raise ValueError("the chat template does not place a reply right after the generation prompt followed by "
                             f"{eos!r}; this warm start needs a ChatML-like template")
        pieces += [(full[cursor:start], 0), (target, 1)]
        cursor = start + len(target)
    pieces.append((full[cursor:], 0))
    ids, mask = [], []
    for text, train in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids += piece
        mask += [train] * len(piece)
    return ids[:max_len], mask[:max_len]


def read_demos(path: str, successful_only: bool = True) -> List[List[dict]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"demos file {path} does not exist: make it with scripts/make_demos.py")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "messages" not in row:
                raise ValueError(f"{path}:{n} has no 'messages' (expected scripts/make_demos.py's format)")
            if row.get("success", True) or not successful_only:
                out.append(row["messages"])
    if not out:
        raise ValueError(f"{path} holds no successful demos")
    return out


def batch_loss(model, batch: List[Tuple[List[int], List[int]]], pad_id: int) -> Tuple[torch.Tensor, int]:
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, (seq, m) in enumerate(batch):
        ids[b, :len(seq)], attn[b, :len(seq)], mask[b, :len(seq)] = torch.tensor(seq), 1, torch.tensor(m)
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits[:, :-1].float()
    target, keep = ids[:, 1:].to(device), mask[:, 1:].to(device).bool()
    nll = torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum")
    return nll, int(keep.sum())


def train(model_dir: str, demos_path: str, out: str, epochs: int, lr: float, batch_size: int, max_len: int,
          seed: int, schedule: str = "constant", bf16: bool = False, gradient_checkpointing: bool = False) -> dict:
    random.seed(seed)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = [demo_tokens(tokenizer, m, max_len) for m in read_demos(demos_path)]
    data = [d for d in data if sum(d[1])]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * math.ceil(len(data) / batch_size)
    scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=0, num_training_steps=steps)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    history = []
    for epoch in range(epochs):
        t, total, tokens = time.time(), 0.0, 0
        order = sorted(random.sample(range(len(data)), len(data)), key=lambda i: len(data[i][0]))
        batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        random.shuffle(batches)
        # an epoch of TextCraft's 1032 demos is minutes long on 2 cores: show it moving
        for chunk in tqdm(batches, desc=f"[sft] epoch {epoch + 1}/{epochs}", mininterval=10, leave=False):
            with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=bf16):
                nll, n = batch_loss(model, [data[i] for i in chunk], tokenizer.pad_token_id)
            (nll / n).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            total, tokens = total + float(nll.detach()), tokens + n
        history.append(total / tokens)
        print(f"[sft] epoch {epoch + 1}/{epochs}: loss {history[-1]:.4f} over {tokens} reply tokens "
              f"({time.time() - t:.0f} s)", flush=True)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"loss": history, "demos": len(data), "out": out}


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m cope_rlhf.local sft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demos", required=True, help="JSONL from scripts/make_demos.py")
    parser.add_argument("--model", required=True, help="HF checkpoint folder to start from")
    parser.add_argument("--out", help="where to save (default: <model>-sft)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--schedule", default="constant", choices=["constant", "cosine", "linear"],
                        help="learning-rate schedule over all steps (cosine/linear decay to 0)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (faster on CPUs with AMX/AVX512-BF16)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="keep each decoder layer's input only and recompute the rest in the backward pass: far "
                             "less memory for a deep model's long demos, for one more forward's time")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.lr <= 0:
        parser.error("--epochs and --batch-size must be >= 1 and --lr > 0")
    return train(args.model, args.demos, args.out or args.model.rstrip("/") + "-sft", args.epochs, args.lr,
                 args.batch_size, args.max_len, args.seed, args.schedule, args.bf16, args.gradient_checkpointing)
