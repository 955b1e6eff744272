"""Parity: the built-in SearchQA server against AgentGym's own SearchQA step code (agentenv-searchqa at 3ef9235).

AgentGym's server cannot start here (its e5 index over Wikipedia and its query files are downloads), so its
``env_wrapper`` runs in-process in ``tests/agentgym_searchqa_reference.py`` with its retriever and dataset loader
replaced by stand-ins that hand it the shipped QA items and the built-in's BM25 ranking; the parsing, texts, reward
and done are AgentGym's own code. Every shipped item (60) and two made-up ones (``EXTRA_ITEMS``) are reset on both
and given the same actions: a fixed script (``script``: searches, garbage, unclosed and mixed tags, wrong answers,
the gold answer re-cased, with punctuation and articles, several answers where the last one counts, steps after the
correct answer) and 40 actions drawn from tag fragments, the gold answer and tricky characters (seeded). Compared:
the first observation, and the observation, reward and done of every step. Exceptions by design, not exercised:
actions over 4096 characters or with a lone surrogate are the built-in's invalid actions; a search returns the
built-in's BM25 passages (AgentGym: e5 over wiki-18), which is why the stand-in ranks with them.

Before the built-in followed AgentGym (its own texts; the first answer pair scored; articles dropped word by word;
steps after the correct answer refused): first observation 0/62, steps 0/3658 (reward and done equal 496/3658);
after: 62/62 and 3658/3658. Seen failing with only the last-answer rule undone (reward and done 3534/3658) and with
only the normalisation's order undone (3657/3658: "the«guillemets»").
"""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest

from tests.agentgym_proc import AGENTGYM_DIR
from tests.env_server_proc import ROOT, EnvServerProcess, require_venv, venv_python

pytestmark = pytest.mark.timeout(180)
DATA = os.path.join(ROOT, "env_gateway", "servers", "data", "searchqa")
PACKAGE = os.path.join(AGENTGYM_DIR, "agentenv-searchqa", "agentenv_searchqa")
FRAGMENTS = ("<search>", "</search>", "<answer>", "</answer>", "<answer>", "</answer>", "GOLD", "the", " a ", " ",
             "x", ".", "\n", "«", "-", "Thought: ", "<think>", "</think>", "AN")
RANDOM_ACTIONS = 40
# Golds where AgentGym's order of normalisation matters: an article next to a character that is neither a word
# character nor ASCII punctuation is dropped ("the«x»" -> "«x»"), which dropping whole words would keep.
EXTRA_ITEMS = [{"question": "Which quote marks does the style guide use?", "answers": ["«guillemets»"]},
               {"question": "What is the unit of the answer?", "answers": ["the €uro"]}]


def script(question: str, gold: str) -> list[str]:
    return [f"<search>{question}</search>", "the answer is 42", "<search>unclosed", "<answer></search>",
            "<ANSWER>x</ANSWER>", "<search></search>", "<answer>definitely wrong</answer>",
            f"<answer>{gold.upper()}.</answer>", f"<answer>the« {gold}</answer>", f"<answer>{gold} the-end</answer>",
            f"<answer>the{gold}</answer>",
            f"<answer>{gold}</answer><answer>wrong</answer>", f"<search>x</search><answer>{gold}</answer>",
            f"<answer>a<search>{gold}</search>", f"<answer><answer>{gold}</answer></answer>",
            f"Thought:\nsure\n\nAction:\n<answer>wrong</answer> no, <answer> An {gold}! </answer>",
            f"<answer>{gold}</answer>", f"<search>{gold}</search>", "<answer>wrong</answer>"]


def random_actions(rng: random.Random, gold: str) -> list[str]:
    return ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12))).replace("GOLD", gold)
            for _ in range(RANDOM_ACTIONS)]


def test_builtin_server_matches_agentgyms_step_code_item_for_item(tmp_path):
    if not os.path.isdir(PACKAGE):
        pytest.skip(f"no AgentGym checkout at {AGENTGYM_DIR} (set AGENTGYM_DIR to AgentGym at 3ef9235): the SearchQA "
                    "parity test runs AgentGym's own step code")
    require_venv("searchqa")
    with open(os.path.join(DATA, "qa.jsonl")) as f:
        items = [json.loads(line) for line in f if line.strip()] + EXTRA_ITEMS
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(item) + "\n" for item in items))
    rng = random.Random(0)
    cases = [{"data_idx": i, "actions": script(item["question"], item["answers"][0])
              + random_actions(rng, item["answers"][0])} for i, item in enumerate(items)]
    reference = subprocess.run(
        [venv_python("searchqa"), os.path.join(ROOT, "tests", "agentgym_searchqa_reference.py"), PACKAGE,
         os.path.join(DATA, "corpus.jsonl"), str(qa)],
        input=json.dumps(cases), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert reference.returncode == 0, reference.stderr[-3000:]
    theirs = json.loads(reference.stdout)

    with EnvServerProcess("searchqa", "--qa", str(qa)) as server:
        counts, mismatches = compare(server, cases, theirs)
    report = (f"SearchQA parity, built-in vs AgentGym's step code: first observation {counts[0]}/{len(cases)}, "
              f"steps {counts[1]}/{counts[3]} (reward and done {counts[2]}/{counts[3]})")
    print("\n" + report + "".join(f"\n  {m[:400]}" for m in mismatches[:5]))
    assert not mismatches, report + "\n" + "\n".join(m[:400] for m in mismatches[:5])


def compare(server, cases: list[dict], theirs: list[dict]) -> tuple[tuple[int, int, int, int], list[str]]:
    """(first observations equal, steps equal, steps with equal reward and done, steps), and the differences."""
    env_id = server.ok("POST", "/create")["id"]
    first_equal, steps_equal, rewards_equal, steps, mismatches = 0, 0, 0, 0, []
    for case, ref in zip(cases, theirs):
        first = server.ok("POST", "/reset", {"id": env_id, "data_idx": case["data_idx"]})["observation"]
        first_equal += first == ref["first"]
        if first != ref["first"]:
            mismatches.append(f"data_idx {case['data_idx']} first observation: {first!r} vs {ref['first']!r}")
        for action, (observation, reward, done) in zip(case["actions"], ref["steps"]):
            ours = server.ok("POST", "/step", {"id": env_id, "action": action})
            same = (ours["observation"], float(ours["reward"]), ours["done"]) == (observation, float(reward), done)
            steps, steps_equal = steps + 1, steps_equal + same
            rewards_equal += (float(ours["reward"]), ours["done"]) == (float(reward), done)
            if not same:
                mismatches.append(f"data_idx {case['data_idx']}, {action!r}: {ours} vs {[observation, reward, done]}")
    server.ok("POST", "/close", {"id": env_id})
    return (first_equal, steps_equal, rewards_equal, steps), mismatches
