"""``python -m cope_rlhf.cli.train_sft``: OpenRLHF's ``train_sft`` (its flags, unchanged), runnable on a host without
CUDA.

On a CUDA host this is OpenRLHF's CLI as it is (launch it with ``deepspeed`` / ``torchrun`` as usual). Without CUDA:
``patch.install`` puts in the same CPU pieces as for ``train_ppo_ray`` (``cpu_cluster``: DeepSpeed's device mesh on
``"cpu"``, torch's AdamW instead of FusedAdam, ``torch.cuda`` device calls answered for the CPU; DeepSpeed picks gloo
by itself), a run without a launcher gets a one-process group (``RANK`` 0 of ``WORLD_SIZE`` 1 on 127.0.0.1, on
any free port, unless the environment says otherwise), and a flag that cannot run on CPU exits 2 naming what to
change (``cpu_preset_error``):

    --ds.attn_implementation sdpa --ds.param_dtype fp32   (no --ds.packing_samples, no --ds.adam_offload)

(``--ds.param_dtype fp32`` is accepted on a host without CUDA, as for ``train_ppo_ray``; bf16 works too, fast only on
a CPU with AVX512-BF16 / AMX.) E.g. a warm start on agent demos (``scripts/make_demos.py``: ``{"messages": [...]}``,
loss on every assistant turn):

    python -m cope_rlhf.cli.train_sft --model.model_name_or_path models/tiny --data.dataset demos.jsonl \\
        --data.input_key messages --data.apply_chat_template --data.multiturn --ds.attn_implementation sdpa \\
        --ds.param_dtype fp32 --train.micro_batch_size 8 --train.batch_size 8 --ckpt.output_dir models/tiny-sft

The quickstart's warm start uses ``python -m cope_rlhf.local sft`` (fp32 torch in one process, no DeepSpeed), which
is faster for its tiny model on a CPU.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import List, Optional

if __name__ == "__main__":  # run as a command: known-benign library notices off before torch prints one (quiet.py)
    from cope_rlhf.quiet import hide_benign_notices

    hide_benign_notices()

import torch  # noqa: E402

OPENRLHF_CLI = "openrlhf.cli.train_sft"
# MASTER_PORT 0: the lone rank's rendezvous store listens on a port the OS picks, since no other rank needs to find
# it; a fixed port failed the run whenever another program (a second SFT run, say) held it.
ONE_PROCESS_GROUP = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not torch.cuda.is_available():
        from cope_rlhf import patch
        from cope_rlhf.cli.args import accept_fp32_on_cpu, cpu_preset_error, run_openrlhf_cli

        patch.install()
        for key, value in ONE_PROCESS_GROUP.items():
            os.environ.setdefault(key, value)
        original = argparse.ArgumentParser.parse_args

        def parse_checked(self, args=None, namespace=None):
            accept_fp32_on_cpu(self)
            parsed = original(self, argv if args is None else args, namespace)
            problem = cpu_preset_error(parsed)
            if problem:
                self.error(problem)
            return parsed

        run_openrlhf_cli(OPENRLHF_CLI, parse_checked)
        return
    sys.argv = [OPENRLHF_CLI, *argv]
    runpy.run_module(OPENRLHF_CLI, run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
