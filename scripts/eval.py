"""Score a checkpoint on held-out item ids, through the env's real agent func and the gateway.

    python scripts/eval.py --env babyai --model CKPT --items data/generated/babyai_test.jsonl --k 4 \\
        --out runs/eval/babyai.json [--gateway http://127.0.0.1:8800] [--engine vllm|hf] [--limit N]
    python scripts/eval.py --env babyai --engine openai --base-url http://127.0.0.1:8000 --model NAME \\
        [--tokenizer DIR] [--api completions|completions-text|chat] [--api-key-file .secrets/KEY] ...

Every item is played ``--k`` times by ``agent_funcs/<env>.py``'s ``AgentExecutor`` (OpenRLHF's
``MultiTurnAgentExecutor``: same prompts, turn limit (MAX_TURNS), action parsing and reward shaping as in
training), all episodes concurrently; generation is batched across the episodes that wait for the model.
``--engine vllm`` (default when vLLM imports) uses ``vllm.LLM``; ``--engine hf`` is plain ``transformers``
``generate`` (CPU tests, small models). With vLLM every episode samples with its own seeds, H(``--seed``, item, trial)
then one per turn (``cope_rlhf.seeds``), so a rerun plays the same episodes; HF samples the batch from one generator
seeded by ``--seed``. ``--engine openai`` scores any OpenAI-compatible server (``vllm serve``, a hosted model) through
the same agent funcs and items, each request with its seed: the prompting floor an RL curve is drawn above
(``OpenAIBackend``; its API key only from a file in .secrets/). Metrics: scripts/agent_metrics.py (success rate,
mean reward, Avg@k, pass^1..k). Writes ``--out`` (metrics and the per-item table) and ``<out>.episodes.jsonl``: one
line per episode, ``{env, item_id, trial, reward, success, turns, messages, turn_rewards, extra_logs}``, with
messages in the ReAct chat format of scripts/make_demos.py (scripts/viz_trajectories.py reads both).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import importlib.util
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file, this module sees only scripts/: the repository's packages need the root

import cope_rlhf.compat  # noqa: E402,F401  (OpenRLHF imports on CPU-only machines)
from env_gateway.secret_file import read_secret_file, redact  # noqa: E402
from scripts.agent_metrics import summarize  # noqa: E402

_TRACE: contextvars.ContextVar[dict] = contextvars.ContextVar("eval_trace")


class HFBackend:
    """``transformers`` generate on a left-padded batch; each reply cut at its first end token and its budget."""

    def __init__(self, model_dir: str, temperature: float, seed: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.temperature = torch, temperature
        torch.manual_seed(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.eos.add(self.tokenizer.eos_token_id)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos)

    def generate(self, requests: list[tuple[list[int], int, int | None]]) -> list[SimpleNamespace]:
        """``requests``: (prompt ids, token budget, seed); the seeds are not used (one generator for the batch)."""
        torch = self.torch
        width = max(len(ids) for ids, *_ in requests)
        input_ids = torch.tensor([[self.pad] * (width - len(ids)) + ids for ids, *_ in requests])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, *_ in requests])
        sample = {"do_sample": True, "temperature": self.temperature, "top_p": 1.0, "top_k": 0} \
            if self.temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, pad_token_id=self.pad,
                                      eos_token_id=sorted(self.eos), max_new_tokens=max(n for _, n, _ in requests),
                                      **sample)
        replies = []
        for row, (_, budget, _) in zip(out[:, width:].tolist(), requests):
            end = next((i + 1 for i, t in enumerate(row[:budget]) if t in self.eos), None)
            ids = row[:end] if end else row[:budget]
            replies.append(SimpleNamespace(token_ids=ids, text=self.tokenizer.decode(ids, skip_special_tokens=True),
                                           finish_reason="stop" if end else "length", logprobs=None))
        return replies


class VLLMBackend:
    """``vllm.LLM`` over token-id prompts (its replies keep the end token in ``token_ids``, not in ``text``)."""

    def __init__(self, model_dir: str, temperature: float, seed: int, max_model_len: int):
        from vllm import LLM, SamplingParams

        self.params, self.temperature, self.seed = SamplingParams, temperature, seed
        import torch

        from cope_rlhf.cpu_vllm import cpu_engine_args

        cpu = {} if torch.cuda.is_available() else cpu_engine_args(max_model_len)  # seeded requests need it there
        self.llm = LLM(model=model_dir, max_model_len=max_model_len, seed=seed, dtype="bfloat16", **cpu)

    def generate(self, requests: list[tuple[list[int], int, int | None]]) -> list[SimpleNamespace]:
        """``requests``: (prompt ids, token budget, the request's seed or None)."""
        prompts = [{"prompt_token_ids": ids} for ids, _, _ in requests]
        params = [self.params(max_tokens=n, temperature=self.temperature, seed=seed) for _, n, seed in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [SimpleNamespace(token_ids=list(o.outputs[0].token_ids), text=o.outputs[0].text,
                                finish_reason=o.outputs[0].finish_reason, logprobs=None) for o in outs]


class OpenAIBackend:
    """An OpenAI-compatible server (``vllm serve``, SGLang, llama.cpp's server, a hosted API), one HTTP request per
    episode turn, all of a batch's requests at once (each keeps its own ``seed``), over ``--api``:

      completions       ``/v1/completions`` with the prompt as token ids and ``return_token_ids`` (vLLM's field):
                        the reply's own token ids come back, so the episode is token in, token out as with the
                        in-process engines. A server that ignores ``return_token_ids`` gets its text re-encoded with
                        the local tokenizer (plus the end token when it stopped on it): the report counts those
                        replies (``retokenized_replies``).
      completions-text  the same with the prompt as text (decoded with the local tokenizer): for servers that take no
                        token ids; replies re-encoded as above.
      chat              ``/v1/chat/completions`` with the episode's messages so far (what eval.py records): the
                        server applies its own chat template; replies re-encoded as above. For hosted chat models.

    Every call has a deadline (``timeout`` s; the connection 10 s); refused connections, 429 and 5xx answers are
    retried ``retries`` times (after ``backoff_s``, then twice that, ...), any other error answer stops the
    evaluation with the server's message. The API key comes only from a file in ``.secrets/`` and never appears in
    a message."""

    takes_messages = True  # BatchingEngine hands over each request's chat so far (used by the chat API only)
    backoff_s = 1.0  # the first retry's wait; doubled for each further one

    def __init__(self, base_url: str, model: str, tokenizer: Any, temperature: float, api: str = "completions",
                 api_key: str | None = None, timeout: float = 600.0, retries: int = 2):
        if api not in OPENAI_APIS:
            raise ValueError(f"api {api!r}: choose one of {', '.join(OPENAI_APIS)}")
        self.base_url, self.model, self.tokenizer = openai_base_url(base_url), model, tokenizer
        self.temperature, self.api, self.timeout, self.retries = temperature, api, timeout, retries
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.eos = tokenizer.eos_token_id
        self.retokenized = 0

    def _payload(self, ids: list[int], budget: int, seed: int | None, messages: list[dict] | None) -> dict:
        body: dict[str, Any] = {"model": self.model, "max_tokens": budget, "temperature": self.temperature,
                                "top_p": 1.0}
        if seed is not None:
            body["seed"] = seed
        if self.api == "chat":
            if messages is None:
                raise ValueError("the chat API needs the episode's messages: run it through eval.py's BatchingEngine")
            body["messages"] = messages
        elif self.api == "completions":
            body.update(prompt=list(ids), return_token_ids=True)
        else:
            body["prompt"] = self.tokenizer.decode(ids, skip_special_tokens=False)
        return body

    def _reply(self, answer: dict) -> SimpleNamespace:
        choice = (answer.get("choices") or [None])[0]
        if not isinstance(choice, dict):
            raise RuntimeError(f"the server answered without choices: {redact(json.dumps(answer)[:300])}")
        if self.api == "chat":
            text = (choice.get("message") or {}).get("content") or ""
        else:
            text = choice.get("text") or ""
        finish = choice.get("finish_reason") or "length"
        ids = choice.get("token_ids") if self.api == "completions" else None
        if ids is None:  # the server's text, encoded here; its end of turn as the local tokenizer's end token
            self.retokenized += 1
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if finish == "stop" and choice.get("stop_reason") is None and self.eos is not None:
                ids = ids + [self.eos]
        return SimpleNamespace(token_ids=list(ids), text=text, finish_reason=finish, logprobs=None)

    async def _post(self, session: Any, path: str, body: dict) -> dict:
        import aiohttp

        url = f"{self.base_url}{path}"
        for attempt in range(self.retries + 1):
            try:
                async with session.post(url, json=body, headers=self.headers) as response:
                    if response.status == 200:
                        return await response.json(content_type=None)
                    detail = redact((await response.text())[:500])
                    if response.status != 429 and response.status < 500:
                        raise RuntimeError(f"{url} answered {response.status}: {detail}")
                    failure = f"{url} answered {response.status}: {detail}"
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                failure = f"{url}: {type(e).__name__}: {redact(str(e)) or 'no answer within the deadline'}"
            if attempt < self.retries:
                await asyncio.sleep(self.backoff_s * 2 ** attempt)
        raise RuntimeError(f"{failure} (after {self.retries + 1} tries)")

    async def _batch(self, requests: list, messages: list) -> list[SimpleNamespace]:
        import aiohttp

        path = "/chat/completions" if self.api == "chat" else "/completions"
        deadline = aiohttp.ClientTimeout(total=self.timeout, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=0)  # the batch is already bounded by --concurrency
        async with aiohttp.ClientSession(timeout=deadline, connector=connector) as session:
            answers = await asyncio.gather(*(self._post(session, path, self._payload(ids, n, seed, chat))
                                             for (ids, n, seed), chat in zip(requests, messages)))
        return [self._reply(a) for a in answers]

    def generate(self, requests: list[tuple[list[int], int, int | None]],
                 messages: list[list[dict] | None] | None = None) -> list[SimpleNamespace]:
        """``requests``: (prompt ids, token budget, seed); ``messages``: each request's chat so far (or None)."""
        return asyncio.run(self._batch(requests, messages or [None] * len(requests)))

    def served_models(self) -> list[str]:
        """The ids ``GET /v1/models`` lists (a 10 s deadline): checked before any episode starts."""
        import urllib.error
        import urllib.request

        request = urllib.request.Request(f"{self.base_url}/models", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                listing = json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise SystemExit(f"eval.py: {self.base_url}/models answered {e.code}: "
                             f"{redact(e.read().decode(errors='replace')[:300])}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise SystemExit(f"eval.py: cannot reach {self.base_url} ({redact(str(e))}): is the server up? "
                             "(--base-url is its root or its /v1 URL)") from None
        return [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]


OPENAI_APIS = ("completions", "completions-text", "chat")


def openai_base_url(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` (with or without a trailing slash) -> the ``/v1`` URL."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise SystemExit(f"eval.py: --base-url {url!r} is not an http(s) URL")
    return url if url.endswith("/v1") else url + "/v1"


def read_api_key(path: str) -> str:
    """The key in ``path``, a file in a ``.secrets`` folder (this checkout's, or $COPE_SECRETS_DIR): one line,
    owner-only (``env_gateway.secret_file.read_secret_file``, which also keeps it out of every message)."""
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    allowed = {os.path.realpath(os.environ.get("COPE_SECRETS_DIR") or os.path.join(ROOT, ".secrets"))}
    if os.path.basename(folder) != ".secrets" and folder not in allowed:
        raise SystemExit(f"eval.py: --api-key-file {path} is not in a .secrets/ folder: keep API keys in .secrets/ "
                         "(git-ignored, mode 600)")
    try:
        return read_secret_file(path)
    except ValueError as e:
        raise SystemExit(f"eval.py: --api-key-file: {e}") from None


class BatchingEngine:
    """The ``generate(token_ids, sampling_params)`` call MultiTurnAgentExecutor makes, served in batches: requests
    that arrive while a batch runs form the next batch."""

    def __init__(self, backend: Any, max_new_tokens: int):
        self.backend, self.max_new_tokens = backend, max_new_tokens
        self.pending: list[tuple[list[int], int, int | None, list[dict] | None, asyncio.Future]] = []
        self.runner: asyncio.Task | None = None

    async def generate(self, token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None) -> Any:
        future = asyncio.get_running_loop().create_future()
        budget = min(self.max_new_tokens, sampling_params.max_tokens or self.max_new_tokens)
        trace = _TRACE.get(None)  # the episode's chat so far, for a backend that sends messages, not tokens
        chat = [dict(m) for m in trace["messages"]] if trace is not None else None
        self.pending.append((list(token_ids), budget, getattr(sampling_params, "seed", None), chat, future))
        if self.runner is None or self.runner.done():
            self.runner = asyncio.ensure_future(self._drain())
        return SimpleNamespace(outputs=[await future])

    async def _drain(self) -> None:
        while self.pending:
            await asyncio.sleep(0)  # let every episode that is about to ask join this batch
            batch, self.pending = self.pending, []
            requests = [(ids, n, seed) for ids, n, seed, _, _ in batch]
            extra = ([chat for *_, chat, _ in batch],) if getattr(self.backend, "takes_messages", False) else ()
            try:
                replies = await asyncio.to_thread(self.backend.generate, requests, *extra)
            except Exception as e:  # noqa: BLE001 - every waiting episode gets the error
                for *_, future in batch:
                    future.set_exception(e)
                continue
            for (*_, future), reply in zip(batch, replies):
                future.set_result(reply)


def recording_executor(env: str) -> type:
    """The env's AgentExecutor (loaded by path, as OpenRLHF loads it), with an agent that also records the
    conversation: the observations it was shown, the replies, and each turn's reward."""
    spec = importlib.util.spec_from_file_location(f"agent_func_{env}", os.path.join(ROOT, "agent_funcs", f"{env}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    agent_cls = module.AgentExecutor.agent_cls

    class RecordingAgent(agent_cls):
        def first_messages(self, observation: str, info: dict) -> list[dict]:
            messages = super().first_messages(observation, info)
            _TRACE.get()["messages"] = [dict(m) for m in messages]
            return messages

        def result(self, observation: str, done: bool) -> dict:
            self.shown = observation
            return super().result(observation, done)

        async def step(self, states: dict, **kwargs: Any) -> dict:
            out = await super().step(states, **kwargs)
            trace = _TRACE.get()
            trace["messages"] += [{"role": "assistant", "content": states["action_text"]},
                                  {"role": "user", "content": self.shown}]
            trace["turn_rewards"].append(float(out["rewards"]))
            return out

    return type("AgentExecutor", (module.AgentExecutor,), {"agent_cls": RecordingAgent})


async def play(env: str, items: list[str], k: int, engine: BatchingEngine, tokenizer: Any, max_length: int,
               concurrency: int, seed: int = 0) -> list[dict]:
    from agent_funcs.base import CLIENTS
    from cope_rlhf.seeds import derive_seed

    executor_cls = recording_executor(env)
    gate = asyncio.Semaphore(concurrency)

    async def episode(item: str, trial: int) -> dict:
        async with gate:
            trace = {"messages": [], "turn_rewards": []}
            _TRACE.set(trace)  # this task's own context
            params = SimpleNamespace(max_tokens=None, logprobs=None, seed=derive_seed(seed, "eval", item, trial))
            out = await executor_cls().execute(f"{env}/{item}", item, params, max_length, tokenizer, engine)
            logs = {k_: float(v) for k_, v in (out.get("extra_logs") or {}).items()}
            return {"env": env, "item_id": item, "trial": trial, "reward": float(out["reward"]),
                    "success": bool(logs.get("success", 0.0)), "turns": len(trace["turn_rewards"]),
                    "messages": trace["messages"], "turn_rewards": trace["turn_rewards"], "extra_logs": logs}

    try:
        return list(await asyncio.gather(*(episode(item, t) for item in items for t in range(k))))
    finally:
        for client in CLIENTS.values():
            await client.aclose()


def read_items(path: str | None, ids: str | None, limit: int | None) -> list[str]:
    if bool(path) == bool(ids):
        raise SystemExit("eval.py: give exactly one of --items FILE.jsonl (scripts/make_itemids.py) or --item-ids")
    if ids:
        items = [i.strip() for i in ids.split(",") if i.strip()]
    else:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        items = [str(r["label"]) if r.get("label") not in (None, "") else str(r["prompt"]).split("/", 1)[1]
                 for r in rows]
    items = items[:limit] if limit else items
    if not items:
        raise SystemExit("eval.py: no item ids to evaluate")
    return items


def item_table(episodes: list[dict], items: list[str]) -> list[dict]:
    table = []
    for item in items:
        mine = sorted((e for e in episodes if e["item_id"] == item), key=lambda e: e["trial"])
        rewards = [e["reward"] for e in mine]
        table.append({"item_id": item, "trials": len(mine), "successes": sum(e["success"] for e in mine),
                      "mean_reward": sum(rewards) / len(rewards), "rewards": rewards,
                      "turns": [e["turns"] for e in mine]})
    return table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", required=True, help="agent func name: agent_funcs/<env>.py")
    p.add_argument("--model", required=True, help="HF checkpoint folder (e.g. a run's model/ output); with --engine "
                   "openai: the model name the server serves")
    p.add_argument("--items", help="prompt-dataset JSONL of held-out item ids (scripts/make_itemids.py)")
    p.add_argument("--item-ids", help="comma-separated item ids instead of --items")
    p.add_argument("--limit", type=int, help="only the first N items")
    p.add_argument("--k", type=int, default=4, help="trials per item (Avg@k, pass^1..k)")
    p.add_argument("--out", required=True, help="metrics + per-item table (JSON)")
    p.add_argument("--episodes-out", help="episode JSONL (default: <out without .json>.episodes.jsonl)")
    p.add_argument("--gateway", default=os.environ.get("COPE_GATEWAY_URL", "http://127.0.0.1:8800"))
    p.add_argument("--engine", choices=("vllm", "hf", "openai"), default=None,
                   help="default: openai when --base-url is given, else vllm when it imports, else hf")
    p.add_argument("--base-url", help="--engine openai: the server's URL (http://host:port or .../v1)")
    p.add_argument("--api", choices=OPENAI_APIS, default="completions", help="--engine openai: which endpoint "
                   "(completions: token ids in and out, vLLM; completions-text; chat: the server's own template)")
    p.add_argument("--tokenizer", help="--engine openai: HF tokenizer folder for the prompts (default: --model, "
                   "when that is a folder, as with `vllm serve FOLDER`)")
    p.add_argument("--api-key-file", help="--engine openai: file in .secrets/ holding the API key (one line, mode 600)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="--engine openai: deadline of one request, seconds")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=512, help="per turn")
    p.add_argument("--max-length", type=int, default=16384, help="whole episode, tokens")
    p.add_argument("--concurrency", type=int, default=64, help="episodes in flight")
    p.add_argument("--seed", type=int, default=0)
    return p


def openai_backend(args: argparse.Namespace) -> tuple[OpenAIBackend, dict]:
    """``--engine openai``'s backend, after checking that the server answers and serves ``--model``; and what the
    report records of it (no key)."""
    from transformers import AutoTokenizer

    folder = args.tokenizer or (args.model if os.path.isdir(args.model) else None)
    if folder is None:
        raise SystemExit(f"eval.py: --engine openai: --model {args.model!r} is the served model's name, not a folder: "
                         "give --tokenizer DIR (a HF tokenizer folder with the served model's chat template)")
    key = read_api_key(args.api_key_file) if args.api_key_file else None
    backend = OpenAIBackend(args.base_url, args.model, AutoTokenizer.from_pretrained(folder), args.temperature,
                            args.api, key, args.request_timeout)
    models = backend.served_models()
    if models and args.model not in models:
        raise SystemExit(f"eval.py: {backend.base_url} serves {', '.join(map(str, models))}, not --model {args.model}")
    return backend, {"base_url": backend.base_url, "api": args.api, "tokenizer": os.path.abspath(folder)}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.k < 1:
        raise SystemExit("eval.py: --k must be >= 1")
    engine_name = args.engine or ("openai" if args.base_url else None)
    if engine_name == "openai" and not args.base_url:
        raise SystemExit("eval.py: --engine openai needs --base-url URL (the OpenAI-compatible server)")
    if engine_name != "openai" and not os.path.isdir(args.model):
        raise SystemExit(f"eval.py: --model {args.model} is not a checkpoint folder")
    items = read_items(args.items, args.item_ids, args.limit)
    os.environ["COPE_GATEWAY_URL"] = args.gateway  # the agent func reads it per episode
    if engine_name is None:
        engine_name = "vllm" if importlib.util.find_spec("vllm") else "hf"
    endpoint = {}
    if engine_name == "openai":
        backend, endpoint = openai_backend(args)
        tokenizer = backend.tokenizer
    elif engine_name == "vllm":
        backend = VLLMBackend(args.model, args.temperature, args.seed, args.max_length)
        tokenizer = backend.llm.get_tokenizer()
    else:
        backend = HFBackend(args.model, args.temperature, args.seed)
        tokenizer = backend.tokenizer
    start = time.monotonic()
    episodes = asyncio.run(play(args.env, items, args.k, BatchingEngine(backend, args.max_new_tokens), tokenizer,
                                args.max_length, args.concurrency, args.seed))
    table = item_table(episodes, items)
    metrics = summarize([row["rewards"] for row in table],
                        [[e["success"] for e in episodes if e["item_id"] == row["item_id"]] for row in table], args.k)
    if endpoint:
        endpoint["retokenized_replies"] = backend.retokenized
    model = args.model if engine_name == "openai" else os.path.abspath(args.model)
    report = {"env": args.env, "model": model, "engine": engine_name, **endpoint, "k": args.k,
              "temperature": args.temperature, "items": len(items), "episodes": len(episodes),
              "env_failures": sum(e["extra_logs"].get("env_failed", 0.0) > 0 for e in episodes),
              "seconds": round(time.monotonic() - start, 1), "metrics": metrics, "per_item": table}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    episodes_out = args.episodes_out or (args.out[:-5] if args.out.endswith(".json") else args.out) + ".episodes.jsonl"
    with open(episodes_out, "w", encoding="utf-8") as f:
        for e in episodes:
            f.write(json.dumps(e) + "\n")
    print(f"eval: {args.env}: {len(items)} items x {args.k} trials: "
          + ", ".join(f"{name} {value:.3f}" for name, value in metrics.items()) + f" -> {args.out}, {episodes_out}")
    return report


if __name__ == "__main__":
    main()
