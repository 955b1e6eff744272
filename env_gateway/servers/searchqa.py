"""SearchQA: question answering with a search tool, as an AgentGym-protocol server (BM25 over a local corpus).

Files (CLI options, defaults: the small set shipped in env_gateway/servers/data/searchqa/, written for this
project): ``--corpus`` JSONL of ``{"id", "title", "text"}`` passages, ``--qa`` JSONL of
``{"question", "answers": [...]}``. ``data_idx`` indexes the QA file. Splits are ranges, test first (as AgentGym's
SearchQA ids): test = the first 20%, dev = the next 10%, train = the rest.

Actions (the first complete tag pair in the text counts, ``first_tag``; found in one pass, where a backtracking regex
took seconds on ``"<search>" * 8000``):
  ``<search>query</search>`` -> ``<information>`` the ``--topk`` best BM25 passages ``</information>``, reward 0;
  ``<answer>text</answer>``  -> exact match against the gold answers after normalisation (lower case, no
                                punctuation, no articles a/an/the, single spaces): reward 1 and done when it
                                matches; otherwise reward 0, not done, and the observation says it was wrong;
  anything else               -> an invalid-action observation, reward 0, not done.
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


def tokenize(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


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
        return f"Question: {ep.item['question']}"

    def step(self, ep: Episode, action: str) -> dict:
        if ep.done:
            return {"observation": "The question is already answered: reset to start another.", "reward": 0,
                    "done": True}
        tag = first_tag(action)
        if tag is None:
            return {"observation": "Invalid action: write <search>your query</search> to search, or "
                                   "<answer>your answer</answer> to answer.", "reward": 0, "done": False}
        kind, text = tag[0], tag[1].strip()
        if kind == "search":
            ep.searched = True
            docs = "\n".join(f"Doc {n} (Title: {d['title']}) {d['text']}" for n, d in enumerate(self.search(text), 1))
            return {"observation": f"<information>{docs}</information>", "reward": 0, "done": False}
        if normalize_answer(text) in {normalize_answer(a) for a in ep.item["answers"]}:
            ep.done = True
            return {"observation": "Your answer is correct.", "reward": 1, "done": True}
        return {"observation": "Your answer is incorrect.", "reward": 0, "done": False}

    def expert_action(self, ep: Episode) -> str:
        if ep.done:
            raise RequestError(409, "episode_over", "the question is already answered: reset first")
        if not ep.searched:
            return f"<search>{ep.item['question']}</search>"
        return f"<answer>{ep.item['answers'][0]}</answer>"


if __name__ == "__main__":
    serve(SearchQAServer)
