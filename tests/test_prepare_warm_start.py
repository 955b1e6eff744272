"""scripts/prepare_warm_start.py: held-out ids are disjoint from training ids and demos; bad requests are refused."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import prepare_warm_start  # noqa: E402


def test_held_out_ids_are_the_tail_and_never_trained_on():
    ids = list(range(0, 4000, 40))
    train, heldout = prepare_warm_start.split_ids(ids, heldout=30, demos=50)
    assert heldout == ids[-30:] and train == ids[:-30]
    assert not set(train) & set(heldout)  # demos are train[:demos], so they never meet held-out ids either


def test_too_few_ids_for_the_request_is_a_clear_error():
    with pytest.raises(SystemExit, match="too few for 30 held-out items plus 80 demos"):
        prepare_warm_start.split_ids(list(range(100)), heldout=30, demos=80)


@pytest.mark.parametrize("argv, message", [
    (["--env", "textcraft", "--out", "x", "--levels", "1"], "--levels is BabyAI's"),
    (["--env", "babyai", "--out", "x", "--levels", "41"], "--levels are 1-40"),
    (["--env", "textcraft", "--out", "x", "--demo-policy", "view"], "--demo-policy view is BabyAI's"),
])
def test_levels_are_checked_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit):
        prepare_warm_start.main(argv)
    assert message in capsys.readouterr().err
