"""cosmos3_gym.processor against diffusers' Cosmos3OmniPipeline, the numerics reference.

The pipeline's own methods (``_prepare_action_video_conditioning``, ``tokenize_prompt``,
``_remove_action_video_padding_from_latent``) are called unbound on a stand-in ``self`` that holds exactly the
attributes they read, so the expected values are diffusers' code, not a re-implementation of it.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
    _EMBODIMENT_TO_DOMAIN_ID,
    _EMBODIMENT_TO_RAW_ACTION_DIM,
    Cosmos3OmniPipeline,
)
from diffusers.video_processor import VideoProcessor
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from cosmos3_gym import processor
from cosmos3_gym.errors import InputError
from cosmos3_gym.processor import (
    ActionStats,
    build_prompt_token_ids,
    load_action_file,
    load_frames,
    prepare_action_chunk,
    prepare_conditioning,
    resolve_domain,
    save_action_file,
)

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer(special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>")):
    """A small byte-level BPE tokenizer with the Qwen chat template, trained in-process."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [
        "This video is captured from a first-person perspective looking at the scene.",
        '{"cinematography": {"framing": ""}, "actions": [{"time": "0:00-0:01", "description": "pick up the cup."}]}',
        "You are a helpful assistant who will generate videos from a give prompt.",
    ]
    bpe.train_from_iterator(corpus, trainer=trainer)
    extra = [token for token in special_tokens if token not in ("<|endoftext|>", "<|im_end|>")]
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=extra,
        chat_template=QWEN_CHAT_TEMPLATE,
    )


class PipelineStandIn:
    """What Cosmos3OmniPipeline's action-conditioning, prompt and latent-crop methods read from ``self``."""

    _build_action_json_prompt = staticmethod(Cosmos3OmniPipeline._build_action_json_prompt)

    def __init__(self, tokenizer=None):
        self.video_processor = VideoProcessor(vae_scale_factor=16, resample="bilinear")
        self.vae_scale_factor_spatial = 16
        self.config = SimpleNamespace(default_use_system_prompt=True)
        if tokenizer is not None:
            self.text_tokenizer = tokenizer
            self.llm_special_tokens = {
                "start_of_generation": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
                "eos_token_id": tokenizer.eos_token_id,
            }
        # Set by Cosmos3OmniPipeline.__init__; tokenize_prompt selects one even in action mode, where none is used.
        self.image_resolution_template = "This image is of {height}x{width} resolution."
        self.video_resolution_template = "This video is of {height}x{width} resolution."
        self.inverse_image_resolution_template = "This image is not of {height}x{width} resolution."
        self.inverse_video_resolution_template = "This video is not of {height}x{width} resolution."
        self.duration_template = "The video is {duration:.1f} seconds long and is of {fps:.0f} FPS."
        self.inverse_duration_template = "The video is not {duration:.1f} seconds long and is not of {fps:.0f} FPS."


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def random_uint8(shape, seed):
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def pil_image(height, width, seed=0, mode="RGB"):
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = random_uint8((height, width, channels), seed)
    return Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode=mode)


# ----------------------------------------------------------------------------------------------------------------
# Conditioning pixels == Cosmos3OmniPipeline._prepare_action_video_conditioning
# ----------------------------------------------------------------------------------------------------------------


def assert_matches_pipeline(observation, pipeline_clip, tier, num_frames, dtype=torch.float32, exact=True):
    """prepare_conditioning(observation) against the pipeline given ``pipeline_clip`` (what a user would pass)."""
    standin = PipelineStandIn()
    expected, image_size, target_h, target_w = Cosmos3OmniPipeline._prepare_action_video_conditioning(
        standin, pipeline_clip, tier, num_frames, device="cpu", dtype=dtype
    )
    got = prepare_conditioning(load_frames(observation), tier, num_frames, dtype=dtype)

    assert got.pixels.dtype == expected.dtype == dtype
    assert got.pixels.shape == expected.shape == (1, 3, num_frames, target_h, target_w)
    if exact:
        assert torch.equal(got.pixels, expected)
    else:
        torch.testing.assert_close(got.pixels, expected, rtol=0, atol=1e-6)
    assert got.canvas_hw == (target_h, target_w)
    assert got.content_hw == (int(image_size[2]), int(image_size[3]))
    latent = torch.zeros(1, 1, 1, target_h // 16, target_w // 16)
    cropped = Cosmos3OmniPipeline._remove_action_video_padding_from_latent(standin, latent, image_size)
    assert got.latent_hw == tuple(cropped.shape[-2:])
    return got


# (height, width, tier, num_frames, what the case covers)
PIL_CASES = [
    (300, 400, 256, 3, "snap 300->288 by Pillow bilinear, downscale, reflect pad"),
    (100, 150, 256, 2, "smaller than the canvas: no upscale, replicate pad"),
    (160, 224, 256, 1, "no resize, reflect pad"),
    (400, 240, 256, 2, "portrait, exact fit after downscale, no pad"),
    (130, 340, 256, 2, "content height 121.9 rounds to 122"),
    (540, 640, 480, 2, "DROID frame on the 544x736 canvas"),
    (200, 300, 704, 1, "tier 704, replicate pad"),
    (250, 450, 720, 1, "tier 720, snap and replicate pad"),
    (480, 832, 480, 2, "the 480x832 canvas itself: no snap, no resize, no pad"),
]


@pytest.mark.parametrize("height,width,tier,num_frames,_case", PIL_CASES, ids=[case[-1] for case in PIL_CASES])
def test_pil_image_matches_pipeline(height, width, tier, num_frames, _case):
    image = pil_image(height, width, seed=height + width)
    assert_matches_pipeline(image, [image], tier, num_frames)


def test_resize_and_pad_paths_are_all_exercised():
    # Guards the case table above: downscale+reflect, replicate and no-pad each happen at least once.
    downscaled = prepare_conditioning(load_frames(pil_image(300, 400)), 256, 1)
    assert downscaled.content_hw == (230, 320) and downscaled.canvas_hw == (256, 320)
    replicated = prepare_conditioning(load_frames(pil_image(100, 150)), 256, 1)
    assert replicated.content_hw == (96, 144) and replicated.canvas_hw == (192, 320)
    assert torch.equal(replicated.pixels[..., -1], replicated.pixels[..., 143])  # edge-replicated columns
    exact = prepare_conditioning(load_frames(pil_image(400, 240)), 256, 1)
    assert exact.content_hw == exact.canvas_hw == (320, 192)
    assert exact.latent_hw == (20, 12)


def test_resize_dtype_matches_pipeline():
    # The pipeline resizes in the transformer's dtype; the same dtype gives the same bits. (bfloat16 antialiased
    # bicubic exists only on CUDA, so CPU tests use float64 to prove the dtype is honoured.)
    image = pil_image(300, 400, seed=3)
    assert_matches_pipeline(image, [image], 256, 2, dtype=torch.float64)


@pytest.mark.parametrize("mode", ["L", "RGBA"])
def test_grayscale_and_rgba_match_pipeline_given_rgb(mode):
    # The pipeline's VideoProcessor does not convert to RGB (do_convert_rgb=False); callers pass RGB.
    image = pil_image(90, 130, seed=5, mode=mode)
    assert_matches_pipeline(image, [image.convert("RGB")], 256, 1)


def test_uint8_array_matches_pipeline_given_pil():
    # Given a uint8 array the pipeline's VideoProcessor computes 2*x-1 on 0..255 values, so the reference for
    # 8-bit pixels is the PIL image of them.
    pixels = random_uint8((300, 400, 3), seed=7)
    assert_matches_pipeline(pixels, [Image.fromarray(pixels)], 256, 2)
    video = random_uint8((3, 300, 400, 3), seed=8)
    assert_matches_pipeline(video, [Image.fromarray(frame) for frame in video], 256, 3)


def test_float_tensor_image_matches_pipeline():
    # 100x150 is not a multiple of 16: the pipeline snaps float tensors with a nearest resize, not Pillow's.
    image = torch.rand(3, 100, 150, generator=torch.Generator().manual_seed(0))
    assert_matches_pipeline(image, [image], 256, 2)
    assert_matches_pipeline(image.permute(1, 2, 0), [image], 256, 1)  # HWC tensor


def test_float_tensor_multiple_of_16_matches_pipeline():
    # Sizes that need no snap skip diffusers' per-frame preprocessing (a direct 2x - 1): still the pipeline's bits.
    video = torch.rand(3, 3, 160, 224, generator=torch.Generator().manual_seed(4))
    assert_matches_pipeline(video, video, 256, 3)
    assert_matches_pipeline(video[0], [video[0]], 256, 1)


def test_float_tensor_video_matches_pipeline():
    video = torch.rand(4, 3, 300, 410, generator=torch.Generator().manual_seed(1))  # TCHW
    assert_matches_pipeline(video, video, 256, 6)
    assert_matches_pipeline(video, video, 256, 2)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # diffusers deprecates [-1, 1] tensors; still what it does
def test_signed_float_tensor_matches_pipeline():
    # [-1, 1] input: the pipeline keeps the values, we map to [0, 1] and back, which may move the last bit.
    image = torch.rand(3, 200, 280, generator=torch.Generator().manual_seed(2)) * 2 - 1
    assert_matches_pipeline(image, [image], 256, 1, exact=False)


@pytest.mark.parametrize("num_frames", [1, 3, 8], ids=["first frame only", "truncate", "repeat last frame"])
def test_pil_video_matches_pipeline(num_frames):
    frames = [pil_image(130, 170, seed=seed) for seed in range(5)]
    got = assert_matches_pipeline(frames, frames, 256, num_frames)
    if num_frames == 8:
        assert torch.equal(got.pixels[:, :, 4], got.pixels[:, :, 7])


def test_mp4_path_matches_pipeline_given_its_frames(tmp_path):
    path = tmp_path / "clip.mp4"
    iio.imwrite(path, random_uint8((3, 96, 128, 3), seed=9), fps=5)
    frames = iio.imread(path, index=None)
    assert_matches_pipeline(str(path), [Image.fromarray(frame) for frame in frames], 256, 4)


def test_conditioning_rejects_bad_tier_and_num_frames():
    frames = load_frames(pil_image(64, 64))
    with pytest.raises(InputError, match="resolution_tier"):
        prepare_conditioning(frames, 300, 1)
    with pytest.raises(InputError, match="num_frames"):
        prepare_conditioning(frames, 256, 0)


# ----------------------------------------------------------------------------------------------------------------
# load_frames
# ----------------------------------------------------------------------------------------------------------------


def test_load_frames_value_rules():
    pixels = random_uint8((5, 7, 3), seed=0)
    frames = load_frames(pixels)
    assert frames.shape == (1, 5, 7, 3) and frames.dtype == np.float32
    np.testing.assert_array_equal(frames[0], pixels.astype(np.float32) / 255.0)
    np.testing.assert_array_equal(load_frames(Image.fromarray(pixels)), frames)
    np.testing.assert_array_equal(load_frames(torch.from_numpy(pixels).permute(2, 0, 1)), frames)  # uint8 CHW

    unit = np.random.default_rng(0).random((2, 5, 7, 3), dtype=np.float32)
    np.testing.assert_array_equal(load_frames(unit), unit)
    np.testing.assert_array_equal(load_frames(torch.from_numpy(unit).permute(0, 3, 1, 2)), unit)  # TCHW
    np.testing.assert_allclose(load_frames(unit * 2 - 1), unit, atol=1e-6)  # [-1, 1] -> [0, 1]
    bf16 = torch.from_numpy(unit[0]).permute(2, 0, 1).to(torch.bfloat16)
    np.testing.assert_array_equal(load_frames(bf16)[0], bf16.float().permute(1, 2, 0).numpy())


def test_load_frames_converts_to_rgb():
    gray = random_uint8((6, 4), seed=1)
    expected = np.repeat(gray[..., None], 3, axis=-1).astype(np.float32) / 255.0
    np.testing.assert_array_equal(load_frames(gray)[0], expected)
    np.testing.assert_array_equal(load_frames(gray[..., None])[0], expected)
    np.testing.assert_array_equal(load_frames(Image.fromarray(gray, mode="L"))[0], expected)
    rgba = random_uint8((6, 4, 4), seed=2)
    np.testing.assert_array_equal(load_frames(rgba)[0], rgba[..., :3].astype(np.float32) / 255.0)
    np.testing.assert_array_equal(load_frames(Image.fromarray(rgba, mode="RGBA"))[0], load_frames(rgba)[0])


def test_load_frames_list_and_image_path(tmp_path):
    first, second = random_uint8((8, 6, 3), seed=3), random_uint8((2, 8, 6, 3), seed=4)
    path = tmp_path / "frame.png"
    Image.fromarray(first).save(path)
    frames = load_frames([path, Image.fromarray(first), second])
    assert frames.shape == (4, 8, 6, 3)
    np.testing.assert_array_equal(frames[0], frames[1])
    np.testing.assert_array_equal(frames[2:], second.astype(np.float32) / 255.0)


def test_mp4_round_trip(tmp_path):
    # A smooth gradient survives lossy H.264 closely.
    y, x = np.mgrid[0:48, 0:64]
    video = np.stack([np.stack([x * 4, y * 5, (x + y + 20 * t) % 256], axis=-1) for t in range(4)]).astype(np.uint8)
    path = tmp_path / "clip.mp4"
    iio.imwrite(path, video, fps=5)
    frames = load_frames(path)
    assert frames.shape == (4, 48, 64, 3) and frames.dtype == np.float32
    assert 0.0 <= frames.min() and frames.max() <= 1.0
    assert np.abs(frames - video / 255.0).mean() < 0.03


def test_gif_round_trip(tmp_path):
    palette = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255]], dtype=np.uint8)
    indexes = np.random.default_rng(0).integers(0, 4, size=(3, 16, 20))
    video = palette[indexes]
    path = tmp_path / "clip.gif"
    iio.imwrite(path, video, duration=100, loop=0)
    frames = load_frames(str(path))
    assert frames.shape == (3, 16, 20, 3)
    np.testing.assert_array_equal(frames, video.astype(np.float32) / 255.0)


def test_video_file_without_frames(tmp_path, monkeypatch):
    path = tmp_path / "empty.mp4"
    path.write_bytes(b"")
    monkeypatch.setattr(processor, "_read_video_file", lambda _path: np.zeros((0, 8, 8, 3), np.uint8))
    with pytest.raises(InputError, match="observation.*no frames"):
        load_frames(path)


def bad_observations(tmp_path):
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("hello")
    unknown = tmp_path / "data.xyz"
    unknown.write_text("hello")
    empty_video = tmp_path / "empty.mp4"
    empty_video.write_bytes(b"")
    nan = np.zeros((4, 4, 3), np.float32)
    nan[0, 0, 0] = np.nan
    inf = np.zeros((4, 4, 3), np.float32)
    inf[1, 1, 1] = np.inf
    return {
        "missing path": tmp_path / "missing.png",
        "unreadable image": not_an_image,
        "unknown format": str(unknown),
        "unreadable video": empty_video,
        "empty list": [],
        "no frames": np.zeros((0, 4, 4, 3), np.uint8),
        "two channels": np.zeros((4, 4, 2), np.uint8),
        "five channel tensor": torch.zeros(5, 4, 6),
        "NaN": nan,
        "inf": torch.from_numpy(inf),
        "float above 1": np.full((4, 4, 3), 2.0, np.float32),
        "float below -1": np.full((4, 4, 3), -2.0, np.float32),
        "int above 255": np.full((4, 4, 3), 300, np.int64),
        "frames of different sizes": [np.zeros((4, 4, 3), np.uint8), np.zeros((4, 5, 3), np.uint8)],
        "unsupported type": {"image": 1},
    }


BAD_OBSERVATION_NAMES = [
    "missing path", "unreadable image", "unknown format", "unreadable video", "empty list", "no frames",
    "two channels", "five channel tensor", "NaN", "inf", "float above 1", "float below -1", "int above 255",
    "frames of different sizes", "unsupported type",
]


@pytest.mark.parametrize("case", BAD_OBSERVATION_NAMES)
def test_bad_observations_raise_input_error(case, tmp_path):
    observation = bad_observations(tmp_path)[case]
    with pytest.raises(InputError, match="observation"):
        load_frames(observation)


# ----------------------------------------------------------------------------------------------------------------
# Prompt token ids == Cosmos3OmniPipeline.tokenize_prompt(action_mode=...)
# ----------------------------------------------------------------------------------------------------------------

PROMPT_CASES = [
    # task, negative_prompt, view_point, num_frames, fps, (height, width), use_system_prompt
    ("pick up the cup", None, "ego_view", 17, 24.0, (480, 832), True),
    ("Put the marker in the bowl.", "blurry, static", "concat_view", 33, 15.0, (544, 736), True),
    ("  stack the blocks  ", "", "wrist_view", 17, 24.0, (640, 640), False),
    ("open the drawer!", None, "third_person_view", 1, 24.0, (256, 320), True),
    ("push the T", None, "ego_view", 129, 10.0, (192, 320), True),
]


@pytest.mark.parametrize("task,negative,view_point,num_frames,fps,canvas,use_system_prompt", PROMPT_CASES)
@pytest.mark.parametrize("mode", ["policy", "forward_dynamics", "inverse_dynamics"])
def test_prompt_ids_match_pipeline(
    tokenizer, mode, task, negative, view_point, num_frames, fps, canvas, use_system_prompt
):
    height, width = canvas
    expected = Cosmos3OmniPipeline.tokenize_prompt(
        PipelineStandIn(tokenizer),
        task,
        negative,
        num_frames=num_frames,
        height=height,
        width=width,
        fps=fps,
        use_system_prompt=use_system_prompt,
        action_mode=mode,
        action_view_point=view_point,
    )
    got = build_prompt_token_ids(
        tokenizer,
        task,
        negative_prompt=negative,
        view_point=view_point,
        num_frames=num_frames,
        fps=fps,
        height=height,
        width=width,
        use_system_prompt=use_system_prompt,
    )
    assert got == expected
    cond_ids, uncond_ids = got
    special = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|vision_start|>")]
    assert cond_ids[-2:] == uncond_ids[-2:] == special
    assert f'"resolution": {{"H": {height}, "W": {width}}}' in tokenizer.decode(cond_ids)


def test_prompt_rejects_unknown_view_point(tokenizer):
    with pytest.raises(InputError, match="view_point"):
        build_prompt_token_ids(
            tokenizer, "x", negative_prompt=None, view_point="top_view", num_frames=17, fps=24.0, height=480, width=832
        )


def test_prompt_rejects_tokenizer_without_vision_start():
    plain = make_tokenizer(special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    with pytest.raises(InputError, match="tokenizer"):
        build_prompt_token_ids(
            plain, "x", negative_prompt=None, view_point="ego_view", num_frames=17, fps=24.0, height=480, width=832
        )


# ----------------------------------------------------------------------------------------------------------------
# Domains and action chunks
# ----------------------------------------------------------------------------------------------------------------


def test_domains_follow_the_diffusers_tables():
    for name, domain_id in _EMBODIMENT_TO_DOMAIN_ID.items():
        if name in _EMBODIMENT_TO_RAW_ACTION_DIM:
            assert resolve_domain(name) == (domain_id, _EMBODIMENT_TO_RAW_ACTION_DIM[name])
        assert resolve_domain(name, raw_action_dim=8) == (domain_id, 8)
    assert resolve_domain("droid_lerobot") == (8, 10)
    assert resolve_domain("droid_lerobot", 8) == (8, 8)  # the released DROID policy's joint-position width
    assert resolve_domain(31, raw_action_dim=64) == (31, 64)


@pytest.mark.parametrize(
    "domain,raw_action_dim,field",
    [
        ("not_a_robot", None, "domain"),
        (8, None, "raw_action_dim"),
        (32, 8, "domain"),
        (-1, 8, "domain"),
        (True, 8, "domain"),
        ("libero", None, "raw_action_dim"),
        ("droid_lerobot", 0, "raw_action_dim"),
        ("droid_lerobot", 65, "raw_action_dim"),
    ],
)
def test_bad_domains_raise_input_error(domain, raw_action_dim, field):
    with pytest.raises(InputError, match=field):
        resolve_domain(domain, raw_action_dim)


def test_unknown_domain_lists_valid_names():
    with pytest.raises(InputError, match="droid_lerobot"):
        resolve_domain("not_a_robot")


def test_action_chunk_repeats_truncates_and_pads():
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    chunk = prepare_action_chunk(rows, chunk=5, raw_action_dim=4)
    assert chunk.dtype == torch.float32 and chunk.shape == (5, 64)
    np.testing.assert_array_equal(chunk[:3, :4].numpy(), rows)
    np.testing.assert_array_equal(chunk[3:, :4].numpy(), np.stack([rows[-1], rows[-1]]))
    assert not chunk[:, 4:].any()
    truncated = prepare_action_chunk(torch.from_numpy(rows), 2, 4, action_dim=8)
    assert truncated.shape == (2, 8) and torch.equal(truncated[:, :4], torch.from_numpy(rows[:2]))
    assert torch.equal(prepare_action_chunk(rows.tolist(), 3, 4), chunk[:3])


@pytest.mark.parametrize(
    "actions,chunk,field",
    [
        (np.zeros(4, np.float32), 4, "actions"),
        (np.zeros((0, 4), np.float32), 4, "actions"),
        (np.zeros((3, 5), np.float32), 4, "actions"),
        (np.array([[0.0, np.nan, 0.0, 0.0]]), 4, "actions"),
        ([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0]], 4, "actions"),
        (np.zeros((3, 4), np.float32), 0, "chunk"),
    ],
)
def test_bad_action_chunks_raise_input_error(actions, chunk, field):
    with pytest.raises(InputError, match=field):
        prepare_action_chunk(actions, chunk, raw_action_dim=4)


# ----------------------------------------------------------------------------------------------------------------
# Action statistics
# ----------------------------------------------------------------------------------------------------------------

STATS = {
    "mean": [1.0, 2.0],
    "std": [2.0, 0.5],
    "min": [0.0, -2.0],
    "max": [10.0, 2.0],
    "q01": [1.0, -1.0],
    "q99": [9.0, 1.0],
}


@pytest.mark.parametrize(
    "mode,normalized,raw",
    [
        ("meanstd", [[0.5, -1.0]], [[2.0, 1.5]]),
        ("minmax", [[-1.0, 1.0], [0.0, 0.0]], [[0.0, 2.0], [5.0, 0.0]]),
        ("quantile", [[-1.0, 1.0], [0.5, -0.5]], [[1.0, 1.0], [7.0, -0.5]]),
    ],
)
def test_stats_known_values(mode, normalized, raw):
    stats = ActionStats.from_json(STATS, mode=mode)
    np.testing.assert_allclose(stats.denormalize(np.array(normalized, np.float32)), raw, rtol=1e-6)
    np.testing.assert_allclose(stats.normalize(np.array(raw, np.float32)), normalized, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.denormalize(torch.tensor(normalized)), torch.tensor(raw))


def test_quantile_rot_uses_the_global_raw_block():
    document = {
        "metadata": {"embodiment_type": "libero"},
        "global": {**STATS, "q01": [-1.0, -1.0], "q99": [1.0, 1.0]},
        "global_raw": {**STATS, "q01": [0.0, 10.0], "q99": [2.0, 30.0]},
    }
    stats = ActionStats.from_json(document, mode="quantile_rot")
    np.testing.assert_allclose(stats.denormalize(np.array([[0.0, 1.0]])), [[1.0, 30.0]])
    # The other modes read the "global" block of the same file.
    quantile = ActionStats.from_json(document, mode="quantile")
    np.testing.assert_allclose(quantile.denormalize(np.array([[0.5, 0.5]])), [[0.5, 0.5]])


@pytest.mark.parametrize("mode", ["meanstd", "minmax", "quantile", "quantile_rot"])
def test_stats_round_trip(mode):
    stats = ActionStats.from_json({"global": STATS, "global_raw": STATS}, mode=mode)
    raw = np.random.default_rng(0).normal(size=(3, 5, 2))
    np.testing.assert_allclose(stats.denormalize(stats.normalize(raw)), raw, rtol=1e-6, atol=1e-6)
    tensor = torch.from_numpy(raw)
    restored = stats.denormalize(stats.normalize(tensor))
    assert isinstance(restored, torch.Tensor) and restored.dtype == torch.float64
    torch.testing.assert_close(restored, tensor)


def test_stats_layouts(tmp_path):
    expected = ActionStats.from_json(STATS, mode="minmax")
    layouts = {
        "lerobot stats.json": {"action": STATS, "observation.state": {"mean": [0.0]}},
        "dataset_statistics.json": {"droid": {"action": STATS, "proprio": STATS, "num_transitions": 10}},
        "native": {"metadata": {}, "global": STATS},
    }
    for name, document in layouts.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(document))
        stats = ActionStats.from_json(path, mode="minmax")
        np.testing.assert_array_equal(stats.offset, expected.offset, err_msg=name)
        np.testing.assert_array_equal(stats.scale, expected.scale, err_msg=name)
        assert stats.source == str(path)
    several = {"a": {"action": STATS}, "b": {"action": {**STATS, "min": [5.0, 5.0]}}}
    assert ActionStats.from_json(several, mode="minmax", dataset="b").offset.tolist() == [5.0, 5.0]


def test_bad_stats_raise_input_error(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"mean": [0.0, 1.0]}))
    with pytest.raises(InputError, match=r"stats\.json.*'std'"):
        ActionStats.from_json(path, mode="meanstd")
    with pytest.raises(InputError, match=r"stats\.json.*global_raw"):
        ActionStats.from_json(path, mode="quantile_rot")
    with pytest.raises(InputError, match="mode"):
        ActionStats.from_json(path, mode="zscore")
    with pytest.raises(InputError, match="several datasets"):
        ActionStats.from_json({"a": {"action": STATS}, "b": {"action": STATS}})
    with pytest.raises(InputError, match="missing.json"):
        ActionStats.from_json(tmp_path / "missing.json")
    path.write_text(json.dumps(STATS))
    stats = ActionStats.from_json(path, mode="minmax")
    with pytest.raises(InputError, match=r"stats\.json.*2 dims"):
        stats.denormalize(np.zeros((4, 3)))
    with pytest.raises(InputError, match=r"stats\.json.*2 dims"):
        stats.normalize(torch.zeros(4, 10))


# ----------------------------------------------------------------------------------------------------------------
# Action files
# ----------------------------------------------------------------------------------------------------------------


def test_action_file_round_trip(tmp_path):
    actions = np.random.default_rng(0).normal(size=(6, 8)).astype(np.float32)
    path = tmp_path / "out_action.json"
    save_action_file(path, torch.from_numpy(actions))
    document = json.loads(path.read_text())
    assert document["shape"] == [6, 8] and document["dtype"] == "float32"
    loaded = load_action_file(path)
    assert loaded.dtype == np.float32
    np.testing.assert_array_equal(loaded, actions)


def test_action_chunks_file(tmp_path):
    chunks = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    path = tmp_path / "chunks.json"
    path.write_text(json.dumps({"action_chunks": chunks.tolist()}))
    np.testing.assert_array_equal(load_action_file(path), chunks[0])
    np.testing.assert_array_equal(load_action_file(path, chunk_index=1), chunks[1])


@pytest.mark.parametrize(
    "content",
    [
        '{"actions": [[1.0]]}',
        '{"shape": [2, 2], "dtype": "float32", "data": [[1.0, 2.0], [3.0]]}',
        '{"shape": [3, 2], "dtype": "float32", "data": [[1.0, 2.0], [3.0, 4.0]]}',
        '{"shape": [1, 2], "dtype": "float32", "data": [[1.0, NaN]]}',
        '{"shape": [1, 2], "dtype": "float32", "data": [[1.0, Infinity]]}',
        '{"action_chunks": [[[1.0, 2.0]]]}',  # read with chunk_index=1 below: out of range
        '{"action_chunks": []}',
        "[[1.0, 2.0]]",
        "not json",
    ],
)
def test_bad_action_files_raise_input_error(tmp_path, content):
    path = tmp_path / "bad_action.json"
    path.write_text(content)
    with pytest.raises(InputError, match="bad_action.json"):
        load_action_file(path, chunk_index=1 if "action_chunks" in content else 0)
