"""The engine seam: ``WorldModelEngine`` (``engine_protocol.py``), ``load_engine`` (``launcher.py``), the deprecated
names, and the package's import graph.

The seam is documented by a second world model: ``FakeWorldModel`` below is not Cosmos3 (each new frame is the last
one brightened by the chunk's mean action) and backs ``WorldModelEnv`` through nothing but the protocol.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from cosmos3_gym import launcher
from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request, Cosmos3Result
from cosmos3_gym.engine_protocol import WorldModelEngine
from cosmos3_gym.errors import InputError
from cosmos3_gym.executors.client import Cosmos3EngineClient
from cosmos3_gym.parallel.mesh import ParallelConfig, resolve_parallel_config


class FakeWorldModel:
    """Another world model behind the same interface: frame k of a chunk is the conditioning frame plus
    ``BRIGHTEN * k * mean(actions)`` (in [0, 1] units)."""

    BRIGHTEN = 0.1
    action_dim = 8
    temporal_compression = 1
    device = torch.device("cpu")
    vae = None
    is_output_rank = True

    def __init__(self):
        self.closed = False
        self.offloaded = False
        self.requests: list[Cosmos3Request] = []

    def step(self, requests, *, decode=None):
        single = isinstance(requests, Cosmos3Request)
        results = [self._one(r) for r in ([requests] if single else requests)]
        return results[0] if single else results

    def _one(self, request: Cosmos3Request) -> Cosmos3Result:
        self.requests.append(request)
        frame = torch.as_tensor(np.asarray(request.observation), dtype=torch.float32).permute(2, 0, 1) / 255
        shift = self.BRIGHTEN * float(np.mean(request.action))
        pixels = torch.stack([frame + shift * k for k in range(request.chunk + 1)], dim=1).clamp(0, 1)
        return Cosmos3Result(request.mode, np.asarray(request.action, np.float32), torch.zeros(1), pixels,
                             request.seed)

    def optimize(self, **options):
        return self

    def offload(self):
        self.offloaded = True

    def onload(self):
        self.offloaded = False

    def close(self):
        self.closed = True


def test_a_second_world_model_backs_the_env():
    from cosmos3_gym.envs import WorldModelEnv

    fake = FakeWorldModel()
    assert isinstance(fake, WorldModelEngine)
    frame = np.random.default_rng(0).integers(40, 200, (96, 128, 3), dtype=np.uint8)
    env = WorldModelEnv(engine=fake, domain="pusht", task="push", chunk=2, num_steps=3, resolution_tier=256,
                        initial_states=[frame])
    observation, _ = env.reset(seed=0)
    action = np.full((2, 2), 0.5, dtype=np.float32)
    next_observation, *_ = env.step(action)
    expected = np.clip(observation["image"] / 255 + 2 * FakeWorldModel.BRIGHTEN * 0.5, 0, 1) * 255
    assert np.abs(next_observation["image"].astype(float) - expected).max() <= 1
    request = fake.requests[-1]
    assert (request.mode, request.num_inference_steps, request.chunk) == ("forward_dynamics", 3, 2)
    env.close()
    assert not fake.closed  # an engine given to the env is the caller's to close


def test_an_engine_without_the_interface_is_rejected():
    from cosmos3_gym.envs import WorldModelEnv

    class NotAnEngine:
        def step(self, requests):
            return requests

    with pytest.raises(InputError, match="engine: expected a WorldModelEngine"):
        WorldModelEnv(engine=NotAnEngine(), domain="pusht", chunk=2, resolution_tier=256,
                      initial_states=[np.zeros((96, 128, 3), np.uint8)])


def protocol_members() -> set[str]:
    return {name for name in vars(WorldModelEngine) if not name.startswith("_")}


def test_every_shipped_engine_implements_the_protocol(tiny_checkpoint):
    assert protocol_members() >= {"step", "close", "closed", "offload", "onload", "optimize", "action_dim",
                                  "temporal_compression", "device", "vae", "is_output_rank"}
    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)
    assert isinstance(engine, WorldModelEngine)
    from cosmos3_gym.executors import ray_replicas

    for cls in (Cosmos3EngineClient, ray_replicas.RayEngineReplicas):  # their members are all properties / methods
        assert not [name for name in protocol_members() if not hasattr(cls, name)], cls


def test_offloaded_engine_onloads_on_step(tiny_checkpoint, monkeypatch):
    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)
    frame = np.random.default_rng(1).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    request = Cosmos3Request("policy", frame, "push", domain="pusht", chunk=4, num_inference_steps=2,
                             resolution_tier=256, seed=3)
    before = engine.step(request, decode=False)
    onloads = []
    original = engine.onload
    monkeypatch.setattr(engine, "onload", lambda: onloads.append(engine._home_device) or original())
    engine.offload()
    after = engine.step(request, decode=False)
    assert onloads == [torch.device("cpu")]  # step moved the offloaded model back to its device
    assert np.array_equal(before.action, after.action)


# ---------------------------------------------------------------------- load_engine


def test_load_engine_picks_the_backend(tiny_checkpoint, monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    engine = launcher.load_engine(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)
    assert type(engine) is Cosmos3Engine
    assert launcher.engine_class("auto", ParallelConfig(tp=2)) is Cosmos3EngineClient
    assert launcher.engine_class("inprocess", ParallelConfig(tp=2)) is Cosmos3Engine

    started = []
    monkeypatch.setattr(launcher, "Cosmos3EngineClient", lambda path, config, kwargs: started.append(
        (path, config, kwargs)) or "client")
    assert launcher.load_engine(tiny_checkpoint, tp=2, cfg_parallel=2, dtype="fp32", optimize=True,
                                vae_dtype="bf16") == "client"
    path, config, kwargs = started[0]
    assert config == ParallelConfig(dp=1, cfg_parallel=2, tp=2)
    assert (kwargs["dtype"], kwargs["optimize"], kwargs["vae_dtype"]) == ("fp32", True, "bf16")
    with pytest.raises(InputError, match="num_key_value_heads"):  # checked before any worker starts
        launcher.load_engine(tiny_checkpoint, tp=4)
    with pytest.raises(InputError, match="backend"):
        launcher.load_engine(tiny_checkpoint, backend="threads")
    with pytest.raises(InputError, match="num_replicas"):
        launcher.load_engine(tiny_checkpoint, num_replicas=2)
    assert len(started) == 1


def test_load_engine_passes_precision_to_every_rank(tiny_checkpoint, stub_engine_client):
    started = stub_engine_client
    assert launcher.load_engine(tiny_checkpoint, dp=2, precision="fp8") == "client"
    assert started[0][2]["precision"] == "fp8"  # the workers' from_pretrained gets it
    with pytest.raises(InputError, match="precision"):  # checked before any worker starts
        launcher.load_engine(tiny_checkpoint, dp=2, precision="int4")
    # fp8 with tensor parallelism reaches the workers too (each quantizes its shards).
    assert launcher.load_engine(tiny_checkpoint, tp=2, precision="fp8") == "client"
    assert started[1][1].tp == 2 and started[1][2]["precision"] == "fp8"
    assert len(started) == 2


def test_env_load_options_reach_load_engine(tiny_checkpoint, monkeypatch):
    """gym.make's engine options (ENGINE_LOAD_KEYS) go to load_engine unchanged; with engine= they are refused."""
    import gymnasium as gym

    from cosmos3_gym.envs import core

    calls = []

    def fake_load_engine(checkpoint, **options):
        calls.append((checkpoint, options))
        return FakeWorldModel()

    monkeypatch.setattr(core, "load_engine", fake_load_engine)
    options = dict(optimize=True, vae_dtype="bf16", backend="mp", cfg_parallel=2, tp=1, dp=1, precision="fp8",
                   device="cpu", dtype="fp32")
    env = gym.make("cosmos3_gym/WorldModel-v0", checkpoint=tiny_checkpoint, domain="pusht", chunk=2,
                   resolution_tier=256, initial_states=[np.zeros((96, 128, 3), np.uint8)], reward_model=None,
                   **options)
    env.reset(seed=0)
    env.step(np.zeros((2, 2), np.float32))
    (checkpoint, received), = calls
    assert received == {**options, "progress": False}
    env.close()
    with pytest.raises(InputError, match="precision"):
        gym.make("cosmos3_gym/WorldModel-v0", engine=FakeWorldModel(), domain="pusht", chunk=2, resolution_tier=256,
                 initial_states=[np.zeros((96, 128, 3), np.uint8)], precision="fp8")


def test_from_pretrained_with_ranks_is_deprecated_and_delegates(tiny_checkpoint, stub_engine_client):
    with pytest.warns(DeprecationWarning, match="load_engine"):
        assert Cosmos3Engine.from_pretrained(tiny_checkpoint, tp=2, dtype="fp32") == "client"
    with pytest.warns(DeprecationWarning, match="load_engine"):
        Cosmos3Engine.from_pretrained(tiny_checkpoint, cfg_parallel=2)
    assert [config for _, config, _ in stub_engine_client] == [ParallelConfig(tp=2), ParallelConfig(cfg_parallel=2)]


# ---------------------------------------------------------------------- deprecated names


def test_num_steps_is_a_deprecated_alias_of_num_inference_steps():
    with pytest.warns(DeprecationWarning, match="num_inference_steps"):
        request = Cosmos3Request("policy", None, num_steps=7)
    assert request.num_inference_steps == 7
    with pytest.warns(DeprecationWarning):
        assert request.num_steps == 7
    with pytest.raises(InputError, match="num_steps: contradicts num_inference_steps=3"):
        with pytest.warns(DeprecationWarning):
            Cosmos3Request("policy", None, num_steps=7, num_inference_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name, and copies of a request, warn about nothing
        copy = dataclasses.replace(Cosmos3Request("policy", None, num_inference_steps=5), seed=1)
    assert copy.num_inference_steps == 5


def test_actions_is_a_deprecated_alias_of_action():
    """``action`` in (as ``Cosmos3Result.action`` out, diffusers' and Gymnasium's name); ``actions`` still works."""
    chunk = np.zeros((4, 2), np.float32)
    with pytest.warns(DeprecationWarning, match="use action="):
        request = Cosmos3Request("forward_dynamics", None, actions=chunk)
    assert request.action is chunk
    with pytest.warns(DeprecationWarning):
        assert request.actions is chunk
    with pytest.raises(InputError, match="actions: contradicts action="):
        with pytest.warns(DeprecationWarning):
            Cosmos3Request("forward_dynamics", None, actions=chunk, action=chunk + 1)


def test_cfg_is_a_deprecated_alias_of_cfg_parallel():
    with pytest.warns(DeprecationWarning, match="cfg_parallel"):
        config = ParallelConfig(cfg=2)
    assert config == ParallelConfig(cfg_parallel=2) and config.cfg == 2 and config.world_size == 2
    # The keyword shorthand (gym.make, load_engine, from_pretrained, the Ray replicas all resolve it here).
    with pytest.warns(DeprecationWarning, match="cfg_parallel"):
        assert resolve_parallel_config(tp=2, cfg=2) == ParallelConfig(cfg_parallel=2, tp=2)
    with pytest.raises(InputError, match="cfg_parallel"):
        ParallelConfig(cfg_parallel=3)


def test_cli_accepts_cfg_parallel_and_the_old_flag():
    from cosmos3_gym.cli import build_parser

    base = ["infer", "--checkpoint", "c", "--image", "i.png", "--out", "o"]
    for flag in ("--cfg-parallel", "--cfg"):
        assert build_parser().parse_args([*base, flag, "2"]).cfg_parallel == 2
