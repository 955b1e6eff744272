"""``cope_rlhf.cpu_cluster`` as a DeepSpeed rank of the real path meets it: installed by ``patch`` on a host without
CUDA, it keeps DeepSpeed from JIT-compiling its shared-memory all-reduce when the process group starts."""

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

RANK_START = """
import cope_rlhf.patch
cope_rlhf.patch.install()
import openrlhf.utils.deepspeed.deepspeed  # what a DeepSpeed rank imports; the CPU swaps import cpu_cluster
from deepspeed.comm.torch import build_shm_op  # what TorchBackend calls before init_process_group
print("shm op:", build_shm_op())
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU swaps are installed only on a host without CUDA")
def test_a_cpu_rank_does_not_build_deepspeeds_shared_memory_all_reduce():
    """DeepSpeed's CPU backend compiles that op (C++, ~80 s of both cores the first time on a machine, in every
    training run's ranks) for its tensor-parallel inference all-reduce only; ZeRO's collectives go through gloo."""
    done = subprocess.run([sys.executable, "-c", RANK_START], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shm op: None" in done.stdout, done.stdout[-2000:]
    assert "built successfully" not in done.stdout
