"""scripts/eval.py --engine openai (issue 60): any OpenAI-compatible server scored through the same agent funcs.

Against a stand-in server on loopback (aiohttp, real sockets; fast): what each API sends (token ids with
``return_token_ids``, text, the episode's messages; the request's seed, budget, temperature; the key from a
.secrets/ file in the Authorization header) and how each reply comes back (the server's token ids, else the text
encoded here with the end token); retries of 5xx, a 4xx stopping with the server's message with the key redacted, the
per-request deadline, an unreachable server, a model the server does not serve; then eval.py's main end to end
through the real BabyAI server and gateway. Against a real ``vllm serve`` of a tiny checkpoint (``-m slow``): the
completions API with token ids in and out, and the chat API.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from aiohttp import web

from tests.conftest import ROOT
from tests.threaded_app import ThreadedApp
from tests.tiny_hf import tiny_checkpoint, tiny_tokenizer

KEY = "sk-stand-in-key-31337"
REPLY = "Thought:\nI turn.\n\nAction:\nturn left"


def load_eval():
    import importlib

    return importlib.import_module("scripts.eval")


class StandInOpenAI(ThreadedApp):
    """A scripted STAND-IN for an OpenAI-compatible server: ``/v1/models`` lists ``policy``; ``/v1/completions`` and
    ``/v1/chat/completions`` answer ``REPLY`` (token ids too when asked, unless ``with_ids`` is off), and record each
    request's path, Authorization header and body. ``fail`` holds statuses to answer first (one per request, the
    400 quoting the request's Authorization header back, as a careless server might); ``delay`` delays answers."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[dict] = []
        self.fail: list[int] = []
        self.delay = 0.0
        self.with_ids = True
        self.tok = tiny_tokenizer()

    async def answer(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"path": request.path, "authorization": request.headers.get("Authorization"),
                              "body": body})
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            status = self.fail.pop(0)
            return web.json_response({"error": f"bad request from {request.headers.get('Authorization')}"},
                                     status=status)
        choice = {"index": 0, "finish_reason": "stop", "stop_reason": None}
        if request.path.endswith("/chat/completions"):
            choice["message"] = {"role": "assistant", "content": REPLY}
        else:
            choice["text"] = REPLY
            if self.with_ids and body.get("return_token_ids"):
                choice["token_ids"] = self.tok(REPLY, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return web.json_response({"id": "x", "object": "text_completion", "model": body.get("model"),
                                  "choices": [choice]})

    def routes(self) -> list:
        return [web.post("/v1/completions", self.answer), web.post("/v1/chat/completions", self.answer),
                web.get("/v1/models", lambda _: web.json_response({"data": [{"id": "policy"}]}))]


@pytest.fixture
def server():
    with StandInOpenAI() as app:
        yield app


def backend(ev, server, api: str, **kwargs):
    return ev.OpenAIBackend(server.url, "policy", tiny_tokenizer(), temperature=0.7, api=api, **kwargs)


def test_each_api_sends_the_request_its_server_expects_and_keeps_token_in_token_out(server):
    ev = load_eval()
    tok = tiny_tokenizer()
    reply_ids = tok(REPLY, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prompt = tok("Your goal: pick up the key", add_special_tokens=False)["input_ids"]
    chat = [{"role": "user", "content": "Your goal: pick up the key"}]

    ids = backend(ev, server, "completions", api_key=KEY)
    replies = ids.generate([(prompt, 12, 7), (prompt[:3], 5, None)])
    assert [r.token_ids for r in replies] == [reply_ids, reply_ids] and ids.retokenized == 0
    assert [(r.text, r.finish_reason, r.logprobs) for r in replies] == [(REPLY, "stop", None)] * 2
    first, second = (r["body"] for r in server.requests)
    assert first == {"model": "policy", "prompt": prompt, "max_tokens": 12, "temperature": 0.7, "top_p": 1.0,
                     "seed": 7, "return_token_ids": True}
    assert "seed" not in second and second["max_tokens"] == 5 and second["prompt"] == prompt[:3]
    assert {r["path"] for r in server.requests} == {"/v1/completions"}
    assert {r["authorization"] for r in server.requests} == {f"Bearer {KEY}"}

    server.requests.clear()
    server.with_ids = False  # a server without vLLM's return_token_ids: its text, encoded here, plus the end token
    assert ids.generate([(prompt, 12, 3)])[0].token_ids == reply_ids and ids.retokenized == 1
    text = backend(ev, server, "completions-text")
    assert text.generate([(prompt, 12, 3)])[0].token_ids == reply_ids
    assert server.requests[-1]["body"]["prompt"] == tok.decode(prompt) and server.requests[-1]["authorization"] is None
    chats = backend(ev, server, "chat")
    assert chats.generate([(prompt, 9, 4)], [chat])[0].token_ids == reply_ids
    assert server.requests[-1]["path"] == "/v1/chat/completions"
    assert server.requests[-1]["body"] == {"model": "policy", "messages": chat, "max_tokens": 9, "temperature": 0.7,
                                           "top_p": 1.0, "seed": 4}
    with pytest.raises(ValueError, match="needs the episode's messages"):
        chats.generate([(prompt, 9, 4)])
    assert ids.served_models() == ["policy"]


@pytest.mark.timeout(60)
def test_failures_retries_deadlines_and_the_key_kept_out_of_messages(server, tmp_path):
    ev = load_eval()
    prompt = [5, 6, 7]
    server.fail = [503, 500]  # retried (after 1 s, then 2 s; shortened here)
    retrying = backend(ev, server, "completions")
    retrying.backoff_s = 0.05
    assert retrying.generate([(prompt, 4, 1)])[0].text == REPLY
    assert len(server.requests) == 3
    server.fail = [400]  # not retried; the server quoted the key back: it is redacted
    key_file = tmp_path / ".secrets" / "api_key"
    key_file.parent.mkdir()
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    with pytest.raises(RuntimeError, match=r"answered 400: .*Bearer \[redacted\]") as caught:
        backend(ev, server, "completions", api_key=ev.read_api_key(str(key_file))).generate([(prompt, 4, 1)])
    assert KEY not in str(caught.value) and len(server.requests) == 4
    server.delay = 5.0
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"TimeoutError.*\(after 1 tries\)"):
        backend(ev, server, "completions", timeout=0.5, retries=0).generate([(prompt, 4, 1)])
    assert time.monotonic() - started < 3
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(SystemExit, match=f"cannot reach {closed}/v1 .*is the server up"):
        ev.OpenAIBackend(closed, "policy", tiny_tokenizer(), 0.0).served_models()
    # the key: only from a one-line, owner-only file in a .secrets folder
    (tmp_path / "elsewhere").write_text(KEY)
    with pytest.raises(SystemExit, match="is not in a .secrets/ folder"):
        ev.read_api_key(str(tmp_path / "elsewhere"))
    key_file.chmod(0o644)
    with pytest.raises(SystemExit, match="can be read by others"):
        ev.read_api_key(str(key_file))
    assert ev.openai_base_url("http://h:1/") == ev.openai_base_url("http://h:1/v1") == "http://h:1/v1"


# ---- eval.py end to end through the real BabyAI server and gateway --------------------------------------------------
from tests.test_eval import agent_env, babyai_gateway  # noqa: E402,F401  (fixtures: the BabyAI server and gateway)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_eval_scores_an_openai_endpoint_through_babyai(babyai_gateway, agent_env, server, tmp_path, api):  # noqa: F811
    """Each episode's turns reach the server with their own seeds (distinct over items, trials and turns, the same
    on a re-run); the chat API sends the conversation the episodes file records, up to that turn."""
    _, gateway = babyai_gateway
    tiny_checkpoint(tmp_path / "tok")
    agent_env.setenv("MAX_TURNS", "2")
    ev = load_eval()
    common = ["--env", "babyai", "--engine", "openai", "--base-url", server.url, "--model", "policy", "--api", api,
              "--tokenizer", str(tmp_path / "tok"), "--item-ids", "3,7", "--k", "2", "--gateway", gateway.url,
              "--max-new-tokens", "16", "--max-length", "4096", "--seed", "5"]
    report = ev.main(common + ["--out", str(tmp_path / "r.json")])
    assert {k: report[k] for k in ("engine", "model", "base_url", "api", "episodes", "env_failures")} == {
        "engine": "openai", "model": "policy", "base_url": server.url + "/v1", "api": api, "episodes": 4,
        "env_failures": 0}
    assert report["retokenized_replies"] == (4 * 2 if api == "chat" else 0)
    sent = [r["body"] for r in server.requests]
    assert len(sent) == 8 and all(b["max_tokens"] == 16 and b["temperature"] == 1.0 for b in sent)
    seeds = [b["seed"] for b in sent]
    assert len(set(seeds)) == 8
    episodes = [json.loads(line) for line in (tmp_path / "r.episodes.jsonl").read_text().splitlines()]
    assert all(e["turns"] == 2 and [m["content"] for m in e["messages"][3::2]] == [REPLY, REPLY] for e in episodes)
    if api == "chat":
        recorded = [e["messages"][:3 + 2 * t] for e in episodes for t in range(2)]
        assert sorted(map(json.dumps, (b["messages"] for b in sent))) == sorted(map(json.dumps, recorded))
    server.requests.clear()
    ev.main(common + ["--out", str(tmp_path / "again.json")])
    assert sorted(b["seed"] for b in (r["body"] for r in server.requests)) == sorted(seeds)


def test_eval_refuses_an_endpoint_it_cannot_use(server, tmp_path):
    ev = load_eval()
    base = ["--env", "babyai", "--item-ids", "3", "--out", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit, match="--engine openai needs --base-url"):
        ev.main(base + ["--engine", "openai", "--model", "policy"])
    with pytest.raises(SystemExit, match="is the served model's name, not a folder: give --tokenizer"):
        ev.main(base + ["--base-url", server.url, "--model", "policy"])  # --base-url alone picks the engine
    tiny_checkpoint(tmp_path / "tok")
    with pytest.raises(SystemExit, match=r"serves policy, not --model other"):
        ev.main(base + ["--base-url", server.url, "--model", "other", "--tokenizer", str(tmp_path / "tok")])
    assert not (tmp_path / "r.json").exists()


# ---- a real `vllm serve` --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eval_scores_a_real_vllm_server(babyai_gateway, tmp_path):  # noqa: F811
    """vLLM's own CLI (its CPU build) serving a tiny random checkpoint; eval.py plays BabyAI against it with token
    ids in and out (the replies' ids are the server's: nothing re-encoded), then with the chat API."""
    pytest.importorskip("vllm")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.test_tau2_align import VLLM_CPU_CLI

    _, gateway = babyai_gateway
    tok = tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    cli = tmp_path / "vllm"
    cli.write_text(VLLM_CPU_CLI.format(python=sys.executable))
    cli.chmod(0o755)
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tmp_path / "vllm.log", "w")
    proc = subprocess.Popen([str(cli), "serve", str(tmp_path / "ckpt"), "--served-model-name", "tiny", "--host",
                             "127.0.0.1", "--port", str(port), "--max-model-len", "4096", "--dtype", "bfloat16",
                             "--enforce-eager"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    import urllib.request

                    urllib.request.urlopen(f"{url}/v1/models", timeout=5).read()
                    break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not answer in 600 s"
                time.sleep(2)
        for api in ("completions", "chat"):
            done = subprocess.run(
                [sys.executable, "scripts/eval.py", "--env", "babyai", "--engine", "openai", "--base-url", url,
                 "--model", "tiny", "--tokenizer", str(tmp_path / "ckpt"), "--api", api, "--item-ids", "0,1", "--k",
                 "2", "--gateway", gateway.url, "--max-new-tokens", "16", "--max-length", "4096",
                 "--out", str(tmp_path / f"{api}.json")],
                cwd=ROOT, env={**os.environ, "MAX_TURNS": "2"}, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            report = json.loads((tmp_path / f"{api}.json").read_text())
            assert report["engine"] == "openai" and report["episodes"] == 4 and report["env_failures"] == 0
            assert report["retokenized_replies"] == (0 if api == "completions" else 8), report
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        log.close()


def test_batching_engine_hands_the_chat_to_a_backend_that_takes_it():
    """Only a backend that declares ``takes_messages`` gets each request's chat (the trace of its episode)."""
    ev = load_eval()

    class Taker:
        takes_messages = True

        def __init__(self):
            self.got = []

        def generate(self, requests, messages):
            self.got.append(messages)
            return [SimpleNamespace(token_ids=[1], text="x", finish_reason="stop", logprobs=None) for _ in requests]

    async def run(taker):
        engine = ev.BatchingEngine(taker, 8)

        async def episode(i):
            trace = {"messages": [{"role": "user", "content": f"obs {i}"}], "turn_rewards": []}
            ev._TRACE.set(trace if i < 2 else None)
            return await engine.generate([i], SimpleNamespace(max_tokens=None, seed=i))

        return await asyncio.gather(episode(0), episode(1), episode(2))  # the last one outside any recorded episode

    taker = Taker()
    asyncio.run(run(taker))
    assert taker.got == [[[{"role": "user", "content": "obs 0"}], [{"role": "user", "content": "obs 1"}], None]]
