"""The checks of scripts/gpu_smoke.sh that need Python, one subcommand each; exit 0 when the check holds, 1 otherwise.

Stage 1 (torch, transformers and this checkout only: no vLLM, Ray, DeepSpeed, OpenRLHF or flash-attn):

    python scripts/gpu_smoke_checks.py torch [--device D]      torch and transformers import, see the GPU (D = cuda)
                                                               and have flex attention; prints their versions
    python scripts/gpu_smoke_checks.py packed-signals [--device D] [--turns N ...] [--tol T]
                                                               the packed signal engine (one row per trajectory,
                                                               branches, under branches.block_attention: flex
                                                               attention on CUDA) equals the per-turn / per-sample
                                                               references of cope_rlhf/signal_references.py: information
                                                               gain, TE members, forecast loss and its gradients

Stage 2 (the full training stack):

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


def resolve_device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def check_torch(device: str) -> int:
    """Stage 1's first look: what the packed signals will run on."""
    import torch
    import transformers

    from cope_rlhf.branches import flex_available

    device = resolve_device(device)
    where = "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            print(f"torch {torch.__version__} sees no GPU (torch.version.cuda = {torch.version.cuda})")
            key(f"torch {torch.__version__}: no GPU")
            return 1
        props = torch.cuda.get_device_properties(0)
        where = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    flex = flex_available()
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, triton "
          f"{triton_version}, flex attention {'yes' if flex else 'no'}; device: {where}")
    problems = []
    if device == "cuda" and not flex:
        problems.append("this PyTorch has no flex attention: the packed CoPE signals cannot use it on the GPU")
    if device == "cuda" and triton_version == "none":
        problems.append("triton does not import: flex attention compiles its kernels with it")
    for problem in problems:
        print(f"error: {problem}")
    key(f"torch {torch.__version__}, transformers {transformers.__version__}, triton {triton_version}, flex "
        f"{'yes' if flex else 'no'}, {device}" + (f" ({where.split(',')[0]})" if device == "cuda" else ""))
    return 1 if problems else 0


def _signal_cost_module():
    """benchmarks/signal_cost.py (its trajectories and tokenizer: the packed-signals check plays the same data)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("signal_cost", os.path.join(ROOT, "benchmarks", "signal_cost.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def check_packed_signals(device: str, turns: list[int], tol: float) -> int:
    """The trainer's packed signal engine against the per-turn / per-sample references, on a small random Llama
    (float32, TF32 off) on ``device``: information gain (``frozen_signals``, every turn scored), TE members (their
    top-M mixture per covered token, and the counts) and the forecast loss with every parameter's gradient
    (``forecast.forecast_loss``), each packed under ``block_attention`` (flex attention on CUDA, ``cope_branch_sdpa``
    on a CPU) and computed the plain way, one forward per turn or per sample, under the model's own sdpa."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cope_rlhf.branches import block_attention
    from cope_rlhf.config import CoPEConfig
    from cope_rlhf.forecast import build_forecast_samples, forecast_loss
    from cope_rlhf.frozen_signals import frozen_signals
    from cope_rlhf.temporal_ensemble import TOP_M, collect_members
    from cope_rlhf.turns import unpadded_trajectories
    from cope_rlhf.signal_references import (assert_same_top_m, per_sample_forecast_loss, per_sample_member_logits,
                                         per_turn_info_gain)

    device = resolve_device(device)
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: PyTorch sees no GPU here")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 on both sides: the differences are float noise only
    torch.backends.cudnn.allow_tf32 = False
    sc = _signal_cost_module()
    tok = sc.benchmark_tokenizer()
    batch = sc.concat([sc.trajectory(tok, n, seed=7 + n) for n in turns], tok.pad_token_id)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1 << 14,
                         tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():  # larger than the default init, so that every KL and probability visibly depends on context
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model = model.to(device).eval()
    run = lambda ids, mask, pos, keep: model(input_ids=ids, attention_mask=mask, position_ids=pos,  # noqa: E731
                                             logits_to_keep=0 if keep is None else keep).logits.float()
    frozen = torch.no_grad()(run)
    seq, am, act = (t.to(device) for t in (batch.sequences, batch.attention_mask, batch.action_mask))
    rows = unpadded_trajectories([batch])
    samples = [build_forecast_samples(*rows[p], tok, k=3, row=p) for p in batch.index]
    signal_config = CoPEConfig(info_probe_tokens=16, info_max_turns=max(turns), info_kl_batch=2,
                               te_micro_batch_size_per_gpu=2)
    with block_attention(model) as build:
        attention = model.config._attn_implementation
        gain, members = frozen_signals(frozen, seq, am, act, signal_config, True, samples,
                                       [rows[p] for p in batch.index], block_mask=build, device=device)
    problems = []
    if device == "cuda" and attention != "flex_attention":
        problems.append(f"the packed path ran {attention}, not flex_attention, on the GPU")
    # information gain: token rewards and metrics
    (packed_rewards, _, packed_metrics) = gain
    want_rewards, _, want_metrics = per_turn_info_gain(frozen, seq, am, act, 16, max(turns), rows_per_forward=2)
    d_gain = float((packed_rewards.cpu() - want_rewards.cpu()).abs().max())
    scored = int(want_metrics["cope/info_turns_scored"])
    if not d_gain <= tol or float(want_rewards.abs().max()) < 1e-4:
        problems.append(f"information gain: packed and per-turn differ by {d_gain:.1e} (> {tol:g})")
    if any(abs(packed_metrics[k] - want_metrics[k]) > tol for k in want_metrics):
        problems.append(f"information gain metrics differ: {packed_metrics} vs {want_metrics}")
    # TE members: each row's covered positions, mixture and counts
    slots = 0
    for p, (got, got_counts) in zip(batch.index, members):
        trimmed, logits = per_sample_member_logits(frozen, samples[p], device=device)
        targets, probs, ids, counts = collect_members(trimmed, logits, {p: rows[p]}, top_m=TOP_M)
        slots += len(targets)
        try:
            assert got["positions"].tolist() == [pos for _, pos in targets], "covered positions differ"
            assert_same_top_m(got["probs"].cpu(), got["ids"].cpu(), probs, ids, atol=tol)
            assert all(abs(got_counts[k] - counts[k]) <= tol for k in counts), f"counts {got_counts} vs {counts}"
        except AssertionError as e:
            problems.append(f"TE members of trajectory {p}: {str(e).splitlines()[0][:200]}")
    if slots == 0:
        problems.append("TE members: no covered slot (the check would prove nothing)")
    # forecast loss and gradients
    flat = [s for row in samples for s in row]
    results = []
    model.train()
    for packed in (True, False):
        model.zero_grad(set_to_none=True)
        if packed:
            with block_attention(model) as build:
                loss = forecast_loss(run, flat, coef=0.01, block_mask=build, device=device)
                loss.backward()
        else:
            loss = per_sample_forecast_loss(run, flat, coef=0.01, pad_token_id=tok.pad_token_id, device=device)
            loss.backward()
        results.append((float(loss.detach()), {n: q.grad.detach().clone() for n, q in model.named_parameters()}))
    (loss_packed, grads_packed), (loss_plain, grads_plain) = results
    d_loss = abs(loss_packed - loss_plain)
    d_grad = max(float((grads_packed[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                 for n, g in grads_plain.items())
    if not d_loss <= tol:
        problems.append(f"forecast loss: packed {loss_packed:.6f} vs per-sample {loss_plain:.6f}")
    if not d_grad <= 1e-3:
        problems.append(f"forecast gradients differ by {d_grad:.1e} of their largest entry (> 1e-3)")
    print(f"{device}: packed path {attention}; {len(turns)} trajectories ({', '.join(map(str, turns))} turns, "
          f"{int(am.sum())} tokens); info gain over {scored} turns max|d| {d_gain:.1e}; TE members: {slots} slots "
          f"(top-{TOP_M}); forecast: {len(flat)} samples, loss |d| {d_loss:.1e}, gradients max rel. |d| {d_grad:.1e}")
    for problem in problems:
        print(f"error: {problem}")
    key(f"packed = per-turn on {device} ({attention}): dIG {d_gain:.0e} ({scored} turns), TE {slots} slots, "
        f"dL_AF {d_loss:.0e}, dgrad {d_grad:.0e}" + (f"; {len(problems)} problem(s)" if problems else ""))
    return 1 if problems else 0


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
        memory = f", mem {row['signals_over_grpo_mem']:.2f}x" if "signals_over_grpo_mem" in row else ""
        parts.append(f"{row['turns']} turns: signals/grpo {row['signals_over_grpo_wall']:.2f}x "
                     f"[{row['signals_over_grpo_wall_min']:.2f}-{row['signals_over_grpo_wall_max']:.2f}]{memory}, "
                     f"max|d| {d:.0e}")
    for problem in problems:
        print(f"error: {problem}")
    key(f"{'; '.join(parts)} (wall, median of {report['repeats']} paired ratios; packed: {report['packed_attention']})")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="check", required=True)
    for name in ("torch", "packed-signals"):
        one = sub.add_parser(name)
        one.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                         help="auto: cuda when PyTorch sees a GPU")
    packed = sub.choices["packed-signals"]
    packed.add_argument("--turns", type=int, nargs="+", default=[1, 3, 12], help="one trajectory of each length")
    packed.add_argument("--tol", type=float, default=1e-4, help="largest allowed |packed - reference| (float32)")
    sub.add_parser("stack")
    sub.add_parser("flash-attn")
    tb = sub.add_parser("tensorboard")
    tb.add_argument("logdir")
    sc = sub.add_parser("signal-cost")
    sc.add_argument("json")
    sc.add_argument("--tol", type=float, default=1e-3,
                    help="largest allowed |packed - per-turn| of info gain and forecast loss (float32 on a GPU)")
    args = parser.parse_args(argv)
    if args.check == "torch":
        return check_torch(args.device)
    if args.check == "packed-signals":
        return check_packed_signals(args.device, args.turns, args.tol)
    if args.check == "stack":
        return check_stack()
    if args.check == "flash-attn":
        return check_flash_attn()
    if args.check == "tensorboard":
        return check_tensorboard(args.logdir)
    return check_signal_cost(args.json, args.tol)


if __name__ == "__main__":
    sys.exit(main())
