"""``WorldModelEnv``: one Cosmos3 forward-dynamics rollout as a ``gymnasium.Env``.

``step(action_chunk)`` asks the model what the next ``chunk`` frames look like when the robot executes the chunk
from the current frame, and continues from the last of them. Observations are ``{"image": uint8 [H, W, 3]}``;
actions are ``Box(-1, 1, (chunk, raw_action_dim), float32)`` in the model's normalised space. The reward comes from
an optional reward model scoring the chunk's frames. Everything model-related lives in ``core.WorldModelCore``
(shared with ``WorldModelVectorEnv``); this class adds Gymnasium's seeding, options and rendering.

Created with ``gym.make("cosmos3_gym/WorldModel-v0", ...)``, ``max_episode_steps`` becomes Gymnasium's ``TimeLimit``
wrapper (the env itself then never truncates); constructed directly, the env truncates after ``max_episode_steps``
chunks itself. Either way a step is one chunk and only one of them counts. The difference shows with
``reward_mode="terminal"``: the env pays the score on the steps that end an episode *inside* it, so under a
``TimeLimit`` wrapper it pays only on termination (``success_threshold``).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
import torch

from ..engine import Cosmos3Engine
from ..errors import InputError
from ..processor import ActionStats
from .core import WorldModelCore, WorldModelExtras

RESET_OPTION_KEYS = ("frames", "task", "initial_state_index")


class WorldModelEnv(WorldModelExtras, gym.Env):
    """Cosmos3 forward dynamics as a Gymnasium environment.

    Args:
        checkpoint: checkpoint directory or hub id; the env loads (and on ``close`` releases) its own engine.
        engine: an already-built ``Cosmos3Engine`` to share between envs (not closed by the env). Give one of the two.
        domain / raw_action_dim: the embodiment (name or integer id) and its action width.
        task: the instruction; None uses each initial state's own task (or "").
        initial_states: folder / file / frames / list, see ``initial_states.load_initial_states``; None means
            frames come from ``reset(options={"frames": ...})`` and ``image_size`` is required.
        image_size: the model frame size ``(H, W)``; default: derived from the first initial state.
        observation_size: ``(h, w)`` to downscale the observed image to (e.g. for small CNN policies); the model
            keeps working at ``image_size`` and ``render()`` / ``info["frames"]`` stay full size.
        reward_model: None (reward 0), a registered name, a callable ``(frames [B,T,3,H,W] in [0,1], tasks) -> [B]``
            or a reward-model instance (resolved by ``cosmos3_gym.rewards.resolve_reward_model``).
        reward_mode: "per_step" (the chunk's score), "terminal" (the score only on the step that ends the episode
            inside the env) or "relative" (score minus the previous chunk's score; the first chunk's minus 0).
        success_threshold: ``terminated`` when the score reaches it (``info["success"]``).
        max_episode_steps: truncate after this many chunks (see the module docstring for ``gym.make``).
        chunk, num_steps, guidance_scale, resolution_tier, fps: the model's settings (``Cosmos3Request``); ``chunk``
            must be a multiple of 4. ``fps`` is also ``metadata["render_fps"]``.
        action_stats: ``ActionStats`` or a statistics JSON path/dict (minmax); adds ``info["raw_action"]`` only.
        return_frames: put the chunk's generated frames in ``info["frames"]`` (uint8 ``[chunk, H, W, 3]``).
        request_options: extra ``Cosmos3Request`` fields: flow_shift, use_karras_sigmas, view_point, negative_prompt,
            prompt_format, use_system_prompt, additional_view_description, canvas, flip_gripper,
            action_history_length (state rows: the env sends each slot's last executed action rows, and at an
            episode's first step the chunk's first row), use_native_flow_schedule.
        preset: a ``presets.PRESETS`` name (e.g. "droid_robolab"): fills the settings left at their defaults.
        render_mode: None or "rgb_array" (the current frame).
        device, dtype: where and in which dtype a checkpoint is loaded.
        tp, cfg, dp: tensor / CFG / data parallel degrees; above 1 the engine runs in worker processes that the
            env starts (``Cosmos3Engine.from_pretrained(..., tp=, cfg=)``), the env process stays light.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 15}

    def __init__(
        self,
        checkpoint: str | os.PathLike | None = None,
        *,
        engine: Cosmos3Engine | None = None,
        domain: str | int = "droid_lerobot",
        raw_action_dim: int | None = None,
        task: str | None = None,
        initial_states: Any = None,
        image_size: tuple[int, int] | None = None,
        observation_size: tuple[int, int] | None = None,
        reward_model: Any = None,
        reward_mode: str = "per_step",
        success_threshold: float | None = None,
        max_episode_steps: int | None = None,
        chunk: int = 32,
        num_steps: int = 4,
        guidance_scale: float = 3.0,
        resolution_tier: int = 480,
        fps: float = 15.0,
        action_stats: ActionStats | str | os.PathLike | dict | None = None,
        return_frames: bool = False,
        request_options: dict[str, Any] | None = None,
        render_mode: str | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        tp: int = 1,
        cfg: int = 1,
        dp: int = 1,
        preset: str | None = None,
    ):
        if task is not None and not isinstance(task, str):
            raise InputError(f"task: expected a string, got {type(task).__name__} (a list needs the vector env).")
        self.render_mode = check_render_mode(render_mode, self.metadata["render_modes"])
        self._core = WorldModelCore(
            1, checkpoint=checkpoint, engine=engine, domain=domain, raw_action_dim=raw_action_dim, task=task,
            initial_states=initial_states, image_size=image_size, observation_size=observation_size,
            reward_model=reward_model, reward_mode=reward_mode, success_threshold=success_threshold,
            max_episode_steps=max_episode_steps, chunk=chunk, num_steps=num_steps, guidance_scale=guidance_scale,
            resolution_tier=resolution_tier, fps=fps, action_stats=action_stats, return_frames=return_frames,
            request_options=request_options, device=device, dtype=dtype, tp=tp, cfg=cfg, dp=dp,
            preset=preset,
        )
        self.observation_space = self._core.single_observation_space
        self.action_space = self._core.single_action_space
        self.metadata = {**self.metadata, "render_fps": self._core.fps}

    # ------------------------------------------------------------------ Gymnasium API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode. ``options``: ``frames`` (an initial frame instead of the source), ``task`` (this
        episode's instruction), ``initial_state_index`` (a specific item of the source instead of a random one)."""
        super().reset(seed=seed)
        options = check_reset_options(options, RESET_OPTION_KEYS)
        info = self._core.reset_slot(0, self.np_random, **options)
        return self._core.observation(0), info

    def step(self, action):
        self._core.check_started([0])  # step before reset: InputError before looking at the action
        action = self._core.check_actions(action, batch=None, field="action")
        (result,) = self._core.step_slots([0], action[None], [self.np_random])
        return result.observation, result.reward, result.terminated, result.truncated, result.info

    def render(self) -> np.ndarray | None:
        if self.render_mode is None:
            gym.logger.warn("render() was called without a render_mode; create the env with render_mode='rgb_array'.")
            return None
        return self._core.frame(0)

    def close(self) -> None:
        """Idempotent; releases the engine only if the env loaded it from ``checkpoint``."""
        self._core.close()

    # ------------------------------------------------------------------ world-model extras: WorldModelExtras

    @property
    def task(self) -> str:
        """The current episode's instruction."""
        return self._core.task(0)


def check_render_mode(render_mode: str | None, render_modes: Sequence[str]) -> str | None:
    if render_mode is not None and render_mode not in render_modes:
        raise InputError(f"render_mode: expected None or one of {list(render_modes)}, got {render_mode!r}.")
    return render_mode


def check_reset_options(options: dict[str, Any] | None, allowed: Sequence[str]) -> dict[str, Any]:
    """A copy of ``options`` with only the ``allowed`` keys (InputError naming any other)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InputError(f"options: expected a dict, got {type(options).__name__}.")
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InputError(f"options: unknown keys {unknown}; expected some of {list(allowed)}.")
    return dict(options)
