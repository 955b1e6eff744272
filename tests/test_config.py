"""CoPEConfig: defaults off, --cope.* flags (the only source: no environment variable), help from the fields,
clear errors."""

import argparse
import re
from dataclasses import fields

import pytest
from openrlhf.utils.config import hierarchize

import os

from cope_rlhf.config import CoPEConfig, CoPEConfigError, add_cope_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SWITCHES = [
    "ACTION_FORECAST_ENABLE", "ACTION_FORECAST_COEF", "ACTION_FORECAST_K", "ACTION_FORECAST_GATE",
    "ACTION_FORECAST_GROUP_NORM", "ACTION_FORECAST_SKIP_INVALID", "ACTION_FORECAST_SUCCESS_THRESHOLD",
    "ACTION_FORECAST_LAYOUT", "ACTION_FORECAST_MODE", "ACTION_FORECAST_MAX_LENGTH", "ACTION_FORECAST_LR_SCALE",
    "SFT_MINI_BATCH_SIZE", "TE_ENABLE", "TE_LAMBDA", "TE_ETA", "TE_WARMUP_STEPS", "TE_HOLD_BELOW", "TE_TRAJ_SUBSAMPLE",
    "TE_MICRO_BATCH_SIZE_PER_GPU", "INFO_INTRINSIC_WEIGHT", "INFO_GATE_TEMP", "INFO_MAX_TURNS", "INFO_PROBE_TOKENS",
    "INFO_KL_BATCH", "GRPO_FILTER_DEGENERATE", "EVAL_FIRST_AND_LAST", "EVAL_DISPATCH_SIZE",
]


def test_every_switch_and_defaults_off():
    assert sorted(f.name.upper() for f in fields(CoPEConfig)) == sorted(SWITCHES)
    config = CoPEConfig.from_args(parse([]))
    assert config == CoPEConfig() and not config.any_enabled and not config.info_gain_enable
    assert (config.action_forecast_coef, config.action_forecast_k, config.action_forecast_gate) == (0.01, 3, "wins")
    assert (config.te_eta, config.info_gate_temp, config.info_max_turns, config.info_probe_tokens) == (0.5, 0.05, 8, 16)
    # upstream CoPE's defaults for the knobs it accepts
    assert (config.action_forecast_mode, config.action_forecast_max_length, config.action_forecast_lr_scale,
            config.sft_mini_batch_size) == ("separate", 4096, 1.0, 0)
    assert (config.te_warmup_steps, config.te_traj_subsample, config.te_micro_batch_size_per_gpu,
            config.info_kl_batch) == (50, 1.0, 1, 2)


def test_flags_parse_values():
    config = CoPEConfig.from_args(parse([
        "--cope.action_forecast_enable", "True", "--cope.action_forecast_k", "5", "--cope.action_forecast_gate",
        "Mixed", "--cope.te_enable", "--cope.te_lambda", "0.1", "--cope.info_intrinsic_weight", "0.1",
        "--cope.grpo_filter_degenerate", "off"]))
    assert config.action_forecast_enable and config.te_enable and config.info_gain_enable
    assert (config.action_forecast_k, config.action_forecast_gate, config.te_lambda) == (5, "mixed", 0.1)
    assert config.action_forecast_layout == "list" and not config.grpo_filter_degenerate


def test_the_environment_is_not_read(monkeypatch):
    """One configuration surface: the launchers turn TE_ENABLE=1 into --cope.te_enable 1; Python reads flags only."""
    monkeypatch.setenv("TE_ENABLE", "1")
    monkeypatch.setenv("ACTION_FORECAST_K", "oops")  # not read, so not an error either
    assert CoPEConfig.from_args(parse([])) == CoPEConfig()


@pytest.mark.parametrize("name,value,words", [
    ("action_forecast_enable", "ture", ["--cope.action_forecast_enable", "'ture'", "true", "false"]),
    ("action_forecast_coef", "-0.1", ["--cope.action_forecast_coef", "allowed: [0.0, inf)"]),
    ("action_forecast_k", "0", ["--cope.action_forecast_k", "allowed: [1, inf)"]),
    ("action_forecast_k", "2.5", ["--cope.action_forecast_k", "not an integer"]),
    ("action_forecast_gate", "best", ["--cope.action_forecast_gate", "wins, all, mixed"]),
    ("action_forecast_layout", "grid", ["--cope.action_forecast_layout", "list, turns"]),
    ("te_eta", "1.5", ["--cope.te_eta", "[0.0, 1.0)"]),
    ("te_eta", "1", ["--cope.te_eta", "[0.0, 1.0)"]),  # eta = 1: q has no mass outside the members' top-M
    ("action_forecast_mode", "both", ["--cope.action_forecast_mode", "separate, joint"]),
    ("te_traj_subsample", "0", ["--cope.te_traj_subsample", "(0.0, 1.0]"]),
    ("info_kl_batch", "0", ["--cope.info_kl_batch", "[1, inf)"]),
    ("info_gate_temp", "0", ["--cope.info_gate_temp", "(0.0, inf)"]),
    ("info_intrinsic_weight", "nan", ["--cope.info_intrinsic_weight"]),
    ("te_warmup_steps", "abc", ["--cope.te_warmup_steps", "not an integer"]),
])
def test_bad_flag_values_name_flag_and_allowed(name, value, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse([f"--cope.{name}", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_direct_construction_is_checked():
    with pytest.raises(CoPEConfigError, match="action_forecast_k"):
        CoPEConfig(action_forecast_k=0)
    with pytest.raises(CoPEConfigError, match="not a boolean"):
        CoPEConfig(te_enable="maybe")


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--actor.model_name_or_path", default="m")  # an OpenRLHF-style dotted arg beside ours
    add_cope_args(parser)
    return parser.parse_args(argv)


def test_flags_and_hierarchized_args_give_one_config():
    argv = ["--cope.action_forecast_k", "6", "--cope.te_enable", "false", "--cope.grpo_filter_degenerate"]
    args = parse(argv)
    config = CoPEConfig.from_args(args)
    assert config.action_forecast_k == 6 and not config.te_enable and config.grpo_filter_degenerate
    nested = hierarchize(args)  # how OpenRLHF hands args around
    assert CoPEConfig.from_args(nested) == config and nested.actor.model_name_or_path == "m"


def test_help_says_what_each_flag_takes():
    parser = argparse.ArgumentParser()
    add_cope_args(parser)
    text = " ".join(parser.format_help().split())
    assert "--cope.te_eta [0.0, 1.0)" not in text  # the range is in the help, not the metavar
    assert "weight of the forecasts in TE's target q (eta; < 1: q keeps some of the policy's mass) ([0.0, 1.0); " \
           "default 0.5)" in text
    assert "(wins, all, mixed; default 'wins')" in text and "(a boolean; default False)" in text
    for f in fields(CoPEConfig):
        assert f"--cope.{f.name}" in text


def test_method_doc_lists_every_setting():
    """docs/METHOD.md's table of settings (launcher variables) names every field, and nothing else."""
    doc = open(os.path.join(ROOT, "docs", "METHOD.md")).read()
    listed = set(re.findall(r"^\| `([A-Z_]+)` \|", doc, re.MULTILINE))
    assert listed == {f.name.upper() for f in fields(CoPEConfig)}


def test_bad_cli_value_exits_2_with_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(["--cope.action_forecast_gate", "best"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--cope.action_forecast_gate='best' is not allowed; allowed: wins, all, mixed" in err


def test_architecture_flag_table_traces_to_names_that_exist():
    """docs/ARCHITECTURE.md's flag table: every CoPEConfig field has a row, and every function, metric and test it
    names exists in the code (a rename that forgets the doc fails here)."""
    doc = open(os.path.join(ROOT, "docs", "ARCHITECTURE.md")).read()
    table = doc[doc.index("| flag (`--cope.`) |"):].split("\n\n", 1)[0].splitlines()[2:]
    source = "\n".join(open(os.path.join(folder, name)).read() for folder in (os.path.join(ROOT, "cope_rlhf"),)
                       for name in os.listdir(folder) if name.endswith(".py"))
    flags, missing = set(), []
    for row in table:
        flag_cell, where, tensor, metrics, tests = [c.strip() for c in row.strip("|").split("|")]
        names = re.findall(r"`([a-z_]+)`", flag_cell)
        flags.update(n if not n.startswith("_") else "action_forecast" + n for n in names)
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", where + " " + tensor):
            if not re.search(rf"\b{re.escape(name.rsplit('.', 1)[-1])}\b", source):
                missing.append(name)
        missing += [m for m in re.findall(r"`(cope/\w+)`", metrics) if f'"{m}"' not in source
                    and f'"{m.split("/", 1)[1]}' not in source]
        test_file = None
        for path, test in re.findall(r"`(test_\w+\.py)?(?:::(test_\w+))?", tests):
            if path:
                test_file = path
                if not os.path.isfile(os.path.join(ROOT, "tests", path)):
                    missing.append(path)
            if test and f"def {test}(" not in open(os.path.join(ROOT, "tests", test_file)).read():
                missing.append(f"{test_file}::{test}")
    assert not missing, f"named in docs/ARCHITECTURE.md's flag table but not found: {missing}"
    fields_named = {f.name for f in fields(CoPEConfig)}
    flags -= {"separate", "joint"}  # the mode's values
    assert flags == fields_named, f"fields without a row: {fields_named - flags}; not fields: {flags - fields_named}"
