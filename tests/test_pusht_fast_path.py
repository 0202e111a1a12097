"""The PushT-v0 fast path (issue 24): the fast engine with the exact decode equals the baseline path (optimize=False)
up to float rounding, decodes only the frame it returns when nothing reads more, and the engine's decode="last" is the
full decode's last frame; the built-in model decodes with its light decoder unless told otherwise. Uses the built-in
PushT model (a few CPU seconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosmos3_gym.cuda_graphs import row_bucket as _row_bucket
from cosmos3_gym.engine import Cosmos3Request
from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.tasks.pusht import env as pusht_env


@pytest.fixture(scope="module")
def assets() -> pusht_env.PushTAssets:
    """The built-in model ships with the package: failing to load it fails these tests (issue 43: a packaging mistake
    used to read as "skipped")."""
    return pusht_env.load_pusht_assets()


def test_the_committed_model_loads_and_validates(assets):
    from cosmos3_gym.checkpoint import checkpoint_defaults, validate_checkpoint

    validate_checkpoint(assets.checkpoint)
    defaults = checkpoint_defaults(assets.checkpoint)
    assert defaults["reward_model"] == f"classifier:{assets.reward_model.resolve()}"
    assert defaults["initial_states"].path == assets.initial_states.resolve()


@pytest.fixture(scope="module")
def env_pair(assets):
    torch.set_num_threads(1)
    fast = pusht_env.make_pusht_vector_env(2, device="cpu", decoder="vae")
    baseline = pusht_env.make_pusht_vector_env(2, device="cpu", optimize=False)
    yield fast, baseline
    fast.close()
    baseline.close()


def test_builtin_env_decodes_with_its_light_decoder_unless_told_otherwise(assets, tmp_path):
    assert assets.meta["decoder"] == "light" and pusht_env.checkpoint_decoder(assets.checkpoint) == "light"
    env = pusht_env.make_pusht_env(device="cpu")
    try:
        assert env.engine.decoder == "light"
    finally:
        env.close()
    baseline = pusht_env.make_pusht_env(device="cpu", optimize=False)  # the path before issue 24: the VAE
    try:
        assert baseline.engine.decoder == "vae"
    finally:
        baseline.close()
    (tmp_path / "meta.json").write_text('{"decoder": "tiles"}')
    with pytest.raises(CheckpointError, match="decoder"):
        pusht_env.checkpoint_decoder(tmp_path)
    (tmp_path / "meta.json").write_text("{}")
    assert pusht_env.checkpoint_decoder(tmp_path) == "vae"


def test_fast_exact_env_equals_the_baseline_path(env_pair):
    fast, baseline = env_pair
    assert fast._core.owns_engine and fast.engine.vae.decode_chunk_frames == 1  # the CPU fast path was applied
    assert fast._core.decode_mode() == "last" and baseline._core.decode_mode() == "last"
    assert baseline.engine.vae.decode_chunk_frames == "auto"  # optimize=False: the engine as WorldModel-v0 loads it
    outputs = []
    for env in (fast, baseline):
        env.reset(seed=3)
        actions = np.random.default_rng(0).uniform(-1, 1, env.action_space.shape).astype(np.float32)
        outputs.append([env.step(actions) for _ in range(2)])
    bf16 = fast.engine.vae.vae.dtype == torch.bfloat16  # on CPUs with native bf16 (pusht._cpu_has_native_bf16)
    for (obs, reward, terminated, truncated, info), (obs_b, reward_b, term_b, trunc_b, info_b) in zip(*outputs):
        assert terminated.tolist() == term_b.tolist() and truncated.tolist() == trunc_b.tolist()
        difference = np.abs(obs["image"].astype(np.int16) - obs_b["image"].astype(np.int16))
        if bf16:
            # bf16 rounding in the VAE: measured 54-56 dB PSNR against fp32 after the first step (2 steps here).
            mse = np.mean(difference.astype(np.float64) ** 2)
            assert mse == 0 or 10 * np.log10(255.0**2 / mse) > 40
            np.testing.assert_allclose(reward, reward_b, atol=2e-2)
        else:
            # float32 summation order only: a pixel may round to the next uint8 value, nothing more.
            assert difference.max() <= 1 and difference.mean() < 1e-3
            np.testing.assert_allclose(reward, reward_b, atol=1e-4)
        assert info["noise_seed"].tolist() == info_b["noise_seed"].tolist()


def test_decode_mode_follows_what_reads_the_frames(env_pair):
    core = env_pair[0]._core
    assert core.decode_mode() == "last"
    settings = core.settings
    core.settings = settings.replace(return_frames=True)
    assert core.decode_mode() == "all"
    core.settings = settings
    core.keep_all_frames = True  # e.g. render_mode="rgb_array_list"
    assert core.decode_mode() == "all"
    core.keep_all_frames = False
    reduce = core.reward_model.reduce
    core.reward_model.reduce = "max"  # reads every frame
    try:
        assert core.decode_mode() == "all"
    finally:
        core.reward_model.reduce = reduce
    # the geometric reward of the GRPO runs reads the last frame too (reduce="last"), its "max" every frame
    from cosmos3_gym.tasks.pusht.reward import PushTGeometricReward

    model = core.reward_model
    try:
        core.reward_model = PushTGeometricReward()
        assert core.decode_mode() == "last"
        core.reward_model = PushTGeometricReward(reduce="max")
        assert core.decode_mode() == "all"
    finally:
        core.reward_model = model


def test_engine_last_frame_decode_is_the_full_decodes_last_frame(env_pair, assets):
    engine = env_pair[0].engine
    frame = pusht_env.read_initial_states(assets.initial_states)[0]["frames"]
    actions = np.random.default_rng(1).uniform(-1, 1, (8, 2)).astype(np.float32)
    requests = [Cosmos3Request(mode="forward_dynamics", observation=frame, task="push", action=actions,
                               domain="pusht", raw_action_dim=2, chunk=8, guidance_scale=1.0, seed=seed,
                               resolution_tier=256) for seed in (0, 1)]
    full = engine.step(requests, decode=True)
    last = engine.step(requests, decode="last")
    for a, b in zip(full, last):
        assert b.pixels.shape == (3, 1, *a.pixels.shape[-2:])
        assert (b.pixels - a.pixels[:, -1:]).abs().max() < 1e-5
        assert torch.equal(a.video_latents, b.video_latents) and np.array_equal(a.action, b.action)
    with pytest.raises(InputError, match="decode"):
        engine.step(requests[0], decode="first")


def test_row_buckets():
    assert [_row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 63, 64, 250)] == [1, 2, 4, 8, 8, 16, 16, 24, 64, 64, 256]
