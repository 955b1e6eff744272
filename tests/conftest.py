"""Shared pytest set-up: the CPU import fix for OpenRLHF, the repository root on sys.path, the tiny tokenizer and
model fixtures the signal and trainer tests share (tests/tiny_hf.py), and the policy / reference checkpoints and
their Ray actor groups (tests/ray_cpu_groups.py) that the experience-maker tests share."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import cope_rlhf.compat  # noqa: E402,F401

# The BabyAI tests' tiny models, demos and expected counts were made on the server's compact text; the servers they
# start inherit this. AgentGym's text (the server's default) has its own tests: test_parity_babyai, test_server_babyai.
os.environ.setdefault("BABYAI_TEXT", "compact")

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from tests.tiny_hf import tiny_tokenizer  # imported on use: the gateway and server tests need no transformers

    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    from tests.tiny_hf import tiny_model

    return tiny_model(len(tok))


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    """One saved tiny checkpoint (seed 0) with its tokenizer: the policy of the actor and trainer tests."""
    from tests.tiny_hf import tiny_model

    path = tmp_path_factory.mktemp("policy")
    tiny_model(len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tok, tmp_path_factory):
    """Two saved tiny checkpoints: [policy (seed 0), reference (seed 1)]."""
    from tests.tiny_hf import tiny_model

    dirs = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"model{seed}")
        tiny_model(len(tok), seed=seed).save_pretrained(path)
        tok.save_pretrained(path)
        dirs.append(str(path))
    return dirs


@pytest.fixture(scope="module")
def groups(checkpoints, group_args):
    """OpenRLHF's RayActorGroups of CPU stand-in model actors over ``checkpoints``, in a Ray started as the CLI starts
    it (OpenRLHF-style ``ray.init`` arguments, wrapped to add CoPE's worker hook). A module using it defines the
    ``group_args`` fixture: the hierarchized args the actors' stand-in strategy carries."""
    import ray

    from cope_rlhf import patch
    from tests.ray_cpu_groups import StandInStrategy, cpu_groups

    patch.ray_init_with_hook(ray.init)(num_cpus=2, include_dashboard=False, log_to_driver=False,
                                       runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        yield cpu_groups(StandInStrategy(group_args), *checkpoints)
    finally:
        ray.shutdown()


# ---- a warm-started BabyAI policy for the end-to-end tests ---------------------------------------------------------
def level1_rows(ids) -> list:
    return [{"prompt": f"babyai/{i}", "label": str(i)} for i in ids]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def make_demos(path, item_ids) -> str:
    import importlib.util

    from tests.env_server_proc import EnvServerProcess

    spec = importlib.util.spec_from_file_location("make_demos", os.path.join(ROOT, "scripts", "make_demos.py"))
    make_demos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_demos)
    with EnvServerProcess("babyai") as server:
        return write_jsonl(path, [make_demos.episode(server.url, "babyai", i, 30) for i in item_ids])


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """A tiny model (scripts/make_tiny_model.py) warm-started on 200 expert demos of BabyAI level 1 (GoToRedBallGrey:
    item ids = 0 mod 40) from the real server, so that rollouts win some episodes; the SFT checkpoint is
    ``<dir>/sft``. Shared by the end-to-end tests of the single-machine front-end and of the real path."""
    from tests.env_server_proc import require_venv

    require_venv("babyai")
    from cope_rlhf.local.sft import train as sft
    from scripts.make_tiny_model import main as make_tiny_model

    d = tmp_path_factory.mktemp("local_e2e")
    demos = make_demos(d / "demos.jsonl", range(800, 800 + 40 * 200, 40))
    make_tiny_model(["--out", str(d / "tiny"), "--corpus", demos])
    sft(str(d / "tiny"), demos, str(d / "sft"), epochs=3, lr=2e-3, batch_size=8, max_len=2048, seed=0)
    return d
