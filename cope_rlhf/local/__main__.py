"""``python -m cope_rlhf.local {train,sft} ...``: the single-machine front-end (``train --help`` / ``sft --help``)."""

import signal
import sys

USAGE = """usage: python -m cope_rlhf.local {train,sft} [flags]   (add --help after the command for its flags)

CoPE-RLHF on one machine, CPU or one GPU:
  train  GRPO (+ CoPE signals) with OpenRLHF's Ray trainer (python -m cope_rlhf.cli.train_ppo_ray): starts the env
         server and the gateway for --env, sizes the run for a small model, evaluates held-out items before and
         after (--eval.dataset); every trainer flag passes through
  sft    supervised warm start of a model on expert demos (scripts/make_demos.py)

e.g. (scripts/quickstart.sh runs both):
  python -m cope_rlhf.local sft --demos runs/quickstart/data/demos.jsonl --model runs/quickstart/model
  python -m cope_rlhf.local train --env babyai --actor.model_name_or_path runs/quickstart/model-sft \\
      --data.prompt_dataset runs/quickstart/data/train.jsonl --local.steps 10"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in ("train", "sft"):
        print(USAGE, file=sys.stderr)
        return 2
    from cope_rlhf.quiet import hide_benign_notices

    hide_benign_notices()  # known-benign library notices off before torch prints one (cope_rlhf/quiet.py)
    import cope_rlhf.compat  # noqa: F401  (OpenRLHF imports on a CPU-only host)

    if argv[0] == "sft":
        from cope_rlhf.local.sft import main as run
    else:
        from cope_rlhf.local.trainer import main as run
    run(argv[1:])
    return 0


if __name__ == "__main__":  # vLLM's engine processes re-import the main module: keep the run behind this guard
    # SIGTERM unwinds like Ctrl-C, so that the run stops what it started (gateway, env servers, Ray, vLLM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
