"""What the helper agents share: the request settings, the seed sequence and the task list."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .. import presets
from ..engine import Cosmos3Request
from ..errors import InputError
from ..processor import RESOLUTION_TIERS, VIEW_POINTS, resolve_domain

_SEED_BOUND = 2**63  # the engine's seeds are non-negative 63-bit integers


class EngineAgent:
    """Builds ``Cosmos3Request``s of one mode with fixed sampling settings.

    With ``seed`` set, every request gets the next seed of a ``np.random.Generator(seed)`` sequence, one request at a
    time in order, so a run reproduces and a batched call uses exactly the seeds the same calls made one by one
    would. With ``seed=None`` the engine draws a fresh random seed per request.

    ``preset`` (``presets.PRESETS``, e.g. "droid_robolab"; default: the engine's) fills the settings left at their
    defaults, and the engine the rest of it (canvas, camera composite, schedule). ``prompt_format``,
    ``use_system_prompt``, ``flip_gripper`` and ``action_history_length`` go to every request as they are
    (``Cosmos3Request``).
    """

    mode: str

    default_task: str | None = None  # the task when neither the constructor nor a call gives one

    def __init__(
        self,
        engine: Any,
        task: str | None = None,
        *,
        domain: str | int = "droid_lerobot",
        raw_action_dim: int | None = None,
        chunk: int = 32,
        num_steps: int = 4,
        guidance_scale: float = 3.0,
        resolution_tier: int = 480,
        fps: float = 15.0,
        seed: int | None = None,
        view_point: str = "ego_view",
        negative_prompt: str | None = None,
        preset: str | None = None,
        prompt_format: str | None = None,
        use_system_prompt: bool | None = None,
        flip_gripper: bool | None = None,
        action_history_length: int | None = None,
    ):
        if preset is None:  # the engine's own (from_pretrained(preset=...)), so the agent resolves the same way
            preset = getattr(engine, "preset", None)
        settings = presets.resolve_settings(preset, dict(
            domain=domain, raw_action_dim=raw_action_dim, chunk=chunk, num_steps=num_steps,
            guidance_scale=guidance_scale, resolution_tier=resolution_tier, fps=fps, view_point=view_point,
            negative_prompt=negative_prompt, prompt_format=prompt_format, use_system_prompt=use_system_prompt,
            flip_gripper=flip_gripper, action_history_length=action_history_length, observation_adapter=None,
        ))
        domain, raw_action_dim, chunk, num_steps = (settings[k] for k in ("domain", "raw_action_dim", "chunk",
                                                                          "num_steps"))
        guidance_scale, resolution_tier, fps, view_point = (settings[k] for k in ("guidance_scale",
                                                                                  "resolution_tier", "fps",
                                                                                  "view_point"))
        if not callable(getattr(engine, "step", None)):
            raise InputError(f"engine: expected a Cosmos3Engine, got {type(engine).__name__}")
        _check_int("chunk", chunk)
        _check_int("num_steps", num_steps)
        if not _is_number(guidance_scale) or guidance_scale < 0:
            raise InputError(f"guidance_scale: expected a finite number >= 0, got {guidance_scale!r}")
        if not _is_number(fps) or fps <= 0:
            raise InputError(f"fps: expected a positive number, got {fps!r}")
        if resolution_tier not in RESOLUTION_TIERS:
            raise InputError(f"resolution_tier: expected one of {list(RESOLUTION_TIERS)}, got {resolution_tier!r}")
        if view_point not in VIEW_POINTS:
            raise InputError(f"view_point: expected one of {list(VIEW_POINTS)}, got {view_point!r}")
        if task is not None and not isinstance(task, str):
            raise InputError(f"task: expected a string or None, got {type(task).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise InputError(f"seed: expected a non-negative integer or None, got {seed!r}")
        _, self.raw_action_dim = resolve_domain(
            domain, raw_action_dim, action_dim=engine.action_dim
        )
        self.engine = engine
        self.task = self.default_task if task is None else task
        self.domain = domain
        self.chunk = chunk
        self.num_steps = num_steps
        self.guidance_scale = float(guidance_scale)
        self.resolution_tier = resolution_tier
        self.fps = float(fps)
        self.view_point = view_point
        self.negative_prompt = settings["negative_prompt"]
        self.preset = None if preset is None else presets.get_preset(preset).name
        self.prompt_format = settings["prompt_format"]
        self.use_system_prompt = settings["use_system_prompt"]
        self.flip_gripper = settings["flip_gripper"]
        self.action_history_length = _check_count("action_history_length", settings["action_history_length"])
        self.observation_adapter = settings["observation_adapter"]  # set by a preset only
        # Actions in the model's normalised space are clipped to [-1, 1]; a preset's raw actions are not.
        self.normalized_actions = preset is None or presets.get_preset(preset).normalized_actions
        self.reset(seed)

    def reset(self, seed: int | None = None) -> None:
        """Restart the seed sequence from ``seed`` (``None``: fresh random seeds from the engine)."""
        self._seeds = np.random.default_rng(seed) if seed is not None else None

    def _next_seed(self) -> int | None:
        return None if self._seeds is None else int(self._seeds.integers(0, _SEED_BOUND))

    def _tasks(self, task: str | Sequence[str] | None, count: int) -> list[str]:
        """One task per request: ``task`` (one string for all, or a list of ``count``) or the agent's own."""
        task = self.task if task is None else task
        if task is None:
            raise InputError(f"task: {type(self).__name__} needs a task; pass task= to the constructor or the call")
        if isinstance(task, str):
            return [task] * count
        tasks = list(task)
        if len(tasks) != count or not all(isinstance(t, str) for t in tasks):
            raise InputError(f"task: expected one string or a list of {count} strings (one per observation)")
        return tasks

    def _request(
        self, observation: Any, task: str, chunk: int | None = None, action_history: Any = None
    ) -> Cosmos3Request:
        return Cosmos3Request(
            mode=self.mode,
            observation=observation,
            task=task,
            domain=self.domain,
            raw_action_dim=self.raw_action_dim,
            chunk=self.chunk if chunk is None else chunk,
            num_steps=self.num_steps,
            guidance_scale=self.guidance_scale,
            fps=self.fps,
            seed=self._next_seed(),
            resolution_tier=self.resolution_tier,
            view_point=self.view_point,
            negative_prompt=self.negative_prompt,
            preset=self.preset,
            prompt_format=self.prompt_format,
            use_system_prompt=self.use_system_prompt,
            flip_gripper=self.flip_gripper,
            action_history_length=self.action_history_length,
            action_history=action_history,
        )

    def _run(self, requests: list[Cosmos3Request]) -> np.ndarray:
        """One batched engine pass (no video decode) -> the action chunks ``[N, chunk, raw_action_dim]``."""
        results = self.engine.step(requests, decode=False)
        return np.stack([result.action for result in results]).astype(np.float32, copy=False)


def _check_int(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{field}: expected an integer >= 1, got {value!r}")


def _check_count(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{field}: expected an integer >= 0, got {value!r}")
    return value


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
