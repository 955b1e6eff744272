"""Launchers: every run/launch/example script under DRY_RUN=1 prints a command that the real
``cope_rlhf.cli.train_ppo_ray`` parser (OpenRLHF's + ``--cope.*``) accepts; one CoPE variable adds exactly its flag;
secrets stay off argv; the scripts pass ``bash -n`` and shellcheck; the tmux launcher brings up the real BabyAI
server and gateway, says "all servers healthy", names a server that never comes up, and leaves no process behind."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex
import shutil
import subprocess
import time

import pytest

from cope_rlhf.config import CoPEConfig
from tests.conftest import ROOT
from tests.env_server_proc import call, refusing_port, venv_python

ENVS = ["babyai", "sciworld", "textcraft", "alfworld", "searchqa", "webshop", "webarena", "appworld", "tau2"]
RUN = [f"scripts/run_{env}_grpo_train.sh" for env in ENVS]
LAUNCH = [f"scripts/launch_{env}_grpo_tmux.sh" for env in ENVS]
EXAMPLES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "examples/train/*/*_train.sh")))
TRAINING_SCRIPTS = RUN + LAUNCH + EXAMPLES
ALL_SCRIPTS = TRAINING_SCRIPTS + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "examples/eval/*.sh"))) + [
    "scripts/lib/common.sh", "scripts/lib/tmux.sh", "scripts/lib/disk_check.sh", "scripts/lib/help.sh",
    "scripts/ray_cluster_head.sh",
    "scripts/ray_cluster_worker.sh",
    "scripts/sbatch_train.sh", "scripts/quickstart.sh", "scripts/setup.sh", "scripts/setup_env.sh", "scripts/test.sh",
    "scripts/gpu_smoke.sh", ".ci/run", "scripts/launch_tau2_infopo_aligned.sh", "scripts/tau2_align_eval.sh",
    "scripts/sbatch_tau2_align.sh", "scripts/test_under_load.sh"]
COPE_VARS = [f.name.upper() for f in dataclasses.fields(CoPEConfig)]
# a valid, non-default value for every switch
COPE_VALUES = {"ACTION_FORECAST_ENABLE": "1", "ACTION_FORECAST_COEF": "0.05", "ACTION_FORECAST_K": "4",
               "ACTION_FORECAST_GATE": "mixed", "ACTION_FORECAST_GROUP_NORM": "1", "ACTION_FORECAST_SKIP_INVALID": "0",
               "ACTION_FORECAST_SUCCESS_THRESHOLD": "0.8", "ACTION_FORECAST_LAYOUT": "turns",
               "ACTION_FORECAST_MODE": "joint", "ACTION_FORECAST_MAX_LENGTH": "2048", "ACTION_FORECAST_LR_SCALE": "0.5",
               "SFT_MINI_BATCH_SIZE": "16", "TE_ENABLE": "1", "TE_LAMBDA": "0.1", "TE_ETA": "0.3",
               "TE_WARMUP_STEPS": "10", "TE_TRAJ_SUBSAMPLE": "0.5", "TE_MICRO_BATCH_SIZE_PER_GPU": "4",
               "INFO_INTRINSIC_WEIGHT": "0.1", "INFO_GATE_TEMP": "0.2", "INFO_MAX_TURNS": "4", "INFO_PROBE_TOKENS": "8",
               "INFO_KL_BATCH": "4", "GRPO_FILTER_DEGENERATE": "1", "EVAL_FIRST_AND_LAST": "1",
               "EVAL_DISPATCH_SIZE": "64", "TE_HOLD_BELOW": "0.2"}
# Upstream CoPE's run scripts: the forecast switched on brings group norm and skip-invalid with it, TE skip-invalid.
FORECAST_DEFAULTS = ["--cope.action_forecast_group_norm", "1", "--cope.action_forecast_skip_invalid", "1"]
TE_DEFAULTS = ["--cope.action_forecast_skip_invalid", "1"]
TAU2_USER = {"TAU2_USER_MODEL": "openai/gpt-4o-mini", "TAU2_USER_BASE_URL": "http://127.0.0.1:9/v1"}
EXTERNAL = {"webshop", "webarena", "appworld"}


def clean_env(**extra: str) -> dict:
    """A minimal environment: none of the caller's CoPE/launcher settings leak into what is tested."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env["COPE_SECRETS_DIR"] = os.path.join(ROOT, "tests", "no-secrets-here")
    env.update(extra)
    return env


def script_env(script: str, **extra: str) -> dict:
    env_name = os.path.basename(script).split("_")[1] if script.startswith("scripts/") else \
        os.path.basename(script).split("_")[0]
    if script.startswith("scripts/launch_") and env_name in EXTERNAL:
        extra.setdefault("ENV_SERVER_URLS", "http://127.0.0.1:9")
    if env_name == "tau2":
        extra = {**TAU2_USER, **extra}
    return clean_env(DRY_RUN="1", **extra)


def dry_run(script: str, **extra: str) -> str:
    done = subprocess.run(["bash", script], cwd=ROOT, env=script_env(script, **extra), capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, f"{script}: {done.stderr}"
    return done.stdout


def trainer_command(output: str) -> tuple[dict, list[str]]:
    """(VAR=value assignments before the interpreter, the trainer's arguments) of the printed command."""
    line = next(line for line in output.splitlines() if "cope_rlhf.cli.train_ppo_ray" in line)
    words = shlex.split(line)
    at = words.index("cope_rlhf.cli.train_ppo_ray")
    assert words[at - 1] == "-m"
    assignments = dict(w.split("=", 1) for w in words[:at - 2] if "=" in w and not w.startswith("-"))
    return assignments, words[at + 1:]


@pytest.fixture(scope="module")
def parser():
    from cope_rlhf.cli.args import build_parser

    return build_parser()  # no CoPE default comes from the environment (tests/test_config.py)


def parse(parser, argv: list[str]):
    from cope_rlhf.cli.args import combination_error

    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"the trainer's parser rejected the command (exit {e.code}): {shlex.join(argv)}")
    assert combination_error(args) is None, combination_error(args)
    return args


def test_cope_vars_in_common_sh_are_the_config_fields():
    done = subprocess.run(["bash", "-c", 'source scripts/lib/common.sh; echo "${COPE_VARS[@]}"'], cwd=ROOT,
                          capture_output=True, text=True, timeout=10, env=clean_env())
    assert done.stdout.split() == COPE_VARS


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_dry_run_command_parses_with_the_trainer_parser(parser, script):
    env_vars, argv = trainer_command(dry_run(script))
    args = parse(parser, argv)
    env = argv[argv.index("--train.agent_func_path") + 1].split("/")[-1][:-3]
    assert env in script
    assert getattr(args, "algo.advantage.estimator") == "group_norm"
    assert getattr(args, "data.input_key") == "prompt" and getattr(args, "data.label_key") == "label"
    assert env_vars["COPE_GATEWAY_URL"].startswith("http://127.0.0.1:")
    assert not [a for a in argv if a.startswith("--cope.")]  # no CoPE variable set: stock GRPO
    if "ScalingInter-RL" in script:
        assert "," in env_vars["HORIZON_SCHEDULE"] and int(env_vars["HORIZON_EPISODES_PER_STEP"]) >= 1
    elif script.startswith("examples/"):
        assert "HORIZON_SCHEDULE" not in env_vars and int(env_vars["MAX_TURNS"]) > 0


def test_resources_follow_cuda_visible_devices(parser):
    _, argv = trainer_command(dry_run("scripts/run_textcraft_grpo_train.sh", CUDA_VISIBLE_DEVICES="0,1,2,3",
                                      VLLM_TP="2"))
    args = parse(parser, argv)
    assert getattr(args, "actor.num_gpus_per_node") == 4 and getattr(args, "vllm.num_engines") == 2
    assert getattr(args, "vllm.tensor_parallel_size") == 2
    # OpenRLHF starts a reward group even without a reward model; under colocation it must fit the actor's bundles
    assert getattr(args, "reward.num_gpus_per_node") == getattr(args, "ref.num_gpus_per_node") == 4


def test_gpu_smoke_training_command_parses(parser):
    """scripts/gpu_smoke.sh's training run, as its dry run prints it (through the BabyAI run script), passes the
    trainer's parser and the CoPE combination checks: one GPU for everything, every signal on."""
    done = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--dry-run"], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    _, argv = trainer_command(done.stdout)
    args = parse(parser, argv)
    for size in ("actor.num_gpus_per_node", "ref.num_gpus_per_node", "reward.num_gpus_per_node", "vllm.num_engines"):
        assert getattr(args, size) == 1, size
    for switch in ("train.colocate_all", "vllm.enable_sleep", "ds.enable_sleep", "ds.packing_samples"):
        assert getattr(args, switch), switch
    assert getattr(args, "ds.zero_stage") == 3
    assert getattr(args, "ds.attn_implementation") == "flash_attention_2"
    assert getattr(args, "vllm.gpu_memory_utilization") <= 0.2
    assert getattr(args, "cope.action_forecast_enable") and getattr(args, "cope.te_enable")
    assert getattr(args, "cope.te_warmup_steps") == 0 and getattr(args, "cope.te_lambda") > 0
    assert getattr(args, "cope.info_intrinsic_weight") > 0 and getattr(args, "cope.grpo_filter_degenerate")


def test_baselines_carry_the_published_hyperparameters(parser):
    """docs/BASELINES.md: AgentGym-RL max turns, ScalingInter-RL schedules, n per env, lr 1e-6, KL loss 0.001."""
    turns = {"babyai": "20", "sciworld": "20", "textcraft": "30", "searchqa": "5", "webarena": "15"}
    schedules = {"babyai": ("6,13,20", "100"), "sciworld": ("10,20,30", "100"), "textcraft": ("10,20,30", "100"),
                 "searchqa": ("5,8,10", "100"), "webarena": ("8,12,15", "80")}
    for env in turns:
        for family in ("AgentGym-RL", "ScalingInter-RL"):
            env_vars, argv = trainer_command(dry_run(f"examples/train/{family}/{env}_train.sh"))
            args = parse(parser, argv)
            assert getattr(args, "rollout.n_samples_per_prompt") == (4 if env in ("searchqa", "webarena") else 8)
            assert getattr(args, "actor.adam.lr") == 1e-6 and getattr(args, "algo.kl.init_coef") == 0.001
            assert getattr(args, "algo.kl.use_loss") and getattr(args, "algo.kl.estimator") == "k3"
            if family == "AgentGym-RL":
                assert env_vars["MAX_TURNS"] == turns[env]
            else:
                assert (env_vars["HORIZON_SCHEDULE"], env_vars["HORIZON_STAGE_STEPS"]) == schedules[env]


@pytest.mark.parametrize("var", COPE_VARS)
def test_one_cope_variable_adds_exactly_its_flag(parser, var):
    _, base = trainer_command(dry_run("scripts/run_babyai_grpo_train.sh"))
    _, with_var = trainer_command(dry_run("scripts/run_babyai_grpo_train.sh", **{var: COPE_VALUES[var]}))
    flag = f"--cope.{var.lower()}"
    # flags come in COPE_VARS order: the forecast's defaults after it, skip-invalid before TE_ENABLE
    expected = {"ACTION_FORECAST_ENABLE": [flag, COPE_VALUES[var]] + FORECAST_DEFAULTS,
                "TE_ENABLE": TE_DEFAULTS + [flag, COPE_VALUES[var]]}.get(var, [flag, COPE_VALUES[var]])
    assert with_var == base + expected
    stock, changed = parser.parse_args(base), parser.parse_args(with_var)
    dest = f"cope.{var.lower()}"
    assert getattr(changed, dest) != getattr(stock, dest)


def test_forecast_defaults_follow_upstream_and_can_be_turned_off(parser):
    _, base = trainer_command(dry_run("scripts/run_babyai_grpo_train.sh"))
    _, off = trainer_command(dry_run("scripts/run_babyai_grpo_train.sh", ACTION_FORECAST_ENABLE="1",
                                     ACTION_FORECAST_GROUP_NORM="0"))
    assert off == base + ["--cope.action_forecast_enable", "1", "--cope.action_forecast_group_norm", "0",
                          "--cope.action_forecast_skip_invalid", "1"]
    args = parse(parser, off)
    assert (getattr(args, "cope.action_forecast_group_norm"), getattr(args, "cope.action_forecast_skip_invalid")) == (
        False, True)


def test_te_brings_skip_invalid_unless_the_user_turns_it_off(parser):
    """As upstream's launchers: TE's members and targets leave out actions the env rejected, unless the user says so
    (TE alone used to build members from rejected and unparseable actions: docs/METHOD.md "Verdict on TE")."""
    _, base = trainer_command(dry_run("scripts/run_babyai_grpo_train.sh"))
    _, on = trainer_command(dry_run("scripts/run_babyai_grpo_train.sh", TE_ENABLE="1"))
    _, off = trainer_command(dry_run("scripts/run_babyai_grpo_train.sh", TE_ENABLE="1",
                                     ACTION_FORECAST_SKIP_INVALID="0"))
    assert on == base + ["--cope.action_forecast_skip_invalid", "1", "--cope.te_enable", "1"]
    assert off == base + ["--cope.action_forecast_skip_invalid", "0", "--cope.te_enable", "1"]
    assert getattr(parse(parser, on), "cope.action_forecast_skip_invalid") is True
    assert getattr(parse(parser, off), "cope.action_forecast_skip_invalid") is False


@pytest.mark.parametrize("script", LAUNCH[1:] + EXAMPLES)
def test_every_script_passes_a_cope_variable_through(script):
    _, base = trainer_command(dry_run(script))
    _, with_var = trainer_command(dry_run(script, TE_ENABLE="1", TE_LAMBDA="0.1"))
    assert with_var == base + TE_DEFAULTS + ["--cope.te_enable", "1", "--cope.te_lambda", "0.1"]


EVAL_SCRIPTS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "examples/eval/*_eval.sh"))
                      if not p.endswith("tau2_eval.sh"))


@pytest.mark.parametrize("script", EVAL_SCRIPTS)
def test_eval_script_dry_run_parses_with_the_eval_parser(script):
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_script", os.path.join(ROOT, "scripts", "eval.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    env = os.path.basename(script).split("_")[0]
    line = next(line for line in dry_run(script, CKPT="runs/x/model").splitlines() if "scripts/eval.py" in line)
    words = shlex.split(line)
    at = words.index("scripts/eval.py")
    args = module.build_parser().parse_args(words[at + 1:])
    assert (args.env, args.model, args.k, args.items) == (env, "runs/x/model", 4, f"data/generated/{env}_test.jsonl")
    assert int(dict(w.split("=", 1) for w in words[:at - 1])["MAX_TURNS"]) > 0


def test_tau2_eval_is_the_aligned_eval_tau2s_own_cli_then_the_scorer():
    out = dry_run("examples/eval/tau2_eval.sh", TAG="t1", CKPT="runs/x/model").splitlines()
    served = shlex.split(next(line for line in out if " serve " in line))  # after any deviation line
    assert served[:3] == ["vllm", "serve", "runs/x/model"] and "hermes" in served  # CKPT is the policy served
    runs = [shlex.split(line) for line in out if " run --domain " in line]
    assert [w[w.index("--domain") + 1] for w in runs] == ["airline", "retail", "telecom"]
    for words in runs:
        assert words[words.index("--num-trials") + 1] == "4" and words[words.index("--task-split-name") + 1] == "test"
        assert words[words.index("--max-steps") + 1] == "200"  # the published step cap
        assert words[words.index("--save-to") + 1].startswith(os.path.join(ROOT, "runs", "tau2", "t1_"))
    assert "scripts/tau2_align_score.py --tag t1" in out[-1]


def test_ray_job_submit_keeps_the_key_off_argv(tmp_path):
    """RAY_ADDRESS set: `ray job submit` gets the agent funcs' variables and the wandb key in a private runtime-env
    file (deleted afterwards), never on its command line. The ray CLI here is a stand-in script (no Ray cluster
    runs in the tests) that records its argv and the file it was given."""
    secrets, bin_dir = tmp_path / "secrets", tmp_path / "bin"
    secrets.mkdir()
    bin_dir.mkdir()
    (secrets / "wandb_api_key").write_text("sk-test-not-a-real-key\n")
    record = tmp_path / "record"
    fake_ray = bin_dir / "ray"
    fake_ray.write_text(f"""#!/usr/bin/env bash
# stand-in for the ray CLI: record argv and the runtime env file
printf '%s\\n' "$@" > {record}.argv
prev=""; for a in "$@"; do [ "$prev" = --runtime-env ] && cp "$a" {record}.env && stat -c %a "$a" > {record}.mode \
  && echo "$a" > {record}.path; prev="$a"; done
""")
    fake_ray.chmod(0o755)
    env = clean_env(RAY_ADDRESS="http://127.0.0.1:9", COPE_SECRETS_DIR=str(secrets),
                    PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON="python3", TE_ENABLE="1",
                    COPE_SKIP_PREFLIGHT="1")  # nothing here exists (model, data, gateway): the submission is tested
    script = ("source scripts/lib/common.sh; cope_ray() { echo ray; }; ENV_NAME=babyai; MAX_TURNS=20; "
              "cope_train_main")
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "record.argv").read_text().splitlines()
    assert argv[:2] == ["job", "submit"] and "--cope.te_enable" in argv
    assert "sk-test-not-a-real-key" not in " ".join(argv) + done.stdout + done.stderr
    assert argv[argv.index("--logger.wandb.key") + 1] == "from-env"
    for flag in ("--data.prompt_dataset", "--ckpt.path", "--logger.tensorboard_dir"):  # git-ignored: not uploaded
        assert argv[argv.index(flag) + 1].startswith(ROOT + "/")
    runtime_env = (tmp_path / "record.env").read_text()
    assert '"WANDB_API_KEY": "sk-test-not-a-real-key"' in runtime_env and '"MAX_TURNS": "20"' in runtime_env
    assert (tmp_path / "record.mode").read_text().strip() == "600"
    assert not os.path.exists((tmp_path / "record.path").read_text().strip())
    dry = subprocess.run(["bash", "-c", script], cwd=ROOT, env={**env, "DRY_RUN": "1"}, capture_output=True,
                         text=True, timeout=30)
    assert "sk-test" not in dry.stdout and "<redacted>" in dry.stdout


def test_ray_job_submit_runs_the_preflight_first(tmp_path):
    """A submission that cannot run stops on the submitting host, with every problem listed, and nothing is sent."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(f"#!/usr/bin/env bash\ntouch {tmp_path / 'submitted'}\n")
    (bin_dir / "ray").chmod(0o755)
    env = clean_env(RAY_ADDRESS="http://127.0.0.1:9", PATH=f"{bin_dir}:{os.environ['PATH']}",
                    PYTHON=os.path.join(ROOT, ".venv", "bin", "python"), MODEL_PATH=str(tmp_path / "no-model"),
                    COPE_GATEWAY_URL="http://127.0.0.1:9")
    script = "source scripts/lib/common.sh; cope_ray() { echo ray; }; ENV_NAME=babyai; MAX_TURNS=20; cope_train_main"
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "preflight:" in done.stderr and f"{tmp_path / 'no-model'}: no such folder" in done.stderr
    assert "no gateway answers at COPE_GATEWAY_URL=http://127.0.0.1:9" in done.stderr
    assert not (tmp_path / "submitted").exists()


def test_sbatch_and_ray_cluster_dry_runs(parser):
    out = dry_run("scripts/sbatch_train.sh", NODES="node1 node2 node3", ENV_NAME="textcraft", TE_ENABLE="1")
    assert out.count("ray_cluster_worker.sh") == 2 and out.count("ray_cluster_head.sh") == 1
    assert "launch_textcraft_grpo_tmux.sh" in out and "--nodes=3" in out
    _, argv = trainer_command(out)
    args = parse(parser, argv)
    assert getattr(args, "actor.num_nodes") == 3 and getattr(args, "cope.te_enable") is True
    assert "job submit" in out
    head = dry_run("scripts/ray_cluster_head.sh", NUM_GPUS="8")
    assert "start --head --port 6379" in head and "--num-gpus 8" in head
    worker = dry_run("scripts/ray_cluster_worker.sh", HEAD_ADDRESS="10.0.0.1:6379")
    assert "start --address 10.0.0.1:6379" in worker


def test_bash_syntax_and_shellcheck():
    for script in ALL_SCRIPTS:
        done = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True, timeout=10)
        assert done.returncode == 0, f"{script}: {done.stderr}"
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian: apt-get install shellcheck); bash -n passed")
    # the timeout only catches a hang: shellcheck needs ~9 s of CPU for the 51 scripts but took 43-52 s of wall time
    # beside a training run and the rest of the suite (load ~10 on 2 cores), so 60 s failed the suite there
    done = subprocess.run(["shellcheck", "-x", *ALL_SCRIPTS], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]


# ---- the tmux launcher, for real: BabyAI server + gateway on CPU ------------------------------------------------
def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def tmux_ready() -> None:
    for tool in ("tmux", "curl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (Debian: apt-get install {tool})")
    if not os.path.exists(venv_python("babyai")):
        pytest.skip(".venvs/babyai is missing: run `bash scripts/setup_env.sh babyai`")


def launch(session: str, *args: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    env = clean_env(TMUX_SESSION=session, **extra)
    return subprocess.run(["bash", "scripts/launch_babyai_grpo_tmux.sh", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def session_pids(session: str) -> list[int]:
    done = subprocess.run(["tmux", "-L", session, "list-panes", "-s", "-t", session, "-F", "#{pane_pid}"],
                          capture_output=True, text=True, timeout=10)
    return [int(p) for p in done.stdout.split()]


def tmux_server_running(session: str) -> bool:
    """A tmux server on the session's socket, or its socket file left behind."""
    socket = os.path.join(os.environ.get("TMUX_TMPDIR", "/tmp"), f"tmux-{os.getuid()}", session)
    done = subprocess.run(["tmux", "-L", session, "ls"], capture_output=True, timeout=10)
    return done.returncode == 0 or os.path.exists(socket)


def gateway_url(launcher_stdout: str) -> str:
    found = re.search(r"servers and gateway are up at (http://127\.0\.0\.1:\d+);", launcher_stdout)
    assert found, launcher_stdout
    return found.group(1)


def test_tmux_launcher_brings_up_babyai_and_gateway_then_tears_down():
    """Port 0 everywhere: each server and the gateway bind a free port, and the launcher reads it from the window."""
    tmux_ready()
    session = f"cope-test-{os.getpid()}"
    pids: list[int] = []
    try:
        up = launch(session, LAUNCH_ONLY="1", ENV_REPLICAS="2", ENV_SERVER_PORT="0", GATEWAY_PORT="0",
                    HEALTH_TIMEOUT="90")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "all servers healthy" in up.stdout
        pids = session_pids(session)
        assert len(pids) == 3 and all(alive(p) for p in pids)  # two babyai servers and the gateway
        status, health = call(gateway_url(up.stdout), "GET", "/v1/health", timeout=5)
        assert status == 200 and health["envs"]["babyai"]["healthy_replicas"] == 2
        served = set(re.findall(r"healthy: babyai server (http://127\.0\.0\.1:\d+)", up.stdout))
        status, envs = call(gateway_url(up.stdout), "GET", "/v1/envs", timeout=5)
        assert len(served) == 2 and {r["url"] for r in envs["envs"]["babyai"]["replicas"]} == served
    finally:
        down = launch(session, "stop", timeout=60)
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "processes left after teardown"
    assert not tmux_server_running(session)


def test_tmux_launcher_runs_the_preflight_before_starting_anything():
    """The training run's problems (all but the gateway, which the launcher is about to start) stop the launch
    before any server or tmux session exists."""
    tmux_ready()
    session = f"cope-test-preflight-{os.getpid()}"
    try:
        out = launch(session, MODEL_PATH="runs/none/model-sft", ENV_SERVER_PORT="0", GATEWAY_PORT="0")
    finally:
        if tmux_server_running(session):
            launch(session, "stop", timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "preflight:" in out.stderr and "runs/none/model-sft: no such folder" in out.stderr
    assert "no gateway" not in out.stderr and "nothing was started" in out.stderr
    assert not tmux_server_running(session)


def test_tmux_launcher_names_the_server_that_never_came_up():
    tmux_ready()
    session = f"cope-test-dead-{os.getpid()}"
    with refusing_port() as held:  # nothing listens there, and nothing can while it is held
        dead_port = held.getsockname()[1]
        try:
            out = launch(session, LAUNCH_ONLY="1", ENV_SERVER_URLS=f"http://127.0.0.1:{dead_port}",
                         GATEWAY_PORT="0", HEALTH_TIMEOUT="8")  # the gateway's own start needs >2 s under load
        finally:
            if tmux_server_running(session):
                launch(session, "stop", timeout=60)
    assert out.returncode == 1
    assert f"babyai server http://127.0.0.1:{dead_port} never came up" in out.stderr
    assert "HEALTH_TIMEOUT" in out.stderr and "all servers healthy" not in out.stdout
    assert not tmux_server_running(session)  # the gateway it had started is gone too


def test_tmux_launcher_hold_mode_tears_down_on_sigterm():
    """HOLD=1 (what sbatch_train.sh's srun steps use): the launcher stays in the foreground while the servers run,
    and SIGTERM to it (the job ending) stops every process it started."""
    tmux_ready()
    session = f"cope-test-hold-{os.getpid()}"
    env = clean_env(TMUX_SESSION=session, LAUNCH_ONLY="1", HOLD="1", ENV_SERVER_PORT="0", GATEWAY_PORT="0",
                    HEALTH_TIMEOUT="90")
    proc = subprocess.Popen(["bash", "scripts/launch_babyai_grpo_tmux.sh"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: list[int] = []
    try:
        lines = []
        for line in proc.stdout:  # bounded: HEALTH_TIMEOUT ends the launcher if nothing comes up
            lines.append(line)
            if "all servers healthy" in line:
                break
        assert "all servers healthy" in "".join(lines), "".join(lines)
        pids = session_pids(session)
        assert proc.poll() is None and len(pids) == 2
        proc.terminate()
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and f"session {session} stopped" in rest
        assert not [p for p in pids if alive(p)] and not tmux_server_running(session)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if tmux_server_running(session):
            launch(session, "stop", timeout=60)


@pytest.mark.parametrize("server_args,timeout,says", [
    ("--no-such-flag", "90", "exited before it logged the port it bound"),
    ("--log-level WARNING", "15", "did not log the port it bound ('listening on ...') within 15s (HEALTH_TIMEOUT)"),
])
def test_tmux_launcher_names_a_port_0_server_that_crashed_or_never_logs_its_port(server_args, timeout, says):
    """A crash shows the server's own error from its window; a server that never logs its port is named when
    HEALTH_TIMEOUT runs out. Either way everything the launcher started is stopped."""
    tmux_ready()
    session = f"cope-test-crash-{os.getpid()}"
    try:
        out = launch(session, LAUNCH_ONLY="1", ENV_SERVER_PORT="0", GATEWAY_PORT="0", ENV_SERVER_ARGS=server_args,
                     HEALTH_TIMEOUT=timeout)
    finally:
        if tmux_server_running(session):
            launch(session, "stop", timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"babyai server (window babyai-0) {says}" in out.stderr
    if server_args == "--no-such-flag":
        assert "--no-such-flag" in out.stderr.split("--- last lines of tmux window")[1]  # the server's own error
    assert not tmux_server_running(session)


def test_tmux_launchers_training_window_gets_the_port_0_gateways_url():
    """The training window's COPE_GATEWAY_URL is the port the gateway bound, not the port-0 URL the tmux server's
    environment was created with (the training run here stops at its own preflight: no model)."""
    tmux_ready()
    session = f"cope-test-train-{os.getpid()}"
    try:
        up = launch(session, ENV_SERVER_PORT="0", GATEWAY_PORT="0", HEALTH_TIMEOUT="90", COPE_SKIP_PREFLIGHT="1",
                    MODEL_PATH="runs/none/model-sft")
        assert up.returncode == 0 and "training started in window 'train'" in up.stdout, up.stdout + up.stderr
        gateway = re.search(r"healthy: gateway \((http://127\.0\.0\.1:\d+)/v1/health\)", up.stdout).group(1)
        assert not gateway.endswith(":0")
        windows = subprocess.run(["tmux", "-L", session, "list-windows", "-t", session, "-F",
                                  "#{window_name}\t#{pane_start_command}"], capture_output=True, text=True,
                                 timeout=10).stdout
        train = next(line for line in windows.splitlines() if line.startswith("train\t"))
        assert f"COPE_GATEWAY_URL={gateway} exec bash scripts/run_babyai_grpo_train.sh" in train
    finally:
        if tmux_server_running(session):
            launch(session, "stop", timeout=60)
