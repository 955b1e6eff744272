"""Shared pytest set-up: the CPU import fix for OpenRLHF, and the repository root on sys.path."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import cope_rlhf.compat  # noqa: E402,F401
