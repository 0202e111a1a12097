"""``PushTSimEnv``: the real PushT simulator (gym-pusht, through ``PushTSim``) with the spaces of the PushT world
model env, so that one agent can be trained or evaluated in either world.

Like ``cosmos3_gym/PushT-v0`` (``WorldModelEnv``): observations are ``{"image": uint8 [h, w, 3]}`` (the simulator's
frame rendered at the model's ``image_size``, downscaled to ``observation_size`` by the same ``resize_frame``), an
action is one chunk ``Box(-1, 1, (chunk, 2), float32)`` of the model's normalised actions, and a step runs the whole
chunk. Actions are mapped to table pixels exactly as ``cosmos3_gym.tasks.pusht.compare`` runs a policy in the simulator:
clipped to [-1, 1], ``action_stats.denormalize``, clipped to the table [0, 512]. The reward is the true coverage of
the target after the chunk's last step (the world model's reward is its reward model's estimate of that coverage on
the chunk's last frame), the episode terminates when it reaches ``success_threshold`` and is truncated after
``max_episode_steps`` chunks. ``info``: ``coverage`` / ``score`` (the same number; ``score`` as the world-model env
names it), ``max_coverage`` (best coverage within the chunk), ``success``, ``sim_seed``, ``elapsed_steps``,
``raw_action`` and, with ``return_frames``, ``frames`` (the chunk's frames at ``image_size``).

Episodes start from ``PushTSim.reset(seed)`` with a seed drawn (with the env's ``np_random``) from ``start_seeds``,
or the one given as ``reset(options={"sim_seed": s})``. ``make_pusht_sim_env`` takes every setting from a PushT
model folder (default: the built-in one): its action statistics, chunk, image size, episode length, success
threshold and, as start seeds, the simulator seeds of its shipped start frames (``initial_states.npz``), so both
worlds start from the same states. Needs gym-pusht.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from ...data.initial_states import resize_frame
from ...errors import InputError
from ...processor import ActionStats
from . import episodes as pusht

__all__ = ["PushTSimEnv", "make_pusht_sim_env", "pusht_sim_env_arguments"]


class PushTSimEnv(gym.Env):
    """gym-pusht with chunked normalised actions and image observations; see the module docstring."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": pusht.SIM_FPS}

    def __init__(
        self,
        action_stats: ActionStats | str | os.PathLike | dict,
        *,
        start_seeds: Sequence[int],
        chunk: int = 8,
        image_size: tuple[int, int] = (256, 256),
        observation_size: tuple[int, int] | None = None,
        max_episode_steps: int | None = None,
        success_threshold: float | None = pusht.SUCCESS_COVERAGE,
        return_frames: bool = False,
        render_mode: str | None = None,
    ):
        if not isinstance(action_stats, ActionStats):
            action_stats = ActionStats.from_json(action_stats, mode="minmax")
        if action_stats.dim != pusht.RAW_ACTION_DIM:
            raise InputError(f"action_stats: expected {pusht.RAW_ACTION_DIM} dims (x, y), got {action_stats.dim}.")
        for name, value in (("chunk", chunk), ("max_episode_steps", max_episode_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
                raise InputError(f"{name}: expected an integer >= 1, got {value!r}.")
        start_seeds = [int(seed) for seed in start_seeds]
        if not start_seeds:
            raise InputError("start_seeds: expected at least one simulator seed.")
        if render_mode not in (None, "rgb_array"):
            raise InputError(f"render_mode: expected None or 'rgb_array', got {render_mode!r}.")
        self.action_stats = action_stats
        self.start_seeds = start_seeds
        self.chunk = int(chunk)
        self.image_size = pusht._check_image_size(tuple(image_size))
        self.observation_size = (
            self.image_size if observation_size is None else pusht._check_image_size(tuple(observation_size))
        )
        self.max_episode_steps = max_episode_steps
        self.success_threshold = success_threshold
        self.return_frames = return_frames
        self.render_mode = render_mode
        self.observation_space = spaces.Dict({"image": spaces.Box(0, 255, (*self.observation_size, 3), dtype=np.uint8)})
        self.action_space = spaces.Box(-1.0, 1.0, (self.chunk, pusht.RAW_ACTION_DIM), dtype=np.float32)
        self._sim: pusht.PushTSim | None = pusht.PushTSim(self.image_size)  # None once closed
        self._frame: np.ndarray | None = None
        self._elapsed = 0
        self.sim_seed: int | None = None

    @property
    def coverage(self) -> float:
        """The true coverage of the target now."""
        return self._open_sim().coverage

    def raw_actions(self, action: np.ndarray) -> np.ndarray:
        """Normalised actions ``[..., 2]`` -> table pixels, as ``compare.simulate_policy`` maps a policy's actions."""
        normalised = np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)
        return np.clip(self.action_stats.denormalize(normalised), 0.0, pusht.TABLE_SIZE)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = dict(options or {})
        unknown = sorted(set(options) - {"sim_seed"})
        if unknown:
            raise InputError(f"options: unknown keys {unknown}; expected 'sim_seed'.")
        sim_seed = options.get("sim_seed")
        if sim_seed is None:
            sim_seed = self.start_seeds[int(self.np_random.integers(len(self.start_seeds)))]
        self.sim_seed = int(sim_seed)
        self._frame = self._open_sim().reset(self.sim_seed)
        self._elapsed = 0
        return self._observation(), {"sim_seed": self.sim_seed, "coverage": self.coverage}

    def step(self, action):
        if self._frame is None:
            raise InputError("reset: call reset() before step().")
        action = np.asarray(action, dtype=np.float32)
        if action.shape != self.action_space.shape:
            raise InputError(f"action: expected shape {self.action_space.shape} (chunk, 2), got {action.shape}.")
        raw = self.raw_actions(action)
        frames, coverage = [], []
        for target in raw:
            self._frame = self._open_sim().step(target)
            frames.append(self._frame)
            coverage.append(self.coverage)
        self._elapsed += 1
        score = float(coverage[-1])
        terminated = self.success_threshold is not None and score >= self.success_threshold
        truncated = self.max_episode_steps is not None and self._elapsed >= self.max_episode_steps
        info: dict[str, Any] = {
            "coverage": score,
            "score": score,
            "max_coverage": float(max(coverage)),
            "success": bool(max(coverage) > pusht.SUCCESS_COVERAGE),
            "sim_seed": self.sim_seed,
            "elapsed_steps": self._elapsed,
            "raw_action": raw.astype(np.float32),
        }
        if self.return_frames:
            info["frames"] = np.stack(frames)
        return self._observation(), score, bool(terminated), bool(truncated), info

    def render(self) -> np.ndarray | None:
        if self.render_mode is None:
            gym.logger.warn("render() was called without a render_mode; create the env with render_mode='rgb_array'.")
            return None
        if self._frame is None:
            raise InputError("reset: call reset() before render().")
        return self._frame.copy()

    def close(self) -> None:
        if self._sim is not None:
            self._sim.close()
            self._sim = None

    def _open_sim(self) -> pusht.PushTSim:
        assert self._sim is not None, "PushTSimEnv: the env is closed"
        return self._sim

    def _observation(self) -> dict[str, np.ndarray]:
        assert self._frame is not None  # reset() and step() draw it (the simulator renders every step)
        return {"image": resize_frame(self._frame, self.observation_size).copy()}


def pusht_sim_env_arguments(assets_dir: str | os.PathLike | None = None, **overrides: Any) -> dict[str, Any]:
    """The ``PushTSimEnv`` arguments of a PushT model folder (default: the built-in one), updated with
    ``overrides``: its action statistics, chunk, image size, max_episode_steps, success threshold and the simulator
    seeds of its start frames."""
    from .env import load_pusht_assets, pusht_env_defaults

    assets = load_pusht_assets(assets_dir)
    defaults = pusht_env_defaults(assets)
    if "action_stats" not in defaults:
        raise InputError(f"action_stats: {assets.checkpoint} has no action_stats.json to map actions to the table.")
    with np.load(assets.initial_states, allow_pickle=False) as archive:
        if "sim_seeds" not in archive.files:
            raise InputError(f"start_seeds: {assets.initial_states} has no sim_seeds; pass start_seeds=.")
        start_seeds = [int(seed) for seed in archive["sim_seeds"]]
    arguments = {
        "action_stats": ActionStats.from_json(
            defaults["action_stats"], mode=assets.meta.get("action_normalization", "minmax")
        ),
        "start_seeds": start_seeds,
        "chunk": int(defaults["chunk"]),
        "image_size": tuple(assets.meta.get("image_size", (256, 256))),
        "max_episode_steps": defaults.get("max_episode_steps"),
        "success_threshold": defaults.get("success_threshold", pusht.SUCCESS_COVERAGE),
    }
    return {**arguments, **overrides}


def make_pusht_sim_env(assets_dir: str | os.PathLike | None = None, **overrides: Any) -> PushTSimEnv:
    """``PushTSimEnv`` with the settings of a PushT model folder; any ``PushTSimEnv`` argument in ``overrides``
    wins."""
    return PushTSimEnv(**pusht_sim_env_arguments(assets_dir, **overrides))
