"""CoPE-RLHF: auxiliary training signals for agentic GRPO on OpenRLHF's Ray PPO trainer.

Importing the package installs the CPU import fix for OpenRLHF (``cope_rlhf.compat``); it does nothing on a
CUDA host.
"""

from cope_rlhf import compat  # noqa: F401  (side effect: flash_attn import fix on CPU-only hosts)
