"""scripts/reply_census.py: each reply's action and class, over a crafted episodes file."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, ROOT)
from scripts.reply_census import census, main, reply_action  # noqa: E402

LISTING = 'You see: a red ball 1.\nAvailable actions: ["turn left", "go to red ball 1"]'


def episode(*replies: str, listing: str = LISTING) -> dict:
    messages = [{"role": "system", "content": "rules"}, {"role": "user", "content": "go"},
                {"role": "assistant", "content": "I will give one action each turn."}]
    for reply in replies:
        messages += [{"role": "user", "content": listing}, {"role": "assistant", "content": reply}]
    return {"messages": messages}


def test_the_action_is_the_first_line_after_the_last_action_header():
    assert reply_action("Thought: left.\nAction:\nturn left") == "turn left"
    assert reply_action("Thought: x\nAction: go to red ball 1\nmore") == "go to red ball 1"
    assert reply_action("Action:\nThought:\nAction:\n\n  go to red ball 1 \n") == "go to red ball 1"
    assert reply_action("Action:\n\n") == "" and reply_action("I go to the ball") == ""


def test_replies_are_counted_by_class_and_action(tmp_path):
    path = tmp_path / "run.episodes.jsonl"
    lines = [episode("Action:\nturn left", "Action:\ngo toturn right", "no action here"),
             episode("Action:\ngo to red ball 1"),
             episode("Action:\ncraft 1 stick", listing="Crafting commands: craft 1 stick")]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    row = census(str(path), top=2)
    assert row["replies"] == 5  # the scripted first reply of each episode is not counted
    assert (row["listed"], row["unlisted"], row["none"], row["no list"]) == (0.4, 0.2, 0.2, 0.2)
    assert row["top_actions"][0] == ("turn left", 0.2) and len(row["top_actions"]) == 2


def test_the_command_prints_each_file_and_writes_json_and_names_a_missing_file(tmp_path, capsys):
    path = tmp_path / "run.episodes.jsonl"
    path.write_text(json.dumps(episode("Action:\nturn left", "Thought:")) + "\n")
    main([str(path), "--top", "1", "--json", str(tmp_path / "census.json")])
    assert capsys.readouterr().out == (f"{path}: 2 replies; listed 0.500, unlisted 0.000, none 0.500, no list 0.000\n"
                                       "  most common: 'turn left' 0.500\n")
    [row] = json.loads((tmp_path / "census.json").read_text())
    assert row["listed"] == 0.5 and row["top_actions"] == [["turn left", 0.5]]
    with pytest.raises(SystemExit) as e:
        main([str(path), str(tmp_path / "missing.jsonl")])
    assert e.value.code == 2
    assert f"no such episodes file: {tmp_path / 'missing.jsonl'} (scripts/eval.py --out X" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "scripts/reply_census.py", str(tmp_path / "missing.jsonl")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such episodes file:" in done.stderr


def test_counts_add_up_an_empty_file_is_zeros_and_the_top_is_five_by_default(tmp_path, capsys):
    path = tmp_path / "run.episodes.jsonl"
    lines = [episode("Action:\nturn left", "Action:\nturn left", "", "Thought: no action"),
             episode("Action:\ncraft a", "Action:\ncraft b", listing="no list here"),
             episode(*(f"Action:\nact {i}" for i in range(6)))]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    row = census(str(path), top=3)
    assert row["replies"] == 12 and row["top_actions"][0] == ("turn left", 2 / 12)
    assert (row["listed"], row["none"], row["no list"]) == (2 / 12, 2 / 12, 2 / 12)
    empty = tmp_path / "empty.episodes.jsonl"
    empty.write_text(json.dumps(episode()) + "\n")  # only the scripted first reply
    assert census(str(empty), top=5) == {"file": str(empty), "replies": 0, "listed": 0.0, "unlisted": 0.0,
                                         "none": 0.0, "no list": 0.0, "top_actions": []}
    main([str(path)])
    assert capsys.readouterr().out.splitlines()[1] == (
        "  most common: 'turn left' 0.167; '(none)' 0.167; 'craft a' 0.083; 'craft b' 0.083; 'act 0' 0.083")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    assert capsys.readouterr().err.endswith(
        f"no such episodes file: {tmp_path / 'a.jsonl'}, {tmp_path / 'b.jsonl'} (scripts/eval.py --out X writes X's "
        "*.episodes.jsonl beside it)\n")


def test_help_says_what_it_reads_and_each_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for said in ("What a model's replies asked the env to do: a census of the actions in eval episodes.",
                 "scripts/eval.py's *.episodes.jsonl files", "how many of the most common actions to show",
                 "also write the census here"):
        assert said in text
