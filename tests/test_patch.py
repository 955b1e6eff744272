"""patch.apply(): OpenRLHF's modules hold the CoPE classes in the driver; idempotent; the hook wrapper keeps
OpenRLHF's own ray.init arguments and puts the launching checkout first on the workers' path. (The Ray-worker
side of the swaps is checked in tests/test_experience_maker.py, which starts its Ray session through the same
wrapper and asks a worker.)"""

import importlib
import os
import shutil
import subprocess
import sys
import textwrap

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


def test_conflicting_setup_hook_is_refused(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    init = patch.ray_init_with_hook(lambda **kwargs: kwargs)
    with pytest.raises(RuntimeError, match="worker_process_setup_hook"):
        init(runtime_env={"worker_process_setup_hook": "somebody.else"})
    assert init()["runtime_env"] == {"worker_process_setup_hook": patch.WORKER_SETUP_HOOK,
                                     "env_vars": {"PYTHONPATH": patch.CODE_ROOT}}
    kept = init(num_cpus=1, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true"}})
    assert kept["num_cpus"] == 1
    assert kept["runtime_env"]["env_vars"] == {"TOKENIZERS_PARALLELISM": "true", "PYTHONPATH": patch.CODE_ROOT}
    assert kept["runtime_env"]["worker_process_setup_hook"] == patch.WORKER_SETUP_HOOK


def test_workers_path_puts_this_checkout_ahead_of_the_callers(monkeypatch):
    init = patch.ray_init_with_hook(lambda **kwargs: kwargs)
    sep = os.pathsep
    monkeypatch.setenv("PYTHONPATH", sep.join(["/from/the/shell", patch.CODE_ROOT]))
    assert init()["runtime_env"]["env_vars"]["PYTHONPATH"] == sep.join([patch.CODE_ROOT, "/from/the/shell"])
    # the caller's runtime_env PYTHONPATH is the one its workers would have had: it wins over the shell's
    passed = init(runtime_env={"env_vars": {"PYTHONPATH": "/from/the/caller"}})["runtime_env"]["env_vars"]
    assert passed["PYTHONPATH"] == sep.join([patch.CODE_ROOT, "/from/the/caller"])
    # installed (not a checkout): no path added, the caller's env_vars untouched
    monkeypatch.setattr(patch.site, "getsitepackages", lambda: [patch.CODE_ROOT])
    assert init(runtime_env={"env_vars": {"A": "1"}})["runtime_env"]["env_vars"] == {"A": "1"}
    assert "env_vars" not in init()["runtime_env"]


def test_ray_workers_import_the_launching_checkouts_code(tmp_path):
    """A second checkout that shares this venv (installed in editable mode from another one): its driver and its
    Ray workers must run the same ``cope_rlhf``. Before the path in ``ray_init_with_hook``, the workers ran the
    venv's."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copytree(os.path.join(checkout, "cope_rlhf"), tmp_path / "cope_rlhf",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "driver.py").write_text(textwrap.dedent("""
        import ray
        import cope_rlhf
        from cope_rlhf import patch

        patch.ray_init_with_hook(ray.init)(num_cpus=1, include_dashboard=False, log_to_driver=False)

        @ray.remote
        def where():
            import sys
            return sys.modules["cope_rlhf"].__file__, sys.modules["cope_rlhf.patch"].__file__

        print("driver", cope_rlhf.__file__)
        print("worker", *ray.get(where.remote(), timeout=300))
        ray.shutdown()
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    done = subprocess.run([sys.executable, "driver.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("driver ", "worker ")))
    copy = str(tmp_path / "cope_rlhf")
    assert lines["driver"].startswith(copy)
    # the package and the module the worker setup hook ran (cope_rlhf.patch.install) are the copy's
    assert all(path.startswith(copy) for path in lines["worker"].split()), lines
