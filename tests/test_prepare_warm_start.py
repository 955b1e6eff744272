"""scripts/prepare_warm_start.py: held-out ids and demos are drawn from the whole id list and never overlap; bad
requests are refused; the model has the width and depth asked for; a SIGTERM leaves no env server behind."""

import os
import subprocess
import sys

import pytest

from scripts import prepare_warm_start


def test_held_out_ids_and_demos_come_from_the_whole_range_of_an_ordered_id_list():
    """TextCraft lists its ids by recipe depth; held-out items and demos must not be its two ends (they were: the
    held-out set was the tail, the 100 deepest goals, the demos the head)."""
    ids = list(range(0, 4000, 40))  # think of id // 1000 as the depth
    train, heldout = prepare_warm_start.split_ids(ids, heldout=30, demos=50)
    assert sorted(train + heldout) == ids and not set(train) & set(heldout)  # demos (train[:50]) are never held out
    assert heldout == sorted(heldout) and train != sorted(train)  # demos are train[:demos]: its order matters
    for part in (heldout, train[:50]):
        assert {i // 1000 for i in part} == {0, 1, 2, 3}, part  # every depth, not only the deepest or the shallowest
    assert prepare_warm_start.split_ids(ids, heldout=30, demos=50) == (train, heldout)  # fixed, run to run


def test_too_few_ids_for_the_request_is_a_clear_error():
    with pytest.raises(SystemExit, match="too few for 30 held-out items plus 80 demos"):
        prepare_warm_start.split_ids(list(range(100)), heldout=30, demos=80)


@pytest.mark.parametrize("argv, message", [
    (["--env", "textcraft", "--out", "x", "--levels", "1"], "--levels is BabyAI's"),
    (["--env", "babyai", "--out", "x", "--levels", "41"], "--levels are 1-40"),
    (["--env", "textcraft", "--out", "x", "--demo-policy", "view"], "--demo-policy view is BabyAI's"),
    (["--env", "textcraft", "--out", "x", "--hidden-size", "100"], "--hidden-size must be a positive multiple of 64"),
    (["--env", "textcraft", "--out", "x", "--layers", "0"], "--layers >= 1, got 128 and 0"),
    (["--env", "babyai", "--out", "x", "--texts-per-goal", "2"], "--texts-per-goal is TextCraft's"),
    (["--env", "textcraft", "--out", "x", "--texts-per-goal", "0"], "and >= 1, got 0 for textcraft"),
    (["--env", "babyai", "--out", "x", "--base-model", "tests", "--layers", "3"], "--base-model brings its own"),
    (["--env", "babyai", "--out", "x", "--base-model", "no/such/dir"], "--base-model no/such/dir: no config.json"),
])
def test_levels_are_checked_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit):
        prepare_warm_start.main(argv)
    assert message in capsys.readouterr().err


def test_sigterm_mid_run_stops_its_env_server(tmp_path):
    import psutil

    from tests.env_server_proc import check_sigterm_stops, require_venv

    require_venv("babyai")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    servers = []
    proc = subprocess.Popen([sys.executable, "scripts/prepare_warm_start.py", "--env", "babyai", "--out",
                             str(tmp_path), "--levels", "1", "--heldout", "5", "--demos", "60"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # the ids are written while the server is up; the demos follow
            if "held-out item ids" in line:
                break
        servers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "env_gateway.servers.babyai" in " ".join(c.cmdline())]
        assert servers, "no env server under the run"
    finally:
        check_sigterm_stops(proc, servers, timeout=15)


def test_the_model_is_built_at_the_width_and_depth_asked_for(tmp_path):
    """--hidden-size / --layers reach the model that is trained (one head per 64 of width, as vLLM's CPU attention
    needs): a bigger policy for envs the 0.66M default cannot learn from its demos (TextCraft)."""
    from transformers import AutoConfig

    from tests.env_server_proc import require_venv

    require_venv("babyai")
    out = prepare_warm_start.main(["--env", "babyai", "--out", str(tmp_path), "--levels", "1", "--heldout", "2",
                                   "--demos", "2", "--epochs", "1", "--hidden-size", "192", "--layers", "3"])
    for folder in ("model", "model-sft"):
        config = AutoConfig.from_pretrained(tmp_path / folder)
        assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (192, 3, 3)
    assert out["demos"] == 2 and out["model"] == str(tmp_path / "model-sft")


def test_a_pretrained_base_model_is_warm_started_as_it_is(tmp_path):
    """--base-model (SmolLM2 from scripts/get_smollm2.py, or any checkpoint with a ChatML-like template): the SFT
    starts from its weights and keeps its architecture and tokenizer; no model is built here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tests.env_server_proc import require_venv
    from tests.tiny_hf import tiny_model, tiny_tokenizer

    require_venv("babyai")
    base = tmp_path / "base"
    tiny_model(len(tiny_tokenizer()), seed=3).save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    out = prepare_warm_start.main(["--env", "babyai", "--out", str(tmp_path / "ws"), "--levels", "1", "--heldout", "2",
                                   "--demos", "2", "--epochs", "1", "--sft-lr", "1e-3", "--base-model", str(base)])
    assert out["model"] == str(tmp_path / "ws" / "model-sft") and not (tmp_path / "ws" / "model").exists()
    unnamed = {"_name_or_path": None, "dtype": None}
    config = AutoConfig.from_pretrained(out["model"]).to_dict() | unnamed
    assert config == AutoConfig.from_pretrained(base).to_dict() | unnamed
    assert AutoTokenizer.from_pretrained(out["model"]).get_vocab() == tiny_tokenizer().get_vocab()
    before = AutoModelForCausalLM.from_pretrained(base).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out["model"]).state_dict()
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    assert moved and max(float((before[n] - after[n]).abs().max()) for n in moved) < 0.01  # trained from it


def test_texts_per_goal_trains_on_other_texts_of_training_goals_only():
    """--texts-per-goal K (TextCraft): the training ids are every training goal's texts 0..K-1 (goal + 544 k), round
    by round so that the demos span the goals first; no text of a held-out goal is trained on; the demo count may
    exceed the goals, up to K per goal."""
    ids = list(range(0, 444))
    train, heldout = prepare_warm_start.split_ids(ids, heldout=100, demos=1000, texts=3)
    texts = prepare_warm_start.with_texts(train, 3)
    assert len(texts) == 3 * 344 and len(set(texts)) == len(texts)
    assert {i % 544 for i in texts} == set(train) and not {i % 544 for i in texts} & set(heldout)
    assert [i // 544 for i in texts] == [0] * 344 + [1] * 344 + [2] * 344  # demos (the first 1000) see every goal
    assert texts[:344] == train
    with pytest.raises(SystemExit, match="too few for 100 held-out items plus 1100 demos.*in 3 texts"):
        prepare_warm_start.split_ids(ids, heldout=100, demos=1100, texts=3)
