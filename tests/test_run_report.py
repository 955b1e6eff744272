"""scripts/run_report.py: before → after of a run with paired 95% intervals, and its learning-curve PNG."""

import json
import math

import pytest

from scripts import run_report


def test_wilson_matches_the_textbook_values():
    low, high = run_report.wilson(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = run_report.wilson(45, 100)
    assert (low, high) == (pytest.approx(0.3561, abs=1e-4), pytest.approx(0.5476, abs=1e-4))


def test_paired_gain_is_the_mean_item_difference_with_its_standard_error():
    before = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0}
    after = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "only-after": 1.0}  # unpaired items are left out
    gain, low, high, n = run_report.paired_gain(before, after)
    d = [1.0, 0.0, 1.0, 0.0]
    sd = math.sqrt(sum((x - 0.5) ** 2 for x in d) / 3)
    assert n == 4 and gain == 0.5
    assert high - gain == pytest.approx(1.959964 * sd / 2) and gain - low == pytest.approx(high - gain)
    with pytest.raises(ValueError, match="share no item ids"):
        run_report.paired_gain({"a": 1.0}, {"b": 0.0})


def test_report_reads_a_run_and_draws_its_curve(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    ckpt.mkdir()
    rows = [{"step": 0, "item_id": str(i), "success": float(i < 4), "reward": 0.0} for i in range(10)]
    rows += [{"step": 5, "item_id": str(i), "success": float(i < 7), "reward": 0.0} for i in range(10)]
    (ckpt / "eval_episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    writer = SummaryWriter(str(tb))
    for step in range(1, 6):
        writer.add_scalar("train/rollout/success_rate", 0.1 * step, step)  # as OpenRLHF's logger files it
    writer.close()
    (ckpt / "summary.json").write_text(json.dumps({"tensorboard_dir": str(tb)}))

    out = run_report.main(["--ckpt", str(ckpt), "--png", str(tmp_path / "curve.png"),
                           "--json", str(tmp_path / "out.json")])
    assert [(r["step"], r["success"], r["episodes"]) for r in out["evals"]] == [(0, 0.4, 10), (5, 0.7, 10)]
    assert out["gain"]["gain"] == pytest.approx(0.3) and out["gain"]["items"] == 10
    assert out["gain"]["low"] < 0.3 < out["gain"]["high"]
    with open(tmp_path / "curve.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert json.load(open(tmp_path / "out.json"))["gain"] == out["gain"]


def test_a_run_without_held_out_episodes_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="eval_episodes.jsonl does not exist"):
        run_report.main(["--ckpt", str(tmp_path)])
