"""The foundation: every OpenRLHF module this project builds on imports on this host (CPU included), the
installed versions are the pinned ones, vLLM reports the right platform, and the CPU import fix also holds in
Ray worker processes."""

import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

OPENRLHF_MODULES = [
    "openrlhf.utils.agent",
    "openrlhf.models.loss",
    "openrlhf.trainer.ppo_utils.experience",
    "openrlhf.trainer.ppo_utils.experience_maker",
    "openrlhf.trainer.ppo_utils.samples_generator",
    "openrlhf.trainer.ray.ppo_actor",
    "openrlhf.trainer.ray.vllm_engine",
    "openrlhf.trainer.ppo_trainer",
]


def cuda_host() -> bool:
    import torch

    return torch.cuda.is_available()


def pins(path: str) -> dict[str, str]:
    """name -> version for every `name==version` line of a requirements file (extras stripped)."""
    out = {}
    for line in open(os.path.join(ROOT, path)):
        m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;#]+)", line.strip())
        if m:
            out[m.group(1)] = m.group(3)
    return out


@pytest.mark.parametrize("module", OPENRLHF_MODULES)
def test_openrlhf_module_imports(module):
    importlib.import_module(module)


def test_installed_versions_match_requirements():
    wanted = pins("requirements.txt")
    wanted.update(pins("requirements-cuda.txt" if cuda_host() else "requirements-cpu.txt"))
    assert "openrlhf" in wanted and "deepspeed" in wanted and "ray" in wanted
    wrong = {}
    for name, version in wanted.items():
        installed = importlib.metadata.version(name).split("+")[0]  # 2.13.0+cpu is torch==2.13.0
        if installed != version:
            wrong[name] = f"installed {installed}, pinned {version}"
    assert not wrong, f"run `bash scripts/setup.sh` to fix: {wrong}"


def test_flash_attn_serves_real_files_without_cuda_init():
    import flash_attn
    import flash_attn.bert_padding as bert_padding

    site_dir = os.path.dirname(flash_attn.__spec__.origin)
    assert os.path.dirname(bert_padding.__file__) == site_dir, "bert_padding must come from the installed package"
    if cuda_host():
        pytest.skip("CUDA host: compat changes nothing, flash_attn imports normally")
    assert flash_attn.__cpu_only__ is True
    assert not hasattr(flash_attn, "flash_attn_func"), "the CUDA kernels' entry points must not be faked"
    import torch

    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    unpadded, indices, *_ = bert_padding.unpad_input(x, mask)
    assert unpadded.shape == (6, 3) and indices.tolist() == [0, 1, 4, 5, 6, 7]


def test_openrlhf_log_probs_take_the_cpu_path():
    """On CPU the Triton cross-entropy must be unimportable, so OpenRLHF falls back to pure torch."""
    import torch
    from openrlhf.models.utils import log_probs_from_logits

    if cuda_host():
        pytest.skip("CUDA host: the Triton kernel is OpenRLHF's normal path")
    with pytest.raises(ImportError, match="Triton GPU kernels"):
        import flash_attn.ops.triton.cross_entropy  # noqa: F401
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(log_probs_from_logits(logits.clone(), labels), expected)


def test_vllm_imports_and_reports_platform():
    import vllm  # noqa: F401
    from vllm.platforms import current_platform

    if cuda_host():
        assert current_platform.is_cuda()
    else:
        assert current_platform.is_cpu(), f"vLLM picked platform {current_platform.device_type!r} on a CPU host"


def test_ray_worker_gets_the_import_fix():
    """Ray workers are fresh interpreters: the fix must reach them without any code in the task itself."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        @ray.remote(num_cpus=1)
        def import_trainer_in_worker():
            import openrlhf.trainer.ppo_trainer  # noqa: F401
            import flash_attn

            return getattr(flash_attn, "__cpu_only__", False), os.getpid()

        cpu_only, worker_pid = ray.get(import_trainer_in_worker.remote(), timeout=180)
    finally:
        ray.shutdown()
    assert worker_pid != os.getpid()
    assert cpu_only == (not cuda_host())


def test_setup_second_run_installs_nothing():
    """What makes a second run fast is that it installs nothing (its wall time under load says nothing)."""
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COPE_ENV_SERVERS": "none"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing to install" in proc.stdout, proc.stdout


@pytest.fixture
def small_disk_checkout(tmp_path):
    """A copy of the set-up scripts and pins on a 32 MB tmpfs: a disk far too small for any venv."""
    root = tmp_path / "checkout"
    root.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(root)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (mount -t tmpfs); the short-disk check was not run")
    try:
        shutil.copytree(os.path.join(ROOT, "scripts"), root / "scripts")
        for name in os.listdir(ROOT):
            if re.fullmatch(r"(requirements|constraints)(-\w+)?\.txt", name):
                shutil.copy(os.path.join(ROOT, name), root / name)
        (root / "env_gateway/servers/requirements").mkdir(parents=True)
        shutil.copy(os.path.join(ROOT, "env_gateway/servers/requirements/babyai.txt"),
                    root / "env_gateway/servers/requirements/babyai.txt")
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


@pytest.mark.parametrize("command, builds", [
    (["bash", "scripts/setup.sh"], ".venv"),
    (["bash", "scripts/setup_env.sh", "babyai"], ".venvs/babyai"),
])
def test_setup_on_a_short_disk_stops_before_building_and_says_what_it_needs(small_disk_checkout, command, builds):
    """Out of disk, pip fails minutes into a build with only "[Errno 28] No space left on device" and leaves a
    half-built venv (CI stop 56). The set-up checks first: it stops at once, builds nothing, and gives the numbers."""
    env = {**os.environ, "COPE_DEVICE": "cpu", "COPE_ENV_SERVERS": "none"}
    proc = subprocess.run(command, cwd=small_disk_checkout, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert re.search(rf"not enough disk to build {re.escape(builds)}: it needs about \d+ GB, .* has 0 GB free",
                     proc.stderr), proc.stdout + proc.stderr
    assert not (small_disk_checkout / builds).exists()


def test_compat_import_is_cheap():
    """Every interpreter of the venv imports compat at start-up (.pth): it must not pull torch in."""
    code = "import sys, cope_rlhf.compat; print('torch' in sys.modules, 'flash_attn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def test_what_users_run_never_imports_the_tests():
    """The product (cope_rlhf, env_gateway, agent_funcs, scripts, benchmarks) runs from a checkout without tests/ on
    the path: no Python import of ``tests`` and no ``python -m tests.<module>`` in its Python or shell files."""
    offenders = []
    for folder in ("cope_rlhf", "env_gateway", "agent_funcs", "scripts", "benchmarks", "examples"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith((".py", ".sh")):
                    path = os.path.join(dirpath, name)
                    text = open(path, encoding="utf-8").read()
                    if re.search(r"^\s*(from tests[. ]|import tests\b)|-m tests\.|[\"']tests\.[a-z_]+[\"']", text,
                                 re.MULTILINE):
                        offenders.append(os.path.relpath(path, ROOT))
    assert offenders == []


def test_the_tests_import_this_checkouts_cope_rlhf():
    import cope_rlhf

    assert os.path.dirname(os.path.abspath(cope_rlhf.__file__)) == os.path.join(ROOT, "cope_rlhf")


def test_a_venv_serving_another_checkout_imports_that_checkouts_code(tmp_path):
    """A venv made for this checkout, run from another one (a git worktree whose .venv links here): the start-up
    import of the CPU fix (the venv's cope_rlhf_compat.pth) must not pin ``cope_rlhf`` to this checkout, and the
    fix still holds (flash_attn's pure-torch modules import on a CPU host)."""
    shutil.copytree(os.path.join(ROOT, "cope_rlhf"), tmp_path / "cope_rlhf",
                    ignore=shutil.ignore_patterns("__pycache__"))
    probe = ("import sys, cope_rlhf, cope_rlhf.compat, flash_attn.bert_padding; print(cope_rlhf.__file__); "
             "print(sum(type(f).__name__ == '_FlashAttnCPUFinder' for f in sys.meta_path))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr[-3000:]
    imported, finders = out.stdout.split()
    assert imported == str(tmp_path / "cope_rlhf" / "__init__.py")
    assert int(finders) == 1  # the other checkout's finder replaced the start-up one
