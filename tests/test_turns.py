"""Turn spans from OpenRLHF's shifted action_mask, on Experiences built by OpenRLHF's own code."""

import pytest
import torch
from openrlhf.trainer.ppo_utils.experience import Experience

from cope_rlhf.turns import Turn, action_offset, turn_spans, unpadded_trajectories
from tests.tiny_hf import to_experience


def response(tokens, ranges):
    return {"prompt": "", "label": "", "observation_tokens": tokens, "action_ranges": ranges, "reward": 1.0,
            "scores": 1.0, "rollout_log_probs": None, "truncated": False, "extra_logs": {}}


THREE_TURNS = response(list(range(1, 15)), [(3, 5), (7, 8), (10, 13)])
EXPECTED = [Turn(0, 3, 3, 5, 7), Turn(5, 7, 7, 8, 10), Turn(8, 10, 10, 13, 14)]


def test_three_turn_trajectory_known_spans():
    e = to_experience(THREE_TURNS)
    assert e.action_mask.shape == (1, 13)  # shifted by one against sequences
    assert turn_spans(e.action_mask, e.sequences.shape[1], e.attention_mask) == [EXPECTED]
    for turn, (start, end) in zip(EXPECTED, THREE_TURNS["action_ranges"]):
        expected = THREE_TURNS["observation_tokens"][start:end]
        assert e.sequences[0, turn.action_start : turn.action_end].tolist() == expected


def test_right_padded_batch_and_truncation():
    short = response([1, 2, 3, 4, 5, 6], [(2, 4)])
    cut = to_experience(THREE_TURNS, max_len=12)  # the last action is truncated to [10, 12)
    batch = Experience.concat_experiences([to_experience(THREE_TURNS), to_experience(short), cut], pad_token_id=0)
    assert batch.sequences.shape == (3, 14)
    spans = turn_spans(batch.action_mask, batch.sequences.shape[1], batch.attention_mask)
    assert spans[0] == EXPECTED
    assert spans[1] == [Turn(0, 2, 2, 4, 6)]  # feedback ends where the row's valid tokens end, not at padding
    assert spans[2] == EXPECTED[:2] + [Turn(8, 10, 10, 12, 12)]


def test_left_padding_uses_attention_mask():
    e = to_experience(THREE_TURNS)
    pad = 3
    sequences = torch.nn.functional.pad(e.sequences, (pad, 0))
    attention = torch.nn.functional.pad(e.attention_mask, (pad, 0))
    action = torch.nn.functional.pad(e.action_mask, (pad, 0))
    shifted = [Turn(*(x + pad for x in t)) for t in EXPECTED]
    assert turn_spans(action, sequences.shape[1], attention) == [shifted]


def test_unpadded_trajectories_by_rollout_position():
    short = response([1, 2, 3, 4, 5, 6], [(2, 4)])
    batch = Experience.concat_experiences([to_experience(short), to_experience(THREE_TURNS)], pad_token_id=0)
    batch.index = [7, 3]
    rows = unpadded_trajectories([batch])
    assert rows == {7: ([1, 2, 3, 4, 5, 6], [Turn(0, 2, 2, 4, 6)]), 3: (list(range(1, 15)), EXPECTED)}
    # left padding: coordinates are shifted back to the unpadded tokens
    batch.sequences = torch.nn.functional.pad(batch.sequences, (2, 0))
    batch.attention_mask = torch.nn.functional.pad(batch.attention_mask, (2, 0))
    batch.action_mask = torch.nn.functional.pad(batch.action_mask, (2, 0))
    assert unpadded_trajectories([batch])[3] == (list(range(1, 15)), EXPECTED)


def test_offset_for_shorter_action_mask():
    # Action mask covering only the last 5 tokens of 8 (Actor.forward takes log_probs[:, -A:]).
    mask = torch.tensor([[0, 1, 1, 0, 1]])
    assert action_offset(8, 5) == 3
    assert turn_spans(mask, seq_len=8) == [[Turn(0, 4, 4, 6, 7), Turn(6, 7, 7, 8, 8)]]


def test_no_actions_and_bad_shapes():
    assert turn_spans(torch.zeros(2, 5, dtype=torch.long)) == [[], []]
    with pytest.raises(ValueError, match="action_mask"):
        turn_spans(torch.zeros(5))
    with pytest.raises(ValueError, match="0 < A <= T"):
        turn_spans(torch.zeros(1, 6), seq_len=5)
