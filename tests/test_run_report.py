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
    assert run_report.wilson(0, 0) == (0.0, 1.0)  # no episodes: nothing known


def test_paired_gain_is_the_mean_item_difference_with_its_standard_error():
    before = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0}
    after = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "only-after": 1.0}  # unpaired items are left out
    gain, low, high, n = run_report.paired_gain(before, after)
    d = [1.0, 0.0, 1.0, 0.0]
    sd = math.sqrt(sum((x - 0.5) ** 2 for x in d) / 3)
    assert n == 4 and gain == 0.5
    assert high - gain == pytest.approx(1.959964 * sd / 2) and gain - low == pytest.approx(high - gain)
    with pytest.raises(ValueError, match="^the two evals share no item ids$"):
        run_report.paired_gain({"a": 1.0}, {"b": 0.0})
    # one item: no spread to estimate, the interval is unbounded; two: the standard error is finite
    assert run_report.paired_gain({"a": 0.0}, {"a": 1.0}) == (1.0, -math.inf, math.inf, 1)
    gain, low, high, n = run_report.paired_gain({"a": 0.0, "b": 0.0}, {"a": 1.0, "b": 0.0})
    assert (gain, n) == (0.5, 2) and high - gain == pytest.approx(1.959964 * math.sqrt(0.5) / math.sqrt(2))


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
    (tmp_path / "eval_episodes.jsonl").write_text("\n")
    with pytest.raises(SystemExit, match="eval_episodes.jsonl holds no held-out episodes$"):
        run_report.main(["--ckpt", str(tmp_path)])


def write_evals(ckpt, successes: dict[int, list[float]]) -> str:
    """eval_episodes.jsonl with one episode per item: step -> success of items "0", "1", ..."""
    ckpt.mkdir()
    rows = [{"step": step, "item_id": str(i), "success": s, "reward": s}
            for step, values in successes.items() for i, s in enumerate(values)]
    (ckpt / "eval_episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(ckpt)


def test_versus_is_the_other_runs_success_minus_this_ones_paired_by_item_at_each_shared_step(tmp_path, capsys):
    this = write_evals(tmp_path / "a", {0: [0, 0, 1, 1], 10: [1, 0, 0, 0], 20: [0, 0, 0, 0]})
    other = write_evals(tmp_path / "b", {0: [0, 0, 1, 1], 10: [1, 1, 1, 0], 30: [1, 1, 1, 1]})
    out = run_report.main(["--ckpt", this, "--versus", other])
    assert out["versus"]["ckpt"] == other
    steps = out["versus"]["steps"]
    assert [r["step"] for r in steps] == [0, 10]  # the steps both runs evaluated
    assert steps[0]["difference"] == 0 and steps[0]["low"] == steps[0]["high"] == 0
    d = [0, 1, 1, 0]
    sd = math.sqrt(sum((x - 0.5) ** 2 for x in d) / 3)
    assert steps[1]["difference"] == 0.5 and steps[1]["items"] == 4
    assert steps[1]["high"] - 0.5 == pytest.approx(1.959964 * sd / 2) == pytest.approx(0.5 - steps[1]["low"])
    assert f"{other} minus this run at step  10: +0.500" in capsys.readouterr().out


def test_versus_runs_without_a_shared_step_or_item_are_clear_errors(tmp_path):
    this = write_evals(tmp_path / "a", {0: [1, 0]})
    with pytest.raises(SystemExit, match=r"no held-out eval at the same step"):
        run_report.main(["--ckpt", this, "--versus", write_evals(tmp_path / "b", {5: [1, 0]})])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "eval_episodes.jsonl").write_text(json.dumps({"step": 0, "item_id": "x", "success": 1.0,
                                                                     "reward": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="share no item ids: --versus compares two runs on the same held-out items"):
        run_report.main(["--ckpt", this, "--versus", str(tmp_path / "c")])
