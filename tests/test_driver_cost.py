"""benchmarks/driver_cost.py: both drivers get commands their own parsers accept, with the same recipe."""

import os
import sys

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import driver_cost  # noqa: E402


def test_both_commands_parse_and_share_the_recipe():
    from cope_rlhf.cli import train_ppo_ray as cli
    from cope_rlhf.local.trainer import parse_args

    real = driver_cost.real_command("/start", "/out/real", 6)
    local = driver_cost.local_command("/start", "/out/local", 6, "http://127.0.0.1:1")
    assert real[1:3] == ["-m", "cope_rlhf.cli.train_ppo_ray"] and local[1:4] == ["-m", "cope_rlhf.local", "train"]
    args = cli.build_parser().parse_args(real[3:])
    assert cli.combination_error(args) is None and cli.cpu_preset_error(args, cuda=False) is None
    assert getattr(args, "data.max_samples") == 6 * driver_cost.PROMPTS_PER_STEP  # 6 steps of 8 prompts
    local_args = parse_args(local[4:])
    for name in ("rollout.batch_size", "rollout.n_samples_per_prompt", "train.batch_size", "rollout.micro_batch_size",
                 "train.micro_batch_size", "actor.adam.lr", "algo.kl.init_coef", "data.max_len",
                 "rollout.max_new_tokens", "algo.advantage.estimator"):
        value = local_args
        for part in name.split("."):
            value = getattr(value, part)
        assert getattr(args, name) == value, name
    assert local_args.cope.grpo_filter_degenerate and getattr(args, "cope.grpo_filter_degenerate")
