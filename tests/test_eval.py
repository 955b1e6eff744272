"""scripts/eval.py, scripts/agent_metrics.py and scripts/tau2_align_score.py: the metric formulas against their
definitions (docs/BASELINES.md), a checkpoint scored through the real BabyAI server and gateway, and the τ² scorer
refusing incomplete runs."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT
from tests.env_server_proc import EnvServerProcess, require_venv
from tests.tiny_hf import tiny_checkpoint

from scripts.agent_metrics import avg_at_k, pass_hat_k, summarize


def load_script(name: str):
    """scripts/<name>.py as the module ``scripts.<name>``, the name mutmut gives its mutants (scripts/mutation_test.sh):
    loaded under another name, no mutant of it would ever run."""
    return importlib.import_module(f"scripts.{name}")


# ---- formulas ----------------------------------------------------------------------------------------------------
def pass_hat_k_by_enumeration(outcomes: list[list[bool]], k: int) -> float:
    """pass^k from its meaning: over every k-subset of an item's trials, the share where all k succeed."""
    per_item = []
    for trials in outcomes:
        subsets = list(itertools.combinations(trials, k))
        per_item.append(sum(all(s) for s in subsets) / len(subsets))
    return sum(per_item) / len(per_item)


def test_pass_hat_k_matches_its_definition():
    outcomes = [[True, True, False, True], [False] * 4, [True] * 4, [True, False, False, False], [True, True, False,
                                                                                                  False]]
    counts = [(len(t), sum(t)) for t in outcomes]
    for k in range(1, 5):
        assert pass_hat_k(counts, k) == pytest.approx(pass_hat_k_by_enumeration(outcomes, k))
    assert pass_hat_k([(4, 2)], 2) == pytest.approx(1 / 6)  # C(2,2)/C(4,2)
    assert pass_hat_k([(4, 3)], 1) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="at least 4 trials"):
        pass_hat_k([(4, 4), (3, 3)], 4)


def test_avg_at_k_and_summary():
    rewards = [[1.0, 0.0, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]]
    assert avg_at_k(rewards) == pytest.approx((0.5 + 0.2) / 2)
    uneven = [[1.0], [0.0, 0.0, 0.0]]  # per-item mean first: not the episode mean (0.25)
    assert avg_at_k(uneven) == pytest.approx(0.5)
    m = summarize(rewards, [[True, False, False, False], [False] * 4], k=4)
    assert m["success_rate"] == pytest.approx(1 / 8) and m["mean_reward"] == pytest.approx(2.8 / 8)
    assert m["pass^1"] == pytest.approx(0.125) and m["pass^2"] == 0.0 and m["avg@4"] == pytest.approx(0.35)


# ---- the item ids eval.py plays --------------------------------------------------------------------------------------
def test_read_items_takes_each_label_else_the_prompt_after_the_env_and_refuses_unclear_input(tmp_path):
    read_items = load_script("eval").read_items
    path = tmp_path / "items.jsonl"
    path.write_text('{"prompt": "tau2/retail/5", "label": "retail/5"}\n\n{"prompt": "tau2/retail/9"}\n'
                    '{"prompt": "babyai/3", "label": ""}\n{"prompt": "babyai/8", "label": 11}\n')
    assert read_items(str(path), None, None) == ["retail/5", "retail/9", "3", "11"]
    assert read_items(str(path), None, 2) == ["retail/5", "retail/9"]  # --limit: the first ones
    assert read_items(None, " 4, 7,,9 ", None) == ["4", "7", "9"]
    for both_or_neither in ((str(path), "4"), (None, None)):
        with pytest.raises(SystemExit, match="give exactly one of --items FILE.jsonl .* or --item-ids"):
            read_items(*both_or_neither, None)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    for empty in ((str(tmp_path / "empty.jsonl"), None), (None, " , ")):
        with pytest.raises(SystemExit, match="no item ids to evaluate"):
            read_items(*empty, None)


# --engine openai's flags (tests/test_eval_openai.py)
OPENAI_DEFAULTS = {"base_url": None, "api": "completions", "tokenizer": None, "api_key_file": None,
                   "request_timeout": 600.0}


def test_eval_flags_their_defaults_types_and_the_required_ones(monkeypatch):
    """The defaults the eval scripts and published comparisons rely on (k = 4 trials for Avg@4 and pass^1..4,
    sampling at temperature 1, the per-turn and per-episode token budgets)."""
    monkeypatch.delenv("COPE_GATEWAY_URL", raising=False)
    parser = load_script("eval").build_parser()
    required = ["--env", "babyai", "--model", "m", "--out", "o.json"]
    assert vars(parser.parse_args(required)) == {
        "env": "babyai", "model": "m", "items": None, "item_ids": None, "limit": None, "k": 4, "out": "o.json",
        "episodes_out": None, "gateway": "http://127.0.0.1:8800", "engine": None, "temperature": 1.0,
        "max_new_tokens": 512, "max_length": 16384, "concurrency": 64, "seed": 0, **OPENAI_DEFAULTS}
    given = parser.parse_args(required + ["--items", "i.jsonl", "--item-ids", "1,2", "--limit", "3", "--k", "2",
                                          "--episodes-out", "e.jsonl", "--engine", "hf", "--temperature", "0.5",
                                          "--max-new-tokens", "8", "--max-length", "99", "--concurrency", "2",
                                          "--seed", "7"])
    assert vars(given) == {"env": "babyai", "model": "m", "items": "i.jsonl", "item_ids": "1,2", "limit": 3, "k": 2,
                           "out": "o.json", "episodes_out": "e.jsonl", "gateway": "http://127.0.0.1:8800",
                           "engine": "hf", "temperature": 0.5, "max_new_tokens": 8, "max_length": 99,
                           "concurrency": 2, "seed": 7, **OPENAI_DEFAULTS}
    for at in (0, 2, 4):  # each required flag, left out
        with pytest.raises(SystemExit):
            parser.parse_args(required[:at] + required[at + 2:])
    with pytest.raises(SystemExit):
        parser.parse_args(required + ["--engine", "tpu"])
    assert parser.parse_args(required + ["--engine", "vllm"]).engine == "vllm"  # only the slow test plays on it
    monkeypatch.setenv("COPE_GATEWAY_URL", "http://10.0.0.5:9000")  # the launchers' gateway, when they set it
    assert load_script("eval").build_parser().parse_args(required).gateway == "http://10.0.0.5:9000"


# ---- the generation backends: HFBackend on hand-built checkpoints whose replies are known, BatchingEngine ----------
def wired_checkpoint(path, tokenizer, next_token: dict[int, int], generation_eos) -> None:
    """A tiny Qwen2 whose greedy next token is ``next_token[current token]``: attention and MLP outputs are zero, so
    the last hidden state is the normed embedding of the current token alone (random, so nearly orthogonal to the
    others at width 128), and the untied LM head holds that state in the row of the token it leads to.
    ``generation_eos`` is the config's ``eos_token_id`` (a list, one id or None)."""
    import torch
    from tests.tiny_hf import pass_through_qwen2

    torch.manual_seed(0)
    model = pass_through_qwen2(len(tokenizer), 128, generation_eos)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_()
        model.lm_head.weight.zero_()
        for current, following in next_token.items():
            state = model.model.norm(model.model.embed_tokens.weight[current])
            model.lm_head.weight[following] += state
    model.generation_config.eos_token_id = generation_eos
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture
def one_torch_thread():
    """Token-by-token generation on a tiny model is all synchronisation: with two threads on a loaded 2-core machine
    it ran ~10x slower than with one (200 tokens: 3.1 s against 0.37 s beside a training run)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def word_ids(tokenizer, *words: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(w) for w in words]


def test_hf_backend_ends_each_reply_at_its_first_end_token_or_at_its_own_budget(tmp_path, one_torch_thread):
    """A reply keeps its first end token in ``token_ids`` but not in ``text`` (finish_reason "stop"), or stops at its
    request's budget ("length"). The end tokens are the tokenizer's and the generation config's, whether that is a
    list, one id or none."""
    from tests.tiny_hf import tiny_tokenizer

    tok = tiny_tokenizer()
    end = tok.eos_token_id
    look, key, door, ball, left = word_ids(tok, "look", "Ġkey", "Ġdoor", "Ġball", "Ġleft")
    chain = {look: key, key: door, door: ball, ball: end, end: left, left: left}  # look -> key door ball <end> left..
    prompt = tok("Thought:\nI should")["input_ids"] + [look]
    longer = tok("Action:\nopen door\nThought:\nI should")["input_ids"] + [look]
    HFBackend = load_script("eval").HFBackend
    for generation_eos, first_end in ((None, end), (door, door), ([look, door], door)):
        folder = tmp_path / f"eos-{generation_eos}"
        wired_checkpoint(folder, tok, chain, generation_eos)
        # the last request never ends, so the batch runs to its longest budget and the others' rows go on (as padding)
        # after their end token
        replies = HFBackend(str(folder), temperature=0.0, seed=0).generate(
            [(prompt, 10, None), (longer, 2, None), (prompt, 4, None), (prompt[:-1] + [left], 9, None)])
        want = [key, door, ball, end] if first_end == end else [key, door]
        assert [r.token_ids for r in replies] == [want, [key, door], want, [left] * 9], generation_eos
        cut = "length" if first_end == end else "stop"  # [key, door]: its budget, or door is an end token
        assert [r.finish_reason for r in replies] == ["stop", cut, "stop", "length"]
        full = " key door ball" if first_end == end else " key door"  # the end token is not in the text
        assert [r.text for r in replies[:3]] == [full, " key door", full]
        assert all(r.logprobs is None for r in replies)  # what MultiTurnAgentExecutor reads when it asks for none


def test_hf_backend_pads_a_batch_on_the_left_and_masks_the_padding(tmp_path, one_torch_thread):
    """Prompts of different lengths batched together get the replies each would get alone (a random tiny model, whose
    replies depend on every token it attends to), with the tokenizer's pad token and without one."""
    from tests.tiny_hf import tiny_tokenizer

    tok = tiny_tokenizer()
    short = tok("pick up key")["input_ids"]
    long_ = tok("Invalid action. Nothing happens. You see a red ball")["input_ids"]
    HFBackend = load_script("eval").HFBackend
    for pad in (True, False):
        folder = tmp_path / f"pad-{pad}"
        tiny_checkpoint(folder)
        if not pad:
            settings = json.loads((folder / "tokenizer_config.json").read_text())
            settings["pad_token"] = None  # not just left out: Qwen2Tokenizer would default to <|endoftext|>
            (folder / "tokenizer_config.json").write_text(json.dumps(settings))
        backend = HFBackend(str(folder), temperature=0.0, seed=0)
        assert (backend.tokenizer.pad_token_id is None) == (not pad)
        alone = [backend.generate([(ids, 12, None)])[0].token_ids for ids in (short, long_)]
        assert [r.token_ids for r in backend.generate([(short, 12, None), (long_, 12, None)])] == alone
        assert [r.token_ids for r in backend.generate([(long_, 12, None), (short, 12, None)])] == alone[::-1]


def two_word_checkpoint(path, tokenizer, likely: int, unlikely: int) -> None:
    """A tiny Qwen2 whose next-token logits are 1 for ``likely``, 0 for ``unlikely`` and -30 for every other token,
    whatever the context: every embedding is the ones vector, attention and MLP outputs are zero, so the last hidden
    state is ones, and each LM-head row sums to its logit. P(likely) = 1 / (1 + e^(-1/T)) at temperature T."""
    import torch
    from tests.tiny_hf import pass_through_qwen2

    model = pass_through_qwen2(len(tokenizer), 64, tokenizer.eos_token_id)
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.fill_(-30.0 / model.config.hidden_size)
        model.lm_head.weight[likely] = 1.0 / model.config.hidden_size
        model.lm_head.weight[unlikely] = 0.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_hf_backend_samples_at_its_temperature_from_its_seed_and_is_greedy_at_zero(tmp_path, one_torch_thread):
    """Temperature T > 0 samples from softmax(logits / T) with nothing cut (no top-k, no top-p); T = 0 takes the
    argmax; the same seed gives the same sample. 200 tokens per reply: P(likely) is 0.731 at T = 1 (its share lands
    in [0.58, 0.88], 5 standard deviations) and 0.982 at T = 0.25 (share >= 0.93)."""
    from tests.tiny_hf import tiny_tokenizer

    tok = tiny_tokenizer()
    likely, unlikely = word_ids(tok, "Ġkey", "Ġdoor")
    two_word_checkpoint(tmp_path / "ckpt", tok, likely, unlikely)
    HFBackend = load_script("eval").HFBackend
    prompt = tok("pick up")["input_ids"]

    def share(temperature: float, seed: int = 0) -> tuple[float, list[int]]:
        reply, short = HFBackend(str(tmp_path / "ckpt"), temperature, seed).generate([(prompt, 200, None), (prompt, 7, None)])
        assert len(reply.token_ids) == 200 and len(short.token_ids) == 7  # each its own budget; no end token drawn
        assert reply.finish_reason == short.finish_reason == "length" and set(reply.token_ids) <= {likely, unlikely}
        return reply.token_ids.count(likely) / 200, reply.token_ids

    warm, drawn = share(1.0)
    assert 0.58 <= warm <= 0.88
    assert share(1.0)[1] == drawn and share(1.0, seed=1)[1] != drawn
    assert share(0.25)[0] >= 0.93
    assert share(0.0)[0] == 1.0


class RecordingBackend:
    """Stand-in for a backend (the engine's own logic is under test, not a model's): records each batch it is asked
    for and answers every request with its budget; its first batch fails when ``fail_first`` is set."""

    def __init__(self, fail_first: bool = False):
        self.batches: list[list[tuple[list[int], int, int | None]]] = []
        self.fail_first = fail_first
        self.first_started, self.release = threading.Event(), threading.Event()

    def generate(self, requests):
        self.batches.append(requests)
        if self.fail_first and len(self.batches) == 1:
            self.first_started.set()
            self.release.wait(timeout=60)
            raise RuntimeError("backend failed")
        return [SimpleNamespace(token_ids=[n], text=str(n), finish_reason="length", logprobs=None)
                for _, n, _ in requests]


@pytest.mark.timeout(120)
def test_batching_engine_caps_each_budget_and_gives_every_waiting_episode_the_backend_error():
    """A request's budget is the smaller of its own max_tokens and the engine's (the engine's when it sets none);
    requests that arrive together form one batch; a failed batch fails each of its requests, and a request that
    arrived while it ran is still served (a hang here is stopped by the per-test timeout)."""
    BatchingEngine = load_script("eval").BatchingEngine

    async def run() -> None:
        backend = RecordingBackend()
        engine = BatchingEngine(backend, max_new_tokens=10)
        asks = [SimpleNamespace(max_tokens=m, seed=s) for m, s in ((5, 7), (None, None), (50, 9))]
        outs = await asyncio.gather(*(engine.generate([i], ask) for i, ask in enumerate(asks)))
        assert [o.outputs[0].token_ids for o in outs] == [[5], [10], [10]]
        assert backend.batches == [[([0], 5, 7), ([1], 10, None), ([2], 10, 9)]]  # one batch of all three, seeds kept

        failing = RecordingBackend(fail_first=True)
        engine = BatchingEngine(failing, max_new_tokens=10)
        first = [asyncio.ensure_future(engine.generate([i], SimpleNamespace(max_tokens=None))) for i in (0, 1)]
        await asyncio.to_thread(failing.first_started.wait, 60)
        later = asyncio.ensure_future(engine.generate([2], SimpleNamespace(max_tokens=3)))
        await asyncio.sleep(0)
        failing.release.set()
        for future in first:
            with pytest.raises(RuntimeError, match="backend failed"):
                await future
        assert (await later).outputs[0].token_ids == [3]
        assert failing.batches == [[([0], 10, None), ([1], 10, None)], [([2], 3, None)]]

    asyncio.run(run())


# ---- eval.py through the real BabyAI server and gateway -----------------------------------------------------------
@pytest.fixture(scope="module")
def babyai_gateway():
    require_venv("babyai")
    from tests.agent_funcs_stack import TEST_GATEWAY_FLAGS
    from tests.gateway_proc import GatewayProcess

    with EnvServerProcess("babyai") as server, \
            GatewayProcess(*TEST_GATEWAY_FLAGS, envs={"babyai": server.url}) as gateway:
        yield server, gateway


@pytest.fixture
def agent_env(monkeypatch):
    for name in ("HORIZON_SCHEDULE", "COPE_TRAIN_STEP_FILE", "HORIZON_EPISODES_PER_STEP"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_episodes_file_starts_with_the_chat_the_policy_answered():
    """eval's recording agent keeps each env agent's own first messages, so the chat template over the recorded
    messages is the policy's first prompt: ScienceWorld's task (the reset's info) before the look, τ²'s system
    message with its policy (and, when the template ignores ``tools=``, only the prompt lists the tools)."""
    from tests.tiny_hf import tiny_tokenizer

    ev = load_script("eval")
    tok = tiny_tokenizer()
    look = "This room is called the kitchen."
    tools = [{"type": "function", "function": {"name": "get_order", "parameters": {}}}]
    cases = [("babyai", {}, look), ("sciworld", {"task_description": "Your task is to boil water."},
                                    "Your task is to boil water.\n" + look),
             ("tau2", {"policy": "Refund only delivered orders."}, look),
             ("tau2", {"policy": "Refund only delivered orders.", "tools": tools}, look)]
    for env, info, shown in cases:
        agent_cls = ev.recording_executor(env).agent_cls
        agent = agent_cls.__new__(agent_cls)  # no gateway session: only the prompt is built
        agent.episode = SimpleNamespace(tokenizer=tok)
        trace = {"messages": [], "turn_rewards": []}
        ev._TRACE.set(trace)
        prompt = agent.first_prompt(look, info)
        assert trace["messages"][-1] == {"role": "user", "content": shown}, env
        recorded = tok.apply_chat_template(trace["messages"], tokenize=False, add_generation_prompt=True)
        if "tools" in info:
            assert "get_order" in prompt and "get_order" not in recorded
            assert trace["messages"][0]["content"].endswith("# Policy\nRefund only delivered orders.")
        else:
            assert recorded == prompt, env


def test_eval_scores_a_tiny_checkpoint_through_babyai(babyai_gateway, agent_env, tmp_path, capsys):
    _, gateway = babyai_gateway
    tiny_checkpoint(tmp_path / "ckpt")
    (tmp_path / "items.jsonl").write_text("".join(json.dumps({"prompt": f"babyai/{i}", "label": str(i)}) + "\n"
                                                  for i in (3, 7)))
    agent_env.setenv("MAX_TURNS", "2")
    agent_env.setenv("COPE_GATEWAY_URL", "http://127.0.0.1:9")  # main() sets it from --gateway; monkeypatch undoes it
    main = load_script("eval").main
    common = ["--env", "babyai", "--model", str(tmp_path / "ckpt"), "--engine", "hf", "--gateway", gateway.url,
              "--max-new-tokens", "12", "--max-length", "8192"]
    with pytest.raises(SystemExit, match="--k must be >= 1"):
        main(common + ["--items", str(tmp_path / "items.jsonl"), "--k", "0", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="--model .*nothing-here is not a checkpoint folder"):
        main(["--env", "babyai", "--model", str(tmp_path / "nothing-here"), "--item-ids", "3", "--out", "x.json"])
    started = time.monotonic()
    report = main(common + ["--items", str(tmp_path / "items.jsonl"), "--k", "2",
                            "--out", str(tmp_path / "out" / "babyai.json")])
    took = time.monotonic() - started
    assert report == json.loads((tmp_path / "out" / "babyai.json").read_text())
    assert {key: report[key] for key in ("env", "model", "engine", "k", "temperature", "items", "episodes")} == {
        "env": "babyai", "model": str(tmp_path / "ckpt"), "engine": "hf", "k": 2, "temperature": 1.0, "items": 2,
        "episodes": 4}
    assert 0 < report["seconds"] <= took + 0.1  # the run's own time, rounded to 0.1 s
    assert report["episodes"] == 4 and [row["item_id"] for row in report["per_item"]] == ["3", "7"]
    assert report["env_failures"] == 0
    printed = capsys.readouterr().out
    assert f"eval: babyai: 2 items x 2 trials: success_rate {report['metrics']['success_rate']:.3f}, " in printed
    assert printed.rstrip().endswith(f"-> {tmp_path / 'out' / 'babyai.json'}, "
                                     f"{tmp_path / 'out' / 'babyai.episodes.jsonl'}")
    # --item-ids, --limit, one trial, and an --out not named .json: its episodes file is <out>.episodes.jsonl
    other = main(common + ["--item-ids", "7,3", "--limit", "1", "--k", "1", "--out", str(tmp_path / "one.out")])
    assert other["items"] == 1 and [row["item_id"] for row in other["per_item"]] == ["7"]
    assert len((tmp_path / "one.out.episodes.jsonl").read_text().splitlines()) == 1
    episodes = [json.loads(line) for line in (tmp_path / "out" / "babyai.episodes.jsonl").read_text().splitlines()]
    assert sorted((e["item_id"], e["trial"]) for e in episodes) == [("3", 0), ("3", 1), ("7", 0), ("7", 1)]
    from agent_funcs.instructions import ACKNOWLEDGEMENT, INSTRUCTIONS

    for e in episodes:
        assert 1 <= e["turns"] <= 2 and len(e["messages"]) == 3 + 2 * e["turns"]
        assert [m["role"] for m in e["messages"]] == ["user", "assistant", "user"] + ["assistant", "user"] * e["turns"]
        assert e["messages"][0]["content"] == INSTRUCTIONS["babyai"] and e["messages"][1]["content"] == ACKNOWLEDGEMENT
        assert e["messages"][2]["content"].startswith("Your goal:")  # the server's first observation
        # every later turn: the policy's reply as it was written, then what the env showed (never empty)
        assert all(isinstance(m["content"], str) for m in e["messages"][3::2])
        assert all(isinstance(m["content"], str) and m["content"] for m in e["messages"][4::2])
        assert e["extra_logs"]["turns"] == e["turns"] == len(e["turn_rewards"]) and e["env"] == "babyai"
        assert all(isinstance(r, float) for r in e["turn_rewards"])
    for row in report["per_item"]:
        mine = sorted((e for e in episodes if e["item_id"] == row["item_id"]), key=lambda e: e["trial"])
        assert row["trials"] == 2 and row["turns"] == [e["turns"] for e in mine]
    # The report's metrics against the episodes file, computed here from their definitions (not with summarize)
    rewards = {i: [e["reward"] for e in episodes if e["item_id"] == i] for i in ("3", "7")}
    wins = {i: sum(e["success"] for e in episodes if e["item_id"] == i) for i in ("3", "7")}
    assert [sorted(row["rewards"]) for row in report["per_item"]] == [sorted(rewards["3"]), sorted(rewards["7"])]
    assert report["metrics"] == pytest.approx({
        "success_rate": sum(wins.values()) / 4, "mean_reward": sum(map(sum, rewards.values())) / 4,
        "avg@2": sum(sum(r) / 2 for r in rewards.values()) / 2,
        "pass^1": sum(c / 2 for c in wins.values()) / 2, "pass^2": sum(c == 2 for c in wins.values()) / 2})


def test_eval_takes_vllm_when_it_is_installed_else_transformers(babyai_gateway, agent_env, tmp_path, monkeypatch):
    """Without --engine, eval.py plays on vLLM when the package can be found, else on transformers; vLLM's backend
    gets the checkpoint, --temperature, --seed and --max-length, and the tokenizer is vLLM's own. A stand-in takes
    vLLM's place and records what it was given, playing with transformers underneath: vLLM's start alone takes over
    a minute here (the real engine: test_eval_with_the_vllm_engine, slow)."""
    _, gateway = babyai_gateway
    tiny_checkpoint(tmp_path / "ckpt")
    agent_env.setenv("MAX_TURNS", "1")
    agent_env.chdir(tmp_path)  # eval.py finds the agent func from its own folder, not the caller's
    ev = load_script("eval")
    given = []

    class StandInVLLM:
        def __init__(self, *args):
            given.append(args)
            self.hf = ev.HFBackend(*args[:3])
            self.llm = SimpleNamespace(get_tokenizer=lambda: self.hf.tokenizer)

        def generate(self, requests):
            return self.hf.generate(requests)

    monkeypatch.setattr(ev, "VLLMBackend", StandInVLLM)
    find_spec = importlib.util.find_spec
    for installed in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: (
            (find_spec("json") if installed else None) if name == "vllm" else find_spec(name, *rest)))
        report = ev.main(["--env", "babyai", "--model", str(tmp_path / "ckpt"), "--item-ids", "3", "--k", "1",
                          "--gateway", gateway.url, "--temperature", "0.5", "--seed", "3", "--max-new-tokens", "8",
                          "--max-length", "4096", "--out", str(tmp_path / f"{installed}.json")])
        assert report["engine"] == ("vllm" if installed else "hf") and report["episodes"] == 1
        assert report["env_failures"] == 0
    assert given == [(str(tmp_path / "ckpt"), 0.5, 3, 4096)]  # once: the second run did not start it


@pytest.mark.slow
def test_eval_with_the_vllm_engine(babyai_gateway, tmp_path):
    """The default engine: vllm.LLM (CPU build here; about 80 s with its start-up). vLLM needs head_dim 64."""
    pytest.importorskip("vllm")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny_hf import tiny_tokenizer

    _, gateway = babyai_gateway
    tokenizer = tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    env = {**os.environ, "MAX_TURNS": "2", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([sys.executable, "scripts/eval.py", "--env", "babyai", "--model", str(tmp_path / "ckpt"),
                           "--item-ids", "0,1", "--k", "2", "--engine", "vllm", "--gateway", gateway.url,
                           "--max-new-tokens", "16", "--max-length", "4096", "--out", str(tmp_path / "r.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["engine"] == "vllm" and report["episodes"] == 4 and report["env_failures"] == 0
    episodes = [json.loads(line) for line in (tmp_path / "r.episodes.jsonl").read_text().splitlines()]
    assert all(e["turns"] == 2 and e["messages"][2]["content"].startswith("Your goal:") for e in episodes)


class ExpertReplayModel:
    """Stand-in for the policy model (a random tiny model never wins): it reads the prompt, finds the item by its
    first observation, and answers the expert's next action, except in an item's second trial of the "wanderer"
    item, where it only turns left. Same ``generate(requests)`` surface as eval.py's backends."""

    def __init__(self, tokenizer, expert: dict[str, tuple[str, list[str]]], wanderer: str):
        self.tokenizer, self.expert, self.wanderer = tokenizer, expert, wanderer
        self.started: dict[str, int] = {}
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def reply(self, prompt: str) -> str:
        item = next(i for i, (first, _) in self.expert.items() if first in prompt)
        turn = prompt.count("<|im_start|>assistant") - 2  # the acknowledgement and the open generation turn
        if turn == 0:
            self.started[item] = self.started.get(item, 0) + 1
            if item == self.wanderer and self.started[item] == 2:
                return "Thought:\nI wander.\n\nAction:\nturn left"
        if "I wander." in prompt:
            return "Thought:\nI wander.\n\nAction:\nturn left"
        return f"Thought:\nI follow the plan.\n\nAction:\n{self.expert[item][1][turn]}"

    def generate(self, requests):
        out = []
        for ids, *_ in requests:
            text = self.reply(self.tokenizer.decode(ids))
            out.append(SimpleNamespace(token_ids=self.tokenizer(text, add_special_tokens=False)["input_ids"]
                                       + [self.eos], text=text, finish_reason="stop", logprobs=None))
        return out


def test_eval_metrics_on_real_wins_and_losses(babyai_gateway, agent_env):
    """Two items x 2 trials; one item won twice, the other won once: success 3/4, pass^1 0.75, pass^2 0.5."""
    from tests.agent_funcs_stack import expert_rollout
    from tests.tiny_hf import tiny_tokenizer

    server, gateway = babyai_gateway
    ev = load_script("eval")
    expert = {}
    for item in ("0", "5"):
        actions, observations, _ = expert_rollout(server.url, int(item))
        expert[item] = (observations[0], actions)
    agent_env.setenv("MAX_TURNS", str(max(len(a) for _, a in expert.values()) + 2))
    agent_env.setenv("COPE_GATEWAY_URL", gateway.url)
    tokenizer = tiny_tokenizer()
    engine = ev.BatchingEngine(ExpertReplayModel(tokenizer, expert, wanderer="5"), max_new_tokens=64)
    episodes = asyncio.run(asyncio.wait_for(ev.play("babyai", ["0", "5"], 2, engine, tokenizer, 200_000, 8), 120))
    table = ev.item_table(episodes, ["0", "5"])
    assert [row["successes"] for row in table] == [2, 1]
    metrics = summarize([r["rewards"] for r in table],
                        [[e["success"] for e in episodes if e["item_id"] == i] for i in ("0", "5")], 2)
    assert metrics["success_rate"] == 0.75 and metrics["pass^1"] == 0.75 and metrics["pass^2"] == 0.5
    wins = [e["reward"] for e in episodes if e["success"]]
    assert all(0 < r <= 1 for r in wins)  # BabyAI's own reward, 1 - 0.9 * steps / max_steps
    assert metrics["avg@2"] == pytest.approx((sum(table[0]["rewards"]) / 2 + sum(table[1]["rewards"]) / 2) / 2)
    lost = next(e for e in episodes if not e["success"])
    assert lost["turns"] == int(os.environ["MAX_TURNS"]) and lost["reward"] == 0.0


# ---- τ²-bench scorer ---------------------------------------------------------------------------------------------
def tau2_results(domain: str, trials: int = 4, drop: int = 0, user: str = "gpt-4o-mini-2024-07-18",
                 crash: bool = False) -> dict:
    """A Results file shaped as τ²'s `tau2 run --save-to` writes it, at the published settings; task k succeeds in
    trials j < k % 5. (Every protocol setting the scorer checks: tests/test_tau2_score.py.)"""
    with open(os.path.join(ROOT, "data", f"tau2_{domain}_test.jsonl")) as f:
        tasks = [json.loads(line)["label"].split("/", 1)[1] for line in f]
    sims = [{"task_id": t, "trial": j, "termination_reason": "user_stop",
             "reward_info": {"reward": 1.0 if j < k % 5 else 0.0}} for k, t in enumerate(tasks) for j in range(trials)]
    if crash:  # task 1's first trial, a win, crashed: it counts as reward 0
        sims[trials]["reward_info"] = None
    return {"info": {"num_trials": trials, "git_commit": "c5b2d22abc", "max_steps": 200, "max_errors": 10, "seed": 300,
                     "user_info": {"implementation": "user_simulator", "llm": user, "llm_args": {"temperature": 0.0}},
                     "agent_info": {"implementation": "llm_agent", "llm_args": {"temperature": 0.0}}},
            "tasks": [{"id": t} for t in tasks], "simulations": sims[:len(sims) - drop]}


def run_scorer(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/tau2_align_score.py", "--tag", "t1", "--results-dir",
                           str(tmp_path), *extra], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_tau2_align_score_scores_a_complete_run(tmp_path):
    (tmp_path / "t1_eval_config.json").write_text(json.dumps({  # what scripts/tau2_align_eval.sh writes beside it
        "task_split": "test", "num_trials": 4, "max_steps": 200, "policy": {"max_model_len": 32768}, "deviations": []}))
    for domain in ("airline", "retail", "telecom"):
        (tmp_path / f"t1_{domain}.json").write_text(json.dumps(tau2_results(domain, crash=domain == "retail")))
    done = run_scorer(tmp_path, "--out", str(tmp_path / "s.json"))
    assert done.returncode == 0, done.stderr
    scores = json.loads((tmp_path / "s.json").read_text())["scores"]
    tasks = len(tau2_results("airline")["tasks"])
    expected = sum(min(k % 5, 4) / 4 for k in range(tasks)) / tasks
    assert scores["airline"]["avg@4"] == pytest.approx(expected) and scores["airline"]["not_comparable"] == ""
    retail = sum(min(k % 5, 4) / 4 for k in range(40)) / 40 - (1 / 4) / 40
    assert scores["retail"]["avg@4"] == pytest.approx(retail) and scores["retail"]["tasks"] == 40
    assert scores["retail"]["pass^1"] == pytest.approx(retail)  # binary rewards: pass^1 = Avg@k
    assert "InfoPO" in done.stdout and "16.3 (" in done.stdout  # the published row beside ours, with the difference


def test_tau2_align_score_refuses_incomplete_runs_and_flags_other_user_models(tmp_path):
    (tmp_path / "t1_airline.json").write_text(json.dumps(tau2_results("airline", drop=3)))
    done = run_scorer(tmp_path, "--domains", "airline")
    assert done.returncode == 2 and "incomplete run, refusing to score it" in done.stderr
    (tmp_path / "t1_airline.json").write_text(json.dumps(tau2_results("airline", trials=2)))
    assert "declares 2 trials" in run_scorer(tmp_path, "--domains", "airline").stderr
    (tmp_path / "t1_airline.json").write_text(json.dumps(tau2_results("airline", user="qwen-7b")))
    done = run_scorer(tmp_path, "--domains", "airline")
    assert done.returncode == 0 and "not comparable" in done.stdout and "qwen-7b" in done.stdout
    missing = run_scorer(tmp_path, "--domains", "retail")
    assert missing.returncode == 2 and "t1_retail" in missing.stderr
