"""cope_rlhf.preflight: each check fails with its own message on a crafted bad setup, a good setup passes, the CLI
lists every problem at once and exits 2 in seconds, and a placement group that cannot be placed stops the run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from cope_rlhf import preflight
from cope_rlhf.cli.args import build_parser
from env_gateway.fake_backend import FakeBackendProcess
from tests.conftest import ROOT, write_jsonl
from tests.gateway_proc import GatewayProcess

pytestmark = pytest.mark.timeout(120)
CPU = ["--ds.attn_implementation", "sdpa", "--vllm.sync_backend", "gloo", "--vllm.enforce_eager"]


@pytest.fixture(scope="module")
def parser():
    return build_parser()


@pytest.fixture(scope="module")
def gateway_url():
    """A gateway with one healthy babyai replica (the fake AgentGym backend: only health matters here)."""
    with FakeBackendProcess() as backend:
        gw = GatewayProcess("--env", f"babyai={backend.url}", ready="healthy")
        try:
            yield gw.url
        finally:
            gw.stop()


@pytest.fixture
def good(tmp_path, model_dir, gateway_url, monkeypatch):
    """A setup with nothing wrong: (argv, tmp_path); COPE_GATEWAY_URL points at the gateway."""
    monkeypatch.setenv("COPE_GATEWAY_URL", gateway_url)
    for name in ("COPE_GATEWAY_TOKEN_FILE", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COPE_SECRETS_DIR", str(tmp_path / "secrets"))
    data = write_jsonl(tmp_path / "babyai_train.jsonl", [{"prompt": "babyai/1", "label": "1"}])
    argv = [*CPU, "--actor.model_name_or_path", model_dir, "--train.agent_func_path", "agent_funcs/babyai.py",
            "--data.prompt_dataset", data, "--data.input_key", "prompt", "--data.label_key", "label",
            "--eval.dataset", data, "--ckpt.path", str(tmp_path / "out" / "ckpt"),
            "--ckpt.output_dir", str(tmp_path / "out" / "model"), "--logger.tensorboard_dir", str(tmp_path / "tb"),
            "--algo.advantage.estimator", "group_norm"]
    return argv, tmp_path


def found(parser, argv, **kw) -> list:
    return preflight.problems(parser.parse_args(argv), **kw)


def replaced(argv: list, flag: str, value: str) -> list:
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def test_a_good_setup_passes(parser, good):
    argv, _ = good
    t0 = time.perf_counter()
    assert found(parser, argv) == []
    print(f"preflight of a good setup: {time.perf_counter() - t0:.2f} s")


def test_missing_dataset_names_the_command_that_makes_it(parser, good):
    argv, tmp = good
    [problem] = found(parser, replaced(argv, "--data.prompt_dataset", str(tmp / "data" / "babyai_train.jsonl")))
    assert "no such file" in problem and (f"scripts/make_itemids.py --env babyai --split train --out "
                                          f"{tmp / 'data'}") in problem


def test_dataset_with_other_keys_or_empty_or_not_json(parser, good):
    argv, tmp = good
    wrong = write_jsonl(tmp / "wrong.jsonl", [{"input": "babyai/1", "output": "1"}])
    [problem] = found(parser, replaced(argv, "--eval.dataset", wrong))
    assert "--eval.dataset" in problem and "['input', 'output'], not ['prompt', 'label']" in problem
    (tmp / "empty.jsonl").write_text("\n")
    assert "empty" in found(parser, replaced(argv, "--eval.dataset", str(tmp / "empty.jsonl")))[0]
    (tmp / "text.jsonl").write_text("babyai/1\n")
    assert "not JSON" in found(parser, replaced(argv, "--eval.dataset", str(tmp / "text.jsonl")))[0]


def test_no_gateway_and_a_gateway_without_the_env(parser, good, monkeypatch):
    argv, _ = good
    monkeypatch.setenv("COPE_GATEWAY_URL", "http://127.0.0.1:9")
    [problem] = found(parser, argv)
    assert problem.startswith("no gateway answers at COPE_GATEWAY_URL=http://127.0.0.1:9") and \
        "scripts/launch_babyai_grpo_tmux.sh" in problem
    assert found(parser, argv, check_gateway=False) == []  # the tmux launcher, before it starts the gateway
    with FakeBackendProcess() as backend:
        gw = GatewayProcess("--env", f"textcraft={backend.url}", ready="healthy")
        try:
            monkeypatch.setenv("COPE_GATEWAY_URL", gw.url)
            [problem] = found(parser, argv)
            assert "has no env 'babyai' (it has ['textcraft'])" in problem
        finally:
            gw.stop()


def test_model_folder_without_tokenizer_and_a_missing_one(parser, good, tok):
    argv, tmp = good
    from tests.tiny_hf import tiny_model

    tiny_model(len(tok)).save_pretrained(tmp / "no_tokenizer")
    [problem] = found(parser, replaced(argv, "--actor.model_name_or_path", str(tmp / "no_tokenizer")))
    assert "needs config.json and a tokenizer" in problem
    [problem] = found(parser, replaced(argv, "--actor.model_name_or_path", "runs/quickstart/model-sft"))
    assert "no such folder" in problem and "scripts/quickstart.sh" in problem


def test_agent_func_that_does_not_load_or_has_no_executor(parser, good):
    argv, tmp = good
    (tmp / "broken.py").write_text("raise RuntimeError('boom')\n")
    (tmp / "empty.py").write_text("X = 1\n")
    assert "does not load: RuntimeError: boom" in found(
        parser, replaced(argv, "--train.agent_func_path", str(tmp / "broken.py")))[0]
    assert "defines no AgentExecutor" in found(
        parser, replaced(argv, "--train.agent_func_path", str(tmp / "empty.py")))[0]


def test_unwritable_folder_and_no_room_for_a_checkpoint(parser, good, monkeypatch):
    argv, tmp = good
    (tmp / "a_file").write_text("")
    [problem] = found(parser, replaced(argv, "--ckpt.output_dir", str(tmp / "a_file" / "model")))
    assert "--ckpt.output_dir" in problem and "cannot be written" in problem
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))  # 1 kB free
    [problem] = found(parser, argv)
    assert "one checkpoint of this model needs" in problem and "free" in problem


def test_a_folder_without_write_permission_is_a_problem(parser, good, monkeypatch):
    """As a user without write permission sees it (the tests run as root, whom os.access never refuses, so the refusal
    is stood in for): an existing folder that cannot be written, though it is a folder."""
    argv, tmp = good
    locked, access = tmp / "locked", os.access
    locked.mkdir()
    monkeypatch.setattr(preflight.os, "access",
                        lambda path, mode: access(path, mode) and not (str(path) == str(locked) and mode & os.W_OK))
    [problem] = found(parser, replaced(argv, "--ckpt.output_dir", str(locked / "model")))
    assert problem == (f"--ckpt.output_dir {locked / 'model'}: {locked} cannot be written: choose a folder you own "
                       "(OUTPUT_DIR=...)")


def test_cope_signals_off_grpo_are_a_problem_too(parser, good):
    argv, _ = good
    [problem] = found(parser, [*replaced(argv, "--algo.advantage.estimator", "reinforce"),
                               "--cope.grpo_filter_degenerate"])
    assert problem.startswith("the CoPE signals (--cope.grpo_filter_degenerate) are defined on GRPO advantages; got "
                              "--algo.advantage.estimator reinforce")


def test_secret_files_must_be_owner_only(parser, good, monkeypatch):
    argv, tmp = good
    monkeypatch.setenv("COPE_GATEWAY_TOKEN_FILE", str(tmp / "missing_token"))
    [problem] = found(parser, argv)
    assert problem.startswith("secret file: no file")
    secrets = tmp / "secrets"
    secrets.mkdir()
    (secrets / "wandb_api_key").write_text("wandb-key\n")
    (secrets / "wandb_api_key").chmod(0o644)
    monkeypatch.delenv("COPE_GATEWAY_TOKEN_FILE")
    [problem] = found(parser, argv)
    assert "wandb_api_key can be read by others" in problem and "chmod 600" in problem


def test_gpu_count_against_the_host_and_the_cluster(parser, good, monkeypatch):
    argv, _ = good
    args = parser.parse_args(argv + ["--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2",
                                     "--reward.num_gpus_per_node", "1", "--vllm.num_engines", "2",
                                     "--algo.kl.init_coef", "0.01"])
    # the agent func gives the rewards: OpenRLHF starts no reward group (it sets --reward.remote_url "agent")
    assert preflight.gpus_needed(args) == 2 + 2 + 2
    assert preflight.gpus_needed(parser.parse_args(argv + [
        "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2", "--reward.num_gpus_per_node", "1",
        "--vllm.num_engines", "2", "--algo.kl.init_coef", "0.01", "--train.colocate_all"])) == 2
    at = argv.index("--train.agent_func_path")
    with_reward_model = parser.parse_args(argv[:at] + argv[at + 2:] + [
        "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2", "--reward.num_gpus_per_node", "1",
        "--vllm.num_engines", "2", "--algo.kl.init_coef", "0.01"])
    assert preflight.gpus_needed(with_reward_model) == 2 + 2 + 1 + 2
    assert "the flags place 6 GPUs and the Ray cluster has 4" in preflight.cluster_gpu_problem(args, {"GPU": 4.0})
    assert preflight.cluster_gpu_problem(args, {"GPU": 6.0}) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA host with one device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    [problem] = preflight.gpu_problems(args)
    assert "the flags place 6 GPUs" in problem and "this host has 1" in problem


def test_the_cli_lists_every_problem_at_once_and_exits_2_in_seconds(tmp_path):
    """The issue's run: a model and a dataset that do not exist, no gateway, the GPU preset on a CPU host."""
    env = {**os.environ, "COPE_GATEWAY_URL": "http://127.0.0.1:9"}
    env.pop("COPE_SKIP_PREFLIGHT", None)
    done = subprocess.run([sys.executable, "-m", "cope_rlhf.cli.train_ppo_ray", "--actor.model_name_or_path",
                           "runs/quickstart/model-sft", "--train.agent_func_path", "agent_funcs/babyai.py",
                           "--data.prompt_dataset", "data/generated/babyai_train.jsonl", "--data.input_key", "prompt",
                           "--data.label_key", "label", "--ckpt.path", str(tmp_path / "ckpt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # not Ray's endless wait
    assert done.returncode == 2, done.stderr[-3000:]
    report = done.stderr[done.stderr.index("preflight:"):]
    assert ("3 problems" if torch.cuda.is_available() else "4 problems") in report.splitlines()[0]
    for expected in ("runs/quickstart/model-sft: no such folder", "data/generated/babyai_train.jsonl: no such file",
                     "no gateway answers"):
        assert expected in report
    assert torch.cuda.is_available() or "this host has no CUDA device" in report
    skipped = subprocess.run([sys.executable, "-m", "cope_rlhf.preflight", "--no-gateway", *CPU,
                              "--actor.model_name_or_path", "runs/quickstart/model-sft"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert skipped.returncode == 2 and "no gateway" not in skipped.stderr and "no such folder" in skipped.stderr


PLACEMENT = """
import ray
from ray.util.placement_group import placement_group
from cope_rlhf import preflight
ray.init(num_cpus=1, num_gpus=0, include_dashboard=False)
try:
    preflight.bound_placement_groups()
    try:
        ray.get(placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK").ready())  # unbounded: waits for good
        print("placed one that cannot be placed")
    except SystemExit as e:
        print("stopped:", e)
    ray.get(placement_group([{"CPU": 1}], strategy="PACK").ready(), timeout=30)
    print("placed one that fits")
finally:
    ray.shutdown()
"""


def test_a_placement_group_that_cannot_be_placed_stops_the_run():
    """In a subprocess of its own: Ray's processes are then that one's children, not pytest's (a test runner that
    waits for its own children, as mutmut does for its mutant workers, took an exiting raylet for one of them)."""
    done = subprocess.run([sys.executable, "-c", PLACEMENT], cwd=ROOT, env={**os.environ, "RAY_PG_TIMEOUT_S": "2"},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if line.startswith(("stopped:", "placed"))]
    assert len(said) == 2 and said[1] == "placed one that fits", done.stdout
    assert re.fullmatch(r"stopped: Ray could not place 1 bundles \({'CPU': 1.0, 'GPU': 1.0} in all\) within 2s "
                        r"\(RAY_PG_TIMEOUT_S\); free in the cluster: \{.*\}\. Add nodes "
                        r"\(scripts/ray_cluster_worker.sh\) or ask for fewer GPUs", said[0]), said[0]
