"""What the helper agents share: the settings (``WorldModelSettings``), the seed sequence and the task list."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import presets
from ..engine import Cosmos3Request
from ..envs.settings import WorldModelSettings
from ..errors import InputError

_SEED_BOUND = 2**63  # the engine's seeds are non-negative 63-bit integers


class EngineAgent:
    """Builds ``Cosmos3Request``s of one mode with fixed sampling settings (a ``WorldModelSettings``).

    ``settings`` and/or its fields as keywords (domain, raw_action_dim, chunk, num_steps, guidance_scale,
    resolution_tier, fps, request_options; keywords win); ``view_point`` / ``negative_prompt`` are shorthands for
    ``request_options`` entries. ``from_env(env)`` takes the env's engine and settings, so the agent's actions fit
    the env. The settings read through the agent too (``agent.chunk`` is ``agent.settings.chunk``).

    With ``seed`` set, every request gets the next seed of a ``np.random.Generator(seed)`` sequence, one request at a
    time in order, so a run reproduces and a batched call uses exactly the seeds the same calls made one by one
    would. With ``seed=None`` the engine draws a fresh random seed per request.

    ``preset`` (``presets.PRESETS``, e.g. "droid_robolab"; default: the engine's) fills the settings left at their
    defaults, and the engine the rest of it (canvas, camera composite, schedule). ``prompt_format``,
    ``use_system_prompt``, ``flip_gripper`` and ``action_history_length`` go to every request as they are.
    """

    mode: str

    default_task: str | None = None  # the task when neither the constructor nor a call gives one

    def __init__(
        self,
        engine: Any,
        task: str | None = None,
        *,
        settings: WorldModelSettings | None = None,
        seed: int | None = None,
        view_point: str | None = None,
        negative_prompt: str | None = None,
        **setting_fields: Any,
    ):
        if not callable(getattr(engine, "step", None)):
            raise InputError(f"engine: expected a Cosmos3Engine, got {type(engine).__name__}")
        if task is not None and not isinstance(task, str):
            raise InputError(f"task: expected a string or None, got {type(task).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise InputError(f"seed: expected a non-negative integer or None, got {seed!r}")
        shorthands = {
            key: value
            for key, value in (("view_point", view_point), ("negative_prompt", negative_prompt))
            if value is not None
        }
        if shorthands:
            base_options = settings.request_options if settings is not None else {}
            options = setting_fields.get("request_options") or base_options
            setting_fields["request_options"] = {**options, **shorthands}
        # An engine loaded with a preset (from_pretrained(preset=...)) gives it to its agents unless they name one.
        engine_preset = getattr(engine, "preset", None)
        if engine_preset is not None and "preset" not in setting_fields and getattr(settings, "preset", None) is None:
            setting_fields["preset"] = engine_preset
        self.settings = WorldModelSettings.build(settings, overrides=setting_fields)
        self.settings.check_engine(engine, decodes_chunk=False)
        preset = None if self.settings.preset is None else presets.get_preset(self.settings.preset)
        self.observation_adapter = None if preset is None else preset.observation_adapter  # e.g. camera composite
        # Actions in the model's normalised space are clipped to [-1, 1]; a preset's raw actions are not.
        self.normalized_actions = preset is None or preset.normalized_actions
        self.engine = engine
        self.task = self.default_task if task is None else task
        self.reset(seed)

    @classmethod
    def from_env(cls, env: Any, task: str | None = None, *, seed: int | None = None, **setting_fields: Any):
        """An agent on ``env``'s engine with its settings (domain, chunk, sampling steps, guidance, resolution tier,
        fps, request options), so that ``agent.act(obs)`` returns an action ``env.step`` accepts. ``task``: default
        the env's fixed task (``env.settings.task``) when it has one. Keywords override settings."""
        base = getattr(env, "unwrapped", env)
        settings = getattr(base, "settings", None)
        if not isinstance(settings, WorldModelSettings):
            raise InputError(
                f"env: {cls.__name__}.from_env needs a cosmos3_gym world-model env (WorldModelEnv / "
                f"WorldModelVectorEnv, or a wrapper of one), got {type(env).__name__}."
            )
        if task is None and isinstance(settings.task, str):
            task = settings.task
        return cls(base.engine, task, settings=settings, seed=seed, **setting_fields)

    def __getattr__(self, name: str) -> Any:
        # Only called for names the agent lacks: the settings' fields (agent.chunk, agent.raw_action_dim, ...).
        settings = self.__dict__.get("settings")
        if settings is not None and name in WorldModelSettings.field_names():
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
        fields = self.settings.request_fields()
        if chunk is not None:
            fields["chunk"] = chunk
        return Cosmos3Request(
            mode=self.mode,
            observation=observation,
            task=task,
            seed=self._next_seed(),
            action_history=action_history,
            **fields,
        )

    def _run(self, requests: list[Cosmos3Request]) -> np.ndarray:
        """One batched engine pass (no video decode) -> the action chunks ``[N, chunk, raw_action_dim]``."""
        results = self.engine.step(requests, decode=False)
        return np.stack([result.action for result in results]).astype(np.float32, copy=False)
