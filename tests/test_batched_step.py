"""The batched env step (issue 24) gives exactly what the per-slot code gave: canvas pixels of a batch of requests,
uint8 frames, and Gymnasium vector infos built as arrays."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gymnasium.vector import VectorEnv

from cosmos3_gym import processor
from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.envs.core import _to_uint8_frames
from cosmos3_gym.envs.vector_env import WorldModelVectorEnv
from cosmos3_gym.media import to_uint8


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


@pytest.mark.parametrize("size, calls", [((200, 280), 6), ((256, 256), 1)])  # snapped, resized, padded / as is
def test_batched_conditioning_equals_one_call_per_request(engine, size, calls, monkeypatch):
    rng = np.random.default_rng(0)
    requests = [
        Cosmos3Request("forward_dynamics", rng.integers(0, 256, (*size, 3), dtype=np.uint8), task="push",
                       action=np.zeros((4, 2), np.float32), chunk=4, resolution_tier=256, seed=i)
        for i in range(5)
    ]
    requests.append(Cosmos3Request("policy", requests[0].observation, chunk=4, resolution_tier=256, seed=9))
    validated = [engine._validated(r) for r in requests]
    solo = [engine._conditioning(r, shape) for r, shape in validated]

    made = []
    original = processor.prepare_conditioning
    monkeypatch.setattr(processor, "prepare_conditioning", lambda *a, **k: made.append(1) or original(*a, **k))
    batched = engine._batched_conditionings(validated)
    # a frame that fits the canvas as it is: one call, the other five frames scaled together; else one call each
    assert len(made) == calls
    for one, many in zip(solo, batched):
        assert torch.equal(one.pixels, many.pixels)
        assert (one.canvas_hw, one.content_hw, one.latent_hw) == (many.canvas_hw, many.content_hw, many.latent_hw)


def test_uint8_frames_match_media_to_uint8():
    frames = torch.rand(3, 2, 3, 8, 10) * 1.4 - 0.2  # values outside [0, 1] too
    frames[0, 0, 0, 0, :4] = torch.tensor([0.5 / 255, 1.5 / 255, 254.5 / 255, 1.0])  # rounding boundaries
    expected = to_uint8(frames.permute(0, 1, 3, 4, 2).numpy())
    assert np.array_equal(_to_uint8_frames(frames), expected)


def test_batch_infos_equal_gymnasium_add_info_per_slot():
    num_envs = 5
    env = SimpleNamespace(num_envs=num_envs)
    batch = {
        "task": np.array(["a", "b", "c"], dtype=object),
        "elapsed_steps": np.array([1, 2, 3], dtype=np.int64),
        "score": np.array([0.25, 0.5, 1.0]),
        "is_success": np.array([False, True, True]),
        "raw_action": np.arange(12, dtype=np.float32).reshape(3, 2, 2),
    }
    slots, rows = np.array([0, 3, 4]), np.array([True, True, True])
    start = {"task": np.full(num_envs, None, dtype=object), "_task": np.zeros(num_envs, dtype=np.bool_)}
    start["task"][1], start["_task"][1] = "reset", True

    ours = WorldModelVectorEnv._add_batch_info(env, {k: v.copy() for k, v in start.items()}, batch, slots, rows)
    theirs = {k: v.copy() for k, v in start.items()}
    for row, slot in enumerate(slots):
        info = {key: values[row].item() if values.ndim == 1 and values.dtype != object else values[row]
                for key, values in batch.items()}
        theirs = VectorEnv._add_info(env, theirs, info, int(slot))
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype, key
        assert np.array_equal(ours[key], theirs[key]), key
