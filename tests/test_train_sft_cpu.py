"""``python -m cope_rlhf.cli.train_sft``: OpenRLHF's own SFT trainer (DeepSpeed, ZeRO-2, fp32) on this CPU host, one
process without a launcher: one epoch on BabyAI expert demos (``conftest.warm_model``'s) lowers the tiny model's loss
on the demos' agent replies, and a flag that cannot run on CPU is refused with exit code 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import torch

from tests.conftest import ROOT


def reply_nll(model_dir: str, demos: str, count: int = 20) -> float:
    """Mean next-token loss over the agent replies of the first ``count`` demos (the warm start's token layout)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cope_rlhf.local.sft import demo_tokens

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with open(demos) as f:
        rows = [json.loads(line) for line in f][:count]
    for row in rows:
        ids, mask = demo_tokens(tok, row["messages"], 2048)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
        losses = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        keep = torch.tensor(mask[1:], dtype=torch.bool)
        total, tokens = total + float(losses[keep].sum()), tokens + int(keep.sum())
    return total / tokens


def sft(*extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "cope_rlhf.cli.train_sft", *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_openrlhf_sft_trains_on_cpu(warm_model, tmp_path):
    """Without a launcher, the one-process group needs no fixed port: the run succeeds while another program holds
    29531 (the port it once hard-coded), as two SFT runs on one machine, or a run beside any server, would."""
    demos, start = str(warm_model / "demos.jsonl"), str(warm_model / "tiny")
    other_program = socket.create_server(("127.0.0.1", 29531))
    try:
        done = sft("--model.model_name_or_path", start, "--data.dataset", demos, "--data.input_key", "messages",
                   "--data.apply_chat_template", "--data.multiturn", "--data.max_len", "2048",
                   "--train.micro_batch_size", "8", "--train.batch_size", "8", "--train.max_epochs", "1",
                   "--adam.lr", "2e-3", "--ds.attn_implementation", "sdpa", "--ds.param_dtype", "fp32",
                   "--ckpt.output_dir", str(tmp_path / "out"), "--ckpt.path", str(tmp_path / "ckpt"))
    finally:
        other_program.close()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    before, after = reply_nll(start, demos), reply_nll(str(tmp_path / "out"), demos)
    assert after < 0.8 * before, (before, after)


def test_a_flag_that_needs_cuda_is_refused(warm_model, tmp_path):
    done = sft("--model.model_name_or_path", str(warm_model / "tiny"), "--data.dataset", "unused",
               "--ds.param_dtype", "bf16", "--ckpt.output_dir", str(tmp_path / "out"), timeout=120)
    assert done.returncode == 2
    assert "--ds.attn_implementation sdpa" in done.stderr and "no CUDA device" in done.stderr
