"""Every environment variable an agent func or the trainer reads reaches a Ray job's runtime env.

With RAY_ADDRESS set, scripts/lib/common.sh submits the trainer with `ray job submit`: the job runs on the cluster,
where none of the submitting shell's variables exist, unless they travel in the job's runtime env. The launchers'
variable table (``AGENT_VARS`` in common.sh) says which travel. This test reads the sources (agent_funcs/*.py,
env_gateway/client.py, which the agent funcs call the gateway with, and cope_rlhf/, the trainer) for every variable
they read from the environment, and checks that each is in the table, or in ``NOT_FORWARDED`` with the reason it
must not travel; then it sets every one and submits through a stand-in ray CLI (no cluster runs), and reads the
runtime env the job would get: each variable is there, with its value.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess

from tests.conftest import ROOT

SOURCES = ("agent_funcs/*.py", "env_gateway/client.py", "cope_rlhf/**/*.py")
READS = re.compile(r"""(?:os\.environ\.get|os\.getenv|_env_int|_env_float)\(\s*["']([A-Z][A-Z0-9_]*)["']"""
                   r"""|os\.environ\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\](?!\s*=[^=])""")
# Read by the trainer, yet not the user's to send: each with the reason.
NOT_FORWARDED = {
    "WORLD_SIZE": "set in each training rank by the distributed launcher",
    "RAY_ADDRESS": "read where the job is submitted; Ray sets the job driver's own",
    "PYTHONPATH": "Ray's runtime env sets the job's (cope_rlhf/patch.py merges the caller's)",
    "PYTHONWARNINGS": "the trainer extends it for its own child processes",
    "HF_HOME": "each node's own model cache",
    "COPE_SECRETS_DIR": "secrets are read on the submitting host; the wandb key itself travels as WANDB_API_KEY",
}


def variables_read() -> dict[str, list[str]]:
    """Each variable the agent funcs and the trainer read, with the files that read it."""
    found: dict[str, list[str]] = {}
    for pattern in SOURCES:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for match in READS.finditer(text):
                name = match.group(1) or match.group(2)
                found.setdefault(name, []).append(os.path.relpath(path, ROOT))
    return found


def table() -> list[str]:
    """``AGENT_VARS`` of scripts/lib/common.sh, as bash reads it."""
    done = subprocess.run(["bash", "-c", 'source scripts/lib/common.sh; printf "%s\\n" "${AGENT_VARS[@]}"'], cwd=ROOT,
                          capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.split()


def test_every_variable_the_agent_funcs_and_the_trainer_read_is_in_the_launchers_table():
    read = variables_read()
    assert {"MAX_TURNS", "COPE_GATEWAY_URL", "COPE_TRAIN_STEP_FILE"} <= set(read)  # the scan finds what it must
    missing = {name: files for name, files in read.items() if name not in table() and name not in NOT_FORWARDED}
    assert not missing, f"read but never sent to a Ray job (add them to AGENT_VARS in scripts/lib/common.sh): {missing}"
    stale = [name for name in NOT_FORWARDED if name not in read]
    assert not stale, f"NOT_FORWARDED names variables nothing reads any more: {stale}"


def test_each_of_them_reaches_the_runtime_env_of_a_submitted_job(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "runtime_env.json"
    (bin_dir / "ray").write_text(f"""#!/usr/bin/env bash
# stand-in for the ray CLI: keep the runtime env file it was given
prev=""; for a in "$@"; do [ "$prev" = --runtime-env ] && cp "$a" {record}; prev="$a"; done
""")
    (bin_dir / "ray").chmod(0o755)
    names = sorted(set(variables_read()) - set(NOT_FORWARDED))
    values = {name: f"value-of-{name.lower()}" for name in names}
    values["HORIZON_SCHEDULE"] = "6,13,20"  # the launcher checks its form
    values["COPE_SKIP_PREFLIGHT"] = "1"  # and nothing here is real: skip the preflight here and in the job
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env.update(values, RAY_ADDRESS="http://127.0.0.1:9", PYTHON="python3",
               PATH=f"{bin_dir}:{os.environ['PATH']}", COPE_SECRETS_DIR=str(tmp_path / "no-secrets"))
    script = "source scripts/lib/common.sh; cope_ray() { echo ray; }; ENV_NAME=babyai; cope_train_main"
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    sent = json.loads(record.read_text())["env_vars"]
    lost = {name: sent.get(name) for name in names if sent.get(name) != values[name]}
    assert not lost, f"set here, but the job's runtime env has instead: {lost}"
