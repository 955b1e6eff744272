"""AgentGym's SearchQA step code (agentenv-searchqa at 3ef9235) run in-process, the reference of
tests/test_parity_searchqa.py.

    .venvs/searchqa/bin/python tests/agentgym_searchqa_reference.py AGENTGYM_PKG_DIR CORPUS QA < cases > replies

AgentGym's server needs its e5 index over Wikipedia, a retriever model and its query parquet files, none of which
are here, so its ``env_wrapper`` module is imported with three stand-ins (named, and nothing else replaced):
``datasets.load_dataset`` hands it the QA file's rows as its test split (``{question, reward_model: {ground_truth:
{target: answers}}}``; data_idx i is AgentGym's test item i), its retriever returns the built-in server's BM25
ranking of the corpus as its documents (``contents`` = title, newline, text, as in its wiki-18 corpus), and its
``utils`` module (which loads transformers for the retriever) is a plain config holder. Everything else that runs --
the action parsing, the observation texts, the reward (its ``reward_score`` package), done -- is AgentGym's own code.

stdin: a JSON list of ``{"data_idx": int, "actions": [str, ...]}``; stdout: a JSON list of
``{"first": observation after reset, "steps": [[observation, reward, done], ...]}``, one per case.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from env_gateway.servers.searchqa import SearchQAServer  # noqa: E402


def import_agentgym_env_wrapper(package_dir: str, builtin: SearchQAServer) -> types.ModuleType:
    rows = [{"question": item["question"], "reward_model": {"ground_truth": {"target": item["answers"]}}}
            for item in builtin.items]

    class BM25StandIn:
        def search(self, query: list[str], num: int, return_score: bool):
            docs = [{"contents": f"{d['title']}\n{d['text']}"} for d in builtin.search(query[0])[:num]]
            return docs, [0.0] * len(docs)

    datasets = types.ModuleType("datasets")
    datasets.load_dataset = lambda kind, data_files, **_: {
        "train": rows if data_files.endswith("test.parquet") else []}
    utils = types.ModuleType("agentenv_searchqa.utils")
    utils.Config = lambda **kwargs: types.SimpleNamespace(**kwargs)
    retriever = types.ModuleType("agentenv_searchqa.retriever")
    retriever.get_retriever = lambda config: BM25StandIn()
    package = types.ModuleType("agentenv_searchqa")  # its __init__ would start the FastAPI app: only the path
    package.__path__ = [package_dir]
    sys.modules.update({"datasets": datasets, "agentenv_searchqa": package, "agentenv_searchqa.utils": utils,
                        "agentenv_searchqa.retriever": retriever})
    return importlib.import_module("agentenv_searchqa.env_wrapper")


def main() -> None:
    package_dir, corpus, qa = sys.argv[1:4]
    wrapper = import_agentgym_env_wrapper(package_dir, SearchQAServer(corpus=corpus, qa=qa))
    server = wrapper.searchqa_env_server
    out = []
    with contextlib.redirect_stdout(sys.stderr):  # AgentGym prints on close: stdout carries only the replies
        for case in json.load(sys.stdin):
            env_idx = server.create(case["data_idx"])
            server.reset(env_idx, case["data_idx"])
            first = server.observation(env_idx)
            steps = [list(server.step(env_idx, action)[:3]) for action in case["actions"]]
            server.close(env_idx)
            out.append({"first": first, "steps": steps})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
