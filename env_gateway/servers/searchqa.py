"""SearchQA: question answering with a search tool, AgentGym's SearchQA server (agentenv-searchqa at 3ef9235) on a
local corpus with BM25 in place of its e5 index over Wikipedia.

Files (CLI options, defaults: the small set shipped in env_gateway/servers/data/searchqa/, written for this
project): ``--corpus`` JSONL of ``{"id", "title", "text"}`` passages, ``--qa`` JSONL of
``{"question", "answers": [...]}``. ``data_idx`` indexes the QA file. Splits are ranges, test first (as AgentGym's
SearchQA ids): test = the first 20%, dev = the next 10%, train = the rest.

What the agent sees and earns is AgentGym's (``tests/test_parity_searchqa.py`` runs AgentGym's own step code on the
same items and actions):
  reset -> ``AGENTGYM_PROMPT`` + " Question: <question>";
  the first complete ``<search>...</search>`` or ``<answer>...</answer>`` pair decides the action (``first_tag``,
  found in one pass, where a backtracking regex took seconds on ``"<search>" * 8000``):
  search -> ``<information>Doc 1(Title: t) text`` one line per passage, the ``--topk`` best BM25 passages, stripped
            ``</information>``, reward 0;
  answer -> reward = exact match of the LAST ``<answer>...</answer>`` in the action (stripped) with a gold answer,
            both normalised as AgentGym does (lower case, ASCII punctuation dropped, the words a/an/the dropped,
            whitespace collapsed); 1 ends the episode ("Congratulations! ..."), 0 does not ("Sorry, ...");
  anything else -> AgentGym's invalid-action text, reward 0, not done.
As in AgentGym, a step after the correct answer is played like any other. Differences, by design: an action over
``max_action_chars`` (4096) or with a lone surrogate is the base server's invalid action; retrieval is BM25 over the
given corpus (AgentGym: e5 dense retrieval over wiki-18), so a search returns other passages than AgentGym's.
Expert (GET /expert): ``<search>question</search>`` first, then ``<answer>gold answer</answer>``.
The retriever is ``rank_bm25.BM25Okapi`` over lower-cased word tokens of title + text, built once and shared.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import string
from dataclasses import dataclass

from rank_bm25 import BM25Okapi

from env_gateway.servers._base import EnvServer, RequestError, serve

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "searchqa")
DEFAULT_CORPUS = os.path.join(DATA_DIR, "corpus.jsonl")
DEFAULT_QA = os.path.join(DATA_DIR, "qa.jsonl")
# AgentGym's texts (agentenv-searchqa at 3ef9235), reproduced as the environment's output.
AGENTGYM_PROMPT = (
    "You must reason inside <think>...</think> first. If you do not have enough knowledge, issue a "
    "<search>...</search> and then STOP. Do not generate <information> or <answer> yet. Wait for external input "
    "wrapped in <information>...</information>. After receiving information, reason again in <think>. If confident, "
    "output your final answer in <answer>...</answer>. Do not output <answer> before receiving <information> unless "
    "you are fully confident. If you find no further external knowledge needed, you can directly provide the answer "
    "inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Follow "
    "this process every time.\n\n")
CORRECT = "Congratulations! You have answered the question correctly."
INCORRECT = "Sorry, your answer is incorrect. Please try again."
INVALID = ("Your previous action is invalid. If you want to search, you should put the query between <search> and "
           "</search>. If you want to give the final answer, you should put the answer between <answer> and </answer>. "
           "Please try again.")
SPLIT_FRACTIONS = {"test": (0.0, 0.2), "dev": (0.2, 0.3), "train": (0.3, 1.0)}


def first_tag(action: str) -> tuple[str, str] | None:
    """(kind, inner text) of the leftmost ``<kind>...</kind>`` in ``action`` (kind: search or answer; the inner text
    ends at the first closing tag), or None. Only the first opening tag of a kind can start the leftmost pair: a
    closing tag after any later one is also after the first."""
    found = []
    for kind in ("search", "answer"):
        start = action.find(f"<{kind}>")
        end = -1 if start == -1 else action.find(f"</{kind}>", start + len(kind) + 2)
        if end != -1:
            found.append((start, kind, action[start + len(kind) + 2:end]))
    return min(found)[1:] if found else None


def last_answer(action: str) -> str | None:
    """The inner text, stripped, of the last ``<answer>...</answer>`` of the pairs found left to right (each inner
    text ends at the first closing tag after its opening tag, the next pair starts after it), or None."""
    found, pos = None, 0
    while (start := action.find("<answer>", pos)) != -1 and (end := action.find("</answer>", start + 8)) != -1:
        found, pos = action[start + 8:end].strip(), end + 9
    return found


def tokenize(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


ARTICLES = re.compile(r"\b(a|an|the)\b")
ASCII_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, ASCII punctuation dropped, then the words a/an/the (between word boundaries), whitespace collapsed:
    AgentGym's normalisation, in its order (the punctuation goes first: "the." loses "the", "the-end" becomes
    "theend")."""
    return " ".join(ARTICLES.sub(" ", text.lower().translate(ASCII_PUNCTUATION)).split())


def read_jsonl(path: str, required: tuple[str, ...]) -> list[dict]:
    if not os.path.exists(path):
        raise SystemExit(f"searchqa: file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [k for k in required if k not in row]
            if missing:
                raise SystemExit(f"searchqa: {path} line {n} lacks field(s) {missing}; "
                                 f"each line needs {list(required)}")
            rows.append(row)
    if not rows:
        raise SystemExit(f"searchqa: {path} has no rows")
    return rows


def split_ids(n_items: int, split: str) -> list[int]:
    if split not in SPLIT_FRACTIONS:
        raise RequestError(400, "bad_split", f"split must be one of {sorted(SPLIT_FRACTIONS)}, got {split!r}")
    lo, hi = SPLIT_FRACTIONS[split]
    return list(range(round(lo * n_items), round(hi * n_items)))


def item_ids(split: str, qa: str = DEFAULT_QA) -> list[int]:
    return split_ids(len(read_jsonl(qa, ("question", "answers"))), split)


@dataclass
class Episode:
    item: dict | None = None
    searched: bool = False
    done: bool = False


class SearchQAServer(EnvServer):
    name = "searchqa"

    def __init__(self, max_instances: int = 256, workers: int = 8, corpus: str = DEFAULT_CORPUS,
                 qa: str = DEFAULT_QA, topk: int = 3):
        super().__init__(max_instances=max_instances, workers=workers)
        self.docs = read_jsonl(corpus, ("title", "text"))
        self.items = read_jsonl(qa, ("question", "answers"))
        self.topk = topk
        self.bm25 = BM25Okapi([tokenize(f"{d['title']} {d['text']}") for d in self.docs])

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--corpus", default=DEFAULT_CORPUS, help="JSONL passages {id, title, text}")
        parser.add_argument("--qa", default=DEFAULT_QA, help="JSONL questions {question, answers: [...]}")
        parser.add_argument("--topk", type=int, default=3, help="passages returned per search")

    def new_env(self) -> Episode:
        return Episode()

    def num_items(self) -> int:
        return len(self.items)

    def item_ids(self, split: str) -> list[int]:
        return split_ids(len(self.items), split)

    def search(self, query: str) -> list[dict]:
        scores = self.bm25.get_scores(tokenize(query))
        best = sorted(range(len(self.docs)), key=lambda i: (-scores[i], i))[: self.topk]
        return [self.docs[i] for i in best]

    def reset(self, ep: Episode, data_idx: int) -> dict:
        ep.item, ep.searched, ep.done = self.items[data_idx], False, False
        return {"observation": self.observation(ep), "reward": 0, "done": False}

    def observation(self, ep: Episode) -> str:
        if ep.item is None:
            raise RequestError(409, "not_reset", "this instance has not been reset: POST /reset first")
        return f"{AGENTGYM_PROMPT} Question: {ep.item['question'].strip()}"

    def step(self, ep: Episode, action: str) -> dict:
        tag = first_tag(action)
        if tag is None:
            return {"observation": INVALID, "reward": 0, "done": False}
        if tag[0] == "search":
            ep.searched = True
            docs = "".join(f"Doc {n}(Title: {d['title']}) {d['text']}\n"
                           for n, d in enumerate(self.search(tag[1].strip()), 1))
            return {"observation": f"<information>{docs.strip()}</information>", "reward": 0, "done": False}
        answer = last_answer(action)
        if normalize_answer(answer) in {normalize_answer(a) for a in ep.item["answers"]}:
            ep.done = True
            return {"observation": CORRECT, "reward": 1, "done": True}
        return {"observation": INCORRECT, "reward": 0, "done": False}

    def expert_action(self, ep: Episode) -> str:
        if ep.done:
            raise RequestError(409, "episode_over", "the question is already answered: reset first")
        if not ep.searched:
            return f"<search>{ep.item['question']}</search>"
        return f"<answer>{ep.item['answers'][0]}</answer>"


if __name__ == "__main__":
    serve(SearchQAServer)
