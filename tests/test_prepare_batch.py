"""``Cosmos3Engine._prepare_batch`` (a vector env's whole batch at once) gives exactly what ``prepare`` gives one
request at a time: every field of every prepared request, the canvas pixels and the encoded latents."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cosmos3_gym import processor
from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.errors import InputError


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


def uint8_frames(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def actions(seed: int, rows: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (rows, 2)).astype(np.float32)


def varied_requests() -> tuple[list[Cosmos3Request], int]:
    """Requests of every kind a batch may mix, and how many of them take the uint8 batch path."""
    common = dict(domain="pusht", chunk=4, num_inference_steps=2, resolution_tier=256)
    fast = [  # uint8 numpy frames on a multiple of 16 that are not downscaled
        *(Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(s, (256, 256, 3)), task="push the T",
                         action=actions(s), seed=s, **common) for s in range(4)),
        Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(4, (256, 256, 3)), task="another prompt",
                       action=actions(4, rows=2), seed=4, guidance_scale=1.0, **common),
        Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(5, (96, 160, 3)), task="padded canvas",
                       action=actions(5), seed=5, fps=10.0, **common),  # padded (reflect) onto 192x320
        Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(6, (256, 256, 3)), task="push the T",
                       action=actions(6), seed=6, action_history=actions(7, rows=3), action_history_length=2,
                       flip_gripper=True, **common),
        *(Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(s, (256, 256, 3)), task="push the T",
                         action=actions(s, rows=2 + s % 5), seed=s, action_history=actions(s + 1, rows=2 + s % 2),
                         action_history_length=2, flip_gripper=True, **common) for s in (17, 18)),
        Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(19, (256, 256, 3)), task="push the T",
                       action=actions(19, rows=6), seed=19, **common),  # a longer chunk, cut to 4 rows
        Cosmos3Request(mode="policy", observation=uint8_frames(8, (256, 256, 3)), seed=8,
                       **{**common, "num_inference_steps": 3}),
        Cosmos3Request(mode="inverse_dynamics", observation=uint8_frames(9, (3, 256, 256, 3)), seed=9,
                       **common),  # a clip, repeated to the encoded frames
        Cosmos3Request(mode="policy", observation=uint8_frames(10, (9, 256, 256, 3)), seed=10,
                       cond_frame_indexes=[0, 1], **common),  # a clip, cut to the encoded frames
        Cosmos3Request(mode="policy", observation=uint8_frames(11, (208, 272, 3)), seed=11, canvas="native",
                       **common),
    ]
    slow = [  # everything else goes through prepare_conditioning as before
        Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(12, (200, 280, 3)), task="push the T",
                       action=actions(12), seed=12, **common),  # snapped to 16 through PIL
        Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(13, (512, 512, 3)), task="push the T",
                       action=actions(13), seed=13, **common),  # downscaled
        Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(14, (256, 256, 3)) / np.float32(255),
                       task="push the T", action=actions(14), seed=14, **common),  # float frames
        Cosmos3Request(mode="forward_dynamics", observation=torch.from_numpy(uint8_frames(15, (3, 256, 256))),
                       task="push the T", action=actions(15), seed=15, **common),  # a CHW tensor
        Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(16, (256, 256, 4)), task="push the T",
                       action=actions(16), seed=16, **common),  # RGBA
    ]
    requests = fast + slow
    order = np.random.default_rng(0).permutation(len(requests))  # fast and slow interleaved
    return [requests[i] for i in order], len(fast)


def assert_same(old, new, where: str) -> None:
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        assert isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor), where
        assert old.dtype == new.dtype and old.device == new.device, where
        assert torch.equal(old, new), where
    elif isinstance(old, np.ndarray):
        assert isinstance(new, np.ndarray) and old.dtype == new.dtype and np.array_equal(old, new), where
    elif dataclasses.is_dataclass(old):
        assert type(old) is type(new), where
        for f in dataclasses.fields(old):
            assert_same(getattr(old, f.name), getattr(new, f.name), f"{where}.{f.name}")
    else:
        assert type(old) is type(new) and old == new, where


def test_prepare_batch_equals_prepare_one_by_one(engine, monkeypatch):
    requests, num_fast = varied_requests()

    one_by_one = [engine.prepare(r, encode=False) for r in requests]
    old_pixels = [p.pixels for p in one_by_one]
    engine._encode_conditions(one_by_one)

    batched_observations, new_pixels = [], []
    prepare_uint8 = processor.prepare_uint8_conditioning

    def counting(observations, *args, **kwargs):
        batched_observations.extend(observations)
        return prepare_uint8(observations, *args, **kwargs)

    def encode(prepared):
        new_pixels.extend(p.pixels for p in prepared)
        Cosmos3Engine._encode_conditions(engine, prepared)

    monkeypatch.setattr(processor, "prepare_uint8_conditioning", counting)
    monkeypatch.setattr(engine, "_encode_conditions", encode)
    batched = engine._prepare_batch(requests)

    assert len(batched_observations) == num_fast  # the fast path ran, for exactly the requests it takes
    # requests that share their settings with an earlier one were prepared from it (_prepare_like), not on their own
    assert engine_prepare_calls(engine, requests) < len(requests) - 4
    assert len(batched) == len(requests)
    for index, (old, new) in enumerate(zip(one_by_one, batched)):
        assert_same(old_pixels[index], new_pixels[index], f"request {index}: pixels")
        assert new.pixels is None and new.x0_video is not None
        assert_same(old, new, f"request {index}")


def test_uint8_conditioning_every_level(engine):
    """Each 8-bit level maps to the float ``load_frames`` + ``prepare_conditioning`` give it, on a reflect-padded
    canvas, from an HWC image and from a THWC clip."""
    levels = np.arange(256, dtype=np.uint8)
    image = np.stack([np.roll(levels, shift) for shift in range(3)], axis=-1).reshape(16, 16, 3).repeat(6, 0)
    image = np.ascontiguousarray(np.concatenate([image, image[:, ::-1]], axis=1)).repeat(2, 1)  # [96, 64, 3]
    for observation in (image, np.stack([image, image[::-1]])):
        for num_frames in (1, 3):
            layout = processor.uint8_layout(observation, 256, num_frames, "diffusers")
            assert layout is not None and layout.canvas_hw != layout.source_hw  # padded
            expected = processor.prepare_conditioning(observation, 256, num_frames).pixels
            (pixels,) = processor.prepare_uint8_conditioning([observation], layout, num_frames)
            assert torch.equal(pixels, expected)


def test_uint8_conditioning_stacked_equals_clip_by_clip():
    """The GPU's way (clips stacked, one copy, one lookup), run on the CPU, gives the CPU's way's tensors."""
    observations = [uint8_frames(seed, (2, 96, 160, 3)) for seed in range(3)]
    layout = processor.uint8_layout(observations[0], 256, 5, "diffusers")
    stacked = processor.prepare_uint8_conditioning(observations, layout, 5, stacked=True)
    for new, old in zip(stacked, processor.prepare_uint8_conditioning(observations, layout, 5, stacked=False)):
        assert new.shape == (1, 3, 5, 192, 320) and torch.equal(new, old)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uint8_conditioning_on_cuda_equals_host():
    observations = [uint8_frames(seed, (96, 160, 3)) for seed in range(4)]
    layout = processor.uint8_layout(observations[0], 256, 1, "diffusers")
    pixels = processor.prepare_uint8_conditioning(observations, layout, 1, device="cuda")
    for observation, on_device in zip(observations, pixels):
        assert on_device.is_cuda
        assert torch.equal(on_device.cpu(), processor.prepare_conditioning(observation, 256, 1).pixels)


def engine_prepare_calls(engine, requests) -> int:
    """How many requests ``_prepare_batch`` prepares from scratch (``_prepare``) rather than from an earlier one."""
    calls = []
    prepare = engine._prepare

    def counting(request, defer_uint8_frames):
        calls.append(request)
        return prepare(request, defer_uint8_frames)

    engine._prepare = counting
    try:
        engine._prepare_batch(requests)
    finally:
        del engine._prepare
    return len(calls)


@pytest.mark.parametrize(
    "field, bad, message",
    [
        ("action", np.full((4, 2), np.nan, np.float32), "actions: contains NaN"),
        ("action", np.zeros((4, 3), np.float32), "actions: expected 2 values per row"),
        ("action", None, "action: mode 'forward_dynamics' needs an action chunk"),
    ],
)
def test_prepare_batch_checks_every_request_that_shares_settings(engine, field, bad, message):
    """A request prepared from an earlier one with the same settings is still checked on its own values, with the
    error ``prepare`` gives it."""
    common = dict(mode="forward_dynamics", task="push the T", domain="pusht", chunk=4, num_inference_steps=2,
                  resolution_tier=256)
    good = Cosmos3Request(observation=uint8_frames(0, (256, 256, 3)), action=actions(0), seed=0, **common)
    wrong = Cosmos3Request(observation=uint8_frames(1, (256, 256, 3)), seed=1, **{**common, field: bad})
    with pytest.raises(InputError) as alone:
        engine.prepare(wrong, encode=False)
    with pytest.raises(InputError) as batched:
        engine._prepare_batch([good, wrong])
    assert message in str(alone.value) and str(batched.value) == str(alone.value)


def test_denoise_starts_every_row_from_its_own_seeded_noise(engine, monkeypatch):
    """The batched start of the denoising loop (noise drawn over host threads, clean masks and clean latents built
    for the whole batch at once) is, row by row, what ``initial_noise`` and the request's own conditioning give: the
    noise where the row is noisy (zero beyond its raw action width), its clean latents and actions elsewhere."""
    common = dict(domain="pusht", chunk=4, num_inference_steps=1, resolution_tier=256, guidance_scale=1.0)
    requests = [
        Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(s, (256, 256, 3)), task="push the T",
                       action=actions(s), seed=100 + s, **common)
        for s in range(40)  # enough rows for several host threads
    ] + [Cosmos3Request(mode="policy", observation=uint8_frames(40, (256, 256, 3)), seed=140, **common)]
    first_call = {}

    def forward(text, layout, video, video_noisy, timesteps, actions_in, action_noisy, domain_ids):
        first_call.setdefault("inputs", (video.clone(), video_noisy.clone(), actions_in.clone(), action_noisy.clone()))
        return torch.zeros_like(video), torch.zeros_like(actions_in)

    monkeypatch.setattr(Cosmos3Engine, "gen_forward", property(lambda self: forward))
    with torch.inference_mode():
        prepared = engine._prepare_batch(requests)
        engine._denoise(prepared, frames=None)
    video, video_noisy, actions_in, action_noisy = first_call["inputs"]
    assert video_noisy.any() and action_noisy.any() and (~video_noisy).any()
    for row, request in enumerate(requests):
        alone = engine.prepare(request, encode=False)
        noise, action_noise, _ = engine.initial_noise(alone)
        action_noise[:, alone.raw_action_dim :] = 0
        clean = prepared[row].x0_video[0]  # the batch's own encode (batched convolutions sum in another order)
        for frame in range(video.shape[2]):
            expected = noise[0, :, frame] if video_noisy[row, frame] else clean[:, frame]
            assert torch.equal(video[row, :, frame], expected), (row, frame)
        expected_actions = torch.where(action_noisy[row][:, None], action_noise, alone.x0_actions)
        assert torch.equal(actions_in[row], expected_actions), row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_results_come_to_the_host_as_rows_of_their_own_or_stay_on_the_gpu(tiny_checkpoint):
    """From a GPU each result's latents and pixels are rows of their own on the host (one copy of the batch, then
    cloned: a pickled result carries only its row, a kept one holds no pinned memory), or with ``latents_on_device``
    / ``pixels_on_device`` the same values on the GPU."""
    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="fp32", progress=False)
    common = dict(domain="pusht", chunk=4, num_inference_steps=2, resolution_tier=256, task="push the T")
    requests = [Cosmos3Request(mode="forward_dynamics", observation=uint8_frames(s, (256, 256, 3)), action=actions(s),
                               seed=s, **common) for s in range(3)]
    on_host = engine.step(requests)
    on_gpu = engine.step(requests, latents_on_device=True, pixels_on_device=True)
    for host, gpu in zip(on_host, on_gpu):
        for name in ("video_latents", "pixels"):
            row = getattr(host, name)
            assert row.device.type == "cpu" and not row.is_pinned(), name
            assert row.untyped_storage().nbytes() == row.numel() * row.element_size(), name
            assert getattr(gpu, name).is_cuda and torch.equal(getattr(gpu, name).float().cpu(), row), name
        assert np.array_equal(host.action, gpu.action)


def test_text_kvs_keys_per_prompt_list_keep_the_lru_order(engine):
    """``text_kvs`` makes one key per distinct prompt list; the K/V it returns and the cache's LRU order are those of
    a key per prompt, moved to the end in turn (shared lists, equal lists that are different objects, repeats)."""
    engine.clear_text_cache()
    a, b, c, d = ([7, 8, 9, n] for n in range(4))
    engine.text_kvs([a, b, c])
    prompts = [b, d, b, list(a), c, d, a, b, list(d)]
    before = list(engine._text_cache)
    found = engine.text_kvs(prompts)
    expected_order = before + [tuple(d)]  # the missing key is added, then each prompt's key moved to the end in turn
    for ids in prompts:
        expected_order.remove(tuple(ids))
        expected_order.append(tuple(ids))
    assert list(engine._text_cache) == expected_order
    for ids, kv in zip(prompts, found):
        assert kv is engine._text_cache[tuple(ids)]
    engine.clear_text_cache()
