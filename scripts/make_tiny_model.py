"""Build a small chat model offline: a BPE tokenizer trained on environment text, and a random ``Qwen2ForCausalLM``.

    python scripts/make_tiny_model.py --out models/tiny [--corpus demos.jsonl ...] [--seed 0] [--vocab-size 2048]
                                      [--hidden-size 128] [--layers 4] [--heads 2] [--max-positions 4096]

Tokenizer: byte-level BPE (``tokenizers``) trained on every agent instruction (``agent_funcs.instructions``), the
ReAct/forecast prompt words, and the ``--corpus`` files (JSONL demos: the ``content`` of every ``messages`` entry;
any other file: its lines). Special tokens ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>`` (end of
turn = EOS) and a ChatML chat template. Model: ``Qwen2ForCausalLM`` with head_dim = hidden_size / heads = 64 (vLLM's
CPU attention rejects smaller heads), tied embeddings, weights drawn from ``torch.manual_seed(seed)``.
Same inputs and seed -> byte-identical tokenizer and weights. Saved with ``save_pretrained``: a normal HF
checkpoint folder that vLLM and OpenRLHF load like any other.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def trainer_text() -> list[str]:
    """Words the trainer itself writes into prompts (cope_rlhf.forecast's prompts, agent_funcs' invalid-action note)."""
    from agent_funcs.base import INVALID_ACTION
    from cope_rlhf.forecast import NEXT_ACTION, PLAN_AHEAD, PLAN_AHEAD_TURNS

    return [PLAN_AHEAD.format(k=3), PLAN_AHEAD_TURNS.format(k=3), NEXT_ACTION, "Thought:\n", "\n\nAction:\n",
            INVALID_ACTION]


def corpus_texts(paths: list[str]) -> list[str]:
    from agent_funcs.instructions import ACKNOWLEDGEMENT, INSTRUCTIONS

    texts = [INSTRUCTIONS[name] for name in sorted(INSTRUCTIONS)] + [ACKNOWLEDGEMENT] + trainer_text()
    for path in paths:
        if not os.path.isfile(path):
            raise SystemExit(f"make_tiny_model: corpus file {path} does not exist")
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if path.endswith(".jsonl"):
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise SystemExit(f"make_tiny_model: {path}:{n} is not JSON ({e})") from None
                    texts += [m["content"] for m in row.get("messages", []) if isinstance(m.get("content"), str)]
                else:
                    texts.append(line.rstrip("\n"))
    return texts


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 bos_token=None, model_max_length=1 << 20)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_model(tokenizer, seed: int, hidden_size: int, layers: int, heads: int, max_positions: int):
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden_size % heads or hidden_size // heads != 64:
        raise SystemExit(f"make_tiny_model: hidden_size/heads must be 64 (vLLM's CPU attention needs head_dim 64), "
                         f"got {hidden_size}/{heads}")
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True, eos_token_id=eos, pad_token_id=pad,
        bos_token_id=None, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    return model


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder (an HF checkpoint)")
    parser.add_argument("--corpus", nargs="*", default=[], help="demos JSONL or text files to train the BPE on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--max-positions", type=int, default=4096)
    args = parser.parse_args(argv)

    tokenizer = build_tokenizer(corpus_texts(args.corpus), args.vocab_size)
    model = build_model(tokenizer, args.seed, args.hidden_size, args.layers, args.heads, args.max_positions)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"make_tiny_model: {n / 1e6:.2f}M parameters, vocabulary {len(tokenizer)} -> {args.out}")
    return args.out


if __name__ == "__main__":
    main()
