"""scripts/gpu_smoke.sh, the parts that run without a GPU: it passes ``bash -n`` and shellcheck; its dry run prints
every stage's needs and command (the training run's flags included) and creates nothing; ``--stage 1`` / ``--stage 2``
select the stages; it refuses a host without a GPU with exit code 2; its stage runner records OK / FAIL / TIMEOUT /
SKIP, keeps one log per stage and fails the whole run for any of them; on a host whose venv cannot use the GPU it
stops at the torch and stack stages and skips what depends on them. Stage 1 runs for real on the CPU
(``SMOKE_DEVICE=cpu``) with OpenRLHF, vLLM, Ray, DeepSpeed and flash-attn made unimportable: it needs only torch,
transformers and the checkout. scripts/gpu_smoke_checks.py's TensorBoard and signal-cost checks run on files written
here. (tests/test_launchers.py parses the dry run's training command with the trainer's own parser.)"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = "scripts/gpu_smoke.sh"
STAGE1 = ["gpu", "torch", "packed_signals", "signal_shape"]
STAGE2 = ["setup", "stack", "flash_attn", "signal_cost", "prepare", "servers", "train", "tensorboard"]
STAGES = ["gpu", "setup"] + STAGE1[1:] + STAGE2[1:]  # both: set-up first, so that stage 1 runs on its venv


def clean_env(**extra: str) -> dict:
    """No settings of the caller's shell (CoPE variables, OUT, RAY_ADDRESS, ...) reach the script."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env.update(extra)
    return env


def smoke(*args: str, timeout: float = 30, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=clean_env(**extra), capture_output=True, text=True,
                          timeout=timeout)


def fake_nvidia_smi(folder, gpu: bool) -> str:
    """A stand-in for nvidia-smi: one GPU listed, or the driver's answer when it finds none."""
    path = folder / "nvidia-smi"
    if gpu:
        path.write_text('#!/bin/sh\ncase "$1" in -L) echo "GPU 0: Fake GPU (UUID: GPU-0)";; '
                        '*) echo "Fake GPU, 1024 MiB, 0.0";; esac\n')
    else:
        path.write_text('#!/bin/sh\necho "No devices were found"\nexit 6\n')
    path.chmod(0o755)
    return str(path)


def test_bash_syntax_and_shellcheck():
    done = subprocess.run(["bash", "-n", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian: apt-get install shellcheck); bash -n passed")
    done = subprocess.run(["shellcheck", "-x", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-4000:]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    logs = tmp_path_factory.mktemp("smoke") / "logs"
    done = smoke("--dry-run", SMOKE_DIR=str(logs), SMOKE_WORK_DIR=str(logs / "work"))
    assert done.returncode == 0, done.stderr
    assert not logs.exists(), "a dry run created its folders"
    return done.stdout.replace(str(logs), "LOGS")


def stage_lines(output: str, needs: dict | None = None) -> dict:
    """{stage: [its printed lines]} of a dry run, without its "# needs:" line (put into ``needs`` when given)."""
    stages, current = {}, None
    for line in output.splitlines():
        if line.startswith("## "):
            current = line[3:]
            stages[current] = []
        elif current and line.startswith("# needs: "):
            if needs is not None:
                needs[current] = line[len("# needs: "):]
        elif current:
            stages[current].append(line)
    return stages


def test_dry_run_prints_every_stage_in_order(dry_run):
    needs = {}
    stages = stage_lines(dry_run, needs)
    assert list(stages) == STAGES and list(needs) == STAGES  # each stage says what it needs
    for name in STAGE1[1:]:  # stage 1: torch, transformers and the checkout, nothing of the training stack
        assert "torch and transformers" in needs[name] and "nothing else" in needs[name], needs[name]
    assert "package index" in needs["setup"] and "OpenRLHF" in needs["stack"]
    assert stages["gpu"] == ["+ nvidia-smi -L"]
    assert any("scripts/gpu_smoke_checks.py torch --device cuda" in line for line in stages["torch"])
    packed = shlex.split(next(line for line in stages["packed_signals"] if "packed-signals" in line))
    assert packed[packed.index("--turns") + 1:] == ["1", "3", "12"] and "CUDA_VISIBLE_DEVICES=0" in packed
    shape = shlex.split(next(line for line in stages["signal_shape"] if "benchmarks/signal_cost.py" in line))
    assert shape[shape.index("--shape") + 1] == "smollm2" and "--no-joint" in shape
    assert shape[shape.index("--device") + 1] == "cuda" and shape[shape.index("--turns") + 1:][:3] == ["5", "20", "40"]
    assert any("gpu_smoke_checks.py signal-cost" in line and "signal_cost_smollm2.json" in line
               for line in stages["signal_shape"])
    assert "+ env COPE_DEVICE=cuda COPE_ENV_SERVERS=babyai bash scripts/setup.sh" in stages["setup"]
    assert any("scripts/gpu_smoke_checks.py stack" in line for line in stages["stack"])
    assert any("scripts/gpu_smoke_checks.py flash-attn" in line for line in stages["flash_attn"])
    bench = shlex.split(next(line for line in stages["signal_cost"] if "benchmarks/signal_cost.py" in line))
    assert bench[bench.index("--turns") + 1] == "20" and bench[bench.index("--device") + 1] == "cuda"
    assert "CUDA_VISIBLE_DEVICES=0" in bench
    assert any("scripts/make_tiny_model.py --out" in line for line in stages["prepare"])
    assert any("scripts/make_itemids.py --env babyai --split train" in line for line in stages["prepare"])
    assert any(line.startswith("+ head -n 8 ") for line in stages["prepare"])  # 2 steps x 4 prompts
    # the launcher's own dry run: the real BabyAI server and the gateway, on the smoke test's ports
    servers = "\n".join(stages["servers"])
    assert "LAUNCH_ONLY=1" in servers and "window babyai-0:" in servers and "--port 18100" in servers
    assert "window gateway:" in servers and "--env babyai=http://127.0.0.1:18100" in servers
    assert any("scripts/gpu_smoke_checks.py tensorboard" in line for line in stages["tensorboard"])


def trainer_argv(output: str) -> tuple[dict, list[str]]:
    line = next(line for line in output.splitlines() if "cope_rlhf.cli.train_ppo_ray" in line)
    words = shlex.split(line)
    at = words.index("cope_rlhf.cli.train_ppo_ray")
    return dict(w.split("=", 1) for w in words[:at - 2]), words[at + 1:]


def flag_values(argv: list[str]) -> dict:
    """{flag: value} ("" for a switch); a flag given twice keeps its last value, as argparse does."""
    values, i = {}, 0
    while i < len(argv):
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        values[argv[i]] = argv[i + 1] if has_value else ""
        i += 2 if has_value else 1
    return values


def test_dry_run_training_command_has_every_setting(dry_run):
    """One GPU: actor, reference, reward group and vLLM colocated and sized 1; vLLM small and asleep while the actor
    trains; ZeRO-3; flash attention with packed samples; every CoPE signal on; a prompt file of 2 steps."""
    env, argv = trainer_argv(dry_run)
    flags = flag_values(argv)
    expected = {
        "--train.colocate_all": "", "--vllm.enable_sleep": "", "--ds.enable_sleep": "",
        "--vllm.gpu_memory_utilization": "0.15", "--ds.zero_stage": "3", "--ds.packing_samples": "",
        "--ds.attn_implementation": "flash_attention_2", "--vllm.enforce_eager": "",
        "--actor.num_gpus_per_node": "1", "--ref.num_gpus_per_node": "1", "--reward.num_gpus_per_node": "1",
        "--vllm.num_engines": "1", "--vllm.tensor_parallel_size": "1",
        "--algo.advantage.estimator": "group_norm", "--rollout.batch_size": "4", "--rollout.n_samples_per_prompt": "4",
        "--train.batch_size": "16", "--train.num_episodes": "1", "--data.max_samples": "8",
        "--cope.action_forecast_enable": "1", "--cope.action_forecast_gate": "all",
        "--cope.action_forecast_group_norm": "0", "--cope.action_forecast_skip_invalid": "0",
        "--cope.te_enable": "1", "--cope.te_lambda": "0.1", "--cope.te_warmup_steps": "0",
        "--cope.info_intrinsic_weight": "0.1", "--cope.grpo_filter_degenerate": "1",
    }
    assert {flag: flags.get(flag) for flag in expected} == expected
    assert not any(flag.startswith("--logger.wandb") for flag in flags)  # offline host: no wandb
    assert env["COPE_GATEWAY_URL"] == "http://127.0.0.1:18800" and env["MAX_TURNS"] == "4"
    assert flags["--actor.model_name_or_path"].endswith("/work/model")
    assert flags["--data.prompt_dataset"].endswith("/work/data/prompts.jsonl")


def test_dry_run_by_variable_is_the_same_and_settings_reach_the_commands(dry_run, tmp_path):
    logs = tmp_path / "logs"
    same = smoke(DRY_RUN="1", SMOKE_DIR=str(logs), SMOKE_WORK_DIR=str(logs / "work"))
    assert same.returncode == 0 and same.stdout.replace(str(logs), "LOGS") == dry_run
    changed = smoke("--dry-run", SMOKE_STEPS="3", SMOKE_PROMPTS="2", SMOKE_SKIP_SETUP="1", SMOKE_GPU="5",
                    SMOKE_ATTENTION="sdpa", SMOKE_PACKING="0", SMOKE_DIR=str(logs))
    assert changed.returncode == 0, changed.stderr
    stages = stage_lines(changed.stdout)
    assert stages["setup"] == ["# off (SMOKE_SKIP_SETUP=1)"]
    assert any(line.startswith("+ head -n 6 ") for line in stages["prepare"])
    env, argv = trainer_argv(changed.stdout)
    flags = flag_values(argv)
    assert flags["--rollout.batch_size"] == "2" and flags["--data.max_samples"] == "6"
    assert flags["--ds.attn_implementation"] == "sdpa" and "--ds.packing_samples" not in flags
    assert "CUDA_VISIBLE_DEVICES=5" in "\n".join(stages["train"] + stages["signal_cost"])


@pytest.mark.parametrize("gpu_answer", ["absent", "no devices"])
def test_refuses_a_host_without_gpu(tmp_path, gpu_answer):
    nvidia_smi = str(tmp_path / "missing") if gpu_answer == "absent" else fake_nvidia_smi(tmp_path, gpu=False)
    logs = tmp_path / "logs"
    done = smoke(NVIDIA_SMI=nvidia_smi, SMOKE_DIR=str(logs), SMOKE_WORK_DIR=str(logs / "work"))
    assert done.returncode == 2
    assert "no GPU here" in done.stderr and "--dry-run" in done.stderr
    assert ("is not installed" if gpu_answer == "absent" else "No devices were found") in done.stderr
    assert not logs.exists() and done.stdout == ""


def test_unknown_argument_is_refused():
    done = smoke("--bogus")
    assert done.returncode == 2 and "unknown argument '--bogus'" in done.stderr
    done = smoke("--stage", "3")
    assert done.returncode == 2 and "--stage takes 1, 2 or all, got '3'" in done.stderr
    done = smoke("--dry-run", SMOKE_DEVICE="cpu")  # stage 2 trains on a GPU
    assert done.returncode == 2 and "SMOKE_DEVICE=cpu runs stage 1 only" in done.stderr


def test_stage_selects_which_stages_run(tmp_path):
    logs = tmp_path / "logs"
    one = smoke("--dry-run", "--stage", "1", SMOKE_DIR=str(logs))
    assert one.returncode == 0 and list(stage_lines(one.stdout)) == STAGE1
    two = smoke("--stage=2", "--dry-run", SMOKE_DIR=str(logs))
    assert two.returncode == 0 and list(stage_lines(two.stdout)) == ["gpu"] + STAGE2
    cpu = smoke("--dry-run", "--stage", "1", SMOKE_DEVICE="cpu", SMOKE_PYTHON="/opt/py", SMOKE_DIR=str(logs))
    stages = stage_lines(cpu.stdout)
    assert stages["gpu"] == ["# off (SMOKE_DEVICE=cpu)"]
    assert all(line.split()[1] == "/opt/py" or "/opt/py" in line.split()
               for name in STAGE1[1:] for line in stages[name] if "gpu_smoke_checks.py" in line)
    assert not logs.exists()
    assert smoke("--stage", "1", "--help").stdout.startswith("GPU smoke test")


BLOCKER = """import runpy, sys
# The training stack the GPU image lacks: unimportable here (find_spec answers None, import raises ImportError).
for name in ("openrlhf", "vllm", "ray", "deepspeed", "flash_attn"):
    sys.modules[name] = None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.timeout(400)
def test_stage_1_runs_on_cpu_with_only_torch_transformers_and_the_checkout(tmp_path):
    """``SMOKE_DEVICE=cpu bash scripts/gpu_smoke.sh --stage 1`` for real, its interpreter unable to import the
    training stack: the packed signals equal the per-turn references (the CPU's packed attention), and the signal
    cost runs at SmolLM2's vocabulary (a 1-layer, 64-wide stand-in of its family, so that it takes seconds)."""
    (tmp_path / "block.py").write_text(BLOCKER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(tmp_path / "block.py"))} "$@"\n')
    python.chmod(0o755)
    logs = tmp_path / "logs"
    done = smoke("--stage", "1", timeout=380, SMOKE_DEVICE="cpu", SMOKE_PYTHON=str(python), SMOKE_DIR=str(logs),
                 SMOKE_WORK_DIR=str(tmp_path / "work"), SMOKE_PACKED_TURNS="1 3", SMOKE_SHAPE_TURNS="2",
                 SMOKE_SHAPE_REPEATS="1", SMOKE_SHAPE_ARGS="--layers 1 --hidden 64 --batch 1")
    assert done.returncode == 0, done.stdout + "".join(p.read_text()[-2000:] for p in logs.glob("*.log"))
    rows = table_rows(done.stdout)
    assert list(rows) == STAGE1 and rows["gpu"][0] == "OFF"
    assert all(rows[name][0] == "OK" for name in STAGE1[1:]), rows
    assert "cpu" in rows["torch"][2] and rows["packed_signals"][2].startswith("packed = per-turn on cpu")
    assert "signals/grpo" in rows["signal_shape"][2] and "mem " in rows["signal_shape"][2]
    report = json.loads((tmp_path / "work" / "signal_cost_smollm2.json").read_text())
    assert report["shape"] == "smollm2" and report["joint"] is False and "vocab 49152" in report["model"]
    assert sorted(os.listdir(logs)) == ["packed_signals.log", "signal_shape.log", "summary.txt", "torch.log"]


def run_sourced(tmp_path, body: str, **extra: str) -> subprocess.CompletedProcess:
    """Source the script (its main does not run then) and run ``body`` with its functions."""
    script = f"source {SCRIPT}; smoke_config; smoke_init; {body}"
    env = clean_env(SMOKE_DIR=str(tmp_path / "logs"), SMOKE_WORK_DIR=str(tmp_path / "work"), **extra)
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def table_rows(output: str) -> dict:
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("|", 3)]  # key numbers may hold a "|" (max|d|)
        if len(cells) == 4 and cells[0] not in ("stage", ""):
            rows[cells[0]] = cells[1:]
    return rows


def test_stage_runner_records_each_outcome_and_fails_the_run(tmp_path):
    body = """
SMOKE_STAGES=(ok bad dependent slow late)
smoke_run_stage ok shared 0 bash -c 'echo noise; echo "[smoke:key] 3 widgets"; echo "[smoke:key] 2 gadgets"' || true
smoke_run_stage bad shared 0 bash -c 'echo "[smoke:key] half done"; echo "the real reason" >&2; exit 3' || true
smoke_needs dependent bad || true
smoke_run_stage slow slow 0 bash -c 'echo started; sleep 30' || true
smoke_run_stage late late 0 true || true
if smoke_summary; then echo "summary exit 0"; else echo "summary exit 1"; fi  # set -e
"""
    done = run_sourced(tmp_path, body, SMOKE_BUDGET_S="3")
    rows = table_rows(done.stdout)
    assert rows["ok"][0] == "OK" and rows["ok"][2] == "3 widgets; 2 gadgets"
    assert rows["bad"][0] == "FAIL" and rows["bad"][2] == "half done; exit 3: the real reason (log: shared.log)"
    assert rows["dependent"] == ["SKIP", "0", "not run: needs bad (FAIL)"]
    assert rows["slow"][0] == "TIMEOUT" and 2 <= int(rows["slow"][1]) <= 5 and "last: started" in rows["slow"][2]
    assert rows["late"][0] == "SKIP" and "budget" in rows["late"][2]
    assert "FAILED: bad slow (not run: dependent late)" in done.stdout and "summary exit 1" in done.stdout
    # one log per log name, each stage's section under its own header; the summary is kept beside them
    shared = (tmp_path / "logs" / "shared.log").read_text()
    assert shared.index("===== ok") < shared.index("3 widgets") < shared.index("===== bad") < shared.index("reason")
    summary = (tmp_path / "logs" / "summary.txt").read_text()
    assert summary.startswith("GPU smoke ") and summary in done.stdout


def test_stage_runner_passes_when_every_stage_is_ok_or_off(tmp_path):
    body = """
SMOKE_STAGES=(a b)
smoke_record a OFF 0 "off by request"
smoke_run_stage b b 0 true || true
if smoke_summary; then echo "summary exit 0"; else echo "summary exit 1"; fi  # set -e
"""
    done = run_sourced(tmp_path, body)
    assert table_rows(done.stdout)["b"][0] == "OK"
    assert "\nPASSED\n" in done.stdout and "summary exit 0" in done.stdout


def test_an_unreachable_package_index_is_found_in_seconds():
    """What decides, before scripts/setup.sh would sit in pip's retries, that this host cannot install anything."""
    if subprocess.run(["python3", "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("python3 has no pip here: the script then leaves the question to setup.sh")
    env = clean_env(PIP_CONFIG_FILE="/dev/null", PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_FIND_LINKS="")
    done = subprocess.run(["bash", "-c", f"source {SCRIPT}; if smoke_index_reachable; then echo yes; else echo no; fi"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=40)
    assert done.stdout.strip() == "no", done.stderr


def test_stack_failure_skips_what_depends_on_it(tmp_path):
    """The whole script on a host whose GPU is a stand-in: this checkout's venv holds the CPU build of torch, so
    the stack stage fails and names that; every stage that needs the stack is skipped, nothing is started, and
    the run exits 1 with the table."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    logs = tmp_path / "logs"
    done = smoke(NVIDIA_SMI=fake_nvidia_smi(bin_dir, gpu=True), SMOKE_SKIP_SETUP="1", SMOKE_DIR=str(logs),
                 SMOKE_WORK_DIR=str(tmp_path / "work"), timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    assert list(rows) == STAGES
    assert rows["gpu"] == ["OK", "0", "Fake GPU, 1024 MiB, 0.0"]
    assert rows["torch"][0] == "FAIL" and "no GPU" in rows["torch"][2]
    assert [rows[s] for s in ("packed_signals", "signal_shape")] == [["SKIP", "0", "not run: needs torch (FAIL)"]] * 2
    assert rows["setup"][0] == "OFF"
    assert rows["stack"][0] == "FAIL" and "sees no GPU" in rows["stack"][2]
    assert all(rows[s][0] == "SKIP" for s in STAGE2[2:])
    assert rows["flash_attn"][2] == "not run: needs stack (FAIL)"
    assert sorted(os.listdir(logs)) == ["stack.log", "summary.txt", "torch.log"]


# ---- scripts/gpu_smoke_checks.py ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checks():
    spec = importlib.util.spec_from_file_location("gpu_smoke_checks", os.path.join(ROOT, "scripts",
                                                                                    "gpu_smoke_checks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_events(folder, tags) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder))
    for step in (1, 2):
        for tag in tags:
            writer.add_scalar(tag, 0.5, step)
    writer.close()


def test_tensorboard_check_names_a_missing_cope_tag(checks, tmp_path, capsys):
    every = [f"train/{name}" for name in checks.EXPECTED_COPE_TAGS] + ["train/policy_loss"]
    write_events(tmp_path / "full" / "gpu_smoke_run", every)  # OpenRLHF writes under <dir>/<run name>/
    assert checks.main(["tensorboard", str(tmp_path / "full")]) == 0
    out = capsys.readouterr().out
    assert f"[smoke:key] cope tags {len(every) - 1}/{len(every) - 1}, steps 1-2" in out
    write_events(tmp_path / "partial" / "run", [t for t in every if not t.endswith("/cope/te_kl")])
    assert checks.main(["tensorboard", str(tmp_path / "partial")]) == 1
    out = capsys.readouterr().out
    assert "MISSING cope/te_kl" in out and "missing te_kl" in out
    (tmp_path / "empty").mkdir()
    assert checks.main(["tensorboard", str(tmp_path / "empty")]) == 1
    assert "no TensorBoard event file" in capsys.readouterr().out


def signal_report(path, attention="flex_attention", d_info=2e-6, d_loss=1e-7, device="cuda:0") -> str:
    row = {"turns": 20, "signals_over_grpo_wall": 1.2, "signals_over_grpo_wall_min": 1.1,
           "signals_over_grpo_wall_max": 1.35, "max_abs_d_info_gain": d_info, "abs_d_forecast_loss": d_loss}
    path.write_text(json.dumps({"device": device, "packed_attention": attention, "repeats": 3, "rows": [row]}))
    return str(path)


def test_signal_cost_check(checks, tmp_path, capsys):
    assert checks.main(["signal-cost", signal_report(tmp_path / "ok.json")]) == 0
    assert "20 turns: signals/grpo 1.20x [1.10-1.35]" in capsys.readouterr().out
    assert checks.main(["signal-cost", signal_report(tmp_path / "sdpa.json", attention="cope_branch_sdpa")]) == 1
    assert "not flex_attention" in capsys.readouterr().out
    assert checks.main(["signal-cost", signal_report(tmp_path / "cpu.json", attention="cope_branch_sdpa",
                                                     device="cpu")]) == 0  # flex is the GPU's path only
    assert checks.main(["signal-cost", signal_report(tmp_path / "off.json", d_info=0.3)]) == 1
    assert "differ by 3.0e-01" in capsys.readouterr().out
    assert checks.main(["signal-cost", signal_report(tmp_path / "nan.json", d_loss=float("nan"))]) == 1
