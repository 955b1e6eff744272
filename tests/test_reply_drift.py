"""scripts/reply_drift.py: per-part KL between two models on the same replies."""

import copy
import json

import pytest
import torch

from scripts.reply_drift import drift_by_part, main, reply_part
from tests.tiny_hf import tiny_model, tiny_tokenizer

EPISODE = {"messages": [
    {"role": "user", "content": "You control an agent."},
    {"role": "assistant", "content": "Understood."},
    {"role": "user", "content": "Your goal: go to the red ball. You see a red ball 1."},
    {"role": "assistant", "content": "Thought:\nThe ball is in view.\n\nAction:\ngo to red ball 1"},
    {"role": "user", "content": "You reached the red ball."},
    {"role": "assistant", "content": "Thought:\nDone.\n\nAction:\nturn left"},
]}


def test_reply_part_splits_a_react_reply():
    assert reply_part("") == "thought"
    assert reply_part("Thought:\nThe ball") == "thought"
    assert reply_part("Thought:\nThe ball is in view.\n") == "to-action"
    assert reply_part("Thought:\nThe ball is in view.\n\nAction:") == "to-action"
    assert reply_part("Thought:\nThe ball is in view.\n\nAction:\ngo to") == "action"
    assert reply_part("Action:\n") == "action"  # a reply that skipped its thought


def test_same_model_has_no_drift_and_a_changed_head_drifts_everywhere():
    tok = tiny_tokenizer()
    ref = tiny_model(len(tok)).eval()
    same = drift_by_part(ref, copy.deepcopy(ref), tok, [EPISODE])
    assert set(same) == {"thought", "to-action", "action", "end"}
    assert all(abs(v) < 1e-5 for values in same.values() for v in values)
    # the scripted first reply is skipped; each later reply counts its own tokens and its EOS, not the template's
    # newline after the EOS
    replies = [m["content"] for m in EPISODE["messages"][3::2]]
    assert sum(map(len, same.values())) == sum(len(tok(r, add_special_tokens=False)["input_ids"]) + 1 for r in replies)
    assert len(same["end"]) == 2
    new = copy.deepcopy(ref)
    with torch.no_grad():
        new.model.norm.weight.mul_(3.0)  # sharper logits at every position
    moved = drift_by_part(ref, new, tok, [EPISODE])
    assert all(min(values) > 0 for values in moved.values())


def test_cli_reads_episodes_and_refuses_an_empty_file(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    for name in ("ref", "new"):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    episodes = tmp_path / "episodes.jsonl"
    episodes.write_text(json.dumps(EPISODE) + "\n")
    table = main(["--ref", str(tmp_path / "ref"), "--new", str(tmp_path / "new"), "--episodes", str(episodes)])
    assert set(table) == {"thought", "to-action", "action", "end"} and all(abs(r["mean"]) < 1e-5 for r in table.values())
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit, match="has no episodes"):
        main(["--ref", str(tmp_path / "ref"), "--new", str(tmp_path / "new"), "--episodes", str(tmp_path / "empty.jsonl")])
