"""Asking a command what it does runs nothing; the quickstart shows its progress on the terminal (issue 63).

- Every scripts/*.sh answers -h / --help (anywhere among its arguments) with its usage, settings and an example,
  exit 0, and starts nothing (no process carrying the run's marker variable outlives it) and writes nothing in the
  checkout (a listing of its files before and after). So do the Python entry points: scripts/*.py,
  benchmarks/*.py, the ``python -m`` modules (the trainer's heavy ones, which import the whole stack, under
  ``-m slow``). They run in a copy of the checkout's code (the venvs linked in), so that the listing sees only what
  they write: in a working tree where other programs write too (a training run filing its results under docs/), it
  would see theirs.
- cope_rlhf/quiet.py hides exactly pynvml's deprecation and DeepSpeed's CPU notice, in the process and in its
  children; other warnings still show.
- scripts/quickstart_progress.py turns a stage's log into a line per SFT epoch / GRPO step (with elapsed and time
  left), each held-out eval, the trainer's own warnings, and a line at least every --quiet-s seconds; and
  scripts/quickstart.sh, run with stand-in stages, prints those lines on the terminal while the logs keep the rest.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import quickstart_progress as qp  # noqa: E402

PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
SHELL_SCRIPTS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "scripts", "*.sh")))
LIBRARIES = {"scripts/agent_metrics.py"}  # imported by other scripts, not run
PYTHON_SCRIPTS = sorted(os.path.relpath(p, ROOT) for folder in ("scripts", "benchmarks")
                        for p in glob.glob(os.path.join(ROOT, folder, "*.py"))
                        if os.path.relpath(p, ROOT) not in LIBRARIES)
SERVERS = ["babyai", "textcraft", "sciworld", "alfworld", "searchqa", "tau2"]
# what a file listing leaves out: caches Python and pytest write for any import, and the venvs' insides (their
# top-level entries are listed on their own: a venv being built shows there)
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".venv", ".venvs"}
MARKER = "COPE_HELP_PROBE"
CODE = ["scripts", "benchmarks", "cope_rlhf", "env_gateway", "agent_funcs", "examples", "data", "pyproject.toml",
        "requirements.txt", "requirements-cpu.txt", "requirements-cuda.txt", "constraints-cpu.txt"]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> str:
    """A copy of the checkout's code and files the scripts read, with .venv and .venvs linked to the real ones."""
    root = tmp_path_factory.mktemp("checkout")
    for name in CODE:
        source = os.path.join(ROOT, name)
        if os.path.isdir(source):
            shutil.copytree(source, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif os.path.exists(source):
            shutil.copy2(source, root / name)
    for venv in (".venv", ".venvs"):
        os.symlink(os.path.join(ROOT, venv), root / venv)
    return str(root)


def listing(root: str) -> dict:
    """{path: (mtime, size)} of the files under ``root``, and each entry of its .venv and .venvs."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames + dirnames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            out[os.path.relpath(path, root)] = "dir" if os.path.isdir(path) else (st.st_mtime_ns, st.st_size)
    for venvs in (".venv", ".venvs"):
        folder = os.path.join(root, venvs)
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            st = os.lstat(os.path.join(folder, name))
            out[f"{venvs}/{name}"] = "dir" if os.path.isdir(os.path.join(folder, name)) else (st.st_mtime_ns, st.st_size)
    return out


def changes(before: dict, after: dict) -> list:
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))


def marked_processes(marker: str) -> list:
    """Pids of the processes whose environment carries ``marker``: every descendant of a probed command, daemons
    that left its session included."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def probe(cmd: list, cwd: str, timeout: int = 60) -> tuple:
    """Runs ``cmd`` in ``cwd`` with a minimal environment and a unique marker variable, in its own session.
    Returns (completed process, pids left behind: killed here)."""
    marker = f"{MARKER}={uuid.uuid4().hex}"
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env.update(PYTHONDONTWRITEBYTECODE="1", COPE_SECRETS_DIR=os.path.join(ROOT, "tests", "no-secrets-here"))
    env[MARKER] = marker.split("=", 1)[1]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(timed out after {timeout} s)"
    left = marked_processes(marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), left


# ---- scripts/*.sh -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_script_answers_help_and_touches_nothing(checkout, script, flag):
    before = listing(checkout)
    done, left = probe(["bash", script, flag], checkout, timeout=30)
    assert done.returncode == 0, f"{script} {flag}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    assert not left, f"{script} {flag} left processes running: {left}"
    assert changes(before, listing(checkout)) == [], f"{script} {flag} wrote in the checkout"
    assert done.stderr == ""
    # the usage: an example invocation of the script itself, and more than a line of it
    name = os.path.basename(script)
    assert re.search(rf"(bash|sbatch)\b.*scripts/{re.escape(name)}", done.stdout), done.stdout[:1500]
    assert len(done.stdout.splitlines()) >= 4


def test_help_anywhere_among_the_arguments_and_the_shared_settings(checkout):
    """A run script's -h after other arguments still only prints; its help includes the settings of
    scripts/lib/common.sh it reads, a tmux launcher's those of tmux.sh too, the Ray head's neither."""
    done, left = probe(["bash", "scripts/run_babyai_grpo_train.sh", "--actor.adam.lr", "1e-5", "-h"], checkout)
    assert done.returncode == 0 and not left and done.stdout.startswith("usage: bash scripts/run_babyai_grpo_train.sh")
    assert "---- from scripts/lib/common.sh ----" in done.stdout and "ROLLOUT_BATCH_SIZE=16" in done.stdout
    launch, _ = probe(["bash", "scripts/launch_babyai_grpo_tmux.sh", "--help"], checkout)
    assert "---- from scripts/lib/tmux.sh ----" in launch.stdout and "GATEWAY_PORT=8800" in launch.stdout
    assert launch.stdout.count("---- from scripts/lib/common.sh ----") == 1
    head, _ = probe(["bash", "scripts/ray_cluster_head.sh", "--help"], checkout)
    assert "RAY_PORT=6379" in head.stdout and "---- from" not in head.stdout


# ---- Python entry points ------------------------------------------------------------------------------------------
def python_commands() -> list:
    """The commands, with interpreters relative to the checkout they run in."""
    commands = [[".venv/bin/python", script, "--help"] for script in PYTHON_SCRIPTS]
    commands += [[".venv/bin/python", "-m", module, "--help"] for module in ("cope_rlhf.local", "env_gateway")]
    for name in SERVERS:  # each server runs in its own venv (scripts/setup_env.sh NAME)
        if os.path.exists(os.path.join(ROOT, ".venvs", name, "bin", "python")):
            commands.append([f".venvs/{name}/bin/python", "-m", f"env_gateway.servers.{name}", "--help"])
    return commands


def test_python_entry_points_answer_help_and_touch_nothing(checkout):
    commands = python_commands()
    before = listing(checkout)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # each is mostly Python's start-up: 0.2-4 s on 2 cores
        results = list(pool.map(lambda cmd: probe([os.path.join(checkout, cmd[0]), *cmd[1:]], checkout,
                                                  timeout=120), commands))
    failures = []
    for cmd, (done, left) in zip(commands, results):
        if done.returncode != 0 or "usage:" not in done.stdout or done.stderr or left:
            failures.append(f"{' '.join(cmd)}: exit {done.returncode}, left {left}, stderr {done.stderr[-600:]!r}, "
                            f"stdout {done.stdout[:200]!r}")
    assert not failures, "\n".join(failures)
    assert changes(before, listing(checkout)) == []


HEAVY = [["-m", "cope_rlhf.cli.train_ppo_ray", "--help"], ["-m", "cope_rlhf.local", "train", "--help"],
         ["-m", "cope_rlhf.local", "sft", "--help"], ["-m", "cope_rlhf.cli.train_sft", "--help"],
         ["-m", "cope_rlhf.preflight", "--help"]]


@pytest.mark.slow
@pytest.mark.parametrize("args", HEAVY, ids=lambda a: " ".join(a[1:3]))
def test_trainer_commands_answer_help_without_benign_notices(checkout, args):
    """The commands that import torch, DeepSpeed and OpenRLHF (20-40 s each on 2 busy cores): usage, exit 0, and
    neither pynvml's deprecation nor DeepSpeed's CPU notice in what they print."""
    before = listing(checkout)
    done, left = probe([os.path.join(checkout, ".venv", "bin", "python"), *args], checkout, timeout=600)
    assert done.returncode == 0 and "usage:" in done.stdout and not left, done.stderr[-3000:]
    assert changes(before, listing(checkout)) == []
    everything = done.stdout + done.stderr
    assert "pynvml package is deprecated" not in everything and "Setting accelerator to CPU" not in everything


# ---- cope_rlhf/quiet.py -------------------------------------------------------------------------------------------
QUIET_CHECK = textwrap.dedent("""
    import logging, os, subprocess, sys, warnings
    os.environ.pop("DS_ACCELERATOR", None)
    if sys.argv[1] == "quiet":
        from cope_rlhf.quiet import hide_benign_notices
        hide_benign_notices()
        hide_benign_notices()  # idempotent
    import pynvml  # the pynvml shim warns on this import (what torch does on every start)
    warnings.warn("a FutureWarning of our own", FutureWarning)
    deepspeed = logging.getLogger("DeepSpeed")  # as deepspeed.utils.logging sets it up
    deepspeed.addHandler(logging.StreamHandler(sys.stderr))
    deepspeed.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
    deepspeed.warning("a DeepSpeed warning of its own")
    print("DS_ACCELERATOR=%s" % os.environ.get("DS_ACCELERATOR"))
    print("PYTHONWARNINGS=%s" % os.environ.get("PYTHONWARNINGS"))
    sys.stdout.flush()
    child = "import pynvml, warnings; warnings.warn('a child FutureWarning', FutureWarning)"
    subprocess.run([sys.executable, "-c", child])
""")


def test_quiet_hides_exactly_the_benign_notices_here_and_in_children():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "DS_ACCELERATOR")}
    run = {mode: subprocess.run([PYTHON, "-c", QUIET_CHECK, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=120) for mode in ("quiet", "loud")}
    loud, quiet = run["loud"], run["quiet"]
    assert loud.returncode == 0 and quiet.returncode == 0, loud.stderr + quiet.stderr
    # without it: both notices, here and in the child (the check sees the libraries' real text)
    assert loud.stderr.count("The pynvml package is deprecated") == 2 and "Setting accelerator to CPU" in loud.stderr
    assert "DS_ACCELERATOR=None" in loud.stdout
    # with it: neither, and every other warning as before
    assert "pynvml" not in quiet.stderr and "Setting accelerator to CPU" not in quiet.stderr
    for text in ("a FutureWarning of our own", "a DeepSpeed warning of its own", "a child FutureWarning"):
        assert text in quiet.stderr and text in loud.stderr
    assert "DS_ACCELERATOR=cpu" in quiet.stdout  # DeepSpeed's own choice, passed on to the children
    assert "PYTHONWARNINGS=ignore:The pynvml package is deprecated:FutureWarning\n" in quiet.stdout


@pytest.mark.slow
def test_quiet_silences_the_real_deepspeed_notice_in_a_child():
    """The real DeepSpeed on this CPU host (minutes of import on 2 busy cores): no notice in the process nor in a
    child, which takes the CPU accelerator by DS_ACCELERATOR."""
    script = textwrap.dedent("""
        import subprocess, sys
        from cope_rlhf.quiet import hide_benign_notices
        hide_benign_notices()
        from deepspeed.accelerator import get_accelerator
        print("parent", get_accelerator().device_name(), flush=True)
        child = "from deepspeed.accelerator import get_accelerator; print('child', get_accelerator().device_name())"
        subprocess.run([sys.executable, "-c", child])
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "DS_ACCELERATOR")}
    done = subprocess.run([PYTHON, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if "parent cuda" in done.stdout:
        pytest.skip("a CUDA host: DeepSpeed prints no CPU notice here")
    assert done.returncode == 0 and "parent cpu" in done.stdout and "child cpu" in done.stdout, done.stderr[-2000:]
    everything = done.stdout + done.stderr
    assert "Setting accelerator to CPU" not in everything and "pynvml package is deprecated" not in everything


# ---- the quickstart's progress ------------------------------------------------------------------------------------
def ray(line: str, actor: str = "_CoPEPPOTrainer") -> str:
    """A worker's line as Ray forwards it to the driver's log (colored actor prefix)."""
    return f"\x1b[36m({actor} pid=29262)\x1b[0m {line}"


def step_line(step: int, success: float) -> str:
    return ray(f"INFO 12-06 10:55:37 ppo_trainer.py:551] ✨ Global step {step}: {{'truncated': 0.0, 'kl': 0.0, "
               f"'success': {success}, 'rollout/reward_mean': 0.48, 'rollout/success_rate': {success}, "
               "'timing/step_total': 36.5}")


def eval_line(step: int, success: float, seconds: int = 30) -> str:
    return ray(f"INFO 12-06 10:54:59 ppo_trainer.py:203] held-out eval at step {step} in {seconds} s: success "
               f"{success:.3f} over 400 episodes")


def feed_all(progress: qp.Progress, timed_lines: list) -> list:
    out = []
    for now, line in timed_lines:
        out += progress.tick(now) + progress.feed(line, now)
    return out


def test_progress_of_the_warm_start_one_line_per_epoch_with_loss_and_time_left():
    lines = ["[warm start] 360 training and 200 held-out item ids -> runs/quickstart/data",
             "expert demos:  45%|████▌     | 135/300 [00:30<00:37,  4.40it/s]",
             "[warm start] 152/300 successful expert demos -> runs/quickstart/data/demos.jsonl (70 s)",
             "[sft] epoch 1/16:  40%|████      | 15/38 [00:08<00:12,  1.90it/s]",
             "[sft] epoch 1/16: loss 1.2345 over 41234 reply tokens (20 s)",
             "[sft] epoch 2/16: loss 0.5000 over 41234 reply tokens (18 s)",
             "/x/torch/cuda/__init__.py:64: FutureWarning: something a library says"]
    out = feed_all(qp.Progress("warmstart", 16, 0.0), [(10.0 * (i + 1), line) for i, line in enumerate(lines)])
    assert out[0] == "[quickstart] warmstart  360 training and 200 held-out item ids -> runs/quickstart/data"
    assert out[1] == "[quickstart] warmstart  152/300 successful expert demos -> runs/quickstart/data/demos.jsonl (70 s)"
    assert out[2] == "[quickstart] warmstart  epoch  1/16  loss 1.2345   50 s elapsed, ~5 min 00 s left"
    assert out[3] == "[quickstart] warmstart  epoch  2/16  loss 0.5000   1 min 00 s elapsed, ~4 min 26 s left"
    assert len(out) == 4  # the bars and the library's warning stay in the log


def test_progress_of_training_a_line_per_step_eval_and_trainer_warning_nothing_else():
    timed = [(5.0, "2026-12-06 10:53:33,400\tINFO worker.py:2003 -- Started a local Ray instance."),
             (6.0, ray("/x/site-packages/torch/utils/data/dataloader.py:759: UserWarning: 'pin_memory' is set")),
             (7.0, ray("(EngineCore pid=29582) WARNING 12-06 10:54:28 [cpu.py:224] Triton is not installed.",
                       "CPURolloutRayActor")),
             (60.0, eval_line(0, 0.56)),
             (90.0, step_line(1, 0.515625)),
             (100.0, ray("WARNING 12-06 10:55:05 experience_maker.py:74] every group is degenerate")),
             (120.0, step_line(2, 0.75)),
             (170.0, eval_line(2, 0.65, seconds=40)),
             (200.0, step_line(3, 0.8)),
             (230.0, eval_line(3, 0.7))]
    out = feed_all(qp.Progress("train", 3, 0.0, quiet_s=1000, eval_every=2), timed)
    assert out == [
        "[quickstart] train  held-out success 0.560 at step 0 (400 episodes, 30 s)",
        "[quickstart] train  step   1/3  rollout success 0.516  held-out 0.560 (step 0)   1 min 30 s elapsed, "
        "~2 min 00 s left",  # 30 s a step for 2 steps, and 2 evals (steps 2 and the closing one at 3) of 30 s
        "[quickstart] train  warning (experience_maker.py:74): every group is degenerate",
        "[quickstart] train  step   2/3  rollout success 0.750  held-out 0.560 (step 0)   2 min 00 s elapsed, "
        "~1 min 30 s left",
        "[quickstart] train  held-out success 0.650 at step 2 (400 episodes, 40 s)",
        "[quickstart] train  step   3/3  rollout success 0.800  held-out 0.650 (step 2)   3 min 20 s elapsed, "
        "~40 s left",  # the closing eval, at the last eval's 40 s
        "[quickstart] train  held-out success 0.700 at step 3 (400 episodes, 30 s)"]


def test_progress_says_what_the_stage_is_busy_with_at_least_every_quiet_s():
    progress = qp.Progress("train", 50, 0.0, quiet_s=45)
    assert progress.tick(44.0) == []
    progress.feed("2026-12-06 10:53:33,400\tINFO worker.py:2003 -- Started a local Ray instance.", 44.5)
    assert progress.tick(45.0) == ["[quickstart] train  busy: Ray is up; starting the model groups   45 s elapsed"]
    assert progress.tick(60.0) == []
    progress.feed(ray("Generate samples:  47%|████▋     | 60/128 [00:17<00:04, 15.07it/s]"), 70.0)
    assert progress.tick(90.0) == ["[quickstart] train  busy: Generate samples 60/128   1 min 30 s elapsed"]
    progress.feed(eval_line(0, 0.5), 100.0)  # a printed line restarts the count
    assert progress.tick(140.0) == [] and progress.tick(145.0)[0].endswith("busy: step 1/50   2 min 25 s elapsed")


def test_follow_reads_a_growing_log_to_the_end_of_its_writer(tmp_path):
    """The follower as quickstart.sh runs it: the stage's process writes its log (lines, tqdm's carriage returns,
    a last line without a newline); the follower prints as the lines come and ends once the writer has exited."""
    log = tmp_path / "train.log"
    writer = textwrap.dedent(f"""
        import sys, time
        lines = {[eval_line(0, 0.5), step_line(1, 0.25), step_line(2, 0.5)]!r}
        with open(sys.argv[1], "w") as f:
            for line in lines:
                f.write("Episode [1/1]:   2%|▏   | 8/480 [00:37<37:09]\\r" + line + "\\n")
                f.flush()
                time.sleep(0.3)
            f.write({eval_line(2, 0.75)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer, str(log)])
    follower = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "quickstart_progress.py"), "train",
                                 str(log), "--total", "2", "--pid", str(proc.pid), "--eval-every", "2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.wait(timeout=60) == 0  # the writer is reaped here, as quickstart.sh's `wait` reaps the stage
    out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    lines = out.splitlines()
    assert lines[0] == "[quickstart] train  held-out success 0.500 at step 0 (400 episodes, 30 s)"
    assert lines[1].startswith("[quickstart] train  step   1/2  rollout success 0.250  held-out 0.500 (step 0)")
    assert lines[2].startswith("[quickstart] train  step   2/2  rollout success 0.500")
    assert lines[3] == "[quickstart] train  held-out success 0.750 at step 2 (400 episodes, 30 s)"


# A stand-in for .venv/bin/python in a copy of quickstart.sh's folder: the stages print what the real ones print
# (scripts/prepare_warm_start.py, python -m cope_rlhf.local train, scripts/run_report.py) in a second, and write the
# files the closing report reads; the follower and the report's own Python run for real.
FAKE_PYTHON = '''#!{real}
import json, os, sys, time

REAL = {real!r}
args = sys.argv[1:]
if args[0] in ("-", "scripts/quickstart_progress.py"):
    os.execv(REAL, [REAL] + args)
value = lambda flag: args[args.index(flag) + 1]
say = lambda line, end="\\n": (sys.stdout.write(line + end), sys.stdout.flush(), time.sleep(0.02))
if args[0] == "scripts/prepare_warm_start.py":
    out = value("--out")
    say("/x/torch/cuda/__init__.py:64: FutureWarning: a library notice")
    say(f"[warm start] 40 training and 8 held-out item ids -> {{out}}/data")
    for n in (5, 10, 20):
        say(f"expert demos:  {{n * 5}}%|███       | {{n}}/20 [00:01<00:01,  9.9it/s]", end="\\r")
    say(f"[warm start] 12/20 successful expert demos -> {{out}}/data/demos.jsonl (1 s)")
    epochs = int(value("--epochs"))
    for epoch in range(1, epochs + 1):
        say(f"[sft] epoch {{epoch}}/{{epochs}}: loss {{1 / epoch:.4f}} over 1000 reply tokens (0 s)")
    say(f"[warm start] SFT model -> {{out}}/model-sft")
elif args[:2] == ["-m", "cope_rlhf.local"]:
    ckpt, steps, every = value("--ckpt.path"), int(value("--local.steps")), int(value("--eval.steps"))
    trainer = "\\x1b[36m(_CoPEPPOTrainer pid=7)\\x1b[0m "
    evaluate = lambda step: say(trainer + f"INFO 12-06 10:54:59 ppo_trainer.py:203] held-out eval at step {{step}} "
                                f"in 1 s: success 0.500 over 16 episodes")
    evaluate(0)
    for step in range(1, steps + 1):
        time.sleep(0.2)
        say(trainer + f"INFO 12-06 10:55:37 ppo_trainer.py:551] Global step {{step}}: {{{{'rollout/success_rate': "
            f"0.{{step}}, 'timing/step_total': 0.2}}}}")
        if step % every == 0 or step == steps:
            evaluate(step)
    os.makedirs(ckpt, exist_ok=True)
    json.dump({{"tensorboard_dir": ckpt + "/tb", "model": value("--ckpt.output_dir")}}, open(ckpt + "/summary.json", "w"))
elif args[0] == "scripts/run_report.py":
    rate = lambda step, s: {{"step": step, "items": 8, "episodes": 16, "success": s, "low": s - 0.1, "high": s + 0.1}}
    json.dump({{"evals": [rate(0, 0.5), rate(3, 0.6)], "gain": {{"gain": 0.1, "low": 0.0, "high": 0.2}}}},
              open(value("--json"), "w"))
else:
    sys.exit(f"fake python: unexpected {{args}}")
'''


def test_quickstart_shows_each_stage_progress_on_the_terminal(tmp_path):
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in ("quickstart.sh", "quickstart_progress.py"):
        shutil.copy(os.path.join(ROOT, "scripts", name), root / "scripts" / name)
    for venv, text in ((".venv", FAKE_PYTHON.format(real=sys.executable)), (".venvs/babyai", "#!/bin/sh\n")):
        python = root / venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(text)
        python.chmod(0o755)
    out = tmp_path / "qs"
    env = {**{k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}, "QUICKSTART_DIR": str(out),
           "QUICKSTART_STEPS": "3", "QUICKSTART_EVAL_EVERY": "2", "QUICKSTART_SKIP_SETUP": "1"}
    done = subprocess.run(["bash", "scripts/quickstart.sh"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr == ""
    terminal = done.stdout
    for epoch in range(1, 17):
        assert re.search(rf"^\[quickstart\] warmstart  epoch +{epoch}/16  loss \d\.\d{{4}}   .* elapsed", terminal, re.M)
    assert "[quickstart] warmstart  12/20 successful expert demos" in terminal
    for step in (1, 2, 3):
        assert re.search(rf"^\[quickstart\] train  step +{step}/3  rollout success 0\.{step}00  held-out 0\.500 "
                         rf"\(step \d\)   .* elapsed, ~.* left$", terminal, re.M), terminal
    assert terminal.count("[quickstart] train  held-out success 0.500 at step") == 3  # steps 0, 2 and 3
    assert terminal.index("step   3/3") < terminal.index("[quickstart] train: done in") < terminal.index(
        "[quickstart] done in")
    # the rest stays in the logs
    assert "Global step" not in terminal and "FutureWarning" not in terminal and "expert demos:" not in terminal
    assert "Global step 3" in (out / "logs" / "train.log").read_text()
    assert "FutureWarning" in (out / "logs" / "warmstart.log").read_text()
    assert json.loads((out / "ckpt" / "summary.json").read_text())["model"].endswith("model-rl")
