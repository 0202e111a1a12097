"""Presets: named, documented bundles of processor and sampler settings for a ``Cosmos3Request``.

A checkpoint works best with the prompts, action layout, canvas and sampler it was trained and served with, and a
wrong setting fails silently (worse actions, no error). A preset names one such consistent set:

- ``"diffusers"``: diffusers' ``Cosmos3OmniPipeline`` (the numerics reference and the request defaults): JSON action
  caption with the system prompt, no state rows, no gripper flip, the canvas snapped to multiples of 16, the sigma
  schedule of the checkpoint's ``scheduler_config.json``. Steps, guidance, chunk and fps stay the request's.
- ``"droid_robolab"``: NVIDIA's RoboLab policy server for **Cosmos3-Nano-Policy-DROID** (and Edge), as PhyAI's PR49
  (``Cosmos3RoboLabPolicyProcessor``) reproduces it: the wrist camera on top of the two exterior cameras composited
  to 540x640 and fitted on the 544x736 tier-480 canvas unscaled (reflect pad), ``concat_view`` with the camera-layout
  description, PR49's prompt format picked from the checkpoint ("auto": plain for Nano, JSON for Edge) without a
  system prompt, 8-D joint-position actions (7 joints + gripper) in domain ``droid_lerobot``, one proprio state row
  prepended as a clean action row, the gripper flipped (g -> 1 - g) on the way in and out, chunk 32 at 15 fps,
  4 UniPC steps, guidance 3, flow shift 5 on native cosmos' linear flow sigmas (not Karras).

How a preset applies (``resolve_request``, ``resolve_settings``): every setting the preset names takes the preset's
value where the request still holds ``Cosmos3Request``'s default; a value you set yourself wins. The fields added for
the released checkpoints (``prompt_format``, ``canvas``, ``flip_gripper``, ...) default to None, "unset", so any value
you give wins; the older ones (``chunk``, ``num_inference_steps``, ...) have real defaults, and a value equal to the
default cannot be told from it (to force ``num_inference_steps=4`` under a preset whose steps differ, leave the preset
out). Fields
still unset afterwards get diffusers' behaviour (``UNSET_DEFAULTS``). The engine applies a request's ``preset``, else
the engine's (``Cosmos3Engine.from_pretrained(preset=...)``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .errors import InputError

__all__ = [
    "OBSERVATION_ADAPTERS",
    "PRESETS",
    "ROBOLAB_CAMERA_KEYS",
    "UNSET_DEFAULTS",
    "ROBOLAB_CONCAT_VIEW_DESCRIPTION",
    "ROBOLAB_IMAGE_HW",
    "Preset",
    "adapt_observation",
    "get_preset",
    "resolve_request",
    "resolve_settings",
    "robolab_composite",
    "robolab_state",
]

# The camera-layout sentence the RoboLab policy was trained with (PR49's COSMOS3_ROBOLAB_CONCAT_VIEW_DESCRIPTION).
ROBOLAB_CONCAT_VIEW_DESCRIPTION = (
    "The top row is from the wrist-mounted camera. "
    "The bottom row contains two horizontally concatenated third-person "
    "perspective views of the scene from opposite sides, with the robot visible."
)
ROBOLAB_IMAGE_HW = (540, 640)  # the server resizes every composite to this before the canvas
# (wrist, exterior 1, exterior 2): the RoboLab / OpenPI request keys, and the short names also accepted.
ROBOLAB_CAMERA_KEYS = (
    ("observation/wrist_image_left", "observation/exterior_image_1_left", "observation/exterior_image_2_left"),
    ("wrist", "exterior_1", "exterior_2"),
)
_ROBOLAB_IMAGE_KEYS = ("observation/image", "image")  # an already composited image


@dataclass(frozen=True)
class Preset:
    """One named bundle of ``Cosmos3Request`` settings; ``None`` in a setting means "the request's own value"."""

    name: str
    description: str
    # processor
    prompt_format: str | None = None
    use_system_prompt: bool | None = None
    view_point: str | None = None
    additional_view_description: str | None = None
    canvas: str | None = None
    observation_adapter: str | None = None
    resolution_tier: int | None = None
    domain: str | int | None = None
    raw_action_dim: int | None = None
    action_history_length: int | None = None
    flip_gripper: bool | None = None
    cond_frame_indexes: tuple[int, ...] | None = None
    # sampler
    chunk: int | None = None
    fps: float | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    flow_shift: float | None = None
    use_karras_sigmas: bool | None = None
    use_native_flow_schedule: bool | None = None
    # Not a request field: whether the checkpoint's actions are in the normalised [-1, 1] space (agents clip them
    # there) or raw units (the released DROID policy returns joint positions in radians and the gripper in [0, 1]).
    normalized_actions: bool = True

    def settings(self) -> dict[str, Any]:
        """The ``Cosmos3Request`` fields this preset sets, with their values."""
        skip = ("name", "description", "normalized_actions")
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in skip and getattr(self, f.name) is not None
        }


PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        "diffusers": Preset(
            name="diffusers",
            description="diffusers' Cosmos3OmniPipeline: JSON caption + system prompt, no state rows, no flip, "
            "canvas snapped to multiples of 16, the checkpoint's scheduler config",
            prompt_format="json",
            use_system_prompt=True,
            canvas="diffusers",
            action_history_length=0,
            flip_gripper=False,
            use_native_flow_schedule=False,
        ),
        "droid_robolab": Preset(
            name="droid_robolab",
            description="NVIDIA's RoboLab server for Cosmos3-Nano-Policy-DROID / Edge (PhyAI PR49): 3-camera "
            "composite on the 544x736 canvas, concat_view, auto prompt format, 8-D joint positions + 1 state row, "
            "gripper flip, chunk 32 @ 15 fps, 4 steps, guidance 3, shift 5, linear sigmas",
            prompt_format="auto",
            use_system_prompt=False,
            view_point="concat_view",
            additional_view_description=ROBOLAB_CONCAT_VIEW_DESCRIPTION,
            canvas="native",
            observation_adapter="robolab_composite",
            resolution_tier=480,
            domain="droid_lerobot",
            raw_action_dim=8,
            action_history_length=1,
            flip_gripper=True,
            cond_frame_indexes=(0,),
            chunk=32,
            fps=15.0,
            num_inference_steps=4,
            guidance_scale=3.0,
            flow_shift=5.0,
            use_karras_sigmas=False,
            use_native_flow_schedule=True,
            normalized_actions=False,
        ),
    }
)


# What the request fields that default to None mean when neither the request nor a preset sets them: diffusers'.
# (use_system_prompt stays None: it then follows the prompt format, see processor.build_prompt_token_ids.)
UNSET_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "prompt_format": "json",
        "canvas": "diffusers",
        "action_history_length": 0,
        "flip_gripper": False,
        "use_native_flow_schedule": False,
    }
)


def get_preset(name: str | Preset) -> Preset:
    if isinstance(name, Preset):
        return name
    if name not in PRESETS:
        raise InputError(f"preset: got {name!r}; expected one of {sorted(PRESETS)}.")
    return PRESETS[name]


def resolve_settings(
    preset: str | Preset | None, settings: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``settings`` (``Cosmos3Request`` field -> value) with the preset applied: each field the preset sets takes
    its value where ``settings`` lacks it or holds its value in ``defaults`` (``resolve_request``: the request's
    defaults). Fields still None afterwards get ``UNSET_DEFAULTS``."""
    resolved = dict(settings)
    if preset is not None:
        defaults = defaults or {}
        for field, value in get_preset(preset).settings().items():
            if field not in resolved or _same(resolved[field], defaults.get(field, dataclasses.MISSING)):
                resolved[field] = value
    for field, value in UNSET_DEFAULTS.items():
        if field in resolved and resolved[field] is None:
            resolved[field] = value
    return resolved


def resolve_request(request: Any, default_preset: str | Preset | None = None) -> Any:
    """``request`` with its preset (else ``default_preset``) applied, unset fields filled (``UNSET_DEFAULTS``) and
    ``preset`` cleared."""
    preset = request.preset if request.preset is not None else default_preset
    # a class is hashable; mypy does not match type objects to the Hashable protocol of functools.cache's wrapper
    names, defaults = field_defaults(type(request))  # type: ignore[arg-type]
    resolved = resolve_settings(preset, {name: getattr(request, name) for name in names}, defaults)
    return dataclasses.replace(request, **{**resolved, "preset": None})


@functools.cache
def field_defaults(request_type: type) -> tuple[tuple[str, ...], dict[str, Any]]:
    """A request dataclass's field names and defaults, read once (``dataclasses.fields`` costs a vector env's step
    tens of microseconds per slot). The defaults dict is never mutated."""
    fields = dataclasses.fields(request_type)
    return tuple(f.name for f in fields), {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


def _same(value: Any, default: Any) -> bool:
    if value is None or default is None:
        return value is default
    if isinstance(value, (np.ndarray, torch.Tensor)) or isinstance(default, (np.ndarray, torch.Tensor)):
        return False
    return type(value) is type(default) and value == default


# ----------------------------------------------------------------------------------------------------------------
# Observation adapters: what the caller has -> the single image the processor puts on the canvas
# ----------------------------------------------------------------------------------------------------------------


def _rgb_uint8(value: Any, key: str) -> np.ndarray:
    """One camera image as a contiguous ``[H, W, 3]`` uint8 array. Arrays are taken as the server takes them (other
    dtypes clipped to 0-255); anything else ``processor.load_frames`` reads (a path, a PIL image, a ``CHW`` tensor)
    gives its first frame."""
    if not isinstance(value, np.ndarray):
        from .processor import load_frames

        return np.ascontiguousarray(np.rint(load_frames(value)[0] * 255.0).astype(np.uint8))
    image = value
    if image.ndim != 3 or image.shape[-1] != 3:
        raise InputError(f"observation[{key!r}]: expected an RGB image [H, W, 3], got shape {image.shape}.")
    if image.dtype != np.uint8:
        if not np.issubdtype(image.dtype, np.number) or not np.isfinite(image).all():
            raise InputError(f"observation[{key!r}]: expected finite uint8 pixel values, got dtype {image.dtype}.")
        image = np.clip(image, 0, 255).astype(np.uint8)
    return np.ascontiguousarray(image)


def _resize_bilinear_uint8(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The RoboLab server's resize: float bilinear (half-pixel centres, no antialias), then a truncating uint8 cast."""
    tensor = torch.tensor(image).permute(2, 0, 1)[None].float()  # a copy: env frames may be read-only arrays
    resized = F.interpolate(tensor, size=size, mode="bilinear", align_corners=False)
    return resized[0].permute(1, 2, 0).numpy().astype(np.uint8)


def robolab_composite(observation: Any) -> np.ndarray:
    """The RoboLab policy's input image, uint8 ``[540, 640, 3]``, as PR49's ``Cosmos3RoboLabPolicyProcessor``.

    ``observation``: a dict with the three cameras under the RoboLab keys (``observation/wrist_image_left``,
    ``observation/exterior_image_1_left``, ``observation/exterior_image_2_left``) or the short ones (``wrist``,
    ``exterior_1``, ``exterior_2``): the two exterior images are resized to half the wrist image's size and put side
    by side under it. Or an already composited image (``observation/image`` / ``image`` in a dict, or the image
    itself). The result is resized to 540x640 unless it already is.
    """
    if isinstance(observation, Mapping):
        image = None
        for key in _ROBOLAB_IMAGE_KEYS:
            if key in observation:
                image = _rgb_uint8(observation[key], key)
                break
        if image is None:
            keys = next((keys for keys in ROBOLAB_CAMERA_KEYS if all(k in observation for k in keys)), None)
            if keys is None:
                raise InputError(
                    f"observation: the robolab_composite adapter needs {list(_ROBOLAB_IMAGE_KEYS)[0]!r} or the three "
                    f"cameras {list(ROBOLAB_CAMERA_KEYS[0])} (or {list(ROBOLAB_CAMERA_KEYS[1])}), got keys "
                    f"{sorted(map(str, observation))}."
                )
            wrist, left, right = (_rgb_uint8(observation[key], key) for key in keys)
            half = (wrist.shape[0] // 2, wrist.shape[1] // 2)
            bottom = np.concatenate([_resize_bilinear_uint8(left, half), _resize_bilinear_uint8(right, half)], axis=1)
            if bottom.shape[1] != wrist.shape[1]:  # an odd wrist width leaves the bottom row one pixel narrower
                raise InputError(f"observation[{keys[0]!r}]: the wrist image needs an even width, got {wrist.shape}.")
            image = np.concatenate([wrist, bottom], axis=0)
    else:
        image = _rgb_uint8(observation, "image")
    if image.shape[:2] != ROBOLAB_IMAGE_HW:
        image = _resize_bilinear_uint8(image, ROBOLAB_IMAGE_HW)
    return image


def robolab_state(observation: Mapping[str, Any], history_length: int = 1) -> np.ndarray | None:
    """The last ``history_length`` proprio rows ``[history_length, 8]`` (7 joint positions + gripper, the robot's own
    gripper convention) from a RoboLab observation dict, or None when it has no ``observation/joint_position``."""
    if not isinstance(observation, Mapping) or "observation/joint_position" not in observation:
        return None
    joints = np.asarray(observation["observation/joint_position"], dtype=np.float32)
    joints = joints[None] if joints.ndim == 1 else joints
    if "observation/gripper_position" not in observation:
        raise InputError("observation: 'observation/joint_position' needs its 'observation/gripper_position'.")
    gripper = np.asarray(observation["observation/gripper_position"], dtype=np.float32).reshape(-1, 1)
    if joints.ndim != 2 or joints.shape[1] != 7 or len(gripper) != len(joints):
        raise InputError(
            "observation: 'observation/joint_position' must be [T, 7] (or [7]) with one "
            f"'observation/gripper_position' per row, got {joints.shape} and {gripper.shape}."
        )
    if len(joints) < history_length:
        raise InputError(f"observation: {history_length} state rows needed, got {len(joints)}.")
    return np.concatenate([joints, gripper], axis=1)[len(joints) - history_length :]


OBSERVATION_ADAPTERS: Mapping[str, Callable[[Any], Any]] = MappingProxyType({"robolab_composite": robolab_composite})


def adapt_observation(observation: Any, adapter: str | None) -> Any:
    """``observation`` through the named adapter (``None``: unchanged)."""
    if adapter is None:
        return observation
    if adapter not in OBSERVATION_ADAPTERS:
        raise InputError(
            f"observation_adapter: got {adapter!r}; expected None or one of {sorted(OBSERVATION_ADAPTERS)}."
        )
    return OBSERVATION_ADAPTERS[adapter](observation)
