"""Shared pytest set-up: the CPU import fix for OpenRLHF, the repository root on sys.path, and the tiny tokenizer and
model fixtures the signal and trainer tests share (tests/tiny_hf.py)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import cope_rlhf.compat  # noqa: E402,F401

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from tests.tiny_hf import tiny_tokenizer  # imported on use: the gateway and server tests need no transformers

    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    from tests.tiny_hf import tiny_model

    return tiny_model(len(tok))
