"""``WorldModelSettings``: every setting of a world-model env in one frozen, validated object.

The envs (``WorldModelEnv``, ``WorldModelVectorEnv``) and the agents (``PolicyAgent``, ``InverseDynamicsAgent``)
take either ``settings=WorldModelSettings(...)`` or the same fields as keyword arguments (keywords win over
``settings``), and expose the result as ``.settings``. ``PolicyAgent.from_env(env)`` builds an agent with the env's
settings, so its actions fit ``env.step``.

Everything is checked once, here, before any model is loaded; each bad value is an ``InputError`` naming the field.
The settings that need the model (the domain's action width against the transformer's, ``chunk`` against the VAE's
temporal compression) are checked by ``check_engine`` when the engine is known.

Adding a setting is one line in the class body (and, where it needs one, one check in ``__post_init__``).
What is not a setting but a resource stays an argument of the env: the checkpoint or engine, the initial states,
the reward model, the render mode, and how to load the engine (device, dtype, parallel degrees).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from .. import presets, processor
from ..checkpoint import HANDOVERS
from ..errors import InputError

logger = logging.getLogger(__name__)

REWARD_MODES = ("per_step", "terminal", "relative")
# obs_type: "image" -> Dict({"image": Box}) (the default), "pixels" -> the Box itself (as pixel envs name it).
OBS_TYPES = ("image", "pixels")
IMAGINATION_REDUCTIONS = ("mean", "min")
# Cosmos3Request fields a user may set through ``request_options``; the env sets the others itself.
REQUEST_OPTION_KEYS = (
    "flow_shift",
    "use_karras_sigmas",
    "view_point",
    "negative_prompt",
    "additional_view_description",
    "canvas",
    "use_native_flow_schedule",
)
# Preset fields (``presets.Preset``, named as on ``Cosmos3Request``) under another name here.
_PRESET_FIELD_NAMES = {"num_inference_steps": "num_steps"}


@dataclass(frozen=True)
class WorldModelSettings:
    """The settings of a world-model env (and of an agent acting in it). Defaults are the DROID policy's; a
    checkpoint's ``meta.json`` supplies its own (``checkpoint.checkpoint_defaults``) unless the user overrides them.

    Attributes:
        domain / raw_action_dim: the embodiment (name or integer id) and its action width (default: the domain's).
        chunk, num_steps, guidance_scale, resolution_tier, fps: the model's request settings (``Cosmos3Request``).
        task: the instruction; None uses each initial state's own task (or ""). A tuple gives one per vector slot.
        image_size: the model frame size ``(H, W)``; default: derived from the first initial state.
        observation_size: ``(h, w)`` to downscale observations to; the model keeps working at ``image_size``.
        obs_type: "image" (observations ``{"image": uint8 [h, w, 3]}``) or "pixels" (the image array itself, as
            the ``obs_type="pixels"`` of pixel-observation envs).
        reward_mode: "per_step", "terminal" or "relative" (see ``WorldModelEnv``).
        success_threshold: ``terminated`` when the reward model's score reaches it (``info["is_success"]``).
        max_episode_steps: truncate after this many chunks.
        score_name: another name for ``info["score"]`` saying what the score measures (e.g. "coverage").
        action_stats: ``processor.ActionStats`` (or a statistics JSON path / dict, minmax) for ``info["raw_action"]``.
        return_frames: put each chunk's generated frames in ``info["frames"]``.
        imagination_samples: K > 1 scores every chunk by K imagined samples of the same action chunk (K
            forward-dynamics requests with different noise seeds, in the same batched call: K times the model and
            decode work); the slot continues from the first sample, its score is their ``imagination_reduce`` ("mean",
            or "min": pessimistic) and ``info["score_samples"]`` holds all K. The sampling noise alone moves the
            built-in model's imagined coverage by 0.06; the mean of 3 tracks the real coverage after 4 chunks at Pearson
            0.78 instead of 0.68 (``benchmarks/wm_reward_audit.py``, benchmarks/RESULTS.md).
        request_options: extra ``Cosmos3Request`` fields: flow_shift, use_karras_sigmas, view_point, negative_prompt,
            additional_view_description, canvas, use_native_flow_schedule.
        preset: a ``presets.PRESETS`` name (e.g. "droid_robolab"): fills the settings above left at their defaults
            (domain, raw_action_dim, chunk, num_steps, ...); the engine applies the rest of it to every request.
        prompt_format, use_system_prompt, flip_gripper, action_history_length: how the checkpoint was trained
            (``Cosmos3Request``); None: the preset's, else diffusers' behaviour. ``action_history_length``: state rows
            each request carries (the env sends each slot's last executed action rows, at an episode's first step
            the chunk's first row); ``history_length`` is the resolved count.
        handover / context_frames: how a chunk hands over to the next (the envs' forward dynamics; agents condition
            on their observation whatever these say). "pixels" (default): the chunk's decoded last frame conditions the
            next chunk, encoded again. "latent": the last ``context_frames`` (K) latent frames of the chunk (its
            context included) condition the next one as they are (``Cosmos3Request.context_latents``); an episode
            starts from its start frame's latent repeated K times. K > 1 needs "latent"; "latent" needs a chunk that
            is a multiple of the VAE's temporal compression and an in-process engine (``Cosmos3Engine``).
        context_noise: the noise level (a flow sigma in [0, 1)) on the clean frames that condition each chunk of the
            envs' forward dynamics, with that level's timestep on their tokens (``Cosmos3Request.context_noise``): for
            checkpoints trained with context noise (their meta.json names the level they run at); 0 (default): clean.
            Agents condition on real observations and never add it.
    """

    domain: str | int = "droid_lerobot"
    raw_action_dim: int | None = None
    chunk: int = 32
    num_steps: int = 4
    guidance_scale: float = 3.0
    resolution_tier: int = 480
    fps: float = 15.0
    task: str | tuple[str | None, ...] | None = None
    image_size: tuple[int, int] | None = None
    observation_size: tuple[int, int] | None = None
    obs_type: str = "image"
    reward_mode: str = "per_step"
    success_threshold: float | None = None
    max_episode_steps: int | None = None
    score_name: str | None = None
    action_stats: processor.ActionStats | None = field(default=None, compare=False)
    return_frames: bool = False
    imagination_samples: int = 1
    imagination_reduce: str = "mean"
    request_options: Mapping[str, Any] = field(default_factory=dict, hash=False)  # hashable settings: not hashed
    preset: str | None = None
    prompt_format: str | None = None
    use_system_prompt: bool | None = None
    flip_gripper: bool | None = None
    action_history_length: int | None = None
    context_frames: int = 1
    handover: str = "pixels"
    context_noise: float = 0.0

    def __post_init__(self) -> None:  # noqa: C901 (one check per field, in field order)
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen: normalise in place)
        if self.preset is not None:  # first: the preset's values are checked like the user's
            self._apply_preset(set_)
        set_("chunk", check_int(self.chunk, "chunk", minimum=1))
        set_("num_steps", check_int(self.num_steps, "num_steps", minimum=1))
        set_("guidance_scale", check_number(self.guidance_scale, "guidance_scale", minimum=0.0))
        set_("fps", check_number(self.fps, "fps", minimum=0.0, inclusive=False))
        if self.resolution_tier not in processor.RESOLUTION_TIERS:
            raise InputError(
                f"resolution_tier: expected one of {list(processor.RESOLUTION_TIERS)}, got {self.resolution_tier!r}."
            )
        # The width against the model's own action width is checked again in check_engine.
        _, raw_action_dim = processor.resolve_domain(self.domain, self.raw_action_dim)
        set_("raw_action_dim", raw_action_dim)
        set_("task", _check_tasks(self.task))
        if self.image_size is not None:
            size = check_size(self.image_size, "image_size")
            fixed = model_frame_size(*size, self.resolution_tier)
            if fixed != size:
                raise InputError(
                    f"image_size: the model turns a {size[0]}x{size[1]} frame into {fixed[0]}x{fixed[1]} frames at "
                    f"resolution_tier {self.resolution_tier}; use image_size={fixed}."
                )
            set_("image_size", size)
        if self.observation_size is not None:
            set_("observation_size", check_size(self.observation_size, "observation_size"))
        if self.obs_type == "pixels_agent_pos":
            raise InputError(
                "obs_type: 'pixels_agent_pos' needs the agent's position, which a world model that generates only "
                f"pixels cannot provide; expected one of {list(OBS_TYPES)}."
            )
        if self.obs_type not in OBS_TYPES:
            raise InputError(f"obs_type: expected one of {list(OBS_TYPES)}, got {self.obs_type!r}.")
        if self.reward_mode not in REWARD_MODES:
            raise InputError(f"reward_mode: expected one of {list(REWARD_MODES)}, got {self.reward_mode!r}.")
        if self.success_threshold is not None:
            set_("success_threshold", check_number(self.success_threshold, "success_threshold"))
        if self.max_episode_steps is not None:
            set_("max_episode_steps", check_int(self.max_episode_steps, "max_episode_steps", minimum=1))
        if self.score_name is not None and (not isinstance(self.score_name, str) or not self.score_name.isidentifier()):
            raise InputError(
                f"score_name: expected an identifier-like string (e.g. 'coverage'), got {self.score_name!r}."
            )
        set_("action_stats", _resolve_action_stats(self.action_stats, raw_action_dim))
        set_("return_frames", bool(self.return_frames))
        set_("imagination_samples", check_int(self.imagination_samples, "imagination_samples", minimum=1))
        if self.imagination_reduce not in IMAGINATION_REDUCTIONS:
            raise InputError(
                f"imagination_reduce: expected one of {list(IMAGINATION_REDUCTIONS)}, got {self.imagination_reduce!r}."
            )
        set_("request_options", MappingProxyType(_check_request_options(self.request_options)))
        if self.prompt_format is not None and self.prompt_format not in processor.PROMPT_FORMATS:
            raise InputError(
                f"prompt_format: expected one of {list(processor.PROMPT_FORMATS)} or None, got {self.prompt_format!r}."
            )
        for name in ("use_system_prompt", "flip_gripper"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (bool, np.bool_)):
                raise InputError(f"{name}: expected True, False or None, got {getattr(self, name)!r}.")
            if getattr(self, name) is not None:
                set_(name, bool(getattr(self, name)))
        if self.action_history_length is not None:
            set_("action_history_length", check_int(self.action_history_length, "action_history_length", minimum=0))
        set_("context_frames", check_int(self.context_frames, "context_frames", minimum=1))
        if self.handover not in HANDOVERS:
            raise InputError(f"handover: expected one of {list(HANDOVERS)}, got {self.handover!r}.")
        if self.context_frames > 1 and self.handover != "latent":
            raise InputError(
                f"context_frames: {self.context_frames} latent frames of context need handover='latent' (with "
                f"handover={self.handover!r} the next chunk starts from one re-encoded frame)."
            )
        context_noise = check_number(self.context_noise, "context_noise", minimum=0.0)
        if context_noise >= 1.0:
            raise InputError(f"context_noise: expected a noise level in [0, 1), got {self.context_noise!r}.")
        set_("context_noise", context_noise)

    def _apply_preset(self, set_) -> None:
        """Each setting the preset names takes its value where it still holds the class default (an explicit value
        equal to the default cannot be told from it, as in ``presets.resolve_request``)."""
        assert self.preset is not None  # __post_init__ applies a preset only when one is named
        preset = presets.get_preset(self.preset)
        set_("preset", preset.name)
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.default is not dataclasses.MISSING}
        for name, value in preset.settings().items():
            name = _PRESET_FIELD_NAMES.get(name, name)
            if name in defaults and _same(getattr(self, name), defaults[name]):
                set_(name, value)

    # ------------------------------------------------------------------ building

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def build(
        cls,
        settings: WorldModelSettings | None = None,
        defaults: Mapping[str, Any] | None = None,
        overrides: Mapping[str, Any] | None = None,
        *,
        source: str = "the checkpoint",
    ) -> WorldModelSettings:
        """The settings from a base object (or the class defaults), updated with ``defaults`` (e.g. a checkpoint's)
        and then ``overrides`` (the user's). An override that changes a value of ``defaults`` is logged (warning),
        since a checkpoint's own settings belong together. Unknown keys are an ``InputError``."""
        if settings is not None and not isinstance(settings, cls):
            raise InputError(f"settings: expected a WorldModelSettings, got {type(settings).__name__}.")
        defaults, overrides = dict(defaults or {}), dict(overrides or {})
        names = cls.field_names()
        unknown = sorted((set(defaults) | set(overrides)) - set(names))
        if unknown:
            raise InputError(f"settings: unknown settings {unknown}; expected some of {list(names)}.")
        changed = sorted(key for key, value in overrides.items() if key in defaults and not _same(value, defaults[key]))
        if changed:
            logger.warning(
                "Overriding the settings of %s: %s.",
                source,
                ", ".join(f"{key}={overrides[key]!r} (was {defaults[key]!r})" for key in changed),
            )
        base = settings if settings is not None else cls()
        values = {**defaults, **overrides}
        if "raw_action_dim" not in values:
            if values.get("domain", base.domain) != base.domain:
                values["raw_action_dim"] = None  # the new domain's own width, not the old one's
            elif values.get("preset") is not None and base.raw_action_dim == processor.resolve_domain(base.domain)[1]:
                values["raw_action_dim"] = None  # derived from the domain, not given: a preset may set it
        return dataclasses.replace(base, **values) if values else base

    def replace(self, **changes: Any) -> WorldModelSettings:
        """A validated copy with ``changes`` (``InputError`` for unknown fields)."""
        return type(self).build(self, overrides=changes)

    # ------------------------------------------------------------------ checks that need the model

    def check_engine(self, engine: Any, decodes_chunk: bool = True) -> None:
        """InputError where the settings do not fit ``engine``: its action width and, where the chunk's frames are
        generated (``decodes_chunk``, the envs), the VAE's temporal compression and, for ``handover="latent"``, an
        engine that encodes and decodes in this process."""
        temporal = getattr(engine, "temporal_compression", None)
        if decodes_chunk and self.handover == "latent":
            if temporal and self.chunk % temporal:
                raise InputError(
                    f"handover: 'latent' continues in whole latent frames, so chunk must be a multiple of the VAE's "
                    f"temporal compression ({temporal}), got {self.chunk}."
                )
            if not (
                callable(getattr(engine, "encode_frames", None)) and callable(getattr(engine, "decode_latents", None))
            ):
                raise InputError(
                    f"handover: 'latent' encodes start frames and decodes contexts in this process "
                    f"(Cosmos3Engine.encode_frames / decode_latents), which {type(engine).__name__} does not; use "
                    "an in-process engine or handover='pixels'."
                )
        if decodes_chunk and temporal and self.chunk % temporal:
            raise InputError(
                f"chunk: expected a multiple of the VAE's temporal compression ({temporal}) so that the chunk + 1 "
                f"frames decode to exactly chunk new frames, got {self.chunk}."
            )
        processor.resolve_domain(self.domain, self.raw_action_dim, action_dim=engine.action_dim)

    @property
    def history_length(self) -> int:
        """The state rows each request carries: ``action_history_length`` (the preset's where it names one), else 0."""
        return self.action_history_length or 0

    def request_fields(self) -> dict[str, Any]:
        """The ``Cosmos3Request`` fields these settings fix (everything but mode, observation, task, action, seed,
        action_history), under the request's current names (``num_steps`` is ``num_inference_steps`` there)."""
        return dict(
            domain=self.domain,
            raw_action_dim=self.raw_action_dim,
            chunk=self.chunk,
            num_inference_steps=self.num_steps,
            guidance_scale=self.guidance_scale,
            fps=self.fps,
            resolution_tier=self.resolution_tier,
            preset=self.preset,
            prompt_format=self.prompt_format,
            use_system_prompt=self.use_system_prompt,
            flip_gripper=self.flip_gripper,
            action_history_length=self.action_history_length,
            **self.request_options,
        )


def split_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the ``WorldModelSettings`` fields out of ``kwargs`` (in place) and return them."""
    return {name: kwargs.pop(name) for name in WorldModelSettings.field_names() if name in kwargs}


def model_frame_size(height: int, width: int, resolution_tier: int) -> tuple[int, int]:
    """The size ``(H, W)`` of the frames the model generates from a ``height x width`` frame, iterated to the fixed
    point: a frame of the returned size generates frames of the same size. Sizes only shrink along the way."""
    size = (int(height), int(width))
    while True:
        conditioning = processor.prepare_conditioning(np.zeros((*size, 3), np.uint8), resolution_tier, 1)
        latent_h, latent_w = conditioning.latent_hw
        generated = (processor.VAE_SPATIAL_FACTOR * latent_h, processor.VAE_SPATIAL_FACTOR * latent_w)
        if generated == size:
            return size
        size = generated


# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------


def _same(override: Any, default: Any) -> bool:
    """Whether an override keeps a default's value (an action-statistics path names the default's own file)."""
    if isinstance(default, processor.ActionStats):
        if isinstance(override, (str, os.PathLike)):
            return os.fspath(override) == default.source
        if isinstance(override, processor.ActionStats):
            return (
                override.mode == default.mode
                and np.array_equal(override.offset, default.offset)
                and np.array_equal(override.scale, default.scale)
            )
        return False
    try:
        return bool(override == default)
    except Exception:  # arrays and the like: treat as different
        return override is default


def _check_tasks(task: Any) -> str | tuple[str | None, ...] | None:
    if task is None or isinstance(task, str):
        return task
    if isinstance(task, (list, tuple)):
        for i, item in enumerate(task):
            if item is not None and not isinstance(item, str):
                raise InputError(f"task[{i}]: expected a string (or None), got {type(item).__name__}.")
        return tuple(task)
    raise InputError(f"task: expected a string or a list of strings, got {type(task).__name__}.")


def _resolve_action_stats(spec: Any, raw_action_dim: int) -> processor.ActionStats | None:
    if spec is None:
        return None
    stats = spec if isinstance(spec, processor.ActionStats) else processor.ActionStats.from_json(spec)
    if stats.dim != raw_action_dim:
        raise InputError(
            f"action_stats: the statistics have {stats.dim} dims but the domain's actions have {raw_action_dim} "
            "(raw_action_dim)."
        )
    return stats


def _check_request_options(options: Any) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise InputError(f"request_options: expected a dict, got {type(options).__name__}.")
    unknown = sorted(set(options) - set(REQUEST_OPTION_KEYS))
    if unknown:
        raise InputError(f"request_options: unknown keys {unknown}; expected some of {list(REQUEST_OPTION_KEYS)}.")
    if "view_point" in options and options["view_point"] not in processor.VIEW_POINTS:
        raise InputError(f"view_point: expected one of {list(processor.VIEW_POINTS)}, got {options['view_point']!r}.")
    return dict(options)


def check_int(value: Any, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InputError(f"{field}: expected an integer >= {minimum}, got {value!r}.")
    return int(value)


def check_number(value: Any, field: str, minimum: float | None = None, inclusive: bool = True) -> float:
    is_number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value):
        raise InputError(f"{field}: expected a finite number, got {value!r}.")
    if minimum is not None and (value < minimum or (not inclusive and value == minimum)):
        raise InputError(f"{field}: expected a number {'>=' if inclusive else '>'} {minimum}, got {value!r}.")
    return float(value)


def check_size(size: Any, field: str) -> tuple[int, int]:
    if (
        not isinstance(size, (tuple, list))
        or len(size) != 2
        or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in size)
    ):
        raise InputError(f"{field}: expected (height, width) as two positive integers, got {size!r}.")
    return int(size[0]), int(size[1])
