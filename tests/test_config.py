"""CoPEConfig: defaults off, environment variables, --cope.* overrides, clear errors."""

import argparse
from dataclasses import fields

import pytest
from openrlhf.utils.config import hierarchize

from cope_rlhf.config import CoPEConfig, CoPEConfigError, add_cope_args

SWITCHES = [
    "ACTION_FORECAST_ENABLE", "ACTION_FORECAST_COEF", "ACTION_FORECAST_K", "ACTION_FORECAST_GATE",
    "ACTION_FORECAST_GROUP_NORM", "ACTION_FORECAST_SKIP_INVALID", "ACTION_FORECAST_SUCCESS_THRESHOLD",
    "ACTION_FORECAST_LAYOUT", "ACTION_FORECAST_MODE", "ACTION_FORECAST_MAX_LENGTH", "ACTION_FORECAST_LR_SCALE",
    "SFT_MINI_BATCH_SIZE", "TE_ENABLE", "TE_LAMBDA", "TE_ETA", "TE_WARMUP_STEPS", "TE_TRAJ_SUBSAMPLE",
    "TE_MICRO_BATCH_SIZE_PER_GPU", "INFO_INTRINSIC_WEIGHT", "INFO_GATE_TEMP", "INFO_MAX_TURNS", "INFO_PROBE_TOKENS",
    "INFO_KL_BATCH", "GRPO_FILTER_DEGENERATE", "EVAL_FIRST_AND_LAST", "EVAL_DISPATCH_SIZE",
]


def test_every_switch_and_defaults_off():
    assert sorted(f.name.upper() for f in fields(CoPEConfig)) == sorted(SWITCHES)
    config = CoPEConfig.from_env({})
    assert config == CoPEConfig() and not config.any_enabled and not config.info_gain_enable
    assert (config.action_forecast_coef, config.action_forecast_k, config.action_forecast_gate) == (0.01, 3, "wins")
    assert (config.te_eta, config.info_gate_temp, config.info_max_turns, config.info_probe_tokens) == (0.5, 0.05, 8, 16)
    # upstream CoPE's defaults for the knobs it accepts
    assert (config.action_forecast_mode, config.action_forecast_max_length, config.action_forecast_lr_scale,
            config.sft_mini_batch_size) == ("separate", 4096, 1.0, 0)
    assert (config.te_warmup_steps, config.te_traj_subsample, config.te_micro_batch_size_per_gpu,
            config.info_kl_batch) == (50, 1.0, 1, 2)


def test_from_env_parses_values():
    config = CoPEConfig.from_env({
        "ACTION_FORECAST_ENABLE": "True", "ACTION_FORECAST_K": "5", "ACTION_FORECAST_GATE": "Mixed",
        "TE_ENABLE": "on", "TE_LAMBDA": "0.1", "INFO_INTRINSIC_WEIGHT": "0.1", "GRPO_FILTER_DEGENERATE": "0",
        "ACTION_FORECAST_LAYOUT": "", "UNRELATED": "x",
    })
    assert config.action_forecast_enable and config.te_enable and config.info_gain_enable
    assert (config.action_forecast_k, config.action_forecast_gate, config.te_lambda) == (5, "mixed", 0.1)
    assert config.action_forecast_layout == "list" and not config.grpo_filter_degenerate


@pytest.mark.parametrize("name,value,words", [
    ("ACTION_FORECAST_ENABLE", "ture", ["ACTION_FORECAST_ENABLE", "'ture'", "true", "false"]),
    ("ACTION_FORECAST_COEF", "-0.1", ["ACTION_FORECAST_COEF", "allowed: [0.0, inf)"]),
    ("ACTION_FORECAST_K", "0", ["ACTION_FORECAST_K", "allowed: [1, inf)"]),
    ("ACTION_FORECAST_K", "2.5", ["ACTION_FORECAST_K", "not an integer"]),
    ("ACTION_FORECAST_GATE", "best", ["ACTION_FORECAST_GATE", "wins, all, mixed"]),
    ("ACTION_FORECAST_LAYOUT", "grid", ["ACTION_FORECAST_LAYOUT", "list, turns"]),
    ("TE_ETA", "1.5", ["TE_ETA", "[0.0, 1.0)"]),
    ("TE_ETA", "1", ["TE_ETA", "[0.0, 1.0)"]),  # eta = 1: q has no mass outside the members' top-M
    ("ACTION_FORECAST_MODE", "both", ["ACTION_FORECAST_MODE", "separate, joint"]),
    ("TE_TRAJ_SUBSAMPLE", "0", ["TE_TRAJ_SUBSAMPLE", "(0.0, 1.0]"]),
    ("INFO_KL_BATCH", "0", ["INFO_KL_BATCH", "[1, inf)"]),
    ("INFO_GATE_TEMP", "0", ["INFO_GATE_TEMP", "(0.0, inf)"]),
    ("INFO_INTRINSIC_WEIGHT", "nan", ["INFO_INTRINSIC_WEIGHT"]),
    ("TE_WARMUP_STEPS", "abc", ["TE_WARMUP_STEPS", "not an integer"]),
])
def test_bad_env_values_name_variable_and_allowed(name, value, words):
    with pytest.raises(CoPEConfigError) as error:
        CoPEConfig.from_env({name: value})
    for word in words:
        assert word in str(error.value)


def test_direct_construction_is_checked():
    with pytest.raises(CoPEConfigError, match="action_forecast_k"):
        CoPEConfig(action_forecast_k=0)
    with pytest.raises(CoPEConfigError, match="not a boolean"):
        CoPEConfig(te_enable="maybe")


def parse(argv, environ):
    parser = argparse.ArgumentParser()
    parser.add_argument("--actor.model_name_or_path", default="m")  # an OpenRLHF-style dotted arg beside ours
    add_cope_args(parser, environ)
    return parser.parse_args(argv)


def test_cli_overrides_environment():
    environ = {"ACTION_FORECAST_K": "4", "TE_ENABLE": "1", "INFO_INTRINSIC_WEIGHT": "0.1"}
    argv = ["--cope.action_forecast_k", "6", "--cope.te_enable", "false", "--cope.grpo_filter_degenerate"]
    args = parse(argv, environ)
    config = CoPEConfig.from_args(args)
    assert config.action_forecast_k == 6 and not config.te_enable and config.grpo_filter_degenerate
    assert config.info_intrinsic_weight == 0.1  # from the environment
    nested = hierarchize(args)  # how OpenRLHF hands args around
    assert CoPEConfig.from_args(nested) == config and nested.actor.model_name_or_path == "m"


def test_bad_cli_value_exits_2_with_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(["--cope.action_forecast_gate", "best"], {})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--cope.action_forecast_gate='best' is not allowed; allowed: wins, all, mixed" in err


def test_bad_env_default_fails_when_building_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse([], {"TE_ENABLE": "ture"})
    assert exit_info.value.code == 2
    assert "TE_ENABLE='ture' is not a boolean; allowed: 1, true, yes, on, 0, false, no, off" in capsys.readouterr().err
