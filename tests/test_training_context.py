"""Training with K latent context frames and the latent hand-over (``handover="latent"``), on CPU.

Windows are cut from whole-episode encodings (``training.data``): their layout is checked against a direct
computation from one causal encode of the episode; the first K latent frames are clean in every mode and carry no
loss; the settings are validated, fixed on resume and exported in meta.json. The tiny random checkpoint's VAE
stands in for a trained one (the layout does not depend on its weights).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_training import FPS, TASK, TIER, make_dataset, read_log, world_model_config

from cosmos3_gym import processor
from cosmos3_gym.checkpoint import safetensors_files
from cosmos3_gym.engine import MODES
from cosmos3_gym.errors import InputError
from cosmos3_gym.models.transformer import Cosmos3Transformer, Cosmos3TransformerConfig
from cosmos3_gym.models.vae import Cosmos3VAE
from cosmos3_gym.testing import TINY_TRANSFORMER_CONFIG
from cosmos3_gym.tokenizer import build_tiny_tokenizer
from cosmos3_gym.training import build_decoder_windows, train_world_model
from cosmos3_gym.training.data import (
    TrainingWindows,
    _sha256_of_files,
    build_training_windows,
    latent_cache_key,
    read_dataset,
)
from cosmos3_gym.training.flow_matching import FlowMatchingBatch, FlowMatchingObjective, mode_masks
from cosmos3_gym.training.world_model import sample_batch

POLICY, FORWARD, INVERSE = (MODES.index(m) for m in ("policy", "forward_dynamics", "inverse_dynamics"))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("context")


@pytest.fixture(scope="module")
def dataset(work) -> Path:
    """18 actions per episode: 19 frames, of which the whole-episode encode keeps 1 + 4*4 = 17 (5 latents)."""
    return make_dataset(work / "dataset", num_episodes=2, steps=18, size=32)


@pytest.fixture(scope="module")
def vae_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint / "vae"


@pytest.fixture(scope="module")
def vae(vae_dir) -> Cosmos3VAE:
    return Cosmos3VAE.from_pretrained(vae_dir)


def windows_of(dataset, vae, vae_dir, cache_dir, **kwargs):
    defaults = dict(chunk=8, stride=4, resolution_tier=TIER, view_point="ego_view", fps=FPS, cache_dir=cache_dir,
                    progress=False)
    return build_training_windows(read_dataset(dataset), vae, vae_dir, build_tiny_tokenizer(), **{**defaults, **kwargs})


def whole_episode_latents(vae, frames: np.ndarray) -> torch.Tensor:
    """E [C, L+1, h, w]: one causal encode of the frames 0 .. 4*floor(T/4)."""
    kept = 1 + 4 * ((len(frames) - 1) // 4)
    cond = processor.prepare_conditioning(frames[:kept], TIER, kept)
    h, w = cond.latent_hw
    return vae.encode(cond.pixels)[0, :, :, :h, :w]


# ----------------------------------------------------------------------------------------------------------------
# Windows
# ----------------------------------------------------------------------------------------------------------------


def test_latent_windows_are_cut_from_the_whole_episode_encoding(dataset, vae, vae_dir, work):
    k, chunk = 3, 8
    windows = windows_of(dataset, vae, vae_dir, work / "cache", handover="latent", context_frames=k, chunk=chunk)
    info = read_dataset(dataset)
    # starts 0, 4, 8 (8 + 8 <= 18 actions) in each of the 2 episodes; K context + chunk / 4 target latent frames
    assert windows.start.tolist() == [0, 4, 8] * 2 and windows.episode_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert windows.latent_thw == (k + chunk // 4, 2, 2)
    tokenizer = build_tiny_tokenizer()
    expected_prompt = processor.build_prompt_token_ids(
        tokenizer, TASK, negative_prompt=None, view_point="ego_view", num_frames=chunk + 1, fps=FPS, height=256,
        width=256,
    )
    for i in range(len(windows)):
        episode = np.load(info.episode_paths[int(windows.episode_index[i])])
        latents = whole_episode_latents(vae, episode["frames"])
        assert latents.shape[1] == 5  # E[0..4]: the 19th frame is cut
        s = int(windows.start[i])
        j = s // 4
        context = [latents[:, max(0, j - k + 1 + n)] for n in range(k)]  # left-padded with E[0]
        targets = [latents[:, j + 1 + n] for n in range(chunk // 4)]
        torch.testing.assert_close(windows.latents[i], torch.stack(context + targets, dim=1), atol=1e-6, rtol=0)
        # action n moves frame s + n to s + n + 1: the targets E[j+1 .. j+2] are frames s+1 .. s+8
        np.testing.assert_allclose(windows.actions[i].numpy(), info.stats.normalize(episode["actions"][s : s + chunk]),
                                   atol=1e-6)
        assert windows.prompts[int(windows.prompt_index[i])] == expected_prompt  # the clip is still chunk + 1 frames
    # An episode's first window starts as the env does: its start frame encoded and repeated K times.
    first_frame = np.load(info.episode_paths[0])["frames"][:1]
    start = vae.encode(processor.prepare_conditioning(first_frame, TIER, 1).pixels)[0, :, 0, :2, :2]
    for n in range(k):
        torch.testing.assert_close(windows.latents[0, :, n], start, atol=1e-5, rtol=1e-5)
    assert not torch.equal(windows.latents[1, :, 0], windows.latents[1, :, k - 1])  # j = 1: E[0], E[0], E[1]


def test_the_first_whole_episode_latent_is_the_first_frame_encoded_alone(dataset, vae):
    frames = np.load(read_dataset(dataset).episode_paths[1])["frames"]
    alone = vae.encode(processor.prepare_conditioning(frames[:1], TIER, 1).pixels)[0, :, 0, :2, :2]
    torch.testing.assert_close(whole_episode_latents(vae, frames)[:, 0], alone, atol=1e-5, rtol=1e-5)


def test_the_cache_keeps_the_layouts_apart_and_pixel_caches_keep_their_key(dataset, vae, vae_dir, work):
    cache = work / "shared_cache"
    latent = windows_of(dataset, vae, vae_dir, cache, handover="latent", context_frames=1)
    pixels = windows_of(dataset, vae, vae_dir, cache)
    assert latent.latents.shape == pixels.latents.shape  # K = 1: 1 + chunk / 4 frames either way
    assert len(list(cache.iterdir())) == 2  # two cache folders
    # frame 0 is the same first-frame latent at an episode's start; later ones differ (4 frames vs 1 encoded)
    torch.testing.assert_close(latent.latents[0, :, 0], pixels.latents[0, :, 0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(latent.latents[1, :, 0], pixels.latents[1, :, 0], atol=1e-3)
    # read back from the cache: the same windows; another K reuses the whole-episode latents
    again = windows_of(dataset, vae, vae_dir, cache, handover="latent", context_frames=1)
    assert torch.equal(again.latents, latent.latents)
    two = windows_of(dataset, vae, vae_dir, cache, handover="latent", context_frames=2)
    assert torch.equal(two.latents[:, :, 1:], latent.latents) and len(list(cache.iterdir())) == 2
    # the pixel layout's key is the one caches were written under before hand-overs existed
    info = read_dataset(dataset)
    old = {"vae_config": json.loads((vae_dir / "config.json").read_text()),
           "vae_weights": _sha256_of_files(safetensors_files(vae_dir)), "chunk": 8, "stride": 4,
           "resolution_tier": TIER, "episodes": info.episodes.fingerprint()}
    old_key = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert latent_cache_key(info, vae_dir, chunk=8, stride=4, resolution_tier=TIER) == old_key
    assert (cache / old_key).is_dir()


def test_window_errors_name_the_field(dataset, vae, vae_dir, work):
    for kwargs, field in ((dict(handover="latent", chunk=6), "chunk"),
                          (dict(handover="latent", stride=2), "window_stride"),
                          (dict(handover="latents"), "handover"), (dict(context_frames=2), "context_frames"),
                          (dict(handover="latent", context_frames=0), "context_frames")):
        with pytest.raises(InputError, match=f"^{field}:"):
            windows_of(dataset, vae, vae_dir, work / "cache", **kwargs)


def test_light_decoder_windows_from_whole_episode_encodings(dataset, vae):
    windows = build_decoder_windows(dataset, vae, chunk=8, stride=4, handover="latent", progress=False)
    frames = np.load(read_dataset(dataset).episode_paths[0])["frames"]
    latents = whole_episode_latents(vae, frames)
    assert len(windows) == 6 and windows.latents.shape == (6, 16, 3, 2, 2) and windows.frames.shape == (6, 3, 9, 32, 32)
    for i, s in enumerate((0, 4, 8)):  # latents E[j .. j+2] for the frames s .. s+8, s = 4j
        torch.testing.assert_close(windows.latents[i], latents[:, s // 4 : s // 4 + 3], atol=1e-6, rtol=0)
        assert np.array_equal(windows.frames[i].permute(1, 2, 3, 0).numpy(), frames[s : s + 9])
    with pytest.raises(InputError, match="stride"):
        build_decoder_windows(dataset, vae, chunk=8, stride=2, handover="latent", progress=False)


# ----------------------------------------------------------------------------------------------------------------
# Masks, loss, conditioning noise
# ----------------------------------------------------------------------------------------------------------------


def test_the_first_k_frames_are_clean_in_every_mode():
    video_noisy, action_noisy = mode_masks(torch.tensor([POLICY, FORWARD, INVERSE]), 5, 8, context_frames=2)
    assert video_noisy.tolist() == [[False, False, True, True, True]] * 2 + [[False] * 5]
    assert action_noisy.tolist() == [[True] * 8, [False] * 8, [True] * 8]
    assert torch.equal(mode_masks(torch.tensor([POLICY]), 3, 4)[0], torch.tensor([[False, True, True]]))


def _batch(video_noise: torch.Tensor) -> FlowMatchingBatch:
    generator = torch.Generator().manual_seed(0)
    b = video_noise.shape[0]
    return FlowMatchingBatch(
        prompt_ids=[list(range(1, 8))] * b, fps=[FPS] * b, video=torch.randn(video_noise.shape, generator=generator),
        actions=torch.zeros(b, 4, 64), raw_action_dims=torch.full((b,), 2), domain_ids=torch.full((b,), 4),
        modes=torch.tensor([POLICY, FORWARD, INVERSE][:b]), sigmas=torch.tensor([0.7, 0.5, 0.3][:b]),
        video_noise=video_noise, action_noise=torch.randn(b, 4, 64, generator=generator),
    )


def test_context_frames_carry_no_loss():
    """Noise drawn for the K context frames changes nothing (they go in clean and are not scored); noise on the
    first target frame changes the loss (also with K = 1, where it is frame 1)."""
    cfg = Cosmos3TransformerConfig.from_dict({**TINY_TRANSFORMER_CONFIG, "vocab_size": 64})
    torch.manual_seed(0)
    transformer = Cosmos3Transformer(cfg)
    noise = torch.randn(3, 16, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    changed = noise.clone()
    changed[:, :, :2] = torch.randn(3, 16, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    target_changed = noise.clone()
    target_changed[:, :, 2] += 1.0
    with torch.no_grad():
        two = FlowMatchingObjective(transformer, context_frames=2)
        base = two(_batch(noise))
        same = two(_batch(changed))
        assert torch.equal(same["loss"], base["loss"])
        assert torch.equal(same["video_mse"].nan_to_num(), base["video_mse"].nan_to_num())
        assert not torch.equal(two(_batch(target_changed))["loss"], base["loss"])
        one = FlowMatchingObjective(transformer, context_frames=1)
        assert not torch.equal(one(_batch(changed))["loss"], one(_batch(noise))["loss"])
        assert two(_batch(noise))["video_mse"][2].isnan()  # inverse dynamics: no noisy video at all


def test_conditioning_noise_perturbs_every_context_frame(work):
    n = 2
    windows = TrainingWindows(
        latents=torch.randn(n, 16, 4, 2, 2, generator=torch.Generator().manual_seed(0)), actions=torch.zeros(n, 4, 2),
        prompt_index=torch.zeros(n, dtype=torch.long), prompts=[([1, 2], [3])], episode_index=torch.arange(n),
        start=torch.zeros(n, dtype=torch.long), successful=torch.ones(n, dtype=torch.bool), canvas_hw=(32, 32),
    )
    kwargs = dict(domain_id=4, raw_action_dim=2, action_dim=32, fps=FPS)
    settings = dict(batch_size=8, handover="latent", context_frames=2)
    plain = sample_batch(windows, torch.Generator().manual_seed(1), world_model_config(work, **settings), **kwargs)
    noisy = sample_batch(windows, torch.Generator().manual_seed(1),
                         world_model_config(work, **settings, cond_noise_std=0.5), **kwargs)
    assert torch.equal(noisy.video[:, :, 2:], plain.video[:, :, 2:])
    assert torch.equal(noisy.video_noise, plain.video_noise) and torch.equal(noisy.modes, plain.modes)
    change = noisy.video[:, :, :2] - plain.video[:, :, :2]  # [B, C, 2, h, w]
    spread = change.transpose(1, 2).flatten(2).std(2)  # [B, 2]: per sample and context frame
    assert (spread > 0).all() and (spread < 0.5).all()
    # one std per sample for all its context frames (a sample with std near 0 has both frames near unchanged)
    assert torch.corrcoef(spread.T)[0, 1] > 0.9


# ----------------------------------------------------------------------------------------------------------------
# Settings, resume, export
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, field", [
    (dict(context_frames=2), "context_frames"),
    (dict(context_frames=0, handover="latent"), "context_frames"),
    (dict(handover="latents"), "handover"),
    (dict(handover="latent", chunk=6), "chunk"),
    (dict(handover="latent", window_stride=2), "window_stride"),
    (dict(handover="latent", rollout_prob=0.5), "rollout_prob"),
])
def test_bad_settings_name_the_field(work, overrides, field):
    with pytest.raises(InputError, match=f"WorldModelTrainConfig.{field}:"):
        world_model_config(work, **overrides).validate()


def test_latent_handover_run_resumes_exactly_and_exports_its_settings(work, dataset, vae_dir):
    settings = dict(steps=6, warmup_steps=4, ema_decay=0.5, handover="latent", context_frames=2, cond_noise_std=0.3,
                    cache_dir=str(work / "train_cache"))
    straight = work / "straight"
    train_world_model(dataset, straight, world_model_config(work, **settings), vae_dir)
    resumed = work / "resumed"
    train_world_model(dataset, resumed, world_model_config(work, **{**settings, "steps": 3}), vae_dir)
    train_world_model(dataset, resumed, world_model_config(work, **settings, resume=True), vae_dir)
    for name in ("model", "ema", "optimizer"):
        a = load_file(straight / "training" / "state" / "step-000000006" / f"{name}.safetensors")
        b = load_file(resumed / "training" / "state" / "step-000000006" / f"{name}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    losses = [r["loss"] for r in read_log(straight / "training" / "log.jsonl")]
    assert losses == [r["loss"] for r in read_log(resumed / "training" / "log.jsonl")] and np.isfinite(losses).all()
    for changed, field in ((dict(context_frames=3), "context_frames"), (dict(handover="pixels", context_frames=1),
                                                                         "handover")):
        with pytest.raises(InputError, match=f"WorldModelTrainConfig.{field}: .* cannot change on resume"):
            train_world_model(dataset, resumed, world_model_config(work, **{**settings, **changed}, resume=True),
                              vae_dir)

    meta = json.loads((straight / "meta.json").read_text())
    assert meta["handover"] == "latent" and meta["context_frames"] == 2
    assert meta["latent_thw"] == [2 + 4 // 4, 2, 2] and meta["chunk"] == 4
    pixels = train_world_model(dataset, work / "pixels", world_model_config(work, steps=1), vae_dir)
    assert not {"handover", "context_frames"} & set(json.loads((pixels / "meta.json").read_text()))
