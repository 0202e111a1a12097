"""Shared fixtures: a tiny random Cosmos3 policy checkpoint built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosmos3_gym.checkpoint import build_tiny_checkpoint

# The tiny models gain nothing from intra-op threads; with cores shared between processes (parallel test workers,
# gloo ranks) extra threads only oversubscribe them: the tiny pipeline ran 3x slower with 2 threads than with 1.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a tiny random checkpoint (seed 0) in diffusers' layout. Shared by all tests: do not modify it."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"), seed=0)
