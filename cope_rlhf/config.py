"""CoPE switches: one dataclass whose fields carry their default, their check and their help; read from flags.

The trainer reads ``--cope.<name>`` flags only (``add_cope_args``: one per field, its help and allowed values taken
from the field). The launchers (scripts/lib/common.sh) turn an environment variable ``<NAME>`` into that flag, as
OpenRLHF's own scripts turn theirs into flags; Python reads no CoPE variable from the environment. The defaults turn
every signal off, so a run without CoPE settings is OpenRLHF's stock GRPO: ``action_forecast_enable``,
``te_enable``, ``grpo_filter_degenerate`` false and ``info_intrinsic_weight`` 0. ``eval_first_and_last`` and
``eval_dispatch_size`` are no signals: when and how the held-out set is evaluated (``cope_rlhf.ppo_trainer``).

Every value is checked when it is read (flags, direct construction); a bad one raises ``CoPEConfigError`` naming the
flag (or field) and the allowed values. On the command line the same message comes out through argparse (exit
code 2). What each setting means in the method: docs/METHOD.md.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any, Callable

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
FORECAST_GATES = ("wins", "all", "mixed")
FORECAST_LAYOUTS = ("list", "turns")
FORECAST_MODES = ("separate", "joint")


class CoPEConfigError(ValueError):
    pass


def _parse_bool(name: str, raw: str) -> bool:
    """``name``: what to call the value in an error (the flag)."""
    word = str(raw).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise CoPEConfigError(f"{name}={raw!r} is not a boolean; allowed: {', '.join(TRUE_WORDS + FALSE_WORDS)}")


_parse_bool.allowed = "a boolean"


def _number(kind: type, low: float, high: float = float("inf"), low_open: bool = False, high_open: bool = False):
    bracket = "(" if low_open else "["
    upper = "inf)" if high == float("inf") else f"{high}{')' if high_open else ']'}"

    def parse(name: str, raw: str):
        try:
            value = kind(str(raw).strip())
        except ValueError:
            raise CoPEConfigError(f"{name}={raw!r} is not a{'n integer' if kind is int else ' number'}") from None
        below = value <= low if low_open else value < low
        above = value >= high if high_open else value > high
        if below or above or value != value:
            raise CoPEConfigError(f"{name}={raw!r} is out of range; allowed: {bracket}{low}, {upper}")
        return value

    parse.allowed = "any number" if low == float("-inf") else f"{bracket}{low}, {upper}"
    return parse


def _choice(options: tuple):
    def parse(name: str, raw: str) -> str:
        value = str(raw).strip().lower()
        if value not in options:
            raise CoPEConfigError(f"{name}={raw!r} is not allowed; allowed: {', '.join(options)}")
        return value

    parse.allowed = ", ".join(options)
    return parse


def _keep(parse: Callable[[str, Any], Any], kind: type):
    """Values that already have the right type (defaults, direct construction) pass through the same check."""

    def check(name: str, raw: Any):
        if isinstance(raw, bool) and kind is not bool:
            raise CoPEConfigError(f"{name}={raw!r} must be a {kind.__name__}, not a boolean")
        return parse(name, raw if not isinstance(raw, bool) else ("1" if raw else "0"))

    check.allowed = parse.allowed
    return check


def setting(default: Any, parse: Callable[[str, Any], Any], help: str):
    """A ``CoPEConfig`` field: its default, the check of a value (``parse(name, raw)``, ``parse.allowed`` saying what
    it accepts) and its ``--help`` text."""
    return field(default=default, metadata={"check": _keep(parse, type(default)), "help": help})


@dataclass(frozen=True)
class CoPEConfig:
    action_forecast_enable: bool = setting(False, _parse_bool, "train the K-step action forecast (L_AF)")
    action_forecast_coef: float = setting(0.01, _number(float, 0.0), "L_AF's weight")
    action_forecast_k: int = setting(3, _number(int, 1), "actions per forecast window (K)")
    action_forecast_gate: str = setting("wins", _choice(FORECAST_GATES), "which trajectories teach the forecast: "
                                        "winners, all, or winners of groups that hold a loss too")
    action_forecast_group_norm: bool = setting(False, _parse_bool, "weigh samples 1/m_g (m_g: a group's trajectories "
                                               "with samples)")
    action_forecast_skip_invalid: bool = setting(True, _parse_bool, "leave out actions the env rejected, from the "
                                                 "forecast's targets and TE's members and targets (upstream's default)")
    action_forecast_success_threshold: float = setting(0.5, _number(float, float("-inf")),
                                                       "a win is a reward above this")
    action_forecast_layout: str = setting("list", _choice(FORECAST_LAYOUTS), "target as one message (list) or one "
                                          "turn per action (turns)")
    action_forecast_mode: str = setting("separate", _choice(FORECAST_MODES), "own optimizer steps after PPO's "
                                        "(separate, upstream) or inside PPO's step (joint)")
    action_forecast_max_length: int = setting(4096, _number(int, 1), "longer forecast samples lose prefix tokens "
                                              "from the left")
    action_forecast_lr_scale: float = setting(1.0, _number(float, 0.0), "separate mode: forecast lr = actor lr x this")
    sft_mini_batch_size: int = setting(0, _number(int, 0), "separate mode: forecast samples per optimizer step over "
                                       "all ranks; 0 = train.batch_size")
    te_enable: bool = setting(False, _parse_bool, "temporal ensembling: distil earlier forecasts into the policy")
    te_lambda: float = setting(0.0, _number(float, 0.0), "TE loss weight (lambda); 0 = TE diagnostics only")
    te_eta: float = setting(0.5, _number(float, 0.0, 1.0, high_open=True), "weight of the forecasts in TE's target q "
                            "(eta; < 1: q keeps some of the policy's mass)")
    te_warmup_steps: int = setting(50, _number(int, 0), "lambda is 0 while the global step (from 1) is below this")
    te_hold_below: float = setting(0.0, _number(float, 0.0, 1.0), "hold lambda at 0 while the members' mean "
                                   "probability of the action taken (cope/te_member_prob_valid) is below this; "
                                   "0 = never")
    te_traj_subsample: float = setting(1.0, _number(float, 0.0, 1.0, low_open=True), "fraction of each batch's "
                                       "trajectories that get TE members")
    te_micro_batch_size_per_gpu: int = setting(1, _number(int, 1), "trajectories per forward when computing TE "
                                               "members")
    info_intrinsic_weight: float = setting(0.0, _number(float, 0.0), "information-gain bonus weight (w); 0 = off")
    info_gate_temp: float = setting(0.05, _number(float, 0.0, low_open=True), "temperature of the bonus's gate (T)")
    info_max_turns: int = setting(8, _number(int, 1), "turns scored per trajectory (the last ones)")
    info_probe_tokens: int = setting(16, _number(int, 1), "action tokens per turn the KL is read over (P)")
    info_kl_batch: int = setting(2, _number(int, 1), "trajectories per forward when computing information gain (with "
                                 "TE on: the smaller of this and te_micro_batch_size_per_gpu)")
    grpo_filter_degenerate: bool = setting(False, _parse_bool, "groups whose rewards are all equal train nothing")
    eval_first_and_last: bool = setting(False, _parse_bool, "not a signal: also a held-out eval before the first step "
                                        "and after the last")
    eval_dispatch_size: int = setting(0, _number(int, 0), "not a signal: held-out prompts whose episodes run at once; "
                                      "0 = rollout.batch_size")

    def __post_init__(self):
        # Constructing directly (not through from_args) still gets every check.
        for f in fields(self):
            f.metadata["check"](f"CoPEConfig.{f.name}", getattr(self, f.name))

    @property
    def info_gain_enable(self) -> bool:
        return self.info_intrinsic_weight > 0

    @property
    def any_enabled(self) -> bool:
        return self.action_forecast_enable or self.te_enable or self.info_gain_enable or self.grpo_filter_degenerate

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


def add_cope_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--cope.<name>`` group: one flag per ``CoPEConfig`` field, with its default, check and help."""
    group = parser.add_argument_group("CoPE", "CoPE signals (the launchers turn variable <NAME> into --cope.<name>)")
    for f in fields(CoPEConfig):
        flag = f"--cope.{f.name}"

        def arg_type(raw, _check=f.metadata["check"], _flag=flag):
            try:
                return _check(_flag, raw)
            except CoPEConfigError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        extra = dict(nargs="?", const=True) if isinstance(f.default, bool) else {}
        group.add_argument(flag, dest=f"cope.{f.name}", type=arg_type, default=f.default,
                           help=f"{f.metadata['help']} ({f.metadata['check'].allowed}; default {f.default!r})", **extra)
    return parser
