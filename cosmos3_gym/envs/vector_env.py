"""``WorldModelVectorEnv``: ``num_envs`` Cosmos3 rollouts advanced by ONE batched model call per step.

A native ``gymnasium.vector.VectorEnv`` (structured like Gymnasium's ``CartPoleVectorEnv``), not a
``SyncVectorEnv`` over copies of the model: every slot's request goes into one ``engine.step([...])`` call, and the
text K/V of a prompt is computed once and shared by all slots and steps (the engine caches it per prompt).

Autoreset (``autoreset_mode``, Gymnasium's ``AutoresetMode``) resets only the slots that finished:

* ``NEXT_STEP`` (default): the step after a slot finishes resets it (its action is ignored; reward 0,
  terminated/truncated False, its info is the reset info) while the other slots advance.
* ``SAME_STEP``: a finished slot is reset within the same step; its last observation and info are in
  ``info["final_obs"]`` / ``info["final_info"]`` (masked by ``info["_final_obs"]``).
* ``DISABLED``: finished slots must be reset with ``reset(options={"reset_mask": mask})`` before the next step.

Seeds: ``reset(seed=s)`` seeds slot ``i`` with ``s + i`` (a list seeds each slot), as ``SyncVectorEnv`` does, so
slot ``i`` follows the same random stream as a ``WorldModelEnv`` reset with seed ``s + i``. Autoresets continue the
slot's stream. ``max_episode_steps`` is counted per slot, in chunks.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
import torch
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from ..engine import Cosmos3Engine
from ..errors import InputError
from ..processor import ActionStats
from .core import WorldModelCore, WorldModelExtras
from .world_model_env import check_render_mode, check_reset_options

RESET_OPTION_KEYS = ("reset_mask", "frames", "task", "initial_state_index")


class WorldModelVectorEnv(WorldModelExtras, VectorEnv):
    """Batched Cosmos3 forward dynamics; arguments as ``WorldModelEnv`` plus ``num_envs``, ``autoreset_mode`` and
    ``task`` (a string for all slots or a list with one per slot)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 15, "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        num_envs: int = 1,
        checkpoint: str | os.PathLike | None = None,
        *,
        engine: Cosmos3Engine | None = None,
        domain: str | int = "droid_lerobot",
        raw_action_dim: int | None = None,
        task: str | Sequence[str | None] | None = None,
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
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        tp: int = 1,
        cfg: int = 1,
        dp: int = 1,
        preset: str | None = None,
    ):
        if isinstance(num_envs, bool) or not isinstance(num_envs, (int, np.integer)) or num_envs < 1:
            raise InputError(f"num_envs: expected an integer >= 1, got {num_envs!r}.")
        self.num_envs = int(num_envs)
        self.autoreset_mode = _check_autoreset_mode(autoreset_mode)
        self.render_mode = check_render_mode(render_mode, self.metadata["render_modes"])
        self._core = WorldModelCore(
            self.num_envs, checkpoint=checkpoint, engine=engine, domain=domain, raw_action_dim=raw_action_dim,
            task=task, initial_states=initial_states, image_size=image_size, observation_size=observation_size,
            reward_model=reward_model, reward_mode=reward_mode, success_threshold=success_threshold,
            max_episode_steps=max_episode_steps, chunk=chunk, num_steps=num_steps, guidance_scale=guidance_scale,
            resolution_tier=resolution_tier, fps=fps, action_stats=action_stats, return_frames=return_frames,
            request_options=request_options, device=device, dtype=dtype, tp=tp, cfg=cfg, dp=dp,
            preset=preset,
        )
        self.metadata = {**self.metadata, "render_fps": self._core.fps, "autoreset_mode": self.autoreset_mode}
        self.single_observation_space = self._core.single_observation_space
        self.single_action_space = self._core.single_action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)

        self._slot_rngs: list[np.random.Generator | None] = [None] * self.num_envs
        # Slots whose episode ended on the last step: reset at the next step (NEXT_STEP) or required (DISABLED).
        self._finished = np.zeros(self.num_envs, dtype=np.bool_)

    # ------------------------------------------------------------------ Gymnasium API

    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None):
        """Reset all slots, or those in ``options["reset_mask"]`` (bool ``[num_envs]``). Other options, as for
        ``WorldModelEnv``, each either one value for every slot or a list with one per slot (``frames`` must be a
        list with one entry per slot, None where the initial-state source is used)."""
        seeds = self._slot_seeds(seed)
        super().reset(seed=seed if isinstance(seed, (int, np.integer)) else None)
        options = check_reset_options(options, RESET_OPTION_KEYS)
        mask = self._check_reset_mask(options.pop("reset_mask", None))
        per_slot = {key: _per_slot_option(key, value, self.num_envs) for key, value in options.items()}

        infos: dict[str, Any] = {}
        for slot in np.flatnonzero(mask):
            if seeds[slot] is not None or self._slot_rngs[slot] is None:
                self._slot_rngs[slot], _ = seeding.np_random(seeds[slot])
            slot_options = {key: values[slot] for key, values in per_slot.items()}
            infos = self._add_info(infos, self._core.reset_slot(slot, self._slot_rngs[slot], **slot_options), slot)
        self._finished[mask] = False
        return self._observations(), infos

    def step(self, actions):
        self._core.check_started(range(self.num_envs))  # step before reset: InputError before looking at the actions
        actions = self._core.check_actions(actions, batch=self.num_envs, field="actions")
        if self.autoreset_mode == AutoresetMode.DISABLED and self._finished.any():
            raise InputError(
                f"reset_mask: slots {np.flatnonzero(self._finished).tolist()} finished their episodes; with "
                "autoreset_mode DISABLED reset them with reset(options={'reset_mask': mask}) before stepping."
            )
        to_reset = self._finished if self.autoreset_mode == AutoresetMode.NEXT_STEP else np.zeros_like(self._finished)
        stepping = np.flatnonzero(~to_reset).tolist()

        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminated = np.zeros(self.num_envs, dtype=np.bool_)
        truncated = np.zeros(self.num_envs, dtype=np.bool_)
        infos: dict[str, Any] = {}
        results = self._core.step_slots(stepping, actions[stepping], [self._slot_rngs[s] for s in stepping])
        for slot, result in zip(stepping, results):
            rewards[slot], terminated[slot], truncated[slot] = result.reward, result.terminated, result.truncated
            if self.autoreset_mode == AutoresetMode.SAME_STEP and (result.terminated or result.truncated):
                infos = self._add_info(infos, {"final_obs": result.observation, "final_info": result.info}, slot)
                infos = self._add_info(infos, self._core.reset_slot(slot, self._slot_rngs[slot]), slot)
            else:
                infos = self._add_info(infos, result.info, slot)
        for slot in np.flatnonzero(to_reset):
            infos = self._add_info(infos, self._core.reset_slot(slot, self._slot_rngs[slot]), slot)

        self._finished = terminated | truncated
        return self._observations(), rewards, terminated, truncated, infos

    def render(self) -> tuple[np.ndarray, ...] | None:
        if self.render_mode is None:
            gym.logger.warn("render() was called without a render_mode; create the env with render_mode='rgb_array'.")
            return None
        return tuple(self._core.frame(slot) for slot in range(self.num_envs))

    def close_extras(self, **kwargs: Any) -> None:
        """Called once by ``VectorEnv.close``; releases the engine only if the env loaded it."""
        self._core.close()

    # ------------------------------------------------------------------ world-model extras: WorldModelExtras

    @property
    def tasks(self) -> list[str]:
        """The current instruction of every slot."""
        return [self._core.task(slot) for slot in range(self.num_envs)]

    # ------------------------------------------------------------------ helpers

    def _observations(self) -> dict[str, np.ndarray]:
        return {"image": np.stack([self._core.observation(slot)["image"] for slot in range(self.num_envs)])}

    def _slot_seeds(self, seed: Any) -> list[int | None]:
        if seed is None:
            return [None] * self.num_envs
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            return [int(seed) + slot for slot in range(self.num_envs)]
        if isinstance(seed, (list, tuple)) and len(seed) == self.num_envs:
            if all(s is None or (isinstance(s, (int, np.integer)) and not isinstance(s, bool)) for s in seed):
                return [None if s is None else int(s) for s in seed]
        raise InputError(f"seed: expected None, an int or a list of {self.num_envs} ints (or None), got {seed!r}.")

    def _check_reset_mask(self, mask: Any) -> np.ndarray:
        if mask is None:
            return np.ones(self.num_envs, dtype=np.bool_)
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.shape != (self.num_envs,):
            raise InputError(
                f"reset_mask: expected a bool array of shape ({self.num_envs},), got dtype {mask.dtype} and shape "
                f"{mask.shape}."
            )
        if not mask.any():
            raise InputError("reset_mask: expected at least one True entry.")
        return mask


def _check_autoreset_mode(mode: Any) -> AutoresetMode:
    try:
        return AutoresetMode(mode)
    except ValueError:
        raise InputError(
            f"autoreset_mode: expected a gymnasium.vector.AutoresetMode or one of "
            f"{[m.value for m in AutoresetMode]}, got {mode!r}."
        ) from None


def _per_slot_option(key: str, value: Any, num_envs: int) -> list[Any]:
    """One reset option's value for every slot."""
    if key == "frames":  # a list of frames is also one video, so frames are always given per slot
        if not isinstance(value, (list, tuple)) or len(value) != num_envs:
            raise InputError(f"options['frames']: expected a list of {num_envs} frames (None to use initial_states).")
        return list(value)
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != num_envs:
            raise InputError(f"options[{key!r}]: expected one value or a list of {num_envs}, got {len(value)} items.")
        return list(value)
    return [value] * num_envs
