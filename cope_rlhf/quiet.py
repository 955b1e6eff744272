"""Known-benign library notices kept off the terminal of the user-facing commands; every other warning still shows.

``hide_benign_notices()`` is called first thing by the commands users run (``python -m cope_rlhf.cli.train_ppo_ray``,
which the run scripts exec, ``python -m cope_rlhf.local``, ``python -m cope_rlhf.cli.train_sft``,
``python -m cope_rlhf.preflight``, ``scripts/prepare_warm_start.py``, the benchmarks that import torch), before
they import torch. It hides exactly two messages, in the process and in the processes it starts afterwards (Ray's
workers on this host, vLLM's engine):

- pynvml's deprecation, a FutureWarning printed by every process that imports torch: "The pynvml package is
  deprecated. Please install nvidia-ml-py instead. ...". The ``pynvml`` distribution (OpenRLHF requires it;
  requirements.txt pins it) is a shim that warns on ``import pynvml`` and then loads nvidia-ml-py's module of the
  same name, which it installs; torch imports that module on every start. Nothing is wrong and there is nothing for
  the user to do. Hidden by a warnings filter on that message (in the process) and by the same filter in
  PYTHONWARNINGS (its children).
- DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.", a
  WARNING of its "DeepSpeed" logger, printed by every process that imports DeepSpeed on a host without a GPU. On
  such a host the CPU is what CoPE-RLHF means to run on (its CPU path, ``cpu_cluster``). Hidden by a filter on that
  logger, which drops that one record; once DeepSpeed has chosen the CPU by its own detection, the filter also sets
  ``DS_ACCELERATOR=cpu`` (DeepSpeed's documented override, unless the user set one) for the processes started
  afterwards on this host, which would detect the same and print the same notice: with the override they take the
  same CPU accelerator without it.

Ray's usage-stats notice comes from ``ray start`` only (``ray.init`` turns usage stats off for a release wheel and
prints nothing): ``scripts/ray_cluster_head.sh`` switches it off. Every other warning, the libraries' and CoPE's,
is left as it is.
"""

from __future__ import annotations

import logging
import os
import warnings

PYNVML_NOTICE = "The pynvml package is deprecated"  # the start of the message; matched case-insensitively
DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
DEEPSPEED_LOGGER = "DeepSpeed"  # deepspeed.utils.logging: LoggerFactory.create_logger(name="DeepSpeed")
PYTHONWARNINGS_ENTRY = f"ignore:{PYNVML_NOTICE}:FutureWarning"


class _DropDeepSpeedCPUNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != DEEPSPEED_CPU_NOTICE:
            return True
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # this process's DeepSpeed just chose the CPU by detection
        return False


def hide_benign_notices() -> None:
    """Idempotent. Imports nothing but the standard library."""
    warnings.filterwarnings("ignore", message=PYNVML_NOTICE, category=FutureWarning)
    entries = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    if PYTHONWARNINGS_ENTRY not in entries:
        os.environ["PYTHONWARNINGS"] = ",".join(entries + [PYTHONWARNINGS_ENTRY])
    # DeepSpeed's logger is the one logging.getLogger returns: a filter added before DeepSpeed configures it stays
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(f, _DropDeepSpeedCPUNotice) for f in logger.filters):
        logger.addFilter(_DropDeepSpeedCPUNotice())
