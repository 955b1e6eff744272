"""patch.apply(): OpenRLHF's modules hold the CoPE classes in the driver; idempotent; the hook wrapper keeps
OpenRLHF's own ray.init arguments. (The Ray-worker side is checked in tests/test_experience_maker.py, which
starts its Ray session through the same wrapper and asks a worker.)"""

import importlib
import sys

import pytest

from cope_rlhf import patch

OPENRLHF_NAMES = {
    "openrlhf.trainer.ppo_trainer": ["RemoteExperienceMaker", "PPOTrainer"],
    "openrlhf.trainer.ray.ppo_actor": ["ActorPPOTrainer", "PolicyModelActor"],
}


def classes_in_use() -> dict:  # the same question the CPU stand-in actor answers in a Ray worker
    """What OpenRLHF's modules hold in this process, by qualified name."""
    trainer = importlib.import_module("openrlhf.trainer.ppo_trainer")
    actor = importlib.import_module("openrlhf.trainer.ray.ppo_actor")
    return {
        "RemoteExperienceMaker": trainer.RemoteExperienceMaker.__qualname__,
        "PPOTrainer": trainer.PPOTrainer.__ray_actor_class__.__qualname__,
        "ActorPPOTrainer": actor.ActorPPOTrainer.__qualname__,
        "PolicyModelActor": actor.PolicyModelActor.__ray_actor_class__.__qualname__,
    }


PATCHED = {"RemoteExperienceMaker": "CoPEExperienceMaker", "ActorPPOTrainer": "CoPEActorPPOTrainer",
           "PolicyModelActor": "CoPEPolicyModelActor", "PPOTrainer": "_CoPEPPOTrainer"}
STOCK = {name: name for name in PATCHED}


@pytest.fixture
def applied_here():
    """apply() in this process, undone afterwards so that other tests see stock OpenRLHF."""
    modules = {name: importlib.import_module(name) for name in OPENRLHF_NAMES}
    saved = {(m, n): getattr(modules[m], n) for m, names in OPENRLHF_NAMES.items() for n in names}
    meta_path = list(sys.meta_path)
    yield
    for (m, n), value in saved.items():
        setattr(modules[m], n, value)
    sys.meta_path[:] = meta_path


def test_apply_swaps_in_driver_and_is_idempotent(applied_here):
    assert classes_in_use() == STOCK
    patch.apply()
    patch.apply()
    assert classes_in_use() == PATCHED
    assert sum(isinstance(f, patch._PostImportFinder) for f in sys.meta_path) == 1
    from cope_rlhf.experience_maker import CoPEExperienceMaker

    assert importlib.import_module("openrlhf.trainer.ppo_trainer").RemoteExperienceMaker is CoPEExperienceMaker


def test_conflicting_setup_hook_is_refused():
    init = patch.ray_init_with_hook(lambda **kwargs: kwargs)
    with pytest.raises(RuntimeError, match="worker_process_setup_hook"):
        init(runtime_env={"worker_process_setup_hook": "somebody.else"})
    assert init()["runtime_env"] == {"worker_process_setup_hook": patch.WORKER_SETUP_HOOK}
    kept = init(num_cpus=1, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true"}})
    assert kept["num_cpus"] == 1 and kept["runtime_env"]["env_vars"] == {"TOKENIZERS_PARALLELISM": "true"}
    assert kept["runtime_env"]["worker_process_setup_hook"] == patch.WORKER_SETUP_HOOK
