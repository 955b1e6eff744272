"""benchmarks/learning_curve.py: the study runs the quickstart's recipe, and its statistics are the stated ones."""

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import learning_curve  # noqa: E402


def test_the_study_runs_the_quickstart_recipe():
    """Every recipe flag (and its value) appears in the quickstart's train step, so the two cannot drift apart."""
    script = open(os.path.join(ROOT, "scripts", "quickstart.sh")).read()
    train = script[script.index("step train"):script.index("$COPE_FLAGS")]
    flags = " ".join(re.sub(r"\\\n\s*", " ", train).split())
    recipe, i = learning_curve.RECIPE, 0
    while i < len(recipe):
        flag, value = recipe[i], recipe[i + 1] if i + 1 < len(recipe) and not recipe[i + 1].startswith("--") else None
        assert (f"{flag} {value}" if value else flag) in flags, (flag, value)
        i += 2 if value else 1
    # the quickstart's CoPE switches are the study's "filter" config
    assert re.findall(r"--cope\.\w+", flags) == learning_curve.CONFIGS["filter"]


def test_half_width_is_the_t_interval():
    assert learning_curve.half_width([0.5]) == 0.0
    values = [0.4, 0.5, 0.6]  # stdev 0.1, 2 degrees of freedom: t = 4.303
    assert learning_curve.half_width(values) == pytest.approx(4.303 * 0.1 / 3 ** 0.5)


def test_summary_reports_final_success_and_steps_to_grpo_final():
    runs = {"grpo": [{"eval": {0: 0.4, 10: 0.5, 20: 0.6}, "step_s": [20.0, 22.0]},
                     {"eval": {0: 0.4, 10: 0.6, 20: 0.6}, "step_s": [21.0]}],
            "info": [{"eval": {0: 0.4, 10: 0.7, 20: 0.8}, "step_s": [30.0]},
                     {"eval": {0: 0.4, 10: 0.5, 20: 0.6}, "step_s": [30.0]}]}
    rows, curves = learning_curve.summarize("babyai", runs)
    assert curves["grpo"][1] == pytest.approx([0.4, 0.55, 0.6])
    assert rows[0] == "| babyai | grpo | 2 | 0.400 | 0.600 ± 0.000 | 20 | 21.0 |"
    assert rows[1].startswith("| babyai | info | 2 | 0.400 | 0.700 ± ") and rows[1].endswith("| 10 | 30.0 |")
