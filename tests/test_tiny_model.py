"""scripts/make_tiny_model.py (deterministic small chat model) and the SFT warm start's token layout and loss."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cope_rlhf.local.sft import demo_tokens, read_demos, train
from scripts.make_tiny_model import main as make_tiny_model

ACTIONS = ["go to red ball 1", "turn left", "move forward"]


def demo(actions) -> dict:
    messages = [{"role": "user", "content": "You control an agent. Reach the goal."},
                {"role": "assistant", "content": "Understood."},
                {"role": "user", "content": "Your goal: go to the red ball\nYou see: a red ball 1."}]
    for a in actions:
        messages += [{"role": "assistant", "content": f"Thought:\nI go on.\n\nAction:\n{a}"},
                     {"role": "user", "content": f"You did {a}."}]
    return {"env": "babyai", "item_id": "0", "reward": 1.0, "success": True, "turns": len(actions),
            "messages": messages}


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("demos") / "demos.jsonl"
    rows = [demo(ACTIONS[i % 3:] or ACTIONS) for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def built(tmp_path_factory, demos):
    d = tmp_path_factory.mktemp("tiny")
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        make_tiny_model(["--out", str(d / name), "--corpus", demos, "--seed", str(seed)])
    return d


def test_same_seed_same_bytes_other_seed_other_weights(built):
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (built / "a" / name).read_bytes() == (built / "b" / name).read_bytes(), name
    assert (built / "a" / "tokenizer.json").read_bytes() == (built / "c" / "tokenizer.json").read_bytes()
    assert (built / "a" / "model.safetensors").read_bytes() != (built / "c" / "model.safetensors").read_bytes()


def test_is_a_chat_model_vllm_can_serve(built):
    tok = AutoTokenizer.from_pretrained(built / "a")
    model = AutoModelForCausalLM.from_pretrained(built / "a")
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.hidden_size // cfg.num_attention_heads == 64  # vLLM CPU needs 64
    assert tok.eos_token == "<|im_end|>" and cfg.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert tok.pad_token == "<|endoftext|>" and cfg.vocab_size == len(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "go to red ball 1"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\ngo to red ball 1<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < 20  # the BPE learned the environment's words
    # tied embeddings, as the script promises (vLLM and OpenRLHF load the one matrix), and a forward over the whole
    # vocabulary that depends on the context
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([ids, ids[:1] * len(ids)])).logits
    assert logits.shape == (2, len(ids), len(tok)) and torch.isfinite(logits).all()
    assert not torch.allclose(logits[0, -1], logits[1, -1])


def test_bad_head_dim_and_missing_corpus_are_clear_errors(tmp_path, demos):
    with pytest.raises(SystemExit, match="head_dim 64"):
        make_tiny_model(["--out", str(tmp_path / "x"), "--hidden-size", "64", "--heads", "4"])
    with pytest.raises(SystemExit, match="does not exist"):
        make_tiny_model(["--out", str(tmp_path / "x"), "--corpus", str(tmp_path / "none.jsonl")])


def test_sft_loss_covers_exactly_the_replies(built, demos):
    tok = AutoTokenizer.from_pretrained(built / "a")
    messages = read_demos(demos)[0]
    ids, mask = demo_tokens(tok, messages, 4096)
    assert len(ids) == len(mask)
    replies = [m["content"] + "<|im_end|>" for m in messages[3:] if m["role"] == "assistant"]
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "".join(replies)
    # the layout a rollout produces: the whole text, token-for-token re-decodable
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode([t for t, m in zip(ids, mask) if not m]).count("Understood.") == 1  # acknowledgement: prompt


def test_sft_gradient_checkpointing_recomputes_and_learns_the_same(built, demos, tmp_path, monkeypatch):
    """--gradient-checkpointing trades memory for a second forward: the same weights come out."""
    from cope_rlhf.local import sft

    loaded, load = [], AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(sft.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    for name, extra in (("plain", []), ("recomputed", ["--gradient-checkpointing"])):
        sft.main(["--model", str(built / "a"), "--demos", demos, "--out", str(tmp_path / name), "--epochs", "2",
                  "--batch-size", "4", "--max-len", "512", *extra])
    assert [m.is_gradient_checkpointing for m in loaded] == [False, True]
    plain, recomputed = (AutoModelForCausalLM.from_pretrained(tmp_path / n).state_dict()
                         for n in ("plain", "recomputed"))
    assert all(torch.equal(plain[k], recomputed[k]) for k in plain)


@pytest.mark.parametrize("bf16", [False, True])
def test_sft_learns_the_demos(built, demos, tmp_path, bf16):
    result = train(str(built / "a"), demos, str(tmp_path / "sft"), epochs=6, lr=3e-3, batch_size=4, max_len=512,
                   seed=0, bf16=bf16)
    assert result["loss"][-1] < 0.5 * result["loss"][0]
    saved = json.load(open(tmp_path / "sft" / "config.json"))
    assert saved["dtype"] == "float32"  # bf16 autocasts the compute; the weights stay float32
    assert os.path.exists(tmp_path / "sft" / "model.safetensors")
    with pytest.raises(ValueError, match="no successful demos"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({**demo(ACTIONS), "success": False}) + "\n")
        read_demos(str(bad))
