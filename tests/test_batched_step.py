"""The batched env step (issue 24) gives exactly what the per-slot code gave: uint8 frames, and Gymnasium vector
infos built as arrays."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gymnasium.vector import VectorEnv

from cosmos3_gym.envs.core import _stack_rows, _to_uint8_frames
from cosmos3_gym.envs.vector_env import WorldModelVectorEnv
from cosmos3_gym.media import to_uint8


@pytest.mark.parametrize("shape", [(1, 2, 3, 8, 10), (3, 2, 3, 8, 10), (3, 1, 3, 300, 300)])  # the last: per slot
def test_uint8_frames_match_media_to_uint8(shape):
    frames = torch.rand(shape) * 1.4 - 0.2  # values outside [0, 1] too
    frames[0, 0, 0, 0, :4] = torch.tensor([0.5 / 255, 1.5 / 255, 254.5 / 255, 1.0])  # rounding boundaries
    expected = to_uint8(frames.permute(0, 1, 3, 4, 2).numpy())
    assert np.array_equal(_to_uint8_frames(frames), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("staging", [False, True])
def test_uint8_frames_from_the_gpu_match_media_to_uint8(staging):
    """On a GPU, through pinned staging memory or not: the same bytes as the host conversion, and a staged buffer
    is reused by the next call once the previous result is gone."""
    frames = torch.rand((4, 2, 3, 64, 48)) * 1.4 - 0.2
    expected = to_uint8(frames.permute(0, 1, 3, 4, 2).numpy())
    first = _to_uint8_frames(frames.cuda(), staging=staging)
    assert np.array_equal(first, expected)
    assert np.array_equal(_to_uint8_frames(frames.cuda() * 0.5, staging=staging), to_uint8(
        (frames * 0.5).permute(0, 1, 3, 4, 2).numpy()))
    assert np.array_equal(first, expected)  # a kept result is not overwritten by a later call


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


def test_stack_rows_views_consecutive_rows_and_copies_others():
    batch = torch.rand(4, 3, 2, 5, 6)
    rows = [row[:, 1:] for row in batch]  # the env's slice of each result's pixels
    stacked = _stack_rows(rows)
    assert torch.equal(stacked, torch.stack(rows)) and stacked.data_ptr() == rows[0].data_ptr()  # a view
    shuffled = [rows[2], rows[0], rows[1]]
    assert torch.equal(_stack_rows(shuffled), torch.stack(shuffled))
    separate = [torch.rand(3, 1, 5, 6) for _ in range(3)]
    assert torch.equal(_stack_rows(separate), torch.stack(separate))
    assert torch.equal(_stack_rows(rows[:1]), torch.stack(rows[:1]))
