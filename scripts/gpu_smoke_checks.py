"""The checks of scripts/gpu_smoke.sh that need Python, one subcommand each; exit 0 when the check holds, 1 otherwise.

    python scripts/gpu_smoke_checks.py stack                   the CUDA training stack imports and sees the GPU
    python scripts/gpu_smoke_checks.py flash-attn              flash-attn's own kernels run (varlen, forward and
                                                               backward, bf16) and agree with PyTorch's attention
    python scripts/gpu_smoke_checks.py tensorboard DIR         every cope/* scalar the smoke run turns on was logged
    python scripts/gpu_smoke_checks.py signal-cost JSON [--tol T]
                                                               benchmarks/signal_cost.py --json on the GPU: the packed
                                                               signals ran flex attention and match a dense mask

Lines that start with ``[smoke:key]`` are the numbers the smoke script puts in its summary table; everything else
is for the stage's log. The tensorboard and signal-cost checks need no GPU (tests run them on files they write).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# What the smoke run logs with every CoPE signal on (OpenRLHF prefixes its training scalars with "train/"): the
# experience maker's batch metrics and the actor's status (TE KL in the PPO step; the separate forecast update).
EXPECTED_COPE_TAGS = (
    "cope/filtered_frac", "cope/info_reward_mean", "cope/info_beta_mean", "cope/info_turns_scored",
    "cope/forecast_samples", "cope/forecast_kept_frac", "cope/forecast_loss", "cope/forecast_samples_trained",
    "cope/forecast_optimizer_steps", "cope/te_slots", "cope/te_slot_coverage", "cope/te_kl",
    "cope/te_member_first_token_prob", "cope/te_member_prob_valid",
    "cope/te_invalid_target_frac", "cope/te_held",
)


def key(text: str) -> None:
    print(f"[smoke:key] {text}", flush=True)


def check_stack() -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"torch {torch.__version__} sees no GPU (torch.version.cuda = {torch.version.cuda}): the venv holds a "
              "CPU build; rerun scripts/setup.sh on this host (COPE_DEVICE=cuda)")
        return 1
    import deepspeed
    import openrlhf
    import ray
    import vllm
    from deepspeed.accelerator import get_accelerator

    import cope_rlhf.patch  # noqa: F401  (the CoPE classes import against this OpenRLHF)
    import openrlhf.trainer.ppo_trainer  # noqa: F401
    from cope_rlhf.branches import flex_available

    accelerator = get_accelerator().device_name()
    props = torch.cuda.get_device_properties(0)
    print(f"GPU 0: {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, deepspeed "
          f"{deepspeed.__version__} (accelerator {accelerator}), ray {ray.__version__}, openrlhf "
          f"{getattr(openrlhf, '__version__', '?')}, flex attention {'yes' if flex_available() else 'no'}")
    problems = []
    if accelerator != "cuda":
        problems.append(f"DeepSpeed picked the {accelerator} accelerator, not cuda")
    if not flex_available():
        problems.append("this PyTorch has no flex attention: the packed CoPE signals cannot use it")
    for problem in problems:
        print(f"error: {problem}")
    key(f"torch {torch.__version__}, vllm {vllm.__version__}, deepspeed {deepspeed.__version__}, "
        f"flex {'yes' if flex_available() else 'no'}")
    return 1 if problems else 0


def check_flash_attn() -> int:
    """Two packed sequences through flash-attn's varlen kernel (what ``--ds.packing_samples`` runs), forward and
    backward, against PyTorch's causal attention on each sequence alone."""
    import torch
    import torch.nn.functional as F

    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func
        from transformers.utils import is_flash_attn_2_available
    except ImportError as e:
        print(f"flash-attn's kernels do not import ({e}): scripts/setup.sh builds them on a CUDA host "
              "(pip install --no-build-isolation flash-attn==2.8.3 needs nvcc, or a prebuilt wheel)")
        key("flash-attn kernels missing")
        return 1
    lengths, heads, dim = [100, 60], 2, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    cu = torch.tensor([0, lengths[0], sum(lengths)], device="cuda", dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    reference = []
    for t in (q, k, v):
        t.grad = None
    for start, n in zip([0, lengths[0]], lengths):
        part = [t[start:start + n].transpose(0, 1) for t in (q, k, v)]  # (heads, n, dim)
        reference.append(F.scaled_dot_product_attention(*part, is_causal=True).transpose(0, 1))
    reference = torch.cat(reference)
    reference.float().square().sum().backward()
    relative = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())  # noqa: E731
    d_out = relative(out, reference)
    d_grad = max(relative(g, t.grad) for g, t in zip(grads, (q, k, v)))
    transformers_sees_it = is_flash_attn_2_available()
    print(f"flash-attn {flash_attn.__version__}: varlen forward {d_out:.1e}, backward {d_grad:.1e} (max |difference| / "
          f"max |value|) against torch sdpa, bf16; transformers offers flash_attention_2: {transformers_sees_it}")
    # bf16 keeps ~3 significant digits: the two kernels agree to about 1e-2; garbage (a wrong mask, a broken build)
    # is off by order 1
    ok = d_out < 5e-2 and d_grad < 5e-2 and transformers_sees_it
    if not transformers_sees_it:
        print("error: transformers does not offer flash_attention_2 with this flash-attn; the actor could not load")
    key(f"flash-attn {flash_attn.__version__}, varlen fwd+bwd rel. diff {max(d_out, d_grad):.0e}"
        + ("" if ok else " (FAIL)"))
    return 0 if ok else 1


def scalar_tags(logdir: str) -> tuple[dict, int]:
    """({tag: [steps]} over every event folder under ``logdir``, number of event folders)."""
    from cope_rlhf.tb_scalars import event_folders, read_scalars

    return {tag: sorted(steps) for tag, steps in read_scalars(logdir).items()}, len(event_folders(logdir))


def check_tensorboard(logdir: str) -> int:
    tags, folders = scalar_tags(logdir)
    if not folders:
        print(f"no TensorBoard event file under {logdir}: the run logged nothing")
        key("no event file")
        return 1
    found = {name: [t for t in tags if t == name or t.endswith("/" + name)] for name in EXPECTED_COPE_TAGS}
    missing = [name for name, hits in found.items() if not hits]
    steps = sorted({step for logged in tags.values() for step in logged})
    print(f"{folders} event folder(s), {len(tags)} scalar tags, steps {steps}")
    for name, hits in found.items():
        print(f"  {'ok     ' if hits else 'MISSING'} {name}" + (f"  ({', '.join(hits)})" if hits else ""))
    if missing:
        print(f"error: not logged: {', '.join(missing)}")
    key(f"cope tags {len(EXPECTED_COPE_TAGS) - len(missing)}/{len(EXPECTED_COPE_TAGS)}, steps "
        f"{steps[0] if steps else '-'}-{steps[-1] if steps else '-'}"
        + (f"; missing {', '.join(m.split('/')[-1] for m in missing)}" if missing else ""))
    return 1 if missing else 0


def check_signal_cost(path: str, tol: float) -> int:
    with open(path) as f:
        report = json.load(f)
    problems = []
    if report["device"].startswith("cuda") and report["packed_attention"] != "flex_attention":
        problems.append(f"the packed signals ran {report['packed_attention']}, not flex_attention, on the GPU")
    parts = []
    for row in report["rows"]:
        differences = [row["max_abs_d_info_gain"], row["abs_d_forecast_loss"]]
        d = max(differences, key=lambda x: float("inf") if x != x else x)  # NaN is the worst
        if not all(x <= tol for x in differences):  # NaN fails too
            problems.append(f"{row['turns']} turns: the packed signals under {report['packed_attention']} and under a "
                            f"dense mask differ by {d:.1e} (> {tol:g})")
        parts.append(f"{row['turns']} turns: signals/grpo {row['signals_over_grpo_wall']:.2f}x "
                     f"[{row['signals_over_grpo_wall_min']:.2f}-{row['signals_over_grpo_wall_max']:.2f}], "
                     f"max|d| {d:.0e}")
    for problem in problems:
        print(f"error: {problem}")
    key(f"{'; '.join(parts)} (wall, median of {report['repeats']} paired ratios; packed: {report['packed_attention']})")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="check", required=True)
    sub.add_parser("stack")
    sub.add_parser("flash-attn")
    tb = sub.add_parser("tensorboard")
    tb.add_argument("logdir")
    sc = sub.add_parser("signal-cost")
    sc.add_argument("json")
    sc.add_argument("--tol", type=float, default=1e-3,
                    help="largest allowed |packed - per-turn| of info gain and forecast loss (float32 on a GPU)")
    args = parser.parse_args(argv)
    if args.check == "stack":
        return check_stack()
    if args.check == "flash-attn":
        return check_flash_attn()
    if args.check == "tensorboard":
        return check_tensorboard(args.logdir)
    return check_signal_cost(args.json, args.tol)


if __name__ == "__main__":
    sys.exit(main())
