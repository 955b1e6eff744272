"""The CPU mode's training dtype: a PPO micro-step of OpenRLHF's ``Actor`` in bf16 against fp32 (run by hand).

What is timed is what a policy rank runs per micro-step on a host without CUDA: OpenRLHF's ``Actor`` (loaded with
``--ds.param_dtype``'s dtype through the CPU swaps of ``cope_rlhf.patch``, sdpa attention) computing the action
log-probs of a micro-batch, a policy-gradient loss on them, and its backward. The model has the quickstart's shape
(Qwen2, hidden 128, 2 layers, the BabyAI tokenizer's 1068 tokens) with random weights; the micro-batch is the
quickstart's (``--batch`` 8 sequences of ``--length`` 720 tokens, the last ``--actions`` 200 of them actions).
``--shape smollm2`` times SmolLM2-135M-Instruct's architecture instead (``benchmarks/signal_cost.py``'s
``smollm2_model``: 30 layers, hidden 576, vocabulary 49152, random weights): whether a pretrained model's study should
train in bf16 on a host whose CPU multiplies bf16 natively.

Each dtype runs once to warm up, then ``--repeats`` times, interleaved; printed: the median seconds per micro-step
[min-max] of each, and bf16 / fp32 as the median of the per-repeat ratios [min-max]. The CPU's bfloat16 support
(``avx512_bf16`` / ``amx_bf16`` in /proc/cpuinfo, torch's CPU capability) is printed first: where neither flag is
present torch multiplies bf16 matrices in a scalar fallback, which is why the CPU preset trains in fp32.

    .venv/bin/python benchmarks/cpu_param_dtype.py [--repeats 5] [--batch 8] [--length 720] [--actions 200]
        [--shape small|smollm2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from cope_rlhf.quiet import hide_benign_notices  # noqa: E402

hide_benign_notices()  # before torch prints pynvml's deprecation (cope_rlhf/quiet.py)
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import cope_rlhf.patch  # noqa: E402


def cpu_bf16_flags() -> str:
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return "unknown (/proc/cpuinfo unreadable)"
    found = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return ", ".join(found) if found else "none (no avx512_bf16, no amx_bf16)"


def micro_step(actor, sequences: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor) -> float:
    """Seconds for one forward (action log-probs) + policy-gradient loss + backward."""
    start = time.perf_counter()
    log_probs = actor(sequences, action_mask, attention_mask)
    loss = -(log_probs.float() * action_mask).sum() / action_mask.sum()
    loss.backward()
    elapsed = time.perf_counter() - start
    actor.zero_grad(set_to_none=True)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=720)
    parser.add_argument("--actions", type=int, default=200)
    parser.add_argument("--shape", choices=["small", "smollm2"], default="small",
                        help="small: the quickstart's Qwen2; smollm2: SmolLM2-135M-Instruct's architecture")
    args = parser.parse_args()
    if torch.cuda.is_available():
        sys.exit("this benchmark is for hosts without CUDA (the CPU mode's dtype)")
    cope_rlhf.patch.install()  # the CPU swaps, as in every rank: --ds.param_dtype fp32 loads in float32
    from openrlhf.models import Actor
    from transformers import Qwen2Config, Qwen2ForCausalLM

    print(f"CPU bfloat16 support: {cpu_bf16_flags()}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}; "
          f"{torch.get_num_threads()} torch threads")
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        if args.shape == "smollm2":
            from benchmarks.signal_cost import smollm2_model

            model = smollm2_model()
        else:
            model = Qwen2ForCausalLM(Qwen2Config(
                vocab_size=1068, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True))
        config = model.config
        print(f"model: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
              f"{config.num_hidden_layers} layers, vocabulary {config.vocab_size}")
        model.save_pretrained(folder)
        del model
        actors = {dtype: Actor(folder, attn_implementation="sdpa", param_dtype=dtype) for dtype in ("bf16", "fp32")}
    for actor in actors.values():
        actor.train()
    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(3, config.vocab_size, (args.batch, args.length), generator=generator)
    attention_mask = torch.ones_like(sequences)
    action_mask = torch.zeros(args.batch, args.length - 1)
    action_mask[:, -args.actions:] = 1

    for actor in actors.values():  # warm-up
        micro_step(actor, sequences, attention_mask, action_mask)
    times = {dtype: [] for dtype in actors}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for dtype, actor in actors.items():
            times[dtype].append(micro_step(actor, sequences, attention_mask, action_mask))
    for dtype, values in times.items():
        print(f"{dtype}: {statistics.median(values):.3f} s per micro-step [{min(values):.3f}-{max(values):.3f}]")
    ratios = [b / f for b, f in zip(times["bf16"], times["fp32"])]
    print(f"bf16 / fp32: {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] over {args.repeats} "
          f"paired repeats")


if __name__ == "__main__":
    main()
