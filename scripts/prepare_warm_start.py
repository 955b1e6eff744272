"""Everything an RL run on one machine starts from: training and held-out item ids, expert demos, a small model
built here (or a pretrained one), and its supervised warm start.

    python scripts/prepare_warm_start.py --env babyai --out DIR [--levels 1] [--heldout 200] [--demos 300]
                                         [--epochs 16] [--sft-lr 2e-3] [--sft-schedule cosine] [--seed 0]
                                         [--sft-bf16] [--sft-gradient-checkpointing] [--hidden-size 128] [--layers 2]
                                         [--texts-per-goal 1] [--base-model CHECKPOINT]

Starts the env's real server (``.venvs/<env>``), asks it for the train split's item ids (``GET /items``), keeps
BabyAI's ``--levels`` only (level = item id mod 40 + 1), and writes

    DIR/data/heldout.jsonl   ``--heldout`` of those ids, drawn by a fixed shuffle (``split_ids``): the held-out set
    DIR/data/train.jsonl     the others, in shuffled order: RL's prompts (TextCraft with ``--texts-per-goal K``:
                             each training goal's K texts, ids goal + 544 k, round by round: ``with_texts``)
    DIR/data/demos.jsonl     expert episodes (scripts/make_demos.py's ``episode``) of the first ``--demos`` training ids
                             (``--demo-policy view`` / ``view-random`` / ``view-hesitant``: make_demos.view_only_action
                             acts instead of the server's expert)
    DIR/model                scripts/make_tiny_model.py (tokenizer trained on the demos, ``--seed``; ``--hidden-size``
                             and ``--layers``, one attention head per 64 of width); not with ``--base-model``
    DIR/model-sft            ``python -m cope_rlhf.local sft`` on the demos' successful episodes, from DIR/model or
                             from ``--base-model`` (a Hugging Face checkpoint with a ChatML-like chat template, e.g.
                             SmolLM2-135M-Instruct from scripts/get_smollm2.py; a pretrained model wants a far lower
                             ``--sft-lr`` and fewer ``--epochs`` than the defaults, which suit a model built here)

Why held-out ids come from the train split: the benchmarks' own test + dev splits are small (BabyAI: 20 seeds per
level; one item moves a 20-item rate by 0.05, a 95% interval is about ±0.22). Held-out ids never meet training:
not as prompts, not as demos. Item ids are the env's seeds, so distinct ids are distinct episodes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file, this module sees only scripts/: its siblings are imported as scripts.<name>

from scripts import make_demos  # noqa: E402  (stdlib only at import: the demo policies and the episode loop)

BABYAI_LEVELS = 40
TEXTCRAFT_GOALS = 544  # data_idx = goal + 544 k is a goal's k-th text (env_gateway/servers/textcraft.py)
SPLIT_SEED = 0


def split_ids(ids: list, heldout: int, demos: int, texts: int = 1) -> tuple[list, list]:
    """(training ids, held-out ids): a fixed shuffle of ``ids`` (``SPLIT_SEED``, the same for every ``--seed``), whose
    first ``heldout`` are held out (returned sorted) and the rest, in shuffled order, train (demos are their first
    ``--demos``). Shuffled because an env may list its ids in order of difficulty: TextCraft's are its goals sorted by
    recipe depth, so a held-out tail was its 100 deepest goals and the demos its shallowest (greedy held-out success
    0/100). Refuses too few ids (``texts``: each training id stands for that many, ``with_texts``)."""
    if heldout < 1 or demos < 1:
        raise SystemExit("prepare_warm_start: --heldout and --demos must be >= 1")
    if (len(ids) - heldout) * texts < demos:
        raise SystemExit(f"prepare_warm_start: {len(ids)} item ids are too few for {heldout} held-out items plus "
                         f"{demos} demos; lower --heldout / --demos or choose more --levels"
                         + (f" (each training id in {texts} texts)" if texts > 1 else ""))
    shuffled = random.Random(SPLIT_SEED).sample(ids, len(ids))
    return shuffled[heldout:], sorted(shuffled[:heldout])


def with_texts(train: list, texts: int) -> list:
    """TextCraft's training ids with each goal's first ``texts`` texts (id + 544 k, k < ``texts``), round by round
    (every goal's text 0, then every goal's text 1, ...): the demos (the first ``--demos``) then show as many goals as
    they can, each in as many texts as they can. Held-out goals stay out in every text: the split is by goal."""
    return [int(i) + TEXTCRAFT_GOALS * k for k in range(texts) for i in train]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", required=True, help="an env with a server and an expert (babyai, textcraft, ...)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--levels", type=int, nargs="+", help="BabyAI only: level numbers 1-40 to keep")
    parser.add_argument("--heldout", type=int, default=200, help="held-out items (default 200)")
    parser.add_argument("--demos", type=int, default=300, help="expert episodes for the warm start (default 300)")
    parser.add_argument("--demo-max-turns", type=int, default=30, help="an expert episode's turn limit")
    parser.add_argument("--demo-policy", default="expert", choices=make_demos.POLICIES,
                        help="who acts in the demos: the server's expert, or (BabyAI go-to / pick-up levels) "
                             "make_demos.view_only_action, whose moves depend on the text view only (view-random: "
                             "it searches at random when the goal is not in view; view-hesitant: also when it is, "
                             "half of the time)")
    parser.add_argument("--epochs", type=int, default=16,
                        help="SFT epochs (default 16: at 6 the tiny model's per-token loss looks converged while its "
                             "one decision token per reply is still near chance)")
    parser.add_argument("--sft-lr", type=float, default=2e-3)
    parser.add_argument("--sft-schedule", default="cosine", choices=["constant", "cosine", "linear"],
                        help="SFT learning-rate schedule (cosine: the tiny model then tells blind states from ones "
                             "that show the goal; constant leaves it guessing)")
    parser.add_argument("--sft-bf16", action="store_true",
                        help="SFT under bfloat16 autocast: faster on a CPU with AMX / AVX512-BF16, but it ends at a "
                             "higher loss and a weaker warm start")
    parser.add_argument("--sft-gradient-checkpointing", action="store_true",
                        help="SFT recomputing each layer's activations in the backward pass (python -m "
                             "cope_rlhf.local sft --gradient-checkpointing): what a pretrained model's long demos "
                             "need to fit a CPU host's memory")
    parser.add_argument("--seed", type=int, default=0, help="model weights and SFT order")
    parser.add_argument("--hidden-size", type=int,
                        help="the model's width, a multiple of 64 (default 128: the quickstart's 0.66M parameters)")
    parser.add_argument("--layers", type=int, help="the model's decoder layers (default 2)")
    parser.add_argument("--base-model", help="warm-start this Hugging Face checkpoint (a folder: config.json, weights, "
                                             "a tokenizer with a ChatML-like chat template) instead of building a "
                                             "small model here")
    parser.add_argument("--texts-per-goal", type=int, default=1,
                        help="TextCraft only: train on each training goal in this many texts (other distractors, "
                             "another line order; default 1, AgentGym's one text per goal), so that demos show a goal "
                             "read from lists that differ; held-out goals keep their one AgentGym text")
    args = parser.parse_args(argv)
    if args.base_model is not None:
        if args.hidden_size is not None or args.layers is not None:
            parser.error("--hidden-size and --layers shape the model built here; --base-model brings its own")
        if not os.path.isfile(os.path.join(args.base_model, "config.json")):
            parser.error(f"--base-model {args.base_model}: no config.json there; give a Hugging Face checkpoint "
                         "folder (SmolLM2: python scripts/get_smollm2.py --out DIR)")
    args.hidden_size = 128 if args.hidden_size is None else args.hidden_size
    args.layers = 2 if args.layers is None else args.layers
    if args.hidden_size < 64 or args.hidden_size % 64 or args.layers < 1:
        parser.error(f"--hidden-size must be a positive multiple of 64 (vLLM's CPU attention needs 64 per head) and "
                     f"--layers >= 1, got {args.hidden_size} and {args.layers}")
    if args.levels is not None:
        if args.env != "babyai":
            parser.error("--levels is BabyAI's (item id mod 40 + 1 is the level)")
        if not all(1 <= n <= BABYAI_LEVELS for n in args.levels):
            parser.error(f"--levels are 1-{BABYAI_LEVELS}, got {args.levels}")
    if args.texts_per_goal < 1 or (args.texts_per_goal > 1 and args.env != "textcraft"):
        parser.error(f"--texts-per-goal is TextCraft's (ids past its 544 goals are other texts of a goal) and >= 1, "
                     f"got {args.texts_per_goal} for {args.env}")
    if args.demo_policy != "expert" and args.env != "babyai":
        parser.error(f"--demo-policy {args.demo_policy} is BabyAI's (it reads BabyAI's goal line and action list)")

    # SIGTERM (a scheduler, kill) unwinds like Ctrl-C, so the env server below is stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from scripts.make_itemids import write_item_rows
    from cope_rlhf.local.sft import train as sft
    from scripts.make_tiny_model import main as make_tiny_model
    from env_gateway.process import EnvServerProcess
    from tqdm import tqdm

    data = os.path.join(args.out, "data")
    os.makedirs(data, exist_ok=True)
    t = time.time()
    with EnvServerProcess(args.env) as server:
        ids = make_demos.ok(server.url, "GET", "/items?split=train")["item_ids"]
        if args.levels:
            ids = [i for i in ids if int(i) % BABYAI_LEVELS + 1 in args.levels]
        train, heldout = split_ids(ids, args.heldout, args.demos, args.texts_per_goal)
        if args.texts_per_goal > 1:
            train = with_texts(train, args.texts_per_goal)
        write_item_rows(os.path.join(data, "train.jsonl"), args.env, train)
        write_item_rows(os.path.join(data, "heldout.jsonl"), args.env, heldout)
        print(f"[warm start] {len(train)} training and {len(heldout)} held-out item ids -> {data}", flush=True)
        demos = [make_demos.episode(server.url, args.env, int(i), args.demo_max_turns,
                                    make_demos.demo_policy(args.demo_policy, int(i)))
                 for i in tqdm(train[:args.demos], desc="expert demos", mininterval=5)]
    demos_path = os.path.join(data, "demos.jsonl")
    with open(demos_path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in demos)
    wins = sum(d["success"] for d in demos)
    print(f"[warm start] {wins}/{len(demos)} successful expert demos -> {demos_path} ({time.time() - t:.0f} s)",
          flush=True)
    model, model_sft = args.base_model or os.path.join(args.out, "model"), os.path.join(args.out, "model-sft")
    if args.base_model is None:
        make_tiny_model(["--out", model, "--corpus", demos_path, "--seed", str(args.seed), "--hidden-size",
                         str(args.hidden_size), "--layers", str(args.layers), "--heads", str(args.hidden_size // 64)])
    result = sft(model, demos_path, model_sft, args.epochs, args.sft_lr, 8, 2048, args.seed, args.sft_schedule,
                 args.sft_bf16, args.sft_gradient_checkpointing)
    print(f"[warm start] SFT model -> {model_sft}", flush=True)
    return {"train": len(train), "heldout": len(heldout), "demos": len(demos), "successful_demos": wins,
            "sft_loss": result["loss"], "model": model_sft}


if __name__ == "__main__":
    from cope_rlhf.quiet import hide_benign_notices

    hide_benign_notices()  # known-benign library notices off before torch prints one (cope_rlhf/quiet.py)
    main()
