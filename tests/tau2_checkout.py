"""The tau2-bench checkout the τ² tests run against: ``TAU2_BENCH_DIR``, else ``../shared/tau2-bench-c5b2d22`` beside
the repository; the skip marks for a machine without it or without the τ² server's venv; and a copy of its data
folder that tau2 can load (``TAU2_DATA_DIR``), with a stand-in line for each user-simulator guideline file the
checkout lacks (a full checkout's own files are used as they are)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import ROOT
from tests.env_server_proc import venv_python

TAU2_BENCH = os.environ.get("TAU2_BENCH_DIR") or os.path.join(os.path.dirname(ROOT), "shared", "tau2-bench-c5b2d22")
DOMAINS_DIR = os.path.join(TAU2_BENCH, "data", "tau2", "domains")
TAU2_PYTHON = venv_python("tau2")
NEEDS_CHECKOUT = pytest.mark.skipif(not os.path.isdir(DOMAINS_DIR), reason=f"no tau2-bench checkout at {TAU2_BENCH} "
                                    "(its data/tau2/domains): set TAU2_BENCH_DIR to sierra-research/tau2-bench at "
                                    "commit c5b2d22")
NEEDS_VENV = pytest.mark.skipif(not os.path.exists(TAU2_PYTHON), reason=f"{TAU2_PYTHON} is absent: run `bash "
                                "scripts/setup_env.sh tau2` (needs the tau2-bench checkout)")
GUIDELINES = ("simulation_guidelines.md", "simulation_guidelines_tools.md")


def data_copy(tmp_path_factory: pytest.TempPathFactory) -> str:
    data = tmp_path_factory.mktemp("tau2-data")
    shutil.copytree(os.path.join(TAU2_BENCH, "data"), data, dirs_exist_ok=True)
    guidelines = data / "tau2" / "user_simulator"
    guidelines.mkdir(parents=True, exist_ok=True)
    for name in GUIDELINES:
        if not (guidelines / name).exists():
            (guidelines / name).write_text("Stand-in guidelines for tests: play the customer of the scenario.\n")
    return str(data)
