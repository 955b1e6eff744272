"""Shared pytest set-up: the CPU import fix for OpenRLHF, the repository root on sys.path, the tiny tokenizer and
model fixtures the signal and trainer tests share (tests/tiny_hf.py), and the policy / reference checkpoints and
their Ray actor groups (tests/ray_cpu_groups.py) that the experience-maker tests share."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import cope_rlhf.compat  # noqa: E402,F401

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
