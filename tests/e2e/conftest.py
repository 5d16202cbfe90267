"""Session-wide tiny checkpoints and servers for the end-to-end tests."""

from __future__ import annotations

import os

import pytest

from tests.helpers.checkpoints import build_assistant, build_gemma4, build_llama, build_qwen3


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session")
def ckpts(ckpt_root):
    g = build_gemma4(os.path.join(ckpt_root, "gemma4"))
    return {
        "llama": build_llama(os.path.join(ckpt_root, "llama")),
        "qwen3": build_qwen3(os.path.join(ckpt_root, "qwen3")),
        "gemma4": g,
        "assistant": build_assistant(os.path.join(ckpt_root, "assistant"), g),
    }
