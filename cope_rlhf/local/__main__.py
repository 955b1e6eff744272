"""``python -m cope_rlhf.local {train,sft} ...``: the single-machine front-end (``train --help`` / ``sft --help``)."""

import signal
import sys

USAGE = "usage: python -m cope_rlhf.local {train,sft} [flags]   (add --help after the command for its flags)"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("train", "sft"):
        print(USAGE, file=sys.stderr)
        return 2
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
