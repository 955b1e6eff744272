"""CoPE switches: one dataclass, environment-variable defaults, ``--cope.*`` CLI overrides.

Precedence: ``--cope.<name>`` flag > environment variable ``<NAME>`` > built-in default. The built-in
defaults turn every signal off, so a run without CoPE settings is OpenRLHF's stock GRPO:
``ACTION_FORECAST_ENABLE``, ``TE_ENABLE``, ``GRPO_FILTER_DEGENERATE`` false and ``INFO_INTRINSIC_WEIGHT`` 0.
``EVAL_FIRST_AND_LAST`` and ``EVAL_DISPATCH_SIZE`` are no signals either: when and how the held-out set is
evaluated (``cope_rlhf.ppo_trainer``).

Every variable, its default, range and meaning: docs/METHOD.md. Every value is checked when it is read; a bad one
raises ``CoPEConfigError`` naming the variable (or flag)
and the allowed values. On the command line the same message comes out through argparse (exit code 2).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
FORECAST_GATES = ("wins", "all", "mixed")
FORECAST_LAYOUTS = ("list", "turns")
FORECAST_MODES = ("separate", "joint")


class CoPEConfigError(ValueError):
    pass


def _parse_bool(name: str, raw: str) -> bool:
    word = str(raw).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise CoPEConfigError(f"{name}={raw!r} is not a boolean; allowed: {', '.join(TRUE_WORDS + FALSE_WORDS)}")


def _number(kind: type, low: float, high: float = float("inf"), low_open: bool = False, high_open: bool = False):
    def parse(name: str, raw: str):
        try:
            value = kind(str(raw).strip())
        except ValueError:
            raise CoPEConfigError(f"{name}={raw!r} is not a{'n integer' if kind is int else ' number'}") from None
        below = value <= low if low_open else value < low
        above = value >= high if high_open else value > high
        if below or above or value != value:
            bracket = "(" if low_open else "["
            upper = "inf)" if high == float("inf") else f"{high}{')' if high_open else ']'}"
            raise CoPEConfigError(f"{name}={raw!r} is out of range; allowed: {bracket}{low}, {upper}")
        return value

    return parse


def _choice(options: tuple):
    def parse(name: str, raw: str) -> str:
        value = str(raw).strip().lower()
        if value not in options:
            raise CoPEConfigError(f"{name}={raw!r} is not allowed; allowed: {', '.join(options)}")
        return value

    return parse


@dataclass(frozen=True)
class CoPEConfig:
    action_forecast_enable: bool = False
    action_forecast_coef: float = 0.01
    action_forecast_k: int = 3
    action_forecast_gate: str = "wins"
    action_forecast_group_norm: bool = False
    action_forecast_skip_invalid: bool = False
    action_forecast_success_threshold: float = 0.5
    action_forecast_layout: str = "list"
    action_forecast_mode: str = "separate"  # separate: own optimizer steps after PPO (upstream); joint: in PPO's step
    action_forecast_max_length: int = 4096  # forecast samples longer than this lose tokens from the left
    action_forecast_lr_scale: float = 1.0  # separate mode: the forecast steps' learning rate = actor lr x this
    sft_mini_batch_size: int = 0  # separate mode: forecast samples per optimizer step, all ranks; 0 = train.batch_size
    te_enable: bool = False
    te_lambda: float = 0.0  # 0 = compute the TE diagnostics only
    te_eta: float = 0.5  # < 1: q must keep some of pi's mass
    te_warmup_steps: int = 50  # lambda is 0 while the global step (from 1) is below this
    te_traj_subsample: float = 1.0  # fraction of each batch's trajectories that get TE members
    te_micro_batch_size_per_gpu: int = 1  # trajectories per forward when computing TE members
    info_intrinsic_weight: float = 0.0  # 0 = information gain off
    info_gate_temp: float = 0.05
    info_max_turns: int = 8
    info_probe_tokens: int = 16
    info_kl_batch: int = 2  # trajectories per forward when computing information gain
    grpo_filter_degenerate: bool = False
    eval_first_and_last: bool = False  # not a signal: also a held-out eval before step 1 and after the last step
    eval_dispatch_size: int = 0  # not a signal: held-out prompts dispatched at once; 0 = rollout.batch_size

    def __post_init__(self):
        # Constructing directly (not through from_env/from_args) still gets every check.
        for f in fields(self):
            PARSERS[f.name](f"CoPEConfig.{f.name}", getattr(self, f.name))

    @property
    def info_gain_enable(self) -> bool:
        return self.info_intrinsic_weight > 0

    @property
    def any_enabled(self) -> bool:
        return self.action_forecast_enable or self.te_enable or self.info_gain_enable or self.grpo_filter_degenerate

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "CoPEConfig":
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            env_name = f.name.upper()
            if env_name in environ and environ[env_name].strip() != "":
                values[f.name] = PARSERS[f.name](env_name, environ[env_name])
        return cls(**values)

    @classmethod
    def from_args(cls, args: Any) -> "CoPEConfig":
        """From a namespace made by a parser with `add_cope_args`: flat (``"cope.x"``) or hierarchized
        (``args.cope.x``, OpenRLHF's ``hierarchize``)."""
        nested = getattr(args, "cope", None)
        values = {}
        for f in fields(cls):
            if nested is not None and hasattr(nested, f.name):
                values[f.name] = getattr(nested, f.name)
            elif hasattr(args, f"cope.{f.name}"):
                values[f.name] = getattr(args, f"cope.{f.name}")
        return cls(**values)


def _keep(parse: Callable[[str, Any], Any], kind: type):
    """Values that already have the right type (defaults, direct construction) pass through the same check."""

    def check(name: str, raw: Any):
        if isinstance(raw, bool) and kind is not bool:
            raise CoPEConfigError(f"{name}={raw!r} must be a {kind.__name__}, not a boolean")
        return parse(name, raw if not isinstance(raw, bool) else ("1" if raw else "0"))

    return check


PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "action_forecast_enable": _keep(_parse_bool, bool),
    "action_forecast_coef": _keep(_number(float, 0.0), float),
    "action_forecast_k": _keep(_number(int, 1), int),
    "action_forecast_gate": _keep(_choice(FORECAST_GATES), str),
    "action_forecast_group_norm": _keep(_parse_bool, bool),
    "action_forecast_skip_invalid": _keep(_parse_bool, bool),
    "action_forecast_success_threshold": _keep(_number(float, float("-inf")), float),
    "action_forecast_layout": _keep(_choice(FORECAST_LAYOUTS), str),
    "action_forecast_mode": _keep(_choice(FORECAST_MODES), str),
    "action_forecast_max_length": _keep(_number(int, 1), int),
    "action_forecast_lr_scale": _keep(_number(float, 0.0), float),
    "sft_mini_batch_size": _keep(_number(int, 0), int),
    "te_enable": _keep(_parse_bool, bool),
    "te_lambda": _keep(_number(float, 0.0), float),
    "te_eta": _keep(_number(float, 0.0, 1.0, high_open=True), float),
    "te_warmup_steps": _keep(_number(int, 0), int),
    "te_traj_subsample": _keep(_number(float, 0.0, 1.0, low_open=True), float),
    "te_micro_batch_size_per_gpu": _keep(_number(int, 1), int),
    "info_intrinsic_weight": _keep(_number(float, 0.0), float),
    "info_gate_temp": _keep(_number(float, 0.0, low_open=True), float),
    "info_max_turns": _keep(_number(int, 1), int),
    "info_probe_tokens": _keep(_number(int, 1), int),
    "info_kl_batch": _keep(_number(int, 1), int),
    "grpo_filter_degenerate": _keep(_parse_bool, bool),
    "eval_first_and_last": _keep(_parse_bool, bool),
    "eval_dispatch_size": _keep(_number(int, 0), int),
}


def add_cope_args(parser: argparse.ArgumentParser, environ: Optional[Mapping[str, str]] = None):
    """Add the ``--cope.<name>`` group; defaults come from the environment, read and checked now (a bad
    variable exits like a bad flag: argparse's error, exit code 2)."""
    try:
        defaults = CoPEConfig.from_env(environ)
    except CoPEConfigError as e:
        parser.error(str(e))
    group = parser.add_argument_group("CoPE", "CoPE signals (environment variable <NAME> sets the default)")
    for f in fields(CoPEConfig):
        flag = f"--cope.{f.name}"

        def arg_type(raw, _parse=PARSERS[f.name], _flag=flag):
            try:
                return _parse(_flag, raw)
            except CoPEConfigError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        extra = dict(nargs="?", const=True) if f.type in (bool, "bool") else {}
        group.add_argument(
            flag, dest=f"cope.{f.name}", type=arg_type, default=getattr(defaults, f.name),
            help=f"env {f.name.upper()}; default {getattr(defaults, f.name)!r}", **extra,
        )
    return parser
