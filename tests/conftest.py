"""Shared fixtures: a tiny random Cosmos3 policy checkpoint built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosmos3_gym.testing import build_tiny_checkpoint

# The tiny models gain nothing from intra-op threads; with cores shared between processes (parallel test workers,
# gloo ranks) extra threads only oversubscribe them: the tiny pipeline ran 3x slower with 2 threads than with 1.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a tiny random checkpoint (seed 0) in diffusers' layout. Shared by all tests: do not modify it."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"), seed=0)


@pytest.fixture
def tiny_ppo_model():
    """An untrained SB3 ``PPO("MultiInputPolicy")`` on the PushT envs' spaces (a 48 x 48 image, [8, 2] action chunks)
    at small widths, its weights moved off SB3's initialisation so that a policy rebuilt and left unloaded differs."""
    import gymnasium
    import numpy as np
    from stable_baselines3 import PPO

    class PushTSpaces(gymnasium.Env):
        observation_space = gymnasium.spaces.Dict({"image": gymnasium.spaces.Box(0, 255, (48, 48, 3), np.uint8)})
        action_space = gymnasium.spaces.Box(-1.0, 1.0, (8, 2), np.float32)

    model = PPO(
        "MultiInputPolicy",
        PushTSpaces(),
        n_steps=8,
        batch_size=8,
        seed=0,
        device="cpu",
        policy_kwargs=dict(net_arch=[16], features_extractor_kwargs=dict(cnn_output_dim=16)),
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.policy.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model


@pytest.fixture
def stub_engine_client(monkeypatch) -> list:
    """``launcher.load_engine`` without worker processes: single-process env vars cleared, and the worker client
    replaced by a stub that records its ``(path, config, kwargs)`` in the returned list and returns ``"client"``."""
    from cosmos3_gym import launcher

    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    started: list = []
    monkeypatch.setattr(
        launcher, "Cosmos3EngineClient", lambda path, config, kwargs: started.append((path, config, kwargs)) or "client"
    )
    return started


@pytest.fixture(scope="module")
def tiny_engine(tiny_checkpoint: Path):
    """An fp32 CPU engine on the tiny checkpoint, one per test module."""
    from cosmos3_gym.engine import Cosmos3Engine

    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)
