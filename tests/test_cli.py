"""python -m cope_rlhf.cli.train_ppo_ray: OpenRLHF's arguments plus --cope.*, environment defaults, clear
exit-2 errors for bad values and bad combinations, and OpenRLHF's own train() reached with args.cope set."""

import dataclasses
import importlib
import subprocess
import sys

import pytest
import ray
import torch

import openrlhf.utils
from cope_rlhf import patch
from cope_rlhf.cli import args as cli_args
from cope_rlhf.cli import train_ppo_ray as cli
from cope_rlhf.config import CoPEConfig
from tests.conftest import ROOT

COPE_FLAGS = [f"--cope.{f.name}" for f in dataclasses.fields(CoPEConfig)]
GRPO = ["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4"]
AGENT = ["--train.agent_func_path", "agent_funcs/babyai.py"]
# What a run on a host without CUDA needs besides OpenRLHF's defaults (cli.args.cpu_preset_error)
CPU = ["--ds.attn_implementation", "sdpa", "--vllm.sync_backend", "gloo", "--vllm.enforce_eager"]


def run_cli(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "cope_rlhf.cli.train_ppo_ray", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_openrlhf_and_cope_args():
    done = run_cli("--help")
    assert done.returncode == 0, done.stderr[-2000:]
    for flag in ["--actor.model_name_or_path", "--train.agent_func_path", "--algo.advantage.estimator"] + COPE_FLAGS:
        assert flag in done.stdout, flag


def exit_of(capsys, argv):
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    return stopped.value.code, capsys.readouterr().err


@pytest.fixture
def no_patch_left():
    """main() applies the patch in this process; undo it so that other tests see stock OpenRLHF."""
    swaps = patch.SWAPS + patch.CPU_SWAPS
    saved = {(module, name): getattr(importlib.import_module(module), name)
             for module, _, names in swaps for name in names}
    saved.update({("torch.cuda", name): getattr(torch.cuda, name)  # cpu_cluster's stubs, on a host without CUDA
                  for name in ("current_device", "synchronize", "set_device", "current_stream")})
    meta_path = list(sys.meta_path)
    yield
    for (module, name), value in saved.items():
        setattr(importlib.import_module(module), name, value)
    sys.meta_path[:] = meta_path


@pytest.mark.parametrize("argv, message", [
    (["--cope.te_enable", "ture"], "--cope.te_enable='ture' is not a boolean"),
    (["--cope.action_forecast_k", "0"], "--cope.action_forecast_k='0' is out of range"),
    (["--cope.info_intrinsic_weight", "-1"], "--cope.info_intrinsic_weight='-1' is out of range"),
    (GRPO + ["--cope.info_intrinsic_weight", "0.1"], "need multi-turn samples from an agent: pass --train.agent_func_path"),
    (GRPO + ["--cope.action_forecast_enable"], "need multi-turn samples from an agent"),
    (GRPO + AGENT + ["--cope.action_forecast_enable", "--cope.action_forecast_mode", "joint",
                     "--cope.action_forecast_lr_scale", "0.5"], "leave them at 1.0 and 0"),
    (GRPO + AGENT + ["--cope.action_forecast_enable", "--cope.action_forecast_mode", "joint",
                     "--train.dynamic_batch_enable"], "joint mode scales each micro-step's forecast share"),
    (GRPO + AGENT + ["--cope.action_forecast_enable", "--cope.action_forecast_mode", "joint",
                     "--ds.packing_samples"], "drop --ds.packing_samples, or use --cope.action_forecast_mode separate"),
    (GRPO + AGENT + ["--cope.action_forecast_enable", "--train.dynamic_batch_enable"],
     "dynamic batching turns off: drop --train.dynamic_batch_enable"),
    (GRPO + ["--train.agent_func_path", "agent_funcs/tau2.py", "--cope.action_forecast_enable"],
     "pass --cope.action_forecast_layout turns"),
    (GRPO + ["--train.agent_func_path", "agent_funcs/nowhere.py", "--cope.action_forecast_enable"],
     "'agent_funcs/nowhere.py' is not a file"),
    (GRPO + AGENT + ["--cope.te_eta", "1"], "--cope.te_eta='1' is out of range; allowed: [0.0, 1.0)"),
    (AGENT + ["--algo.advantage.estimator", "rloo", "--rollout.n_samples_per_prompt", "4",
              "--cope.grpo_filter_degenerate"], "got --algo.advantage.estimator rloo: use --algo.advantage.estimator group_norm"),
])
def test_bad_values_and_combinations_exit_2(capsys, no_patch_left, argv, message):
    code, err = exit_of(capsys, argv)
    assert code == 2 and message in err, err


def test_bad_flag_value_exits_2(capsys, no_patch_left):
    code, err = exit_of(capsys, GRPO + ["--cope.te_eta", "1.5"])
    assert code == 2 and "--cope.te_eta='1.5' is out of range; allowed: [0.0, 1.0)" in err


def test_flags_not_the_environment(monkeypatch):
    """The trainer reads its CoPE settings from flags only (the launchers turn the variables into flags)."""
    monkeypatch.setenv("ACTION_FORECAST_K", "5")
    monkeypatch.setenv("INFO_INTRINSIC_WEIGHT", "0.1")
    assert CoPEConfig.from_args(cli_args.build_parser().parse_args(GRPO + AGENT)) == CoPEConfig()
    config = CoPEConfig.from_args(cli_args.build_parser().parse_args(GRPO + AGENT + ["--cope.action_forecast_k", "2"]))
    assert config.action_forecast_k == 2 and config.info_intrinsic_weight == 0.0


def test_filter_alone_needs_no_agent_func():
    args = cli_args.build_parser().parse_args(GRPO + ["--cope.grpo_filter_degenerate"])
    assert cli_args.combination_error(args) is None
    assert cli_args.combination_error(cli_args.build_parser().parse_args(["--algo.advantage.estimator", "gae"])) is None


class _TrainReached(Exception):
    def __init__(self, args):
        self.parsed = args


def test_valid_args_reach_openrlhf_train(monkeypatch, no_patch_left):
    """Up to OpenRLHF's train(): its own validation ran, ray.init got the CoPE worker hook next to OpenRLHF's
    env_vars, the patch is in place, and args.cope carries the flags. Ray start and the strategy are stand-ins
    (recording / stopping), as nothing may start here; so the preflight, which would look for a gateway, is off."""
    monkeypatch.setenv("COPE_SKIP_PREFLIGHT", "1")
    started = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: started.update(kwargs))

    def stop_at_strategy(args):
        raise _TrainReached(args)

    monkeypatch.setattr(openrlhf.utils, "get_strategy", stop_at_strategy)
    with pytest.raises(_TrainReached) as reached:
        cli.main(GRPO + AGENT + CPU + ["--cope.te_enable", "--cope.te_lambda", "0.2", "--actor.eps_clip", "0.3"])
    args = reached.value.parsed
    assert args.cope.te_enable is True and args.cope.te_lambda == 0.2
    assert args.actor.eps_clip_low_high == (0.3, 0.3)  # OpenRLHF's own post-processing ran
    assert args.reward.remote_url == ["agent"]
    assert started["runtime_env"]["worker_process_setup_hook"] == patch.WORKER_SETUP_HOOK
    assert "TOKENIZERS_PARALLELISM" in started["runtime_env"]["env_vars"]
    if not torch.cuda.is_available():  # logical GPUs: actor, ref and reward groups of 8 (OpenRLHF's defaults)
        assert started["num_gpus"] == 24 and started["num_cpus"] >= 26
    actor_module = importlib.import_module("openrlhf.trainer.ray.ppo_actor")
    assert actor_module.PolicyModelActor.__ray_actor_class__.__name__ == "CoPEPolicyModelActor"


@pytest.mark.parametrize("extra, needs", [
    ([], ["--ds.attn_implementation sdpa"]),
    (CPU + ["--ds.packing_samples"], ["no --ds.packing_samples"]),
    (CPU + ["--vllm.enable_sleep", "--train.enable_ema"], ["no --ds.enable_sleep / --vllm.enable_sleep",
                                                          "no --train.enable_ema"]),
    (["--ds.attn_implementation", "sdpa", "--vllm.num_engines", "1"], ["--vllm.sync_backend gloo",
                                                                      "--vllm.enforce_eager"]),
    (CPU + ["--ds.param_dtype", "fp16", "--ds.adam_offload"], ["--ds.param_dtype fp32", "no --ds.adam_offload"]),
])
def test_cpu_host_names_every_missing_flag(extra, needs):
    args = cli_args.build_parser().parse_args(GRPO + extra)
    problem = cli_args.cpu_preset_error(args, cuda=False)
    assert problem.startswith("this host has no CUDA device")
    for need in needs:
        assert need in problem, (need, problem)
    assert problem.count(";") == len(needs) - 1  # nothing else is asked for
    assert cli_args.cpu_preset_error(args, cuda=True) is None  # a CUDA host keeps OpenRLHF's defaults


def test_cpu_preset_is_enough():
    args = cli_args.build_parser().parse_args(GRPO + AGENT + CPU + ["--vllm.num_engines", "1"])
    assert cli_args.cpu_preset_error(args, cuda=False) is None


def test_cpu_ray_resources_cover_every_group():
    args = cli_args.build_parser().parse_args(GRPO + CPU + [
        "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "1", "--reward.num_gpus_per_node", "1",
        "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "2"])
    assert cli.cpu_ray_resources(args)["num_gpus"] == 2 + 1 + 1 + 2 * 2
    args = cli_args.build_parser().parse_args(GRPO + CPU + ["--critic.model_name_or_path", "x", "--critic.num_nodes", "2",
                                                       "--critic.num_gpus_per_node", "3"])
    assert cli.cpu_ray_resources(args)["num_gpus"] == 3 * 8 + 6


def test_cpu_host_without_preset_exits_2(capsys, no_patch_left):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: OpenRLHF's GPU defaults apply")
    code, err = exit_of(capsys, GRPO + AGENT)
    assert code == 2 and "this host has no CUDA device" in err and "--ds.attn_implementation sdpa" in err
