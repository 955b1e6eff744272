"""The SearchQA server, run for real from .venvs/searchqa: BM25 search, exact-match answers, sessions, files."""

import json
import os
import subprocess

import pytest

from tests.env_server_proc import (ROOT, EnvServerProcess, check_crafted_actions, check_no_cross_talk,
                                   expert_episode, require_venv, server_fixture, venv_python)

pytestmark = pytest.mark.timeout(120)
# AgentGym's texts (tests/test_parity_searchqa.py compares them with AgentGym's own code)
PROMPT_START = "You must reason inside <think>...</think> first."
CORRECT = "Congratulations! You have answered the question correctly."
INCORRECT = "Sorry, your answer is incorrect. Please try again."
INVALID = ("Your previous action is invalid. If you want to search, you should put the query between <search> and "
           "</search>. If you want to give the final answer, you should put the answer between <answer> and </answer>. "
           "Please try again.")
server = server_fixture("searchqa")
DATA = os.path.join(ROOT, "env_gateway", "servers", "data", "searchqa")


def shipped_items() -> list[dict]:
    with open(os.path.join(DATA, "qa.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_expert_searches_then_answers(server):
    items = shipped_items()
    for data_idx in (0, 31, len(items) - 1):
        first, steps = expert_episode(server, data_idx)
        assert first["observation"].startswith(PROMPT_START)
        assert first["observation"].endswith(f"\n\n Question: {items[data_idx]['question']}")
        assert (first["reward"], first["done"]) == (0, False)
        (search, found), (answer, last) = steps
        assert search == f"<search>{items[data_idx]['question']}</search>"
        assert found["observation"].startswith("<information>Doc 1(Title: ") and not found["done"]
        assert answer == f"<answer>{items[data_idx]['answers'][0]}</answer>"
        assert last == {"observation": CORRECT, "reward": 1, "done": True}


def test_search_ranks_the_supporting_passage_first(server):
    # the shipped questions each name one supporting passage; BM25 on the question finds it at rank 1 or 2
    with open(os.path.join(DATA, "corpus.jsonl")) as f:
        titles = {d["id"]: d["title"] for d in map(json.loads, f)}
    env_id = server.ok("POST", "/create")["id"]
    server.ok("POST", "/reset", {"id": env_id, "data_idx": 0})
    top1 = 0
    for item in shipped_items():
        action = f"<search>{item['question']}</search>"
        obs = server.ok("POST", "/step", {"id": env_id, "action": action})["observation"]
        docs = obs[len("<information>"):-len("</information>")].split("\n")
        assert len(docs) == 3
        top1 += docs[0].startswith(f"Doc 1(Title: {titles[item['doc_id']]})")
    assert top1 >= 0.9 * len(shipped_items())
    server.ok("POST", "/close", {"id": env_id})


def test_answers_exact_match_after_normalisation_and_wrong_answers_do_not_end(server):
    env_id = server.ok("POST", "/create")["id"]
    server.ok("POST", "/reset", {"id": env_id, "data_idx": 0})  # capital of Australia: Canberra
    step = lambda a: server.ok("POST", "/step", {"id": env_id, "action": a})  # noqa: E731
    assert step("Thought:\nguess\n\nAction:\n<answer>Sydney</answer>") == \
        {"observation": INCORRECT, "reward": 0, "done": False}
    assert step("<answer>canberra city</answer>")["reward"] == 0  # exact match, not containment
    assert step("<answer>Canberra</answer>, no: <answer>Sydney</answer>")["reward"] == 0  # the last answer counts
    assert step("<answer> The Canberra. </answer>") == {"observation": CORRECT, "reward": 1, "done": True}
    assert step("<answer>Sydney</answer>") == {"observation": INCORRECT, "reward": 0, "done": False}  # as AgentGym
    server.ok("POST", "/close", {"id": env_id})


def test_garbage_action_is_an_invalid_action_not_an_error(server):
    env_id = server.ok("POST", "/create")["id"]
    server.ok("POST", "/reset", {"id": env_id, "data_idx": 2})
    for garbage in ("the answer is Mars", "<search>unclosed", "<answer></search>"):
        reply = server.ok("POST", "/step", {"id": env_id, "action": garbage})
        assert reply["observation"] == INVALID
        assert reply["reward"] == 0 and reply["done"] is False
    assert server.ok("POST", "/close", {"id": env_id}) == {"closed": env_id}
    assert server.call("POST", "/step", {"id": env_id, "action": "<answer>x</answer>"})[0] == 404


def test_fifty_concurrent_sessions_follow_their_own_items(server):
    check_no_cross_talk(server, list(range(50)), steps=2)


def test_same_item_same_first_observation_across_restarts(server):
    require_venv("searchqa")
    firsts = [expert_episode(server, i, max_turns=1) for i in (0, 17, 59)]
    with EnvServerProcess("searchqa") as other:
        assert [expert_episode(other, i, max_turns=1) for i in (0, 17, 59)] == firsts


def test_corpus_and_qa_files_given_by_path(tmp_path):
    require_venv("searchqa")
    corpus, qa = tmp_path / "corpus.jsonl", tmp_path / "qa.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "title": t, "text": x}) + "\n" for i, (t, x) in enumerate(
        [("Zorblat", "Zorblat is a made-up mineral mined on the island of Quennic."),
         ("Quennic", "Quennic is a fictional island whose capital is Harrowmere.")])))
    qa.write_text(json.dumps({"question": "Where is zorblat mined?", "answers": ["Quennic"]}) + "\n")
    with EnvServerProcess("searchqa", "--corpus", str(corpus), "--qa", str(qa), "--topk", "1") as srv:
        env_id = srv.ok("POST", "/create")["id"]
        assert srv.ok("POST", "/reset", {"id": env_id, "data_idx": 0})["observation"].endswith(
            "\n\n Question: Where is zorblat mined?")
        found = srv.ok("POST", "/step", {"id": env_id, "action": "<search>zorblat mineral</search>"})
        assert found["observation"] == ("<information>Doc 1(Title: Zorblat) Zorblat is a made-up mineral mined on "
                                        "the island of Quennic.</information>")
        assert srv.call("POST", "/reset", {"id": env_id, "data_idx": 1})[0] == 400  # only one question
    bad = subprocess.run([venv_python("searchqa"), "-m", "env_gateway.servers.searchqa", "--qa",
                          str(tmp_path / "missing.jsonl")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "file not found" in bad.stderr


def test_crafted_tag_soup_answers_fast(server):
    """A backtracking tag regex took ~2.5 s on "<search>" * 8000 (64K characters) and held the server meanwhile.
    Over max_action_chars (4096) the action is an invalid action, unparsed; under it the tag search is one pass."""
    over, under = "<search>" * 8000, "<search>" * 500 + "</search>"
    replies = check_crafted_actions(server, {"data_idx": 2}, [over, under])
    assert replies[0]["observation"].startswith("Invalid action: the action is 64000 characters long, over the 4096")
    assert replies[1]["observation"].startswith("<information>")  # the leftmost pair: a query of 499 open tags
    assert all(r["reward"] == 0 and r["done"] is False for r in replies)
