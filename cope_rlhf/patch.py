"""Install the CoPE subclasses into OpenRLHF, in this process and in every Ray worker process.

Swaps (module global -> CoPE replacement), made right after the OpenRLHF module is imported:

    openrlhf.trainer.ppo_trainer.RemoteExperienceMaker -> cope_rlhf.experience_maker.CoPEExperienceMaker
    openrlhf.trainer.ppo_trainer.PPOTrainer            -> cope_rlhf.ppo_trainer.CoPEPPOTrainer
    openrlhf.trainer.ppo_trainer.SamplesGenerator      -> cope_rlhf.ppo_trainer.SeededSamplesGenerator
    openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer     -> cope_rlhf.actor.CoPEActorPPOTrainer
    openrlhf.trainer.ray.ppo_actor.PolicyModelActor    -> cope_rlhf.actor.CoPEPolicyModelActor

and, only on a host without CUDA (``CPU_SWAPS``: OpenRLHF's real Ray path on CPU, ``cpu_cluster`` / ``cpu_vllm``):

    openrlhf.utils.deepspeed.deepspeed.init_device_mesh           -> cope_rlhf.cpu_cluster.cpu_device_mesh
    openrlhf.utils.deepspeed.deepspeed.get_train_ds_config        -> cope_rlhf.cpu_cluster.train_ds_config_with_torch_adam
    openrlhf.utils.utils.convert_to_torch_dtype                   -> cope_rlhf.cpu_cluster.convert_to_torch_dtype_with_fp32
    openrlhf.trainer.ray.ppo_actor.NaiveReplayBuffer              -> cope_rlhf.cpu_cluster.CPUReplayBuffer
    openrlhf.trainer.ray.ppo_actor.stateless_init_process_group   -> cope_rlhf.cpu_cluster.gloo_broadcast_group
    openrlhf.trainer.ray.vllm_engine.RolloutRayActor              -> cope_rlhf.cpu_vllm.CPURolloutRayActor

OpenRLHF builds these classes from those module globals: the experience maker and the samples generator in
``BasePPOTrainer.__init__`` / ``PPOTrainer.__init__`` (inside the PPOTrainer Ray actor), the PPOTrainer Ray actor in
``train()`` (driver), the PPO trainer in ``PolicyModelActor.init_model_from_pretrained`` (inside each actor worker),
the actor class in ``train()`` (driver). Ray workers import OpenRLHF afresh, so a swap
made in the driver does not reach them: ``install`` is also the Ray ``worker_process_setup_hook``
(``ray_init_with_hook`` adds it to OpenRLHF's own ``ray.init`` call). ``install`` only registers a post-import
hook (it imports nothing from OpenRLHF), so workers that never import those modules pay nothing. (Importing them
eagerly in the hook would be simpler, but every Ray worker would pay for it, the idle ones Ray keeps in its pool
too, and importing the OpenRLHF modules costs seconds of CPU per process.)

The subclasses read their switches from ``strategy.args.cope``; with every switch off (or no ``cope``
namespace at all) each override returns what OpenRLHF's own method returns. ``install`` is idempotent.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import site
import sys
from typing import Callable, Dict, List, Tuple

from cope_rlhf import compat

WORKER_SETUP_HOOK = "cope_rlhf.patch.install"
# The directory that holds the ``cope_rlhf`` this process imported (a checkout, or site-packages).
CODE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# (OpenRLHF module, CoPE module, {name in the OpenRLHF module: name in the CoPE module})
SWAPS: List[Tuple[str, str, Dict[str, str]]] = [
    ("openrlhf.trainer.ppo_trainer", "cope_rlhf.experience_maker", {"RemoteExperienceMaker": "CoPEExperienceMaker"}),
    ("openrlhf.trainer.ppo_trainer", "cope_rlhf.ppo_trainer",
     {"PPOTrainer": "CoPEPPOTrainer", "SamplesGenerator": "SeededSamplesGenerator"}),
    ("openrlhf.trainer.ray.ppo_actor", "cope_rlhf.actor",
     {"ActorPPOTrainer": "CoPEActorPPOTrainer", "PolicyModelActor": "CoPEPolicyModelActor"}),
]
CPU_SWAPS: List[Tuple[str, str, Dict[str, str]]] = [
    ("openrlhf.utils.deepspeed.deepspeed", "cope_rlhf.cpu_cluster",
     {"init_device_mesh": "cpu_device_mesh", "get_train_ds_config": "train_ds_config_with_torch_adam"}),
    ("openrlhf.utils.utils", "cope_rlhf.cpu_cluster", {"convert_to_torch_dtype": "convert_to_torch_dtype_with_fp32"}),
    ("openrlhf.trainer.ray.ppo_actor", "cope_rlhf.cpu_cluster",
     {"NaiveReplayBuffer": "CPUReplayBuffer", "stateless_init_process_group": "gloo_broadcast_group"}),
    ("openrlhf.trainer.ray.vllm_engine", "cope_rlhf.cpu_vllm", {"RolloutRayActor": "CPURolloutRayActor"}),
]
_WATCHED = {name for swap in SWAPS + CPU_SWAPS for name in swap[:2]}


def _initializing(module) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _swaps() -> List[Tuple[str, str, Dict[str, str]]]:
    """``SWAPS``, plus ``CPU_SWAPS`` where there is no CUDA device. Asked only once an OpenRLHF module (hence
    torch) is imported."""
    import torch

    return SWAPS if torch.cuda.is_available() else SWAPS + CPU_SWAPS


def _swap(imported: str) -> None:
    """Make every swap that involves module ``imported`` and whose two sides are fully imported. A CoPE module
    imports the OpenRLHF one it replaces names in, so when that import comes first from inside the CoPE module, the
    swap waits for the CoPE module's own post-import hook."""
    for openrlhf_name, cope_name, names in _swaps():
        if imported not in (openrlhf_name, cope_name):
            continue
        module = sys.modules.get(openrlhf_name)
        if module is None or _initializing(module):
            continue
        cope = sys.modules.get(cope_name)
        if cope is not None and _initializing(cope):
            continue
        cope = importlib.import_module(cope_name)
        for name, cope_object in names.items():
            setattr(module, name, getattr(cope, cope_object))


class _SwapAfterExec(importlib.abc.Loader):
    """Runs the real loader, then the swap (a post-import hook). Other attributes (get_source, ...) go to the
    real loader."""

    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.__spec__._initializing = False  # exec is done; importlib clears the flag only after we return
        _swap(self._name)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _SwapAfterExec(spec.loader, fullname)
                return spec
        return None


def install() -> None:
    """Idempotent. Also the Ray ``worker_process_setup_hook`` (with the CPU import fix of ``compat``)."""
    compat.install()
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
    for name in _WATCHED:  # modules imported before install() get their swap now
        if name in sys.modules:
            _swap(name)


def apply() -> None:
    """Driver side: install here; workers get ``install`` through ``ray_init_with_hook``."""
    install()


def ray_init_with_hook(ray_init: Callable) -> Callable:
    """Wraps ``ray.init`` so that its ``runtime_env`` also carries ``WORKER_SETUP_HOOK`` and, when this process
    imported ``cope_rlhf`` from a checkout (not site-packages), puts that checkout first on the workers'
    ``PYTHONPATH``, ahead of the caller's; everything else the caller passes (OpenRLHF's ``env_vars``) is kept.

    Why the path: Ray workers resolve ``cope_rlhf`` by the venv's install, and Ray appends the driver's directory
    after it. Launched from a second checkout that shares a venv installed in editable mode from the first, the
    driver ran the second checkout's code and every worker (the hook, the actors, the experience maker) the
    first's. A checkout path that does not exist on another node is skipped by Python there."""

    def init(*args, **kwargs):
        runtime_env = dict(kwargs.get("runtime_env") or {})
        existing = runtime_env.get("worker_process_setup_hook")
        if existing not in (None, WORKER_SETUP_HOOK, compat.RAY_WORKER_SETUP_HOOK):
            raise RuntimeError(
                f"runtime_env already sets worker_process_setup_hook={existing!r}; CoPE needs "
                f"{WORKER_SETUP_HOOK!r} there (call both from one hook function)"
            )
        runtime_env["worker_process_setup_hook"] = WORKER_SETUP_HOOK
        # Not for a site-packages install: that directory first on PYTHONPATH would put every package ahead of
        # the standard library.
        if CODE_ROOT not in site.getsitepackages() + [site.getusersitepackages()]:
            env_vars = dict(runtime_env.get("env_vars") or {})
            # runtime_env's PYTHONPATH replaces the workers' inherited one, so the caller's is carried over.
            callers = env_vars.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
            env_vars["PYTHONPATH"] = os.pathsep.join(
                [CODE_ROOT] + [p for p in callers.split(os.pathsep) if p and p != CODE_ROOT])
            runtime_env["env_vars"] = env_vars
        kwargs["runtime_env"] = runtime_env
        return ray_init(*args, **kwargs)

    return init
