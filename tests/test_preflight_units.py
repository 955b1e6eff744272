"""cope_rlhf.preflight check by check, in process and without Ray, a model or a subprocess: every message word for
word (users act on them, and mutation testing changes their words), every branch that decides whether a problem is
reported, the GPU arithmetic of each placement, the bounded placement-group wait on a stand-in for Ray, and ``main``'s
exit codes. tests/test_preflight.py runs the same checks end to end (real gateway, real model, the CLI, Ray)."""

from __future__ import annotations

import http.server
import json
import os
import sys
import threading
import types
from types import SimpleNamespace

import pytest

from cope_rlhf import preflight

pytestmark = pytest.mark.timeout(60)


def ns(**flags) -> SimpleNamespace:
    """Parsed args with dotted names: ns(actor__num_nodes=1) -> args."actor.num_nodes" == 1."""
    return SimpleNamespace(**{k.replace("__", "."): v for k, v in flags.items()})


# ---- the commands and paths a message names ----------------------------------------------------------------------
@pytest.mark.parametrize("path,message", [
    ("data/babyai_train.jsonl", "make it with `.venv/bin/python scripts/make_itemids.py --env babyai --split train "
                                "--out data`"),
    ("sci_world_test.jsonl", "make it with `.venv/bin/python scripts/make_itemids.py --env sci_world --split test "
                             "--out .`"),
    ("d/x_dev.jsonl", "make it with `.venv/bin/python scripts/make_itemids.py --env x --split dev --out d`"),
    ("d/babyai_val.jsonl", "make one with `.venv/bin/python scripts/make_itemids.py --env ENV --split train --out "
                           "FOLDER` (FOLDER/ENV_train.jsonl: one {\"prompt\": \"<env>/<item>\", \"label\": \"<item>\"} "
                           "per line)"),
    ("d/train.jsonl", "make one with `.venv/bin/python scripts/make_itemids.py --env ENV --split train --out FOLDER` "
                      "(FOLDER/ENV_train.jsonl: one {\"prompt\": \"<env>/<item>\", \"label\": \"<item>\"} per line)"),
])
def test_make_data_names_the_command_for_the_file(path, message):
    assert preflight.make_data(path) == message


@pytest.mark.parametrize("name,local", [("./model", True), ("/abs/model", True), ("~/model", True),
                                        ("data.json", True), ("x.jsonl", True), ("x.parquet", True), ("x.csv", True),
                                        ("org/name", False), ("name", True), ("a/b/c", True), ("tests/anything", True),
                                        ("Qwen/Qwen2.5-0.5B", False)])
def test_looks_like_path(name, local):
    assert preflight.looks_like_path(name) is local


def test_in_hf_cache_looks_in_hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    (tmp_path / "hub" / "models--org--name").mkdir(parents=True)
    assert preflight.in_hf_cache("org/name", "models") and not preflight.in_hf_cache("org/name", "datasets")
    assert not preflight.in_hf_cache("org/other", "models")
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / ".cache" / "huggingface" / "hub" / "datasets--a--b").mkdir(parents=True)
    assert preflight.in_hf_cache("a/b", "datasets")


def test_hub_reachable_is_one_connection_with_a_deadline(monkeypatch):
    seen = []

    class Conn:
        def close(self) -> None:
            seen.append("closed")

    def connect(address, timeout):
        seen.append((address, timeout))
        return Conn()

    monkeypatch.setattr(preflight.socket, "create_connection", connect)
    assert preflight.hub_reachable() is True and seen == [(("huggingface.co", 443), 3), "closed"]

    def refuse(address, timeout):
        raise OSError("no route")

    monkeypatch.setattr(preflight.socket, "create_connection", refuse)
    assert preflight.hub_reachable() is False


# ---- GPUs ---------------------------------------------------------------------------------------------------------
BASE = dict(actor__num_nodes=1, actor__num_gpus_per_node=2, ref__num_nodes=1, ref__num_gpus_per_node=2,
            critic__num_nodes=1, critic__num_gpus_per_node=3, reward__num_nodes=1, reward__num_gpus_per_node=1,
            vllm__num_engines=2, vllm__tensor_parallel_size=1, algo__kl__init_coef=0.01)


@pytest.mark.parametrize("flags,need", [
    ({}, 2 + 2 + 2 + 1),  # actor, ref (KL > 0), engines, reward model
    ({"algo__kl__init_coef": 0.0}, 2 + 2 + 1),  # no ref without KL
    ({"algo__kl__init_coef": None}, 2 + 2 + 1),
    ({"train__colocate_actor_ref": True}, 2 + 2 + 1),
    ({"train__colocate_all": True}, 2 + 1),  # engines share the actor's GPUs
    ({"train__colocate_all": True, "train__async_enable": True}, 2 + 2 + 1),  # ... unless async
    ({"vllm__tensor_parallel_size": 2}, 2 + 2 + 4 + 1),
    ({"vllm__tensor_parallel_size": 0}, 2 + 2 + 2 + 1),  # TP under 1 counts as 1
    ({"vllm__num_engines": None}, 2 + 2 + 1),
    ({"critic__model_name_or_path": "m"}, 2 + 2 + 2 + 3 + 1),
    ({"critic__model_name_or_path": "m", "train__colocate_critic_reward": True}, 2 + 2 + 2 + 3),
    ({"train__colocate_critic_reward": True}, 2 + 2 + 2 + 1),
    ({"reward__remote_url": "http://r"}, 2 + 2 + 2),
    ({"train__agent_func_path": "agent_funcs/babyai.py"}, 2 + 2 + 2),  # the agent func gives the rewards
    ({"actor__num_nodes": 2}, 4 + 2 + 2 + 1),
    ({"actor__num_nodes": None}, 0 + 2 + 2 + 1),
])
def test_gpus_needed_follows_openrlhfs_placement(flags, need):
    assert preflight.gpus_needed(ns(**{**BASE, **flags})) == need


def test_gpu_problems_on_a_cuda_host_and_a_cluster(monkeypatch):
    import torch

    args = ns(**BASE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)
    assert preflight.gpu_problems(args) == ["the flags place 7 GPUs (actor, ref, critic, reward, vLLM engines x TP; "
                                            "colocation shares them) and this host has 6: lower "
                                            "--actor.num_gpus_per_node / --vllm.num_engines, colocate "
                                            "(--train.colocate_all), or join a cluster (RAY_ADDRESS=..., "
                                            "scripts/ray_cluster_head.sh)"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 7)
    assert preflight.gpu_problems(args) == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # a cluster's GPUs are checked once Ray is up
    assert preflight.gpu_problems(args) == []
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # logical GPUs on a CPU host
    assert preflight.gpu_problems(args) == []
    assert preflight.cluster_gpu_problem(args, {"GPU": 6.0, "CPU": 8.0}) == (
        "the flags place 7 GPUs and the Ray cluster has 6 ({'GPU': 6.0, 'CPU': 8.0}): add nodes "
        "(scripts/ray_cluster_worker.sh), or lower --actor.num_gpus_per_node / --vllm.num_engines")
    assert preflight.cluster_gpu_problem(args, {"GPU": 7.0}) is None
    assert "has 0 ({})" in preflight.cluster_gpu_problem(args, {})


# ---- models and data -------------------------------------------------------------------------------------------
def test_model_problems_word_for_word(tmp_path, monkeypatch):
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text("{}")
    (good / "tokenizer_config.json").write_text("{}")
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(preflight, "hub_reachable", lambda: False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    args = ns(actor__model_name_or_path=str(good), critic__model_name_or_path=str(half),
              reward__model_name_or_path="org/model", reward__remote_url=None)
    assert preflight.model_problems(args) == [
        f"--critic.model_name_or_path {half}: a model folder needs config.json and a tokenizer (tokenizer.json or "
        "tokenizer_config.json): point it at a `save_pretrained` folder",
        "--reward.model_name_or_path org/model: not in the local Hugging Face cache and huggingface.co cannot be "
        "reached: download it where there is a network (`huggingface-cli download` ...) and pass the folder"]
    args = ns(actor__model_name_or_path=str(no_config), critic__model_name_or_path="./nowhere",
              reward__model_name_or_path="org/model", reward__remote_url="http://rm")  # a remote reward: not checked
    assert preflight.model_problems(args) == [
        f"--actor.model_name_or_path {no_config}: a model folder needs config.json and a tokenizer (tokenizer.json or "
        "tokenizer_config.json): point it at a `save_pretrained` folder",
        "--critic.model_name_or_path ./nowhere: no such folder: build a model first (e.g. `bash "
        "scripts/quickstart.sh` writes runs/quickstart/model-sft) or give a hub id"]
    (tmp_path / "hf" / "hub" / "models--org--model").mkdir(parents=True)
    assert preflight.model_problems(ns(actor__model_name_or_path="org/model")) == []  # in the cache
    monkeypatch.setattr(preflight, "hub_reachable", lambda: True)
    assert preflight.model_problems(ns(actor__model_name_or_path="org/elsewhere")) == []  # on the hub
    assert preflight.model_problems(ns(actor__model_name_or_path=None, critic__model_name_or_path="")) == []


def test_dataset_problems_word_for_word(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "hub_reachable", lambda: False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "b.jsonl").write_text('{"prompt": "babyai/1"}\n')
    (folder / "a.jsonl").write_text('\n  \n{"prompt": "babyai/2", "label": "2"}\n')  # the first file, sorted
    empty_folder = tmp_path / "empty_folder"
    empty_folder.mkdir()
    (empty_folder / "notes.txt").write_text("x")
    listed = tmp_path / "list.jsonl"
    listed.write_text("[1, 2]\n")
    args = ns(data__input_key="prompt", data__label_key="label",
              data__prompt_dataset=f" {folder} , {empty_folder},org/data", eval__dataset=str(listed))
    assert preflight.dataset_problems(args) == [
        f"--data.prompt_dataset {empty_folder}: a folder without .json/.jsonl files: {preflight.make_data(str(empty_folder))}",
        f"--data.prompt_dataset org/data: not a local file, and huggingface.co cannot be reached: "
        f"{preflight.make_data('org/data')}",
        f"--eval.dataset {listed}: its rows have list, not ['prompt', 'label']: set --data.input_key / "
        "--data.label_key to the file's keys (the agent funcs' files: prompt / label)"]
    args = ns(data__input_key="prompt", data__label_key=None, data__prompt_dataset=str(folder / "b.jsonl"),
              eval__dataset=None)
    assert preflight.dataset_problems(args) == []  # no label key: only the input key is needed
    (tmp_path / "hf" / "hub" / "datasets--org--data").mkdir(parents=True)
    assert preflight.dataset_problems(ns(data__input_key="prompt", data__label_key=None,
                                         data__prompt_dataset="org/data")) == []
    monkeypatch.setattr(preflight, "hub_reachable", lambda: True)
    assert preflight.dataset_problems(ns(data__input_key="prompt", data__label_key=None,
                                         data__prompt_dataset="org/other")) == []
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    [problem] = preflight.dataset_problems(ns(data__input_key="prompt", data__label_key=None,
                                              data__prompt_dataset=str(tmp_path / "bad.jsonl")))
    assert problem == (f"--data.prompt_dataset {tmp_path / 'bad.jsonl'}: the first line is not JSON (Expecting "
                       "property name enclosed in double quotes: line 1 column 2 (char 1)): the prompts are JSON lines")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    assert preflight.dataset_problems(ns(data__input_key="p", data__label_key=None,
                                         eval__dataset=str(tmp_path / "blank.jsonl"))) == [
        f"--eval.dataset {tmp_path / 'blank.jsonl'}: empty: {preflight.make_data(str(tmp_path / 'blank.jsonl'))}"]
    assert preflight.dataset_problems(ns(data__input_key="p", data__label_key=None,
                                         eval__dataset=str(tmp_path / "x" / "babyai_dev.jsonl"))) == [
        f"--eval.dataset {tmp_path / 'x' / 'babyai_dev.jsonl'}: no such file: make it with `.venv/bin/python "
        f"scripts/make_itemids.py --env babyai --split dev --out {tmp_path / 'x'}`"]
    (tmp_path / "keys.jsonl").write_text('{"b": 1, "a": 2}\n')
    assert preflight.dataset_problems(ns(data__input_key="prompt", data__label_key="a",
                                         eval__dataset=str(tmp_path / "keys.jsonl"))) == [
        f"--eval.dataset {tmp_path / 'keys.jsonl'}: its rows have ['a', 'b'], not ['prompt']: set --data.input_key "
        "/ --data.label_key to the file's keys (the agent funcs' files: prompt / label)"]


# ---- the agent func and its gateway -------------------------------------------------------------------------------
class Health(http.server.BaseHTTPRequestHandler):
    answer: tuple[int, bytes] = (200, b"{}")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        status, body = self.answer
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def health_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_agent_and_gateway_problems_word_for_word(tmp_path, monkeypatch, health_server):
    server, url = health_server
    monkeypatch.setenv("COPE_GATEWAY_URL", url + "/")
    check = lambda path, gateway=True: preflight.agent_and_gateway_problems(  # noqa: E731
        ns(train__agent_func_path=path), gateway)
    assert check(None) == [] and check("") == []
    assert check(str(tmp_path / "none.py")) == [f"--train.agent_func_path {tmp_path / 'none.py'}: no such file (the "
                                                "built-in ones: agent_funcs/<env>.py)"]
    (tmp_path / "boom.py").write_text("raise KeyError('k')\n")
    assert check(str(tmp_path / "boom.py")) == [f"--train.agent_func_path {tmp_path / 'boom.py'} does not load: "
                                                "KeyError: 'k'"]
    (tmp_path / "none_defined.py").write_text("X = 1\n")
    assert check(str(tmp_path / "none_defined.py")) == [f"--train.agent_func_path {tmp_path / 'none_defined.py'} "
                                                        "defines no AgentExecutor (OpenRLHF looks for that class)"]
    (tmp_path / "plain.py").write_text("class AgentExecutor:\n    pass\n")  # not on the gateway: nothing to check
    assert check(str(tmp_path / "plain.py")) == []
    agent = tmp_path / "agent.py"
    agent.write_text("class A:\n    env = 'babyai'\n\nclass AgentExecutor:\n    agent_cls = A\n")
    start = ("start it with `bash scripts/launch_babyai_grpo_tmux.sh` (servers, gateway and training) or `python -m "
             "env_gateway --env babyai=URL`, or set COPE_GATEWAY_URL")
    Health.answer = (200, json.dumps({"envs": {"babyai": {"healthy_replicas": 1, "replicas": 1}}}).encode())
    assert check(str(agent)) == []
    assert check(str(agent), gateway=False) == []
    Health.answer = (503, json.dumps({"envs": {"babyai": {"healthy_replicas": 0, "replicas": 2}}}).encode())
    assert check(str(agent)) == [f"the gateway at {url} has no healthy babyai replica (0 of 2): start or restart the "
                                 "babyai server (`python -m env_gateway.servers.babyai`, from .venvs/babyai)"]
    Health.answer = (503, b"")
    assert check(str(agent)) == [f"the gateway at {url} has no env 'babyai' (it has []): {start}"]
    Health.answer = (200, json.dumps({"envs": {"textcraft": {}, "alfworld": {}}}).encode())
    assert check(str(agent)) == [f"the gateway at {url} has no env 'babyai' (it has ['alfworld', 'textcraft']): "
                                 f"{start}"]
    Health.answer = (200, b"not json")
    [problem] = check(str(agent))
    assert problem.startswith(f"no gateway answers at COPE_GATEWAY_URL={url} (") and problem.endswith(f"): {start}")
    monkeypatch.delenv("COPE_GATEWAY_URL")
    monkeypatch.setattr(preflight.urllib.request, "urlopen", lambda u, timeout: (_ for _ in ()).throw(
        OSError(f"{u} {timeout}")))
    assert check(str(agent)) == ["no gateway answers at COPE_GATEWAY_URL=http://127.0.0.1:8800 "
                                 f"(http://127.0.0.1:8800/v1/health 3): {start}"]


# ---- secrets and folders ----------------------------------------------------------------------------------------
def test_secret_problems_word_for_word(tmp_path, monkeypatch):
    monkeypatch.delenv("COPE_GATEWAY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("COPE_SECRETS_DIR", str(tmp_path))
    assert preflight.secret_problems() == []  # neither file: nothing to check
    (tmp_path / "wandb_api_key").write_text("k1\nk2\n")
    (tmp_path / "wandb_api_key").chmod(0o600)
    monkeypatch.setenv("COPE_GATEWAY_TOKEN_FILE", str(tmp_path / "token"))
    assert preflight.secret_problems() == [f"secret file: no file {tmp_path / 'token'}",
                                           f"secret file: {tmp_path / 'wandb_api_key'} has 2 lines: it must hold the "
                                           "secret alone, on one line"]
    monkeypatch.delenv("COPE_SECRETS_DIR")
    assert preflight.secret_problems() == [f"secret file: no file {tmp_path / 'token'}"] or (
        os.path.exists(os.path.join(preflight.ROOT, ".secrets", "wandb_api_key")))


def test_folder_problems_word_for_word(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    model = tmp_path / "model"
    model.mkdir()
    (model / "w.safetensors").write_bytes(b"x" * 1000)
    (model / "w.bin").write_bytes(b"x" * 24)
    args = ns(ckpt__path=str(tmp_path / "new" / "deeper" / "ckpt"), ckpt__output_dir=str(tmp_path / "file" / "m"),
              logger__tensorboard_dir=None, actor__model_name_or_path=str(model))
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=7 * 1024))
    assert preflight.folder_problems(args) == [f"--ckpt.output_dir {tmp_path / 'file' / 'm'}: {tmp_path / 'file'} "
                                               "cannot be written: choose a folder you own (OUTPUT_DIR=...)"]
    seen = []
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: seen.append(path) or SimpleNamespace(
        free=7 * 1024 - 1))
    assert preflight.folder_problems(args)[1:] == [
        f"--ckpt.path {tmp_path / 'new' / 'deeper' / 'ckpt'}: one checkpoint of this model needs ~0.0 GiB (7x its "
        f"0.0 GiB of weights) and {tmp_path} has 0.0 GiB free: free space or point --ckpt.path elsewhere"]
    assert seen == [str(tmp_path)]  # the nearest folder that exists
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=2**40))
    args.ckpt__output_dir = None
    setattr(args, "ckpt.output_dir", None)
    assert preflight.folder_problems(args) == []
    setattr(args, "actor.model_name_or_path", "org/hub-model")  # not a folder: no size to check
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
    assert preflight.folder_problems(args) == []


def test_problems_runs_every_check_in_order(monkeypatch):
    calls = []
    for name in ("gpu_problems", "model_problems", "dataset_problems", "folder_problems"):
        monkeypatch.setattr(preflight, name, lambda args, name=name: calls.append(name) or [name])
    monkeypatch.setattr(preflight, "combination_error", lambda args: "combination")
    monkeypatch.setattr(preflight, "cpu_preset_error", lambda args: None)
    monkeypatch.setattr(preflight, "agent_and_gateway_problems", lambda args, gw: [f"agent {gw}"])
    monkeypatch.setattr(preflight, "secret_problems", lambda: ["secrets"])
    assert preflight.problems(ns()) == ["combination", "gpu_problems", "model_problems", "dataset_problems",
                                        "folder_problems", "agent True", "secrets"]
    assert preflight.problems(ns(), check_gateway=False)[-2] == "agent False"


def test_report_and_main(monkeypatch, capsys):
    assert preflight.report(["a: do b"]) == ("preflight: 1 problem would stop this run (COPE_SKIP_PREFLIGHT=1 skips "
                                             "these checks):\n  1. a: do b")
    assert preflight.report(["x", "y"]).splitlines() == [
        "preflight: 2 problems would stop this run (COPE_SKIP_PREFLIGHT=1 skips these checks):", "  1. x", "  2. y"]
    seen = []

    class Parser:
        def parse_args(self, argv):
            seen.append(argv)
            return ns(flags=argv)

    monkeypatch.setattr(preflight, "build_parser", lambda: Parser())
    monkeypatch.setattr(preflight, "problems", lambda args, gw: [f"gateway checked: {gw}"] if args.flags else [])
    assert preflight.main(["--a", "--no-gateway", "1"]) == 2
    assert seen[-1] == ["--a", "1"]
    assert capsys.readouterr().err == ("preflight: 1 problem would stop this run (COPE_SKIP_PREFLIGHT=1 skips these "
                                       "checks):\n  1. gateway checked: False\n")
    assert preflight.main(["--a"]) == 2 and "gateway checked: True" in capsys.readouterr().err
    assert preflight.main([]) == 0 and capsys.readouterr().out == "preflight: ok\n"
    monkeypatch.setattr(sys, "argv", ["preflight", "--b"])
    assert preflight.main() == 2 and seen[-1] == ["--b"]


# ---- placement groups, on a stand-in for Ray ---------------------------------------------------------------------
def test_placement_groups_wait_at_most_ray_pg_timeout_s(monkeypatch):
    class PlacementGroup:
        def __init__(self, bundles, placed):
            self.bundle_specs, self.placed, self.waited = bundles, placed, []

        def wait(self, timeout_seconds):
            self.waited.append(timeout_seconds)
            return self.placed

        def ready(self):
            return "ready", self

    ray = types.ModuleType("ray")
    ray.available_resources = lambda: {"CPU": 2.0}
    util = types.ModuleType("ray.util")
    pg_module = types.ModuleType("ray.util.placement_group")
    pg_module.PlacementGroup = PlacementGroup
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.util", util)
    monkeypatch.setitem(sys.modules, "ray.util.placement_group", pg_module)
    monkeypatch.delenv("RAY_PG_TIMEOUT_S", raising=False)
    preflight.bound_placement_groups()
    bounded = PlacementGroup.ready
    preflight.bound_placement_groups()  # a second call does not wrap it again
    assert PlacementGroup.ready is bounded and bounded.bounded is True
    fits = PlacementGroup([{"CPU": 1}], placed=True)
    assert fits.ready() == ("ready", fits) and fits.waited == [600.0]
    monkeypatch.setenv("RAY_PG_TIMEOUT_S", "2.5")
    stuck = PlacementGroup([{"GPU": 1, "CPU": 1}, {"GPU": 2}], placed=False)
    with pytest.raises(SystemExit) as e:
        stuck.ready()
    assert str(e.value) == ("Ray could not place 2 bundles ({'CPU': 1, 'GPU': 3} in all) within 2.5s "
                            "(RAY_PG_TIMEOUT_S); free in the cluster: {'CPU': 2.0}. Add nodes "
                            "(scripts/ray_cluster_worker.sh) or ask for fewer GPUs")
    assert stuck.waited == [2.5]


@pytest.mark.parametrize("name", [".cache/model", "/models", "~/m", "org/d.json", "org/d.jsonl", "org/d.parquet",
                                  "org/d.csv"])
def test_each_path_mark_alone_makes_a_local_path(name):
    """One "/" and no local folder of the first part: only the prefix or the suffix says it is a path."""
    assert preflight.looks_like_path(name)


def test_every_listed_model_and_dataset_is_checked_after_one_that_is_skipped_or_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "hub_reachable", lambda: False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    only_tokenizer_json = tmp_path / "m"
    only_tokenizer_json.mkdir()
    (only_tokenizer_json / "config.json").write_text("{}")
    (only_tokenizer_json / "tokenizer.json").write_text("{}")
    assert preflight.model_problems(ns(actor__model_name_or_path=None, critic__model_name_or_path="./a",
                                       reward__model_name_or_path=str(only_tokenizer_json))) == [
        "--critic.model_name_or_path ./a: no such folder: build a model first (e.g. `bash scripts/quickstart.sh` "
        "writes runs/quickstart/model-sft) or give a hub id"]
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "text.jsonl").write_text("no json\n")
    (tmp_path / "keys.jsonl").write_text('{"x": 1}\n')
    (tmp_path / "latin.jsonl").write_bytes(b'{"p": "caf\xe9"}\n')  # not UTF-8: read with replacement, not a crash
    entries = [tmp_path / "gone.jsonl", tmp_path / "empty.jsonl", tmp_path / "text.jsonl", tmp_path / "keys.jsonl",
               tmp_path / "latin.jsonl"]
    found = preflight.dataset_problems(ns(data__input_key="p", data__label_key=None,
                                          data__prompt_dataset=",".join(map(str, entries))))
    assert [p.split(": ")[1][:12] for p in found] == ["no such file", "empty", "the first li", "its rows hav"]
    assert len(found) == 4  # the file that is not UTF-8 is read (with replacement) and has the key


def test_secrets_default_to_the_checkouts_secrets_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("COPE_SECRETS_DIR", raising=False)
    monkeypatch.delenv("COPE_GATEWAY_TOKEN_FILE", raising=False)
    monkeypatch.setattr(preflight, "ROOT", str(tmp_path))
    (tmp_path / ".secrets").mkdir()
    (tmp_path / ".secrets" / "wandb_api_key").write_text("k\n")
    (tmp_path / ".secrets" / "wandb_api_key").chmod(0o644)
    assert preflight.secret_problems() == [f"secret file: {tmp_path / '.secrets' / 'wandb_api_key'} can be read by "
                                           f"others (mode 644): run `chmod 600 {tmp_path / '.secrets' / 'wandb_api_key'}`"]


@pytest.mark.parametrize("flag", ["ckpt.path", "ckpt.output_dir", "logger.tensorboard_dir"])
def test_each_output_folder_is_checked_on_its_own(tmp_path, flag):
    (tmp_path / "file").write_text("")
    args = ns(ckpt__path=None, ckpt__output_dir=None, logger__tensorboard_dir=None, actor__model_name_or_path=None)
    setattr(args, flag, str(tmp_path / "file" / "x"))
    assert preflight.folder_problems(args) == [f"--{flag} {tmp_path / 'file' / 'x'}: {tmp_path / 'file'} cannot be "
                                               "written: choose a folder you own (OUTPUT_DIR=...)"]


def test_the_checkpoint_room_is_told_in_gib(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    with open(model / "w.safetensors", "wb") as f:
        f.truncate(3 * 2**30)  # a sparse file: 3 GiB by its size, nothing on disk
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=5 * 2**30))
    args = ns(ckpt__path=str(tmp_path / "ckpt"), actor__model_name_or_path=str(model))
    assert preflight.folder_problems(args) == [
        f"--ckpt.path {tmp_path / 'ckpt'}: one checkpoint of this model needs ~21.0 GiB (7x its 3.0 GiB of weights) "
        f"and {tmp_path} has 5.0 GiB free: free space or point --ckpt.path elsewhere"]
    assert preflight.folder_problems(ns(ckpt__path=None, actor__model_name_or_path=str(model))) == []  # no ckpt
    assert preflight.folder_problems(ns(ckpt__path=str(tmp_path / "ckpt"), actor__model_name_or_path=None)) == []


def test_gpus_of_a_group_without_a_count_are_none():
    assert preflight.gpus_needed(ns(**{**BASE, "ref__num_gpus_per_node": None})) == 2 + 2 + 1
