"""Make OpenRLHF importable on a CPU-only host. Importing this module is enough.

OpenRLHF imports ``flash_attn.bert_padding`` and ``flash_attn.utils.distributed`` at module level. Both
are pure torch, but ``flash_attn/__init__.py`` loads the CUDA kernels (``flash_attn_2_cuda``), so on a
host whose flash-attn was built without them (``FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE``) every
``import flash_attn.<anything>`` fails.

Contract:
- where ``flash_attn_2_cuda`` is importable (a CUDA host), this module changes nothing;
- otherwise, ``import flash_attn`` yields the *real installed* package with its ``__path__``, so
  ``flash_attn.bert_padding`` etc. load from the installed files, but without running the package
  ``__init__`` (the only file that touches the CUDA kernels). Names that ``__init__`` would have exported
  (``flash_attn_func``, ...) are absent, so code that needs the kernels still fails loudly;
- there, ``flash_attn.ops.triton.*`` (Triton GPU kernels) raises ImportError: it would import, then crash
  when called. OpenRLHF's ``log_probs_from_logits`` tries it for float32 logits and falls back to pure torch
  on ImportError, which is what a CPU host needs.

The fix is a ``sys.meta_path`` finder that costs nothing until ``flash_attn`` is imported (it imports
neither torch nor flash_attn itself). Ray worker processes start fresh interpreters, so they need it too:
``scripts/setup.sh`` writes ``cope_rlhf_compat.pth`` into the venv's site-packages (every interpreter of
the venv, Ray workers included, imports this module at start-up, then drops ``cope_rlhf`` from ``sys.modules``
so that a later ``import cope_rlhf`` resolves on ``sys.path``: a venv made for one checkout that serves another,
e.g. a git worktree, runs that other checkout's code), and ``RAY_WORKER_SETUP_HOOK`` is the hook to pass as
``runtime_env={"worker_process_setup_hook": ...}`` where that file is absent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

RAY_WORKER_SETUP_HOOK = "cope_rlhf.compat.install"


def cuda_kernels_present() -> bool:
    return importlib.util.find_spec("flash_attn_2_cuda") is not None


class _InitlessPackageLoader(importlib.abc.Loader):
    """Creates the package module from its real spec and skips executing ``__init__.py``."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = ModuleType(spec.name)
        module.__path__ = list(spec.submodule_search_locations or [])
        module.__cpu_only__ = True  # lets tests and users see that the CUDA kernels were skipped
        return module

    def exec_module(self, module: ModuleType) -> None:
        pass


GPU_ONLY_PREFIX = "flash_attn.ops.triton"


class _FlashAttnCPUFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == GPU_ONLY_PREFIX or fullname.startswith(GPU_ONLY_PREFIX + "."):
            if cuda_kernels_present():
                return None
            raise ImportError(f"{fullname} holds Triton GPU kernels; this host has no CUDA build of flash-attn "
                              "(cope_rlhf.compat blocks it so that callers take their CPU fallback)")
        if fullname != "flash_attn":
            return None
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if real is None or cuda_kernels_present():
            return None  # not installed, or a CUDA build: let the normal import run
        spec = importlib.machinery.ModuleSpec(fullname, _InitlessPackageLoader(), origin=real.origin,
                                              is_package=True)
        spec.submodule_search_locations = real.submodule_search_locations
        return spec


def install() -> None:
    """Idempotent; also the Ray ``worker_process_setup_hook``. A finder that another copy of this module installed
    (the checkout the venv was made from, imported by the ``.pth`` at start-up) gives way to this one."""
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != _FlashAttnCPUFinder.__name__]
    sys.meta_path.insert(0, _FlashAttnCPUFinder())


install()
