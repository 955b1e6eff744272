"""Cost of the CoPE signals per step against a stock GRPO step, timed on the code the trainer runs (by hand).

For trajectories of 5, 10, 20 and 40 turns (a batch of ``--batch`` of them, a small random Qwen2 on CPU, sdpa
attention) it measures wall time, process CPU time (all threads; other load on the machine does not skew it) and
peak memory (resident set growth over the phase, sampled every 2 ms) of:

  (a) grpo     a stock GRPO step: forward + backward of the trajectory batch (token-mean policy-gradient loss)
  (b) signals  the CoPE signals as the trainer computes them with the forecast in ``separate`` mode: information
               gain of every turn and the TE members in one call of the policy actor's ``cope_frozen_signals``
               (``CoPEActorMethods``: one packed row per trajectory serves both), then the forecast step,
               ``forecast.forecast_loss`` and backward, one trajectory's samples per micro-batch (K=3) under
               ``branches.block_attention``, as the actor's ``_forecast_share`` runs it
  (c) joint    (a)'s step with the forecast in ``joint`` mode: the same forward + backward run inside the actor's
               ``CoPEActorPPOTrainer._forecast_in_forward`` (each trajectory's forecast samples as branches after it
               in the one forward, the forecast loss added to the GRPO loss), as ``_cope_training_step`` runs it

b/a is what the signals add to a GRPO step in separate mode; "jnt/a" the same in joint mode: (the frozen signals'
part of (b) + (c) - (a)) / (a), paired by repeat. A step with every signal on costs 1 + that many GRPO steps.

Each cell is run once to warm up, then ``--repeats`` times (default 3), (a), (b) and (c) interleaved; the table
shows medians with [min-max], and the ratios as the medians of the per-repeat ratios with [min-max].

Cross-check (not timed): the packed path's values under the attention the trainer uses for it (``block_attention``:
``cope_branch_sdpa`` on a CPU, flex attention on a GPU) against the same code under a dense boolean block mask
with the model's own sdpa, for the information gain and the forecast loss (max |d| columns). That the packed layout
equals the per-turn / per-sample computation is what tests/test_branches.py proves (1e-5).

``--device cuda`` puts the model on the GPU: wall time is read after ``torch.cuda.synchronize``, and the memory
columns are the growth of the peak GPU allocation over the phase instead of the resident set. ``--json PATH`` also
writes the medians, the ratios and the attention the packed path used.

``--shape smollm2`` measures at SmolLM2-135M-Instruct's shape instead (``LlamaForCausalLM``: 30 layers, hidden 576,
9 heads / 3 KV heads, MLP 1536, vocabulary 49152, tied embeddings; random weights from that config, since what is
timed does not depend on their values; ``--layers`` / ``--hidden`` / ``--vocab`` given explicitly still override).
(a) and (b) need only torch, transformers and this checkout (scripts/gpu_smoke.sh's stage 1 runs them on a host
without OpenRLHF); (c) runs the OpenRLHF actor's own code and is left out (``--no-joint``, or where OpenRLHF does not
import: the table says so).

    .venv/bin/python benchmarks/signal_cost.py [--turns 5 10 20 40] [--batch 2] [--hidden 256] [--layers 4] [--vocab V]
                                               [--shape small|smollm2] [--no-joint]
                                               [--device cpu|cuda] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repository's packages, and scripts/ as scripts.<name>
from cope_rlhf.quiet import hide_benign_notices  # noqa: E402

hide_benign_notices()  # before torch prints pynvml's deprecation (cope_rlhf/quiet.py)
import torch  # noqa: E402

import cope_rlhf.compat  # noqa: E402,F401  (OpenRLHF importable on CPU)
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

# Only torch, transformers and this checkout below: (a) and (b) run where OpenRLHF is not installed (the joint cell
# imports the OpenRLHF actor when it runs).
from cope_rlhf.actor_forwards import CoPEActorMethods  # noqa: E402
from cope_rlhf.branches import block_attention, dense_mask  # noqa: E402
from cope_rlhf.config import CoPEConfig  # noqa: E402
from cope_rlhf.forecast import build_forecast_samples, forecast_loss  # noqa: E402
from cope_rlhf.frozen_signals import frozen_signals  # noqa: E402
from cope_rlhf.info_gain import position_ids_for  # noqa: E402
from cope_rlhf.turns import unpadded_trajectories  # noqa: E402
from scripts.make_tiny_model import build_tokenizer  # noqa: E402

# SmolLM2-135M-Instruct (scripts/get_smollm2.py checks the real checkpoint has exactly this).
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
               rope_theta=100000.0, rms_norm_eps=1e-5)

WORDS = ("you see a red ball blue key door table room cabinet drawer open closed nothing happens inventory "
         "craft stick oak planks bone move forward turn left right go to pick up toggle through").split()
ACTIONS = ["look around", "pick up key", "open door", "go to red ball 1", "toggle and go through door", "inventory",
           "move forward", "turn left", "craft 4 stick using 2 oak planks"]


@dataclass
class Batch:
    """The fields of an OpenRLHF ``Experience`` the measured code reads, right-padded as ``concat_experiences`` pads."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    index: list = field(default_factory=list)

    def to(self, device: torch.device) -> "Batch":
        return Batch(self.sequences.to(device), self.attention_mask.to(device), self.action_mask.to(device),
                     self.index)


def as_experience(tokens: list[int], ranges: list[tuple[int, int]]) -> Batch:
    """One conversation as OpenRLHF's ``SamplesGenerator._process_response_into_experience`` turns it into an
    Experience (no truncation): every token attended, the action mask over ``sequences[1:]``
    (tests/test_signal_cost.py checks it against OpenRLHF's own)."""
    action = torch.zeros(len(tokens), dtype=torch.long)
    for start, end in ranges:
        action[start:end] = 1
    return Batch(torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.long), action[None, 1:])


def concat(rows: list[Batch], pad_token_id: int) -> Batch:
    """``Experience.concat_experiences``: right padding, ``pad_token_id`` in the sequences, 0 in the masks."""
    width = max(r.sequences.shape[1] for r in rows)
    pad = lambda t, value, w: torch.nn.functional.pad(t, (0, w - t.shape[1]), value=value)  # noqa: E731
    return Batch(torch.cat([pad(r.sequences, pad_token_id, width) for r in rows]),
                 torch.cat([pad(r.attention_mask, 0, width) for r in rows]),
                 torch.cat([pad(r.action_mask, 0, width - 1) for r in rows]), list(range(len(rows))))


def trainer_words() -> list[str]:
    """``scripts.make_tiny_model.trainer_text()`` (the prompt text the trainer writes), read without importing
    ``agent_funcs`` where OpenRLHF, which it imports, is not installed: its invalid-action note from the source."""
    try:
        from scripts.make_tiny_model import trainer_text

        return trainer_text()
    except ImportError:
        import ast

        from cope_rlhf.forecast import NEXT_ACTION, PLAN_AHEAD, PLAN_AHEAD_TURNS

        with open(os.path.join(ROOT, "agent_funcs", "base.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        invalid = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                       and getattr(node.targets[0], "id", None) == "INVALID_ACTION")
        return [PLAN_AHEAD.format(k=3), PLAN_AHEAD_TURNS.format(k=3), NEXT_ACTION, "Thought:\n", "\n\nAction:\n",
                invalid]


def benchmark_tokenizer():
    """A byte-level BPE of the words the trajectories are drawn from and the trainer's prompt text; 430 entries give ~87
    tokens per observation and ~49 per reply, the sizes of the results in docs/results/signal_cost_cpu.md."""
    return build_tokenizer(trainer_words() + list(WORDS) + ACTIONS, vocab_size=430)


def trajectory(tok, turns: int, seed: int) -> Batch:
    """Observations of ~40 words, actions with a ~15-word thought: ~150 tokens per turn with ``main``'s tokenizer.
    Built as OpenRLHF's MultiTurnAgentExecutor returns a conversation (the prompt through the chat template, each
    reply's tokens and <|im_end|>, the feedback rendered as a user turn and the next assistant header) and turned into
    an Experience's tensors as OpenRLHF's conversion does (``as_experience``)."""
    rng = random.Random(seed)
    sentence = lambda n: " ".join(rng.choice(WORDS) for _ in range(n)) + "."  # noqa: E731
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    user_turn = lambda text: tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,  # noqa: E731
                                                     add_generation_prompt=True)
    tokens, ranges = ids(user_turn(sentence(40))), []
    for _ in range(turns):
        start = len(tokens)
        tokens += ids(f"Thought:\n{sentence(15)}\n\nAction:\n{rng.choice(ACTIONS)}") + [tok.eos_token_id]
        ranges.append((start, len(tokens)))
        tokens += ids("\n" + user_turn(sentence(40)))
    return as_experience(tokens, ranges)


def small_model(vocab: int, hidden: int, layers: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
                         max_position_embeddings=1 << 15, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def smollm2_model(vocab: int | None = None, hidden: int | None = None, layers: int | None = None) -> LlamaForCausalLM:
    """SmolLM2-135M-Instruct's architecture with random weights (float32, sdpa); ``vocab`` / ``hidden`` / ``layers``
    override its own (a smaller stand-in of the same family for a quick run: heads of 64, 3 query heads per KV head)."""
    shape = dict(SMOLLM2)
    if hidden:
        heads = max(hidden // 64, 1)
        shape.update(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_attention_heads=heads,
                     num_key_value_heads=max(heads // 3, 1), head_dim=hidden // heads)
    shape.update({k: v for k, v in (("vocab_size", vocab), ("num_hidden_layers", layers)) if v})
    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


class PeakRSS:
    """Resident-set growth over a phase; freed heap is handed back to the OS first so phases do not mask each other."""

    def __enter__(self):
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.base = self.peak = self._rss()
        self.running = True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self._rss())
        self.mib = (self.peak - self.base) / 2**20


def measure(fn, device: torch.device = torch.device("cpu")):
    """(wall s, process CPU s, memory MiB, fn's value). On a GPU the kernels run asynchronously: the clock stops
    after a synchronize, and memory is the peak allocation above what was allocated before the phase."""
    if device.type != "cuda":
        with PeakRSS() as memory:
            wall, cpu = time.perf_counter(), time.process_time()
            value = fn()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return wall, cpu, memory.mib, value
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, (torch.cuda.max_memory_allocated(device) - base) / 2**20, value


def grpo_step(model, batch: Batch, forecast: dict = None):
    """A GRPO step's forward + backward; with ``forecast`` (``_forecast_in_forward``'s dict, the forward then runs
    inside it) the forecast loss joins the GRPO loss (one micro-step: its share is its mean)."""
    model.zero_grad(set_to_none=True)
    mask = batch.attention_mask
    logits = model(input_ids=batch.sequences, attention_mask=mask, position_ids=position_ids_for(mask)).logits
    log_probs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.sequences[:, 1:, None]).squeeze(-1)
    action = batch.action_mask.float()
    advantages = torch.randn(len(mask), 1, device=mask.device)
    loss = -(log_probs * advantages * action).sum() / action.sum()
    if forecast is not None:
        loss = loss + forecast.pop("nll")
    loss.backward()
    return float(loss.detach())


def joint_trainer(model):
    """The policy actor's trainer around the benchmark model, joint forecast on (built once, outside the clock)."""
    from openrlhf.models import Actor
    from openrlhf.utils.config import hierarchize

    from cope_rlhf.actor import CoPEActorPPOTrainer
    from cope_rlhf.cli.args import build_parser

    trainer = object.__new__(CoPEActorPPOTrainer)
    trainer.actor = Actor(model)
    trainer.actor.packing_samples = False
    trainer.args = hierarchize(build_parser().parse_args(["--cope.action_forecast_enable", "--cope.action_forecast_mode",
                                                          "joint"]))
    trainer.strategy = SimpleNamespace(args=trainer.args)
    return trainer


def joint_step(trainer, tok, batch: Batch) -> float:
    """(c): (a) with the forecast riding in its forward, through the policy actor's own ``_forecast_in_forward``
    (the forecast samples built first, as the actor builds them when the experience arrives)."""
    model = trainer.actor.model
    rows = unpadded_trajectories([batch])
    per_row = [build_forecast_samples(*rows[p], tok, k=3, row=p) for p in batch.index]
    with trainer._forecast_in_forward(per_row) as found:
        return grpo_step(model, batch, found)


def forecast_step(run, samples, block_mask, device=None) -> float:
    """L_AF with backward in micro-batches of one trajectory's samples (gradient accumulation, as the actor cuts
    them), each weighted by its share of the target tokens, so the sum is L_AF of all samples."""
    parts = [[s for s in samples if s.row == r] for r in sorted({s.row for s in samples})]
    targets = lambda part: sum(sum(s.loss_mask[1:]) for s in part)  # noqa: E731
    total, value = targets(samples), 0.0
    for part in parts:
        loss = forecast_loss(run, part, coef=0.01, block_mask=block_mask, device=device) * (targets(part) / total)
        loss.backward()
        value += float(loss.detach())
    return value


class ActorShell(torch.nn.Module):
    """What ``CoPEActorMethods`` reads of OpenRLHF's ``Actor``: the HF model as ``.model``, train / eval, and the
    rollout temperature (1)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.temperature = model, 1.0


def actor_methods(model, turns: int) -> CoPEActorMethods:
    """The policy actor's own signal code (``CoPEActorMethods``) around the benchmark model, every turn scored, one
    rank, no ring attention (the trainer's own arguments for these fields)."""
    holder = object.__new__(CoPEActorMethods)
    holder.actor = ActorShell(model)
    holder.strategy = SimpleNamespace(args=SimpleNamespace(
        ds=SimpleNamespace(ring_attn_size=1), cope=CoPEConfig(info_probe_tokens=16, info_max_turns=turns)))
    return holder


def logits_of(model):
    return lambda ids, mask, pos, keep: model(input_ids=ids, attention_mask=mask, position_ids=pos,  # noqa: E731
                                              logits_to_keep=0 if keep is None else keep).logits


def signals(model, tok, batch: Batch, turns: int, cpu: dict) -> None:
    """The three signals as the trainer computes them (module docstring, (b)); CPU seconds per part into ``cpu``
    (and the frozen signals' wall seconds, ``frozen_wall``)."""
    model.zero_grad(set_to_none=True)
    rows = unpadded_trajectories([batch])
    per_row = [build_forecast_samples(*rows[p], tok, k=3, row=p) for p in batch.index]
    clock, wall = time.process_time(), time.perf_counter()
    actor_methods(model, turns).cope_frozen_signals(batch.sequences, batch.attention_mask, batch.action_mask, per_row,
                                                    [rows[p] for p in batch.index])
    cpu["frozen_wall"] = time.perf_counter() - wall
    cpu["frozen"], clock = time.process_time() - clock, time.process_time()
    with block_attention(model) as build:
        forecast_step(logits_of(model), [s for row in per_row for s in row], build, next(model.parameters()).device)
    cpu["forecast"] = time.process_time() - clock


def cross_check(model, tok, batch: Batch, turns: int) -> tuple[float, float]:
    """(max |d| of the information gain, |d| of the forecast loss) between the packed path under ``block_attention``
    and under a dense boolean mask with the model's own sdpa."""
    rows = unpadded_trajectories([batch])
    samples = [s for p in batch.index for s in build_forecast_samples(*rows[p], tok, k=3, row=p)]
    config = CoPEConfig(info_probe_tokens=16, info_max_turns=turns)
    device = next(model.parameters()).device
    values = []
    with torch.no_grad():
        for attention in (block_attention(model), contextlib.nullcontext(dense_mask)):
            with attention as build:
                (gain, _, _), _ = frozen_signals(logits_of(model), batch.sequences, batch.attention_mask,
                                                 batch.action_mask, config, True, block_mask=build, device=device)
                values.append((gain, float(forecast_loss(logits_of(model), samples, 0.01, build, device))))
    (gain, loss), (dense_gain, dense_loss) = values
    return float((gain - dense_gain).abs().max()), abs(loss - dense_loss)


def spread(values: list) -> str:
    return f"[{min(values):.2f}-{max(values):.2f}]"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, nargs="+", default=[5, 10, 20, 40])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--shape", choices=["small", "smollm2"], default="small",
                        help="small: a Qwen2 of --hidden / --layers; smollm2: SmolLM2-135M-Instruct's architecture")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (small: default 256; smollm2: 576)")
    parser.add_argument("--layers", type=int, default=None, help="layers (small: default 4; smollm2: 30)")
    parser.add_argument("--vocab", type=int, default=0, help="LM-head width (default: the tokenizer's, smollm2: "
                        "49152); a real model's 150k makes the logits dominate memory")
    parser.add_argument("--no-joint", action="store_true", help="leave out (c), the joint forecast (it needs OpenRLHF)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the model runs (cuda: the packed path uses flex attention, memory = GPU peak)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per (turns, path) after a warm-up, "
                        "interleaved; the table shows their medians with [min-max]")
    parser.add_argument("--json", help="also write the medians, ratios and differences to this file")
    return parser


def median_or_nan(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: PyTorch sees no GPU here")
    from tqdm import tqdm

    device = torch.device(args.device)
    tok = benchmark_tokenizer()
    if args.shape == "smollm2":
        model = smollm2_model(args.vocab or None, args.hidden, args.layers).to(device)
    else:
        model = small_model(max(args.vocab, len(tok)), args.hidden or 256, args.layers or 4).to(device)
    config = model.config
    vocab, hidden, layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    if len(tok) > vocab:
        parser.error(f"--vocab {vocab} is smaller than the benchmark tokenizer's {len(tok)} entries")
    joint = not args.no_joint and importlib.util.find_spec("openrlhf") is not None
    with block_attention(model):  # what the packed path will run on this device (flex attention on a GPU)
        packed_attention = model.config._attn_implementation
    batches = {n: concat([trajectory(tok, n, seed=n * 100 + i) for i in range(args.batch)], tok.pad_token_id)
               for n in args.turns}
    # The signals take the batch where the experience maker hands it over (host memory; the actor's code moves
    # what it runs); the GRPO step reads it where the model is, as the trainer's update does.
    on_device = {n: b.to(device) for n, b in batches.items()}
    trainer = joint_trainer(model) if joint else None
    cells = ("grpo", "signals", "joint") if joint else ("grpo", "signals")
    for n in args.turns:  # warm-up: every cell once (allocator, kernels; on a GPU the first call of a shape compiles)
        grpo_step(model, on_device[n])
        signals(model, tok, batches[n], n, {})
        if joint:
            joint_step(trainer, tok, on_device[n])
    jobs = [(n, name) for _ in range(args.repeats) for n in args.turns for name in cells]
    runs, part_runs = {}, {}
    for n, name in tqdm(jobs, desc="signal cost", unit="run"):
        if name == "grpo":
            b = on_device[n]
            runs.setdefault((n, name), []).append(measure(lambda: grpo_step(model, b), device))
        elif name == "joint":
            b = on_device[n]
            runs.setdefault((n, name), []).append(measure(lambda: joint_step(trainer, tok, b), device))
        else:
            b, part_times = batches[n], {}
            runs.setdefault((n, name), []).append(measure(lambda: signals(model, tok, b, n, part_times), device))
            part_runs.setdefault(n, []).append(part_times)
    checks = {n: cross_check(model, tok, batches[n], n) for n in args.turns}
    median = lambda key, i: median_or_nan([m[i] for m in runs.get(key, [])])  # noqa: E731
    where = f"on {torch.cuda.get_device_name(device)}, " if device.type == "cuda" else ""
    described = (f"{type(model).__name__} ({args.shape}) hidden {hidden}, {layers} layers, "
                 f"{config.num_attention_heads}/{config.num_key_value_heads} heads, vocab {vocab}, "
                 f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    print(f"\nmodel: {described}, float32, sdpa, {where}"
          f"torch threads {torch.get_num_threads()}; batch {args.batch} trajectories; P=16, K=3, every turn scored; "
          f"packed path: {packed_attention}; medians of {args.repeats} [min-max]"
          + ("; MiB = GPU peak" if device.type == "cuda" else "")
          + ("" if joint else "; (c) joint: not run (" + ("--no-joint" if args.no_joint else "OpenRLHF not installed")
                                + ")"))
    head = (f"{'turns':>5} {'tokens':>6} | {'(a) grpo s':>10} {'[min-max]':>11} {'cpu':>6} {'MiB':>6} | "
            f"{'(b) signals s':>13} {'[min-max]':>11} {'cpu':>6} {'MiB':>6} | {'b/a wall':>8} {'[min-max]':>11} "
            f"{'cpu':>5} {'mem':>5} | {'(c) joint s':>11} {'c/a wall':>8} {'mem':>5} | {'jnt/a':>7} "
            f"{'[min-max]':>11} | {'max |dIG|':>9} {'dL_AF':>8}")
    print(head)
    print("-" * len(head))
    report = {"device": str(device), "packed_attention": packed_attention, "repeats": args.repeats,
              "shape": args.shape, "model": described, "batch": args.batch, "joint": joint, "rows": []}
    for n in args.turns:
        a, b, c = runs[n, "grpo"], runs[n, "signals"], runs.get((n, "joint"), [])
        # paired by repeat: each (b) and (c) ran right after its (a), so slow phases of the machine hit all three
        wall = [y[0] / x[0] for x, y in zip(a, b)]
        cpu = [y[1] / x[1] for x, y in zip(a, b)]
        mem = [y[2] / x[2] if x[2] > 0 else float("nan") for x, y in zip(a, b)]
        joint_wall = [z[0] / x[0] for x, z in zip(a, c)]
        joint_mem = [z[2] / x[2] if x[2] > 0 else float("nan") for x, z in zip(a, c)]
        # what every signal adds in joint mode: the frozen signals' part of (b), and (c) over (a)
        whole = [(p["frozen_wall"] + z[0] - x[0]) / x[0] for x, z, p in zip(a, c, part_runs[n])]
        d_info, d_loss = checks[n]
        tokens = int(batches[n].attention_mask.sum(-1).max())
        print(f"{n:>5} {tokens:>6} | {median((n, 'grpo'), 0):>10.2f} {spread([x[0] for x in a]):>11} "
              f"{median((n, 'grpo'), 1):>6.1f} {median((n, 'grpo'), 2):>6.0f} | "
              f"{median((n, 'signals'), 0):>13.2f} {spread([y[0] for y in b]):>11} {median((n, 'signals'), 1):>6.1f} "
              f"{median((n, 'signals'), 2):>6.0f} | {statistics.median(wall):>8.2f} {spread(wall):>11} "
              f"{statistics.median(cpu):>5.2f} {statistics.median(mem):>5.2f} | {median((n, 'joint'), 0):>11.2f} "
              f"{median_or_nan(joint_wall):>8.2f} {median_or_nan(joint_mem):>5.2f} | "
              f"{median_or_nan(whole):>7.2f} {spread(whole) if whole else '-':>11} | {d_info:>9.1e} {d_loss:>8.1e}")
        report["rows"].append({
            "turns": n, "tokens": tokens, **{f"{k}_{f}": median((n, k), i) for k in cells
                                             for i, f in enumerate(("wall_s", "cpu_s", "mib"))},
            "signals_over_grpo_wall": statistics.median(wall), "signals_over_grpo_wall_min": min(wall),
            "signals_over_grpo_wall_max": max(wall), "signals_over_grpo_mem": statistics.median(mem),
            **({"joint_over_grpo_wall": statistics.median(joint_wall),
                "joint_over_grpo_mem": statistics.median(joint_mem),
                "signals_joint_over_grpo_wall": statistics.median(whole)} if joint else {}),
            "max_abs_d_info_gain": d_info, "abs_d_forecast_loss": d_loss})
    print("\nCPU seconds per part of (b), as a fraction of (a)'s CPU time (medians): info gain + TE members (one call) "
          "/ forecast step")
    for n in args.turns:
        a = median((n, "grpo"), 1)
        fractions = [statistics.median(p[k] for p in part_runs[n]) / a for k in ("frozen", "forecast")]
        print(f"{n:>5} turns   {fractions[0]:.2f} / {fractions[1]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
