"""scripts/viz_trajectories.py: episodes of two real local runs (expert demos from the real BabyAI server, one of
them cut to a single turn) drawn side by side in a real headless browser (Debian's chromium), whose rendered text
is read back: every episode, turn and outcome; the item/outcome filters; text that looks like markup stays text."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest

from scripts import viz_trajectories as viz
from tests.env_server_proc import EnvServerProcess, require_venv

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")


def test_turns_of_reads_the_react_chat_with_per_turn_rewards():
    messages = [{"role": "user", "content": "instr"}, {"role": "assistant", "content": viz.ACKNOWLEDGEMENT},
                {"role": "user", "content": "obs0"},
                {"role": "assistant", "content": "Thought:\nlook first\n\nAction:\nturn left\n"},
                {"role": "user", "content": "obs1"}, {"role": "assistant", "content": "no action here"},
                {"role": "user", "content": "Invalid action"}]
    instruction, turns, final = viz.turns_of(messages, [0.0, 0.5])
    assert instruction == "instr" and final == "Invalid action"
    assert turns == [{"observation": "obs0", "thought": "look first", "action": "turn left", "reward": 0.0},
                     {"observation": "obs1", "thought": "", "action": "no action here", "reward": 0.5}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs on the same five BabyAI items: the expert, and the expert stopped after one turn."""
    require_venv("babyai")
    from scripts import make_demos as demos

    out = tmp_path_factory.mktemp("runs")
    (out / "trained").mkdir()
    with EnvServerProcess("babyai") as server:
        demos.main(["--env", "babyai", "--n", "5", "--url", server.url, "--out", str(out / "base.jsonl")])
        demos.main(["--env", "babyai", "--n", "5", "--url", server.url, "--max-turns", "1",
                    "--out", str(out / "trained" / "episodes.jsonl")])
    return out


def rendered(page: str, tmp_path, fragment: str = "") -> tuple[str, str]:
    """(text, markup) of the page (filter bar and episodes) after its script ran in headless chromium."""
    if BROWSER is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    profile = tmp_path / "profile"
    done = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run",
                           f"--user-data-dir={profile}", "--dump-dom", f"file://{page}{fragment}"],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    body = done.stdout.split('<div class="bar"', 1)[1].split('<script id="data"', 1)[0]
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body))), body


def test_page_renders_both_runs_side_by_side_in_chromium(runs, tmp_path):
    page = viz.main([f"base={runs / 'base.jsonl'}", f"trained={runs / 'trained'}", "--out", str(tmp_path / "t.html")])
    base = [json.loads(line) for line in (runs / "base.jsonl").read_text().splitlines()]
    trained = [json.loads(line) for line in (runs / "trained" / "episodes.jsonl").read_text().splitlines()]
    text, _ = rendered(page, tmp_path)
    assert f"{len(base) + len(trained)} episodes shown" in text
    for episode in base:
        assert f"item {episode['item_id']} base" in text
        for reply in episode["messages"][3::2]:
            assert viz.split_reply(reply["content"])[1] in text  # every action of every turn
    wins = sum(e["success"] for e in trained)
    assert text.count("· failure ·") == len(trained) - wins + sum(not e["success"] for e in base)
    assert "Your goal:" in text  # the server's observations

    lost = next(e for e in trained if not e["success"])  # cut after one turn: at least one item needs more
    only, markup = rendered(page, tmp_path, f"#item={lost['item_id']}&outcome=failure")
    assert "1 episodes shown" in only and f"item {lost['item_id']} base no matching episode trained" in only
    assert markup.count("<h2>") == 1 and markup.count('class="episode ') == 1


def test_markup_in_episodes_stays_text(tmp_path):
    row = {"item_id": "x", "reward": 0.0, "success": False, "turn_rewards": [0.0],
           "messages": [{"role": "user", "content": "go"},
                        {"role": "assistant", "content": "Thought:\nhm\n\nAction:\n</script><b>bold</b>"},
                        {"role": "user", "content": "<img src=x onerror=alert(1)>"}]}
    (tmp_path / "run.jsonl").write_text(json.dumps(row) + "\n")
    page = viz.main([f"odd={tmp_path / 'run.jsonl'}", "--out", str(tmp_path / "odd.html")])
    text, markup = rendered(page, tmp_path)
    assert "<b>" not in markup and "<img" not in markup
    assert "</script><b>bold</b>" in text and "<img src=x onerror=alert(1)>" in text


def test_bad_input_says_what_is_wrong(tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"prompt": "babyai/1", "label": "1"}\n')
    with pytest.raises(SystemExit, match="no episodes"):
        viz.main([f"ids={tmp_path / 'ids.jsonl'}", "--out", str(tmp_path / "x.html")])
    with pytest.raises(SystemExit, match="neither an episode JSONL file nor a directory"):
        viz.main([f"gone={tmp_path / 'missing'}"])


def test_an_observation_that_opens_a_script_escape_does_not_blank_the_page(tmp_path):
    """Was: "<!--<script>" in the data block (only "</" was escaped) made the HTML parser swallow the page's end tag
    of the data script: 0 of 2 episodes rendered."""
    rows = [{"item_id": str(i), "reward": 0.0, "success": False, "turn_rewards": [0.0],
             "messages": [{"role": "user", "content": "go"},
                          {"role": "assistant", "content": "Thought:\nhm\n\nAction:\nlook"},
                          {"role": "user", "content": obs}]}
            for i, obs in enumerate(["a comment <!--<script> opens here", "<!-- --!> <script></script> -->"])]
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    page = viz.main([f"odd={tmp_path / 'run.jsonl'}", "--out", str(tmp_path / "odd.html")])
    assert "<!--" not in open(page).read().split('<script id="data"', 1)[1].split("</script>", 1)[0]
    text, _ = rendered(page, tmp_path)
    assert "2 episodes shown" in text
    assert "a comment <!--<script> opens here" in text and "<!-- --!> <script></script> -->" in text
