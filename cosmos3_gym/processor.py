"""Input and output processing for the Cosmos3 action modes (policy, forward and inverse dynamics).

diffusers' ``Cosmos3OmniPipeline`` (pipeline_cosmos3_omni.py) is the numerics reference for everything that reaches
the model: the observation canvas, the prompt token ids, the domain ids and the padded action chunk. Its tables
(resolution bins, viewpoint sentences, embodiment domains and widths), its ``VideoProcessor`` and its JSON caption
builder are imported rather than copied, so this module cannot drift from the reference; tests/test_processor.py
proves the results equal to calling the pipeline's own methods.

The rest (reading images/videos from files, dataset action statistics, action JSON files) has no diffusers
counterpart; it follows PhyAI's Cosmos3 processor and the native cosmos-framework file formats.

Beyond the diffusers reference, the options the released policy checkpoints were trained with, as PhyAI's PR49
(``mingti-org/phyai`` pull 49, "align Cosmos3 policy inference with native implementation") reproduces NVIDIA's
RoboLab policy server: the ``"plain"`` prompt format, an explicit system-prompt switch, an extra view description,
state (history) rows prepended as clean action rows, the gripper flip, and the ``"native"`` canvas (no snap to a
multiple of 16 before the canvas). Their defaults are the diffusers behaviour, bit-identical to it; the named
bundles of these settings live in ``presets.py``.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch
import torch.nn.functional as F

# Private names of diffusers' pipeline module, imported on purpose: diffusers (pinned to 0.42.1) is the numerics and
# semantics reference, and sharing its tables means a model trained against them sees the same values here.
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
    _ACTION_RESOLUTION_BINS,
    _ACTION_VIEWPOINT_TEMPLATES,
    _EMBODIMENT_TO_DOMAIN_ID,
    _EMBODIMENT_TO_RAW_ACTION_DIM,
    _SYSTEM_PROMPT_IMAGE,
    _SYSTEM_PROMPT_VIDEO,
    Cosmos3OmniPipeline,
)
from diffusers.video_processor import VideoProcessor
from PIL import Image

from .errors import InputError

__all__ = [
    "ACTION_DIM",
    "ACTION_NORMALIZATION_MODES",
    "CANVAS_MODES",
    "PROMPT_FORMATS",
    "DOMAIN_NAMES",
    "NUM_EMBODIMENT_DOMAINS",
    "RESOLUTION_TIERS",
    "VAE_SPATIAL_FACTOR",
    "VIEW_POINTS",
    "ActionStats",
    "CanvasLayout",
    "Conditioning",
    "build_prompt_text",
    "build_prompt_token_ids",
    "canvas_layout",
    "flip_gripper",
    "load_action_file",
    "load_frames",
    "prepare_action_chunk",
    "prepare_action_rows",
    "prepare_conditioning",
    "prepare_uint8_conditioning",
    "resolve_domain",
    "resolve_prompt_format",
    "uint8_layout",
    "save_action_file",
]

VAE_SPATIAL_FACTOR = 16  # Wan2.2 VAE: one latent pixel per 16x16 image pixels.
ACTION_DIM = 64  # the transformer's padded action width (config.action_dim)
NUM_EMBODIMENT_DOMAINS = 32  # rows of the DomainAwareLinear tables (config.num_embodiment_domains)
RESOLUTION_TIERS = tuple(sorted(int(tier) for tier in _ACTION_RESOLUTION_BINS))
VIEW_POINTS = tuple(_ACTION_VIEWPOINT_TEMPLATES)
DOMAIN_NAMES = tuple(sorted(_EMBODIMENT_TO_DOMAIN_ID))
# The two statistics each mode reads: (mean, std) or the (low, high) bounds of the range it maps [-1, 1] onto.
_STATS_KEYS_BY_MODE = {
    "meanstd": ("mean", "std"),
    "minmax": ("min", "max"),
    "quantile": ("q01", "q99"),
    "quantile_rot": ("q01", "q99"),
}
ACTION_NORMALIZATION_MODES = tuple(_STATS_KEYS_BY_MODE)

# "json": diffusers' structured action caption (the default, the reference). "plain": PR49's sentences (task, viewpoint
# sentence, optional view description, duration/fps, resolution), which the released Nano policy was trained with.
# "auto": PR49's rule, read from the transformer config's hidden_act (see resolve_prompt_format).
PROMPT_FORMATS = ("json", "plain", "auto")
# PR49 tells the checkpoints apart by their MLP: Nano (SwiGLU, "silu") takes plain prompts, Edge ("relu2") JSON.
_PROMPT_FORMAT_BY_HIDDEN_ACT = {"silu": "plain", "relu2": "json"}
# "diffusers": the frame is first snapped down to a multiple of 16 (VideoProcessor), then fitted on the tier's canvas.
# "native": fitted as it is (PhyAI PR49 / the native server): a 540x640 RoboLab frame keeps its 540 rows on the 544x736
# canvas (latent cropped to 33x40) instead of being resampled to 528 rows first.
CANVAS_MODES = ("diffusers", "native")
_PLAIN_DURATION_TEMPLATE = "The video is {duration:.1f} seconds long and is of {fps:.0f} FPS."
_PLAIN_RESOLUTION_TEMPLATE = "This video is of {height}x{width} resolution."

VIDEO_SUFFIXES = (".mp4", ".gif", ".webm", ".avi", ".mov", ".mkv")
_VISION_START_TOKEN = "<|vision_start|>"

# The exact processor Cosmos3OmniPipeline.__init__ builds (VAE scale_factor_spatial = 16). Reused, not re-implemented,
# because diffusers is the numerics reference: it decides how a frame is snapped to a multiple of 16 before binning.
_VIDEO_PROCESSOR = VideoProcessor(vae_scale_factor=VAE_SPATIAL_FACTOR, resample="bilinear")


# ----------------------------------------------------------------------------------------------------------------
# Observations
# ----------------------------------------------------------------------------------------------------------------


def load_frames(observation: Any) -> np.ndarray:
    """Read an observation as float32 RGB frames ``[T, H, W, 3]`` in ``[0, 1]``.

    Accepts a path to an image (anything PIL reads) or a video (.mp4/.gif/.webm/.avi/.mov/.mkv), a PIL image, a
    numpy array ``HW``/``HWC``/``THWC``, a torch tensor ``CHW``/``TCHW`` (or channels-last ``HWC``/``THWC``), or a
    list of any of these (the frames of one video). 8-bit integers are divided by 255; floats in [0, 1] are kept;
    floats with negative values are read as [-1, 1] and mapped to [0, 1], as the reference processors do.
    Grayscale and RGBA become RGB.
    """
    if isinstance(observation, list):
        if not observation:
            raise InputError("observation: got an empty list; expected one or more frames.")
        clips = [load_frames(item) for item in observation]
        sizes = sorted({clip.shape[1:3] for clip in clips})
        if len(sizes) > 1:
            raise InputError(f"observation: all frames must have the same height and width, got sizes {sizes}.")
        return np.concatenate(clips, axis=0)
    if isinstance(observation, (str, os.PathLike)):
        return _read_frames_file(Path(observation))
    if isinstance(observation, Image.Image):
        return _pil_to_frames(observation)
    if isinstance(observation, torch.Tensor):
        return _array_to_frames(_tensor_to_channels_last(observation))
    if isinstance(observation, np.ndarray):
        return _array_to_frames(observation)
    raise InputError(
        f"observation: unsupported type {type(observation).__name__}; expected a path, PIL image, numpy array, "
        "torch tensor or a list of these."
    )


def _read_frames_file(path: Path) -> np.ndarray:
    if not path.is_file():
        raise InputError(f"observation: file not found: {path}")
    if path.suffix.lower() in VIDEO_SUFFIXES:
        frames = _read_video_file(path)
        if frames.shape[0] == 0:
            raise InputError(f"observation: video {path} has no frames.")
        return _array_to_frames(frames)
    try:
        with Image.open(path) as image:
            return _pil_to_frames(image)
    except (OSError, ValueError) as error:  # PIL.UnidentifiedImageError is an OSError
        raise InputError(
            f"observation: cannot read {path} as an image ({error}); videos must end in one of {VIDEO_SUFFIXES}."
        ) from error


def _read_video_file(path: Path) -> np.ndarray:
    """All frames of a video file as a ``[T, H, W, C]`` array."""
    import imageio.v3 as iio

    # GIF frames are palette images; ask Pillow for RGB so every frame comes back with 3 channels.
    options = {"plugin": "pillow", "mode": "RGB"} if path.suffix.lower() == ".gif" else {}
    try:
        frames = iio.imread(path, index=None, **options)
    except Exception as error:  # imageio/ffmpeg raise many exception types for unreadable files
        raise InputError(f"observation: cannot read video {path}: {error}") from error
    frames = np.asarray(frames)
    if frames.ndim == 3:  # a single-frame file comes back without the time axis
        frames = frames[None]
    return frames


def _pil_to_frames(image: Image.Image) -> np.ndarray:
    # Same arithmetic as VaeImageProcessor.pil_to_numpy (uint8 -> float32 / 255), so the values are bit-identical.
    return (np.asarray(image.convert("RGB")).astype(np.float32) / 255.0)[None]


def _tensor_to_channels_last(tensor: torch.Tensor) -> np.ndarray:
    """``CHW``/``TCHW`` (or already channels-last ``HWC``/``THWC``) tensor -> channels-last numpy array.

    Shapes that fit both layouts are read channels-first, the torch convention.
    """
    host = tensor.detach().cpu()
    if host.is_floating_point():
        host = host.float()  # numpy has no bfloat16
    array = host.numpy()
    channel_counts = (1, 3, 4)
    if array.ndim in (3, 4) and array.shape[-3] in channel_counts:
        return np.moveaxis(array, -3, -1)
    if array.ndim in (3, 4) and array.shape[-1] in channel_counts:
        return array
    raise InputError(
        f"observation: tensor of shape {tuple(tensor.shape)} is not CHW, TCHW or HWC with 1, 3 or 4 channels."
    )


def _array_to_frames(array: np.ndarray) -> np.ndarray:
    """Channels-last ``HW``/``HWC``/``THWC`` array -> float32 RGB ``[T, H, W, 3]`` in [0, 1]."""
    if array.ndim == 2:  # a single grayscale image
        array = array[:, :, None]
    if array.ndim == 3:
        array = array[None]
    if array.ndim != 4:
        raise InputError(f"observation: expected an HWC image or THWC video, got an array of shape {array.shape}.")
    if array.shape[0] == 0:
        raise InputError("observation: the video has no frames.")
    channels = array.shape[-1]
    if channels not in (1, 3, 4):
        raise InputError(
            f"observation: expected 1 (grayscale), 3 (RGB) or 4 (RGBA) channels, got {channels} "
            f"(array shape {array.shape})."
        )
    if channels == 1:
        array = np.repeat(array, 3, axis=-1)
    elif channels == 4:
        array = array[..., :3]  # PIL's RGBA -> RGB conversion also just drops alpha

    is_number = np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    if array.dtype == np.bool_ or not is_number:
        raise InputError(f"observation: expected uint8 or float pixel values, got dtype {array.dtype}.")
    if np.issubdtype(array.dtype, np.integer):
        if array.min() < 0 or array.max() > 255:
            raise InputError(
                f"observation: integer pixels must lie in [0, 255], got range [{array.min()}, {array.max()}]."
            )
        return array.astype(np.float32) / 255.0

    array = array.astype(np.float32, copy=False)
    if not np.isfinite(array).all():
        raise InputError("observation: pixel values contain NaN or infinity.")
    low, high = float(array.min()), float(array.max())
    if low < 0.0:
        if low < -1.0 or high > 1.0:
            raise InputError(
                f"observation: float pixels with negative values must lie in [-1, 1], got [{low}, {high}]."
            )
        return (array + 1.0) / 2.0
    if high > 1.0:
        raise InputError(
            f"observation: float pixels must lie in [0, 1] or [-1, 1], got [{low}, {high}]; pass 0-255 data as uint8."
        )
    return array


@dataclass(frozen=True)
class Conditioning:
    """The observation clip on the model's canvas.

    ``pixels`` is ``[1, 3, num_frames, *canvas_hw]`` in [-1, 1]; the image content fills the top-left ``content_hw``
    and the rest is padding. After VAE encoding, the latent is cropped to ``latent_hw`` (the content's latent grid),
    as ``Cosmos3OmniPipeline._remove_action_video_padding_from_latent`` does.
    """

    pixels: torch.Tensor
    canvas_hw: tuple[int, int]
    content_hw: tuple[int, int]
    latent_hw: tuple[int, int]


def prepare_conditioning(
    frames: Any,
    resolution_tier: int,
    num_frames: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    canvas: str = "diffusers",
) -> Conditioning:
    """Put the observation frames on the tier's canvas, exactly as ``Cosmos3OmniPipeline`` does for action modes.

    Reproduces ``Cosmos3OmniPipeline._prepare_action_video_conditioning``: VideoProcessor.preprocess_video (snap to a
    multiple of 16, scale to [-1, 1]) -> the tier's canvas closest in aspect ratio -> pad the clip to ``num_frames``
    by repeating its last frame, or keep its first ``num_frames`` -> downscale only (bicubic, antialias) -> pad
    bottom/right (reflect, or replicate when the padding is as large as the content).

    ``frames`` is ``load_frames`` output (anything ``load_frames`` accepts is read through it first). ``num_frames``
    may be smaller than the clip, e.g. 1 to encode only the clean observation. ``device``/``dtype`` are where the
    resize runs; the pipeline runs it on its execution device in the transformer's dtype.

    ``canvas="native"`` skips the snap to a multiple of 16, as PhyAI PR49 and the native server do: the content
    keeps its exact size when it fits the canvas. (A frame larger than the canvas is still downscaled with torch's
    antialiased bicubic, where PR49 uses Pillow's bicubic; the RoboLab 540x640 composite never is.)
    """
    frames = load_frames(frames)
    _check_canvas_settings(resolution_tier, num_frames, canvas)

    snapped = frames.shape[1] % VAE_SPATIAL_FACTOR == 0 and frames.shape[2] % VAE_SPATIAL_FACTOR == 0
    if snapped or canvas == "native":
        # VideoProcessor's snap to a multiple of 16 is then the identity (PIL and torch alike), or the native canvas
        # skips it, leaving its 2x - 1: computed here on one contiguous tensor it is bit-identical and ~10x cheaper
        # than the per-frame PIL round trip.
        pixels = _to_model_range(torch.from_numpy(frames).to(device=device).permute(3, 0, 1, 2)[None])
        pixels = pixels.to(dtype=dtype)
    else:
        pixels = _VIDEO_PROCESSOR.preprocess_video(_video_processor_input(frames)).to(device=device, dtype=dtype)
    layout = canvas_layout(tuple(pixels.shape[-2:]), resolution_tier)
    pixels = _frames_on_canvas(_keep_frames(pixels, num_frames), layout).to(dtype=dtype)
    return Conditioning(pixels, layout.canvas_hw, layout.content_hw, layout.latent_hw)


def _check_canvas_settings(resolution_tier: Any, num_frames: Any, canvas: Any) -> None:
    if canvas not in CANVAS_MODES:
        raise InputError(f"canvas: got {canvas!r}; expected one of {list(CANVAS_MODES)}.")
    if str(resolution_tier) not in _ACTION_RESOLUTION_BINS:
        raise InputError(f"resolution_tier: got {resolution_tier!r}; expected one of {list(RESOLUTION_TIERS)}.")
    if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames < 1:
        raise InputError(f"num_frames: expected an integer >= 1, got {num_frames!r}.")


def _to_model_range(pixels: torch.Tensor) -> torch.Tensor:
    """[0, 1] -> [-1, 1], VideoProcessor.preprocess_video's 2x - 1."""
    return pixels * 2.0 - 1.0


@dataclass(frozen=True)
class CanvasLayout:
    """Where a frame of ``source_hw`` goes on the tier's canvas (``Conditioning`` has the same fields)."""

    source_hw: tuple[int, int]
    canvas_hw: tuple[int, int]
    content_hw: tuple[int, int]
    latent_hw: tuple[int, int]


@functools.lru_cache(maxsize=256)  # a vector env asks for the same few layouts at every step
def canvas_layout(source_hw: tuple[int, int], resolution_tier: int) -> CanvasLayout:
    """The tier's canvas closest in aspect ratio to ``source_hw`` (already snapped to a multiple of 16 unless the
    canvas is native) and the content's size on it: fit inside without upscaling, the pipeline's rounding."""
    source_h, source_w = (int(size) for size in source_hw)
    target_h, target_w = VideoProcessor.classify_height_width_bin(
        source_h, source_w, ratios=_ACTION_RESOLUTION_BINS[str(resolution_tier)]
    )
    scale = min(target_w / source_w, target_h / source_h, 1.0)
    content_h = max(1, int(scale * source_h + 0.5))
    content_w = max(1, int(scale * source_w + 0.5))
    latent_hw = (max(content_h // VAE_SPATIAL_FACTOR, 1), max(content_w // VAE_SPATIAL_FACTOR, 1))
    return CanvasLayout((source_h, source_w), (target_h, target_w), (content_h, content_w), latent_hw)


def _keep_frames(pixels: torch.Tensor, num_frames: int) -> torch.Tensor:
    """``[B, C, T, H, W]`` clips padded to ``num_frames`` by repeating their last frame, or cut to their first."""
    clip_frames = pixels.shape[2]
    if clip_frames < num_frames:
        last_frame = pixels[:, :, -1:].expand(-1, -1, num_frames - clip_frames, -1, -1)
        return torch.cat([pixels, last_frame], dim=2)
    return pixels[:, :, :num_frames]


def _frames_on_canvas(pixels: torch.Tensor, layout: CanvasLayout) -> torch.Tensor:
    """``[B, C, T, *source_hw]`` -> ``[B, C, T, *canvas_hw]``: downscale (bicubic, antialias) if the content is
    smaller than the source, then pad bottom/right."""
    batch, channels, num_frames = pixels.shape[:3]
    (content_h, content_w), (target_h, target_w) = layout.content_hw, layout.canvas_hw
    images = pixels.permute(0, 2, 1, 3, 4).reshape(-1, channels, *layout.source_hw)  # [B * T, C, H, W]
    if layout.content_hw != layout.source_hw:
        images = F.interpolate(images, size=(content_h, content_w), mode="bicubic", align_corners=False, antialias=True)
    pad_bottom, pad_right = target_h - content_h, target_w - content_w
    if pad_bottom or pad_right:
        # Reflect padding needs the pad to be smaller than the content along that axis.
        pad_mode = "replicate" if pad_right >= content_w or pad_bottom >= content_h else "reflect"
        images = F.pad(images, (0, pad_right, 0, pad_bottom), mode=pad_mode)
    return images.reshape(batch, num_frames, channels, target_h, target_w).permute(0, 2, 1, 3, 4)


def uint8_layout(observation: Any, resolution_tier: int, num_frames: int, canvas: str) -> CanvasLayout | None:
    """The canvas layout of an ``observation`` that ``prepare_uint8_conditioning`` takes, else None (then
    ``prepare_conditioning``): a uint8 RGB image ``HWC`` or clip ``THWC`` as a numpy array (a vector env's frames)
    that needs no resampling: its size already a multiple of 16 (or the native canvas), content not downscaled.
    Checks the settings as ``prepare_conditioning`` does."""
    if not (isinstance(observation, np.ndarray) and observation.dtype == np.uint8 and observation.ndim in (3, 4)):
        return None
    if observation.shape[-1] != 3 or 0 in observation.shape:
        return None
    _check_canvas_settings(resolution_tier, num_frames, canvas)
    source_hw = observation.shape[-3:-1]
    if canvas != "native" and (source_hw[0] % VAE_SPATIAL_FACTOR or source_hw[1] % VAE_SPATIAL_FACTOR):
        return None
    layout = canvas_layout(tuple(source_hw), resolution_tier)
    return layout if layout.content_hw == layout.source_hw else None


@functools.cache
def _uint8_to_model_range(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """[256] float32 on ``device``: the value ``prepare_conditioning`` gives each 8-bit level, computed by its own
    functions (``load_frames``' x / 255, then 2x - 1), so a table lookup gives the same bits. Kept per device: a
    copy up from pageable memory would wait for the GPU at every step."""
    if device.type != "cpu":
        return _uint8_to_model_range().to(device)
    levels = np.arange(256, dtype=np.uint8).reshape(1, 256, 1)
    return _to_model_range(torch.from_numpy(load_frames(levels)[0, 0, :, 0]))


def prepare_uint8_conditioning(
    observations: list[np.ndarray],
    layout: CanvasLayout,
    num_frames: int,
    *,
    device: torch.device | str = "cpu",
    stacked: bool | None = None,
) -> list[torch.Tensor]:
    """``prepare_conditioning(observation, ...).pixels`` (``[1, 3, num_frames, *canvas_hw]`` float32, the same
    values) of each of many same-shape observations that ``uint8_layout`` took (``layout``), on ``device``.

    Why: per request, ``prepare_conditioning`` makes ~6 float passes over every frame on the host (x / 255, range
    checks, 2x - 1, ...), the largest host cost of a 64-env step. Here each 8-bit level becomes its float by one
    table lookup (exact: a level has one value). On a GPU the uint8 frames go up stacked, in one copy of a quarter of
    the float32 bytes, and the lookups run there; on a CPU the host still writes every float (clip by clip, so that
    they stay in the cache), which saves less. Repeating frames and padding are copies, the same on any device.
    ``stacked``: the GPU's way (default: on any device but the CPU)."""
    device = torch.device(device)
    if stacked is None:
        stacked = device.type != "cpu"
    clips = [clip[None] if clip.ndim == 3 else clip[:num_frames] for clip in observations]  # [T, H, W, 3] each
    if stacked:
        # Stacked straight into pinned memory for a GPU: the copy up does not wait for the kernels already queued.
        levels = torch.empty((len(clips), *clips[0].shape), dtype=torch.uint8, pin_memory=device.type == "cuda")
        np.stack(clips, out=levels.numpy())  # [B, T, H, W, 3]
        pixels = _uint8_to_pixels(levels.to(device, non_blocking=True)).permute(0, 4, 1, 2, 3)  # [B, 3, T, H, W]
        return list(_frames_on_canvas(_keep_frames(pixels, num_frames), layout).split(1))
    per_clip = [_uint8_to_pixels(torch.from_numpy(clip))[None].permute(0, 4, 1, 2, 3) for clip in clips]
    return [_frames_on_canvas(_keep_frames(clip, num_frames), layout) for clip in per_clip]


def _uint8_to_pixels(levels: torch.Tensor) -> torch.Tensor:
    """uint8 levels -> their float32 values in [-1, 1] (``_uint8_to_model_range``), on the levels' device."""
    table = _uint8_to_model_range(levels.device)
    return table.index_select(0, levels.reshape(-1).int()).reshape(levels.shape)  # int32 indexes: half of int64's


def _video_processor_input(frames: np.ndarray) -> list[Image.Image] | np.ndarray:
    """What the pipeline would have been given for these frames.

    diffusers' VideoProcessor snaps a frame to a multiple of 16 with a Pillow bilinear resize for PIL input but a
    torch nearest-neighbour resize for arrays and tensors. Frames that are exactly 8-bit (an image file, a PIL image,
    uint8 pixels) therefore go back in as PIL images, so the result is bit-identical to giving the pipeline the PIL
    image. (Giving the pipeline a uint8 array is no reference: its VideoProcessor scales uint8 as if it were [0, 1].)
    Other float frames go in as the float array, bit-identical to giving the pipeline that float tensor. (A float
    tensor whose values all happen to be multiples of 1/255 takes the PIL route; that differs from the pipeline only
    when its size is not a multiple of 16.)
    """
    eight_bit = np.rint(frames * 255.0)
    if np.array_equal(eight_bit.astype(np.float32) / 255.0, frames):
        return [Image.fromarray(frame) for frame in eight_bit.astype(np.uint8)]
    return frames


# ----------------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------------


def resolve_prompt_format(prompt_format: str, hidden_act: str | None = None) -> str:
    """``"json"`` or ``"plain"``: ``prompt_format`` itself, or for ``"auto"`` PR49's choice from the transformer
    config's ``hidden_act`` ("silu": Cosmos3-Nano, plain; "relu2": Cosmos3-Edge, JSON)."""
    if prompt_format not in PROMPT_FORMATS:
        raise InputError(f"prompt_format: got {prompt_format!r}; expected one of {list(PROMPT_FORMATS)}.")
    if prompt_format != "auto":
        return prompt_format
    if hidden_act not in _PROMPT_FORMAT_BY_HIDDEN_ACT:
        raise InputError(
            f"prompt_format: 'auto' reads the transformer config's hidden_act, expected one of "
            f"{sorted(_PROMPT_FORMAT_BY_HIDDEN_ACT)}, got {hidden_act!r}; pass 'json' or 'plain'."
        )
    return _PROMPT_FORMAT_BY_HIDDEN_ACT[hidden_act]


def build_prompt_text(
    task: str,
    *,
    prompt_format: str = "json",
    view_point: str,
    num_frames: int,
    fps: float,
    height: int,
    width: int,
    additional_view_description: str | None = None,
) -> str:
    """The conditional prompt text before the chat template.

    ``"json"``: ``Cosmos3OmniPipeline._build_action_json_prompt`` (viewpoint sentence, time span, duration, fps,
    resolution, aspect ratio); an ``additional_view_description`` is appended to the framing sentence as PR49 does.
    ``"plain"`` (PR49's ``Cosmos3TextTokenizeStep._augment``): the task, the viewpoint sentence (with the extra
    description), "The video is {int(num_frames / fps):.1f} seconds long and is of {fps:.0f} FPS." and "This video
    is of {height}x{width} resolution.", each joined with " " after a full stop and ". " otherwise.
    """
    if prompt_format == "json":
        caption = Cosmos3OmniPipeline._build_action_json_prompt(
            task, view_point=view_point, num_frames=num_frames, fps=fps, height=height, width=width
        )
        if not additional_view_description:
            return caption
        document = json.loads(caption)  # key order survives the round trip, so only the framing changes
        document["cinematography"]["framing"] = _join_sentence(
            document["cinematography"]["framing"], additional_view_description.rstrip()
        )
        return json.dumps(document)
    if prompt_format != "plain":
        raise InputError(f"prompt_format: got {prompt_format!r}; expected 'json' or 'plain' (resolve 'auto' first).")
    viewpoint = _ACTION_VIEWPOINT_TEMPLATES[view_point]
    if additional_view_description:
        viewpoint = _join_sentence(viewpoint, additional_view_description.rstrip())
    text = _join_sentence(task, viewpoint)
    text = _join_sentence(text, _PLAIN_DURATION_TEMPLATE.format(duration=int(num_frames / fps), fps=fps))
    return _join_sentence(text, _PLAIN_RESOLUTION_TEMPLATE.format(height=height, width=width))


def _join_sentence(text: str, sentence: str) -> str:
    """PR49's joint: ``text + " " + sentence`` when ``text`` (right-stripped) ends with a full stop, else
    ``text + ". " + sentence``; ``text`` itself is kept as it is, trailing spaces included."""
    return text + (" " if text.rstrip().endswith(".") else ". ") + sentence


def build_prompt_token_ids(
    tokenizer: Any,
    task: str,
    *,
    negative_prompt: str | None,
    view_point: str,
    num_frames: int,
    fps: float,
    height: int,
    width: int,
    use_system_prompt: bool | None = None,
    prompt_format: str = "json",
    additional_view_description: str | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids of the conditional and unconditional prompts, as ``Cosmos3OmniPipeline.tokenize_prompt`` builds them
    with ``action_mode`` set (``prompt_format="json"``, the default), or as PR49 builds them (``"plain"``).

    The task becomes the prompt text of ``build_prompt_text``; the negative prompt ("" when None) is used verbatim.
    Each goes through the tokenizer's chat template, then eos and ``<|vision_start|>`` are appended. With
    ``use_system_prompt`` the conversation starts with diffusers' system prompt (the video one when
    ``num_frames > 1``, the image one otherwise); ``None`` means the format's reference: on for JSON (diffusers'
    ``default_use_system_prompt``), off for plain (PR49 and the native server use none). ``num_frames`` is the clip
    length (chunk + 1) and ``height``/``width`` the padded canvas (``Conditioning.canvas_hw``), which is what the
    pipeline and PR49 report.
    """
    if not isinstance(task, str):
        raise InputError(f"task: expected a string, got {type(task).__name__}.")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise InputError(f"negative_prompt: expected a string or None, got {type(negative_prompt).__name__}.")
    if additional_view_description is not None and not isinstance(additional_view_description, str):
        raise InputError(
            f"additional_view_description: expected a string or None, got {type(additional_view_description).__name__}."
        )
    if prompt_format not in ("json", "plain"):
        raise InputError(f"prompt_format: got {prompt_format!r}; expected 'json' or 'plain' (resolve 'auto' first).")
    if use_system_prompt is not None and not isinstance(use_system_prompt, bool):
        raise InputError(f"use_system_prompt: expected True, False or None, got {use_system_prompt!r}.")
    # Stricter than diffusers, which only warns and drops the framing sentence the model was trained with.
    if view_point not in _ACTION_VIEWPOINT_TEMPLATES:
        raise InputError(f"view_point: got {view_point!r}; expected one of {list(VIEW_POINTS)}.")
    if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames < 1:
        raise InputError(f"num_frames: expected an integer >= 1, got {num_frames!r}.")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        raise InputError(f"fps: expected a positive number, got {fps!r}.")

    eos_id = tokenizer.eos_token_id
    vision_start_id = tokenizer.convert_tokens_to_ids(_VISION_START_TOKEN)
    has_vision_start = vision_start_id is not None and (
        tokenizer.convert_ids_to_tokens(vision_start_id) == _VISION_START_TOKEN
    )
    if eos_id is None or not has_vision_start:
        raise InputError(
            f"tokenizer: needs an eos token and the {_VISION_START_TOKEN} token (a Cosmos3 text_tokenizer)."
        )

    caption = build_prompt_text(
        task,
        prompt_format=prompt_format,
        view_point=view_point,
        num_frames=num_frames,
        fps=fps,
        height=height,
        width=width,
        additional_view_description=additional_view_description,
    )
    if use_system_prompt is None:
        use_system_prompt = prompt_format == "json"
    system_prompt = (_SYSTEM_PROMPT_IMAGE if num_frames == 1 else _SYSTEM_PROMPT_VIDEO) if use_system_prompt else None

    def token_ids(text: str) -> list[int]:
        conversation = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        conversation.append({"role": "user", "content": text})
        encoding = tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=True, add_vision_id=False, return_dict=True
        )
        return list(encoding.input_ids) + [eos_id, vision_start_id]

    return token_ids(caption), token_ids("" if negative_prompt is None else negative_prompt)


# ----------------------------------------------------------------------------------------------------------------
# Domains and actions
# ----------------------------------------------------------------------------------------------------------------


def resolve_domain(
    domain: str | int, raw_action_dim: int | None = None, action_dim: int = ACTION_DIM
) -> tuple[int, int]:
    """``(domain_id, raw_action_dim)`` for an embodiment name from diffusers' table or an integer domain id.

    An explicit ``raw_action_dim`` wins over the table: one domain id serves checkpoints trained on different action
    layouts (the released DROID policy uses 8-D joint positions, the table says 10). An integer id has no table
    entry, so it needs ``raw_action_dim``.
    """
    if isinstance(domain, bool) or not isinstance(domain, (str, int)):
        raise InputError(f"domain: expected an embodiment name or an integer domain id, got {domain!r}.")
    if isinstance(domain, int):
        if not 0 <= domain < NUM_EMBODIMENT_DOMAINS:
            raise InputError(f"domain: integer domain id must be in [0, {NUM_EMBODIMENT_DOMAINS}), got {domain}.")
        if raw_action_dim is None:
            raise InputError(f"raw_action_dim: required with an integer domain id ({domain}); only names have a width.")
        domain_id = domain
    else:
        if domain not in _EMBODIMENT_TO_DOMAIN_ID:
            raise InputError(f"domain: unknown embodiment {domain!r}; expected one of {list(DOMAIN_NAMES)}.")
        domain_id = _EMBODIMENT_TO_DOMAIN_ID[domain]
        if raw_action_dim is None:
            if domain not in _EMBODIMENT_TO_RAW_ACTION_DIM:
                raise InputError(f"raw_action_dim: domain {domain!r} has no standard action width; pass it explicitly.")
            raw_action_dim = _EMBODIMENT_TO_RAW_ACTION_DIM[domain]
    _check_raw_action_dim(raw_action_dim, action_dim)
    return domain_id, raw_action_dim


def _check_raw_action_dim(raw_action_dim: Any, action_dim: int) -> None:
    if isinstance(raw_action_dim, bool) or not isinstance(raw_action_dim, int) or not 1 <= raw_action_dim <= action_dim:
        raise InputError(f"raw_action_dim: expected an integer in [1, {action_dim}], got {raw_action_dim!r}.")


def prepare_action_chunk(actions: Any, chunk: int, raw_action_dim: int, action_dim: int = ACTION_DIM) -> torch.Tensor:
    """Raw actions ``[T, raw_action_dim]`` -> the model's float32 action rows ``[chunk, action_dim]``.

    Like ``Cosmos3OmniPipeline.prepare_latents`` for forward_dynamics: longer inputs are truncated to ``chunk``,
    shorter ones repeat their last row, and the channels are zero-padded to ``action_dim``.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InputError(f"chunk: expected an integer >= 1, got {chunk!r}.")
    _check_raw_action_dim(raw_action_dim, action_dim)
    rows = _as_float_matrix(actions, "actions")
    if rows.shape[1] != raw_action_dim:
        raise InputError(f"actions: expected {raw_action_dim} values per row (raw_action_dim), got {rows.shape[1]}.")

    padded = torch.from_numpy(rows)
    if padded.shape[0] < chunk:
        padded = torch.cat([padded, padded[-1:].expand(chunk - padded.shape[0], -1)], dim=0)
    padded = padded[:chunk]
    return F.pad(padded, (0, action_dim - raw_action_dim))


@overload
def flip_gripper(actions: np.ndarray) -> np.ndarray: ...
@overload
def flip_gripper(actions: torch.Tensor) -> torch.Tensor: ...
@overload
def flip_gripper(actions: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor: ...
def flip_gripper(actions: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """A copy with the last channel (the gripper) mapped g -> 1 - g, PR49's ``flip_gripper`` and the native RoboLab
    server's convention change (the model's gripper is 1 - the robot's). Its own inverse."""
    if isinstance(actions, torch.Tensor):
        cloned = actions.clone()
        cloned[..., -1] = 1.0 - cloned[..., -1]
        return cloned
    flipped = np.array(actions, dtype=np.float32)
    flipped[..., -1] = 1.0 - flipped[..., -1]
    return flipped


def prepare_action_rows(
    mode: str,
    chunk: int,
    raw_action_dim: int,
    action_dim: int = ACTION_DIM,
    *,
    actions: Any = None,
    history: Any = None,
    history_length: int = 0,
    flip: bool = False,
) -> tuple[torch.Tensor, list[int]]:
    """The model's action rows ``[history_length + chunk, action_dim]`` and the indexes of the clean ones.

    As PR49's ``Cosmos3ActionPadStep``: the last ``history_length`` rows of ``history`` (the proprio state, e.g.
    7 joint positions + gripper) come first as clean rows, so ``ACTION_CHUNK = chunk + history_length`` and the
    action positions start at ``1 - history_length`` (``action_start_offset``); the chunk follows, clean for
    forward dynamics (``prepare_action_chunk``) and zero (to be generated) otherwise. With ``flip`` the gripper of
    the history and of the given actions is flipped first. ``history_length=0`` and no flip is diffusers' layout.
    """
    if isinstance(history_length, bool) or not isinstance(history_length, int) or history_length < 0:
        raise InputError(f"action_history_length: expected an integer >= 0, got {history_length!r}.")
    _check_raw_action_dim(raw_action_dim, action_dim)
    rows = []
    if history_length:
        if history is None:
            raise InputError(
                f"action_history: the request needs {history_length} state row(s) [history, raw_action_dim] "
                "(action_history_length); pass the robot's current state."
            )
        state = _as_float_matrix(history, "action_history")
        if state.shape[1] != raw_action_dim:
            raise InputError(
                f"action_history: expected {raw_action_dim} values per row (raw_action_dim), got {state.shape[1]}."
            )
        if state.shape[0] < history_length:
            raise InputError(
                f"action_history: expected at least {history_length} rows (action_history_length), "
                f"got {state.shape[0]}."
            )
        state = state[-history_length:]
        rows.append(torch.from_numpy(flip_gripper(state) if flip else state))
    elif history is not None:
        raise InputError("action_history: given, but action_history_length is 0; set it to the rows to use.")
    if mode == "forward_dynamics":
        if actions is None:
            raise InputError("actions: mode 'forward_dynamics' needs an action chunk [T, raw_action_dim]")
        given = _as_float_matrix(actions, "actions")
        chunk_rows = prepare_action_chunk(flip_gripper(given) if flip else given, chunk, raw_action_dim, action_dim)
        clean = list(range(history_length + chunk))
    else:
        chunk_rows = torch.zeros(chunk, action_dim)
        clean = list(range(history_length))
    history_rows = [F.pad(r, (0, action_dim - raw_action_dim)) for r in rows]
    return torch.cat([*history_rows, chunk_rows], dim=0), clean


def _as_float_matrix(values: Any, field: str) -> np.ndarray:
    """A finite float32 ``[T, D]`` array with ``T >= 1``; InputError naming ``field`` otherwise."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().float().numpy()
    try:
        matrix = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as error:  # ragged or non-numeric nested lists
        raise InputError(f"{field}: expected a numeric [T, D] array ({error}).") from error
    if matrix.ndim != 2 or matrix.shape[0] < 1 or matrix.shape[1] < 1:
        raise InputError(f"{field}: expected shape [T, D] with T >= 1, got {matrix.shape}.")
    if not np.isfinite(matrix).all():
        raise InputError(f"{field}: contains NaN or infinity.")
    return matrix


# ----------------------------------------------------------------------------------------------------------------
# Action statistics
# ----------------------------------------------------------------------------------------------------------------

_STATS_KEYS = ("mean", "std", "min", "max", "q01", "q99")


@dataclass(frozen=True)
class ActionStats:
    """Dataset action statistics mapping the model's normalised actions (about [-1, 1]) to raw units and back.

    ``meanstd``: raw = x * std + mean.  ``minmax``: raw = (x + 1) / 2 * (max - min) + min.  ``quantile``: the same
    with q01/q99.  ``quantile_rot``: the quantile mapping with the statistics of the ``global_raw`` block (native
    cosmos-framework stats files keep identity rotation statistics in ``global`` and the real ones there).
    As in PhyAI's processor, std is clamped to >= 1e-8 and the range to >= 1e-6 so constant dims stay invertible.
    """

    mode: str
    offset: np.ndarray  # mean (meanstd) or the lower bound: min / q01
    scale: np.ndarray  # std (meanstd) or the range: max - min / q99 - q01
    source: str = "<dict>"

    @property
    def dim(self) -> int:
        return int(self.offset.shape[0])

    @classmethod
    def from_json(
        cls, path_or_dict: str | os.PathLike | dict, mode: str = "minmax", dataset: str | None = None
    ) -> ActionStats:
        """Load statistics from a JSON file or an already parsed dict.

        Accepted layouts: the statistics at the top level (``{"mean": [...], "std": [...], "min": ..., "max": ...,
        "q01": ..., "q99": ...}``), under ``"action"`` (LeRobot ``stats.json``), under a dataset name
        (RLinf / OpenVLA ``dataset_statistics.json``: ``{<name>: {"action": {...}}}``; pick one with ``dataset``
        when there are several), and under ``"global"`` / ``"global_raw"`` (native cosmos-framework files).
        """
        if mode not in ACTION_NORMALIZATION_MODES:
            raise InputError(f"action stats mode: got {mode!r}; expected one of {list(ACTION_NORMALIZATION_MODES)}.")
        if isinstance(path_or_dict, dict):
            document, source = path_or_dict, "<dict>"
        else:
            source = str(path_or_dict)
            try:
                document = json.loads(Path(path_or_dict).read_text())
            except (OSError, ValueError) as error:
                raise InputError(f"action stats file {source}: cannot read it as JSON ({error}).") from error
        if not isinstance(document, dict):
            raise InputError(f"action stats file {source}: expected a JSON object, got {type(document).__name__}.")

        block = _select_stats_block(document, mode, source, dataset)
        first_key, second_key = _STATS_KEYS_BY_MODE[mode]
        first, second = _stats_vector(block, first_key, source), _stats_vector(block, second_key, source)
        if first.shape != second.shape:
            raise InputError(
                f"action stats file {source}: {first_key!r} has {first.shape[0]} values but {second_key!r} has "
                f"{second.shape[0]}."
            )
        if mode == "meanstd":
            offset, scale = first, np.maximum(second, 1e-8)
        else:
            offset, scale = first, np.maximum(second - first, 1e-6)
        return cls(mode=mode, offset=offset, scale=scale, source=source)

    @overload
    def denormalize(self, actions: np.ndarray) -> np.ndarray: ...
    @overload
    def denormalize(self, actions: torch.Tensor) -> torch.Tensor: ...
    @overload
    def denormalize(self, actions: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor: ...
    def denormalize(self, actions: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        """Normalised actions ``[..., D]`` -> raw units (same type, dtype and device as the input)."""
        offset, scale = self._as_operands(actions)
        if self.mode == "meanstd":
            return actions * scale + offset
        return (actions + 1.0) / 2.0 * scale + offset

    @overload
    def normalize(self, actions: np.ndarray) -> np.ndarray: ...
    @overload
    def normalize(self, actions: torch.Tensor) -> torch.Tensor: ...
    @overload
    def normalize(self, actions: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor: ...
    def normalize(self, actions: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        """Raw actions ``[..., D]`` -> the model's normalised space (the inverse of ``denormalize``)."""
        offset, scale = self._as_operands(actions)
        if self.mode == "meanstd":
            return (actions - offset) / scale
        return (actions - offset) / scale * 2.0 - 1.0

    def _as_operands(self, actions: np.ndarray | torch.Tensor) -> tuple[Any, Any]:
        if not isinstance(actions, (np.ndarray, torch.Tensor)):
            raise InputError(f"actions: expected a numpy array or torch tensor, got {type(actions).__name__}.")
        if actions.ndim < 1 or actions.shape[-1] != self.dim:
            raise InputError(
                f"action stats file {self.source}: the statistics have {self.dim} dims but the actions have shape "
                f"{tuple(actions.shape)}."
            )
        if isinstance(actions, torch.Tensor):
            dtype = actions.dtype if actions.is_floating_point() else torch.float32
            return (
                torch.as_tensor(self.offset, dtype=dtype, device=actions.device),
                torch.as_tensor(self.scale, dtype=dtype, device=actions.device),
            )
        np_dtype = actions.dtype if np.issubdtype(actions.dtype, np.floating) else np.float32
        return self.offset.astype(np_dtype), self.scale.astype(np_dtype)


def _select_stats_block(document: dict, mode: str, source: str, dataset: str | None) -> dict:
    block = document
    if dataset is not None:
        if not isinstance(block.get(dataset), dict):
            raise InputError(f"action stats file {source}: no dataset {dataset!r}; keys are {sorted(block)}.")
        block = block[dataset]
    elif not any(key in block for key in (*_STATS_KEYS, "action", "global", "global_raw")):
        datasets = sorted(key for key, value in block.items() if isinstance(value, dict) and "action" in value)
        if len(datasets) > 1:
            raise InputError(
                f"action stats file {source}: holds several datasets {datasets}; choose one with `dataset`."
            )
        if datasets:
            block = block[datasets[0]]
    if isinstance(block.get("action"), dict):
        block = block["action"]
    if mode == "quantile_rot":
        if not isinstance(block.get("global_raw"), dict):
            raise InputError(f"action stats file {source}: mode 'quantile_rot' needs a 'global_raw' block.")
        block = block["global_raw"]
    elif isinstance(block.get("global"), dict):
        block = block["global"]
    return block


def _stats_vector(block: dict, key: str, source: str) -> np.ndarray:
    if key not in block:
        raise InputError(f"action stats file {source}: missing field {key!r} (found {sorted(block)}).")
    try:
        vector = np.asarray(block[key], dtype=np.float32)
    except (TypeError, ValueError) as error:
        raise InputError(f"action stats file {source}: field {key!r} is not a list of numbers ({error}).") from error
    if vector.ndim != 1 or vector.shape[0] < 1:
        raise InputError(f"action stats file {source}: field {key!r} must be a flat list, got shape {vector.shape}.")
    if not np.isfinite(vector).all():
        raise InputError(f"action stats file {source}: field {key!r} contains NaN or infinity.")
    return vector


# ----------------------------------------------------------------------------------------------------------------
# Action files
# ----------------------------------------------------------------------------------------------------------------


def load_action_file(path: str | os.PathLike, chunk_index: int = 0) -> np.ndarray:
    """Read float32 actions ``[T, D]`` from ``{"shape": [T, D], "dtype": ..., "data": [[...], ...]}`` or from
    ``{"action_chunks": [[[...], ...], ...]}`` (the chunk ``chunk_index``)."""
    field = f"action file {path}"
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise InputError(f"{field}: cannot read it as JSON ({error}).") from error

    if isinstance(document, dict) and "data" in document:
        actions = _as_float_matrix(document["data"], field)
        if "shape" in document and list(document["shape"]) != list(actions.shape):
            raise InputError(f"{field}: 'shape' says {document['shape']} but 'data' is {list(actions.shape)}.")
        return actions
    if isinstance(document, dict) and "action_chunks" in document:
        chunks = document["action_chunks"]
        if not isinstance(chunks, list) or not chunks:
            raise InputError(f"{field}: 'action_chunks' must be a non-empty list of [T, D] chunks.")
        if isinstance(chunk_index, bool) or not isinstance(chunk_index, int) or not 0 <= chunk_index < len(chunks):
            raise InputError(f"{field}: chunk_index {chunk_index!r} is out of range; it has {len(chunks)} chunks.")
        return _as_float_matrix(chunks[chunk_index], field)
    raise InputError(
        f'{field}: expected {{"shape", "dtype", "data"}} or {{"action_chunks"}}, got '
        f"{sorted(document) if isinstance(document, dict) else type(document).__name__}."
    )


def save_action_file(path: str | os.PathLike, actions: np.ndarray | torch.Tensor) -> None:
    """Write actions ``[T, D]`` as ``{"shape": [T, D], "dtype": "float32", "data": [[...], ...]}``."""
    matrix = _as_float_matrix(actions, "actions")
    document = {"shape": list(matrix.shape), "dtype": "float32", "data": matrix.tolist()}
    Path(path).write_text(json.dumps(document))
