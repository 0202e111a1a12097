"""The pixel policy, its files (``file:PATH`` contract: ``cosmos3_gym.rl.policy:load_policy_file``) and behaviour
cloning."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import safetensors.torch
import torch

from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.rl.bc import BCConfig, random_shift, train_bc
from cosmos3_gym.rl.policy import (
    PixelGaussianPolicy,
    PolicyConfig,
    load_policy_file,
    read_policy_metadata,
    save_policy_file,
)

SMALL = dict(channels=(8, 8, 8, 8), hidden=32)


def test_policy_acts_on_batches_and_single_frames_in_the_action_space():
    torch.manual_seed(0)
    policy = PixelGaussianPolicy(PolicyConfig(**SMALL))
    frames = np.random.default_rng(0).integers(0, 256, (3, 96, 96, 3), dtype=np.uint8)
    batch = policy({"image": frames})
    assert batch.shape == (3, 8, 2) and batch.dtype == np.float32
    np.testing.assert_allclose(policy(frames[1]), batch[1], atol=1e-6)  # one frame -> one chunk
    # Other frame sizes are resized with the envs' resize_frame (the world model's 256 x 256 frames, for example).
    big = np.stack([np.asarray(__import__("PIL.Image", fromlist=["Image"]).fromarray(f).resize((256, 256)))
                    for f in frames])
    assert policy.act(big).shape == (3, 8, 2)
    generator = torch.Generator().manual_seed(1)
    sampled = policy.act(frames, deterministic=False, generator=generator)
    assert not np.allclose(sampled, batch) and np.abs(sampled).max() <= 1.0
    with pytest.raises(InputError, match="observation\\['image'\\]"):
        policy.act(frames.astype(np.float32))


def test_policy_file_round_trip_and_metadata(tmp_path):
    torch.manual_seed(0)
    policy = PixelGaussianPolicy(PolicyConfig(chunk=4, **SMALL))
    with torch.no_grad():
        policy.log_std.fill_(-1.0)
    path = save_policy_file(policy, tmp_path / "p.safetensors", trained_by="test", env_steps=12)
    metadata = read_policy_metadata(path)
    assert metadata["format"] == "cosmos3_gym.policy" and metadata["kind"] == "pixel_gaussian"
    assert metadata["config"]["chunk"] == 4 and metadata["env_steps"] == 12
    loaded = load_policy_file(path)
    frames = np.random.default_rng(1).integers(0, 256, (2, 96, 96, 3), dtype=np.uint8)
    np.testing.assert_array_equal(loaded(frames), policy(frames))
    assert torch.equal(loaded.log_std, policy.log_std)
    with pytest.raises(InputError, match="written by save_policy_file"):
        save_policy_file(policy, tmp_path / "q.safetensors", kind="other")


def test_policy_files_that_are_not_policies_are_refused(tmp_path):
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(CheckpointError, match="no 'kind'"):
        load_policy_file(tmp_path / "plain.safetensors")
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"),
                                metadata={"kind": json.dumps("diffusion"), "format": json.dumps("x")})
    with pytest.raises(CheckpointError, match="kind 'diffusion'"):
        load_policy_file(tmp_path / "other.safetensors")
    (tmp_path / "broken.safetensors").write_bytes(b"not a file")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_policy_file(tmp_path / "broken.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_policy_file(tmp_path / "missing.safetensors")


def test_sb3_policy_files_carry_a_kind_and_load_through_the_same_function(tmp_path, tiny_ppo_model):
    from cosmos3_gym.agents import save_sb3_policy

    path = save_sb3_policy(tiny_ppo_model, tmp_path / "ppo.safetensors")
    assert read_policy_metadata(path)["kind"] == "sb3_ppo"
    policy = load_policy_file(path)
    frames = np.random.default_rng(0).integers(0, 256, (2, 48, 48, 3), dtype=np.uint8)
    actions = policy({"image": frames})
    assert actions.shape == (2, 8, 2) and np.abs(actions).max() <= 1.0


def test_random_shift_moves_images_by_whole_pixels_within_the_bound():
    image = torch.zeros(1, 1, 12, 12)
    image[0, 0, 6, 6] = 1.0
    shifted = random_shift(image.repeat(64, 1, 1, 1), 2, torch.Generator().manual_seed(0))
    positions = {tuple(int(v) for v in torch.nonzero(s[0])[0]) for s in shifted}
    assert len(positions) > 5 and all(abs(r - 6) <= 2 and abs(c - 6) <= 2 for r, c in positions)
    assert torch.equal(shifted.sum((1, 2, 3)), torch.ones(64))


@pytest.mark.parametrize("loss, drop", [("l1", 0.25), ("mse", 0.1)])
def test_behaviour_cloning_learns_where_a_blob_is(loss, drop):
    # The target chunk points at a blob's position: BC must read positions off pixels (the PushT policy's job).
    rng = np.random.default_rng(0)
    positions = rng.uniform(-0.7, 0.7, (256, 2)).astype(np.float32)
    frames = np.full((256, 96, 96, 3), 255, np.uint8)
    for frame, (x, y) in zip(frames, positions):
        col, row = int((x + 1) / 2 * 96), int((y + 1) / 2 * 96)
        frame[max(row - 5, 0):row + 5, max(col - 5, 0):col + 5] = (65, 105, 225)
    chunks = np.repeat(positions[:, None], 8, axis=1)
    torch.manual_seed(0)
    policy = PixelGaussianPolicy(PolicyConfig(channels=(16, 16, 16, 16), hidden=64))
    losses = train_bc(policy, frames, chunks, BCConfig(steps=150, batch_size=32, learning_rate=3e-3, shift=0,
                                                       loss=loss), progress=False)
    assert len(losses) == 150 and np.mean(losses[-10:]) < drop * np.mean(losses[:5])
    error = np.abs(policy({"image": frames[:32]}) - chunks[:32]).mean()
    assert error < 0.12
    with pytest.raises(InputError, match="action_chunks"):
        train_bc(policy, frames[:4], chunks[:4, :4], BCConfig(steps=1), progress=False)


def test_behaviour_cloning_stops_within_its_time_budget():
    frames = np.zeros((16, 96, 96, 3), np.uint8)
    chunks = np.zeros((16, 8, 2), np.float32)
    policy = PixelGaussianPolicy(PolicyConfig(channels=(4, 4), hidden=8))
    started = time.perf_counter()
    losses = train_bc(policy, frames, chunks, BCConfig(steps=10**6, batch_size=4, max_seconds=1.0), progress=False)
    assert 60 <= len(losses) < 10**6 and time.perf_counter() - started < 5.0
    for bad in (dict(loss="huber"), dict(max_seconds=0.0), dict(steps=0)):
        with pytest.raises(InputError):
            BCConfig(**bad)


def test_ieee_convolutions_apply_on_cuda_only_and_restore_the_setting():
    from cosmos3_gym.rl.policy import ieee_fp32_convolutions

    conv = torch.backends.cudnn.conv
    before = conv.fp32_precision
    try:
        conv.fp32_precision = "tf32"
        with ieee_fp32_convolutions(torch.device("cpu")):
            assert conv.fp32_precision == "tf32"
        with ieee_fp32_convolutions(torch.device("cuda")):  # only flips the flag: runs on a CPU-only build too
            assert conv.fp32_precision == "ieee"
        assert conv.fp32_precision == "tf32"
        with pytest.raises(RuntimeError, match="inside"), ieee_fp32_convolutions(torch.device("cuda")):
            raise RuntimeError("inside")
        assert conv.fp32_precision == "tf32"
    finally:
        conv.fp32_precision = before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_training_forward_gives_the_cpu_log_probabilities_at_grpo_sigma():
    """GRPO divides the update's probability of a sampled chunk by the rollout's, at sigma = exp(-3.5): on a GPU the
    training forward (autograd on) must give the CPU's mean to a small fraction of sigma, or the ratios are noise."""
    torch.manual_seed(0)
    policy = PixelGaussianPolicy(PolicyConfig(initial_log_std=-3.5))
    images = torch.randint(0, 256, (256, 96, 96, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    reference = policy(policy.preprocess(images)).detach().double()
    policy.cuda().train()
    mean = policy(policy.preprocess(images))
    mean.sum().backward()  # as in the update
    sigma = float(policy.log_std.exp().mean())
    assert float((mean.detach().cpu().double() - reference).abs().max()) < 0.01 * sigma
